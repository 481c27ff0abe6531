rule regenerate:
    """One shard's assistant turns re-answered by the target (dataset.regenerate); resumes the
    rows it journalled."""
    input:
        unpack(regenerate_inputs),
    output:
        "regenerated/rows_{start}-{end}/manifest.json",
    log:
        "logs/regenerate/rows_{start}-{end}.log",
    benchmark:
        "logs/benchmarks/regenerate/rows_{start}-{end}.tsv"
    # As extraction: no `retries:`; a job retries in itself only when the server is lost.
    conda:
        ENV
    params:
        script=script("regenerate.py"),
        config=RESOLVED,
    shell:
        "python -u {params.script} --config {params.config}"
        " --shard rows_{wildcards.start}-{wildcards.end} 2>&1 | tee -a {log}"
