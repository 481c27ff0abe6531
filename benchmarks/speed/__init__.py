"""Speed benchmarks: each stage's throughput against what it is compared with in the same run."""
