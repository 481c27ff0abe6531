rule vocab:
    """Draft vocabulary from loss-masked token frequencies of the training rows."""
    input:
        table=prepared_table,
        settings=stage_stamp("vocab"),
    output:
        DRAFT_VOCAB,
    log:
        "logs/vocab.log",
    conda:
        ENV
    params:
        script=script("vocab.py"),
        config=RESOLVED,
    shell:
        "python -u {params.script:q} --config {params.config} --table {input.table}"
        " --out {output} 2>&1 | tee {log}"


rule train:
    """EAGLE-3 drafter; gated on every shard's validation report."""
    input:
        vocab=DRAFT_VOCAB,
        table=prepared_table,
        # Each validation's input is its shard's manifest (a re-extracted shard is revalidated,
        # which reruns training), so the 5,000 manifests the script reads are not listed again.
        validated=all_validations,
        settings=stage_stamp("train"),
    output:
        model=DRAFTER_MODEL,
        log=TRAIN_LOG,
    log:
        "logs/train.log",
    benchmark:
        "logs/benchmarks/train.tsv"
    conda:
        ENV
    threads: 2
    params:
        script=script("train.py"),
        config=RESOLVED,
        checkpoints=TRAIN_CHECKPOINTS,
    shell:
        "python -u {params.script:q} --config {params.config} --vocab {input.vocab}"
        " --table {input.table} --out {output.model} --log {output.log}"
        " --checkpoint-dir {params.checkpoints} 2>&1 | tee {log}"


rule evaluate:
    """Per-position accuracy and simulated acceptance length on held-out rows."""
    input:
        # The held-out shards it reads are validated before training: upstream of the model.
        model=DRAFTER_MODEL,
        vocab=DRAFT_VOCAB,
        table=prepared_table,
        settings=stage_stamp("evaluate"),
    output:
        json=EVAL_REPORT,
        plot=EVAL_PLOT,
    log:
        "logs/evaluate.log",
    conda:
        ENV
    params:
        script=script("evaluate.py"),
        config=RESOLVED,
    shell:
        "python -u {params.script:q} --config {params.config} --model {input.model}"
        " --vocab {input.vocab} --table {input.table} --out {output.json} --plot {output.plot} 2>&1 | tee {log}"


rule export:
    """Drafter checkpoints that SGLang and vLLM load as an EAGLE-3 draft model."""
    input:
        model=DRAFTER_MODEL,
        vocab=DRAFT_VOCAB,
        settings=stage_stamp("export"),
    output:
        export_targets(),
    log:
        "logs/export.log",
    conda:
        ENV
    params:
        script=script("export.py"),
        config=RESOLVED,
        out_dir=export_root,
    shell:
        "python -u {params.script:q} --config {params.config} --model {input.model}"
        " --vocab {input.vocab} --out-dir {params.out_dir} 2>&1 | tee {log}"


rule live_acceptance:
    """Real speculative decoding with an exported checkpoint against the target (through
    SGLang when server.engine is sglang); evaluate.live_prompts: 0 records a skip."""
    input:
        unpack(live_acceptance_inputs),
    output:
        LIVE_REPORT,
    log:
        "logs/live_acceptance.log",
    conda:
        ENV
    params:
        script=script("live_acceptance.py"),
        config=RESOLVED,
        export=live_export_arg,
    shell:
        "python -u {params.script:q} --config {params.config} {params.export}"
        " --table {input.table} --eval {input.offline} --out {output}"
        " 2>&1 | tee {log}"
