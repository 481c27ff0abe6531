rule validate:
    """Integrity, schema, coverage, values, provenance and a server spot check of one shard."""
    input:
        manifest="hidden_states/rows_{start}-{end}/manifest.json",
        table=ancient("prepared/tokenized.parquet"),
    output:
        "validated/rows_{start}-{end}.json",
    log:
        "logs/validate/rows_{start}-{end}.log",
    benchmark:
        "logs/benchmarks/validate/rows_{start}-{end}.tsv"
    conda:
        ENV
    params:
        script=script("validate.py"),
        config=RESOLVED,
    shell:
        "python -u {params.script} --config {params.config}"
        " --shard rows_{wildcards.start}-{wildcards.end} 2>&1 | tee {log}"
