"""The benchmark stage: live acceptance on named prompt sets (MT-bench, any JSONL prompt file),
per category and per turn, for our exported drafter and any other EAGLE-3 draft directory,
through the live-acceptance harnesses of `eaglepipe.drafter` (docs/benchmarks.md)."""
