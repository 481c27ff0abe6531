rule extract:
    """One shard of hidden states through the shared server; resumes finished chunks."""
    input:
        table=ancient("prepared/tokenized.parquet"),
        summary=ancient("prepared/summary.json"),
        model=ancient(MODEL_CONFIG),
    output:
        "hidden_states/rows_{start}-{end}/manifest.json",
    log:
        "logs/extract/rows_{start}-{end}.log",
    benchmark:
        "logs/benchmarks/extract/rows_{start}-{end}.tsv"
    retries: 1
    params:
        provenance=shard_provenance,
    shell:
        "{PYTHON} -u {SCRIPTS}/extract.py --config {RESOLVED}"
        " --shard rows_{wildcards.start}-{wildcards.end} 2>&1 | tee {log}"
