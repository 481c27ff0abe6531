"""Operating a run: `eaglepipe status`, the report figures, the CLI, and the Snakefile's
start and end hooks."""
