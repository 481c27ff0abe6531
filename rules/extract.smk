rule extract:
    """One shard of hidden states through the shared server; resumes finished chunks."""
    input:
        unpack(extract_inputs),
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
    shell:
        "python -u {params.script} --config {params.config}"
        " --shard rows_{wildcards.start}-{wildcards.end} 2>&1 | tee {log}"
