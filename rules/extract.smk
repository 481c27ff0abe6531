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
    conda:
        ENV
    params:
        script=script("extract.py"),
        config=RESOLVED,
        provenance=shard_provenance,
    shell:
        "python -u {params.script} --config {params.config}"
        " --shard rows_{wildcards.start}-{wildcards.end} 2>&1 | tee {log}"
