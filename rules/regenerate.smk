rule regenerate:
    """One shard's assistant turns re-answered by the target (dataset.regenerate); resumes the
    rows it journalled."""
    input:
        unpack(regenerate_inputs),
    output:
        REGENERATED_MANIFEST,
    log:
        "logs/regenerate/rows_{start}-{end}.log",
    benchmark:
        "logs/benchmarks/regenerate/rows_{start}-{end}.tsv"
    conda:
        ENV
    # As extraction: no `retries:`; a job retries in itself only when the server is lost.
    resources:
        **PER_SHARD_RESOURCES,
    params:
        script=script("regenerate.py"),
        config=RESOLVED,
    shell:
        "python -u {params.script:q} --config {params.config}"
        " --shard rows_{wildcards.start}-{wildcards.end} 2>&1 | tee -a {log}"


rule regeneration_summary:
    """Every regenerated shard fresh and intact, with the stage's totals: prepare's one input
    from regeneration (eaglepipe/regenerate/summary.py says why one file, not 5,000)."""
    input:
        # Prepare's stamp changes whenever a regenerated shard is stale or missing: without it
        # a summary on disk would hide a deleted manifest, as nothing would need its producer.
        stamp=when_stale(str(provenance.PREPARE_STAMP), PREPARE_IS_FRESH),
        manifests=regenerated_manifests(),
    output:
        REGENERATION_SUMMARY,
    log:
        "logs/regeneration_summary.log",
    localrule: True
    conda:
        ENV
    params:
        script=script("summarize_regeneration.py"),
        config=RESOLVED,
    shell:
        "python -u {params.script:q} --config {params.config} --out {output} 2>&1 | tee {log}"
