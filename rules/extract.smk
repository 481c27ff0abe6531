rule extract:
    """One shard of hidden states through the shared server; resumes finished chunks."""
    input:
        unpack(extract_inputs),
    output:
        SHARD_MANIFEST,
    log:
        "logs/extract/rows_{start}-{end}.log",
    benchmark:
        "logs/benchmarks/extract/rows_{start}-{end}.tsv"
    conda:
        ENV
    # No `retries:` (it would repeat deterministic failures too): a job retries in itself only
    # when the server is lost (eaglepipe.extract.shard.run_extract_job). The log is appended to, so
    # every attempt's lines stay.
    resources:
        **PER_SHARD_RESOURCES,
    params:
        script=script("extract.py"),
        config=RESOLVED,
    shell:
        "python -u {params.script:q} --config {params.config}"
        " --shard rows_{wildcards.start}-{wildcards.end} 2>&1 | tee -a {log}"
