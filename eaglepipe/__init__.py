"""eaglepipe: EAGLE-3 hidden-state extraction and drafter training, as a Snakemake pipeline."""

__version__ = "0.1.0"
