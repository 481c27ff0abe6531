rule build_toy_target:
    """The embedded default target: a tiny seeded Llama and BPE tokenizer, built locally."""
    input:
        corpus=ancient(DATASET),
    output:
        "models/toy-target/config.json",
    log:
        "logs/build_toy_target.log",
    threads: 2
    params:
        toy=CONFIG["model"]["toy"],
    shell:
        "{PYTHON} -u {SCRIPTS}/build_toy_target.py --config {RESOLVED} --out models/toy-target"
        " 2>&1 | tee {log}"


rule prepare:
    """Tokenize with the chat template, build loss masks, split, record skipped rows."""
    input:
        dataset=ancient(DATASET),
        model=ancient(MODEL_CONFIG),
    output:
        table="prepared/tokenized.parquet",
        summary="prepared/summary.json",
        skipped="prepared/skipped.json",
    log:
        "logs/prepare.log",
    params:
        provenance=prepare_provenance,
    shell:
        "{PYTHON} -u {SCRIPTS}/prepare.py --config {RESOLVED} 2>&1 | tee {log}"
