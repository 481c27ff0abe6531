"""The project's benchmarks, checks and studies, grouped by purpose; each runs from the
repository root as `python -m benchmarks.<group>.<name>` (benchmarks/README.md)."""
