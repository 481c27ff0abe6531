rule build_toy_target:
    """The embedded default target: a tiny seeded Llama and BPE tokenizer, built locally."""
    input:
        stamp=TOY_STAMP,
        corpus=ancient(DATASET),
    output:
        TOY_MODEL_CONFIG,
    log:
        "logs/build_toy_target.log",
    conda:
        ENV
    threads: 2
    params:
        script=script("build_toy_target.py"),
        config=RESOLVED,
        out_dir=output_dir,
    shell:
        "python -u {params.script:q} --config {params.config} --out {params.out_dir}"
        " 2>&1 | tee {log}"


rule prepare:
    """Tokenize with the chat template, build loss masks, split, record skipped rows."""
    input:
        unpack(prepare_inputs),
    output:
        table=PREPARED_TABLE,
        summary=PREPARED_SUMMARY,
        skipped=PREPARED_SKIPPED,
    log:
        "logs/prepare.log",
    conda:
        ENV
    # One tokenizing process per thread (eaglepipe/prepare/rows.py).
    threads: 2
    params:
        script=script("prepare.py"),
        config=RESOLVED,
    shell:
        "python -u {params.script:q} --config {params.config} --workers {threads}"
        " 2>&1 | tee {log}"
