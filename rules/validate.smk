rule validate:
    """Integrity, schema, coverage, values, provenance and a server spot check of one shard."""
    input:
        # The prepared table is read too, but is no input of a fresh report: it exists whenever
        # a manifest does, and re-preparing must not revalidate terabytes (eaglepipe/plan/provenance.py).
        unpack(validate_inputs),
    output:
        VALIDATION_REPORT,
    log:
        "logs/validate/rows_{start}-{end}.log",
    benchmark:
        "logs/benchmarks/validate/rows_{start}-{end}.tsv"
    conda:
        ENV
    resources:
        **PER_SHARD_RESOURCES,
    params:
        script=script("validate.py"),
        config=RESOLVED,
    shell:
        "python -u {params.script:q} --config {params.config}"
        " --shard rows_{wildcards.start}-{wildcards.end} 2>&1 | tee {log}"
