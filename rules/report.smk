# Figures and tables for `snakemake --report report.html`; captions in rules/captions/.
rule report_dataset:
    input:
        table=PREPARED_TABLE,
        summary=PREPARED_SUMMARY,
        skipped=PREPARED_SKIPPED,
    output:
        report(
            report_file("dataset.png"),
            caption="captions/dataset.rst",
            category="1. Dataset",
        ),
    log:
        "logs/report/dataset.log",
    conda:
        ENV
    params:
        script=script("report_figures.py"),
    shell:
        "python -u {params.script:q} dataset --table {input.table} --summary {input.summary}"
        " --skipped {input.skipped} --out {output} 2>&1 | tee {log}"


rule report_extraction:
    input:
        all_manifests,
    output:
        png=report(
            report_file("extraction.png"),
            caption="captions/extraction.rst",
            category="2. Extraction",
        ),
        csv=report(
            report_file("extraction.csv"),
            caption="captions/extraction.rst",
            category="2. Extraction",
        ),
    log:
        "logs/report/extraction.log",
    conda:
        ENV
    params:
        script=script("report_figures.py"),
        config=RESOLVED,
    shell:
        "python -u {params.script:q} extraction --config {params.config}"
        " --out {output.png} --table {output.csv} 2>&1 | tee {log}"


rule report_validation:
    input:
        all_validations,
    output:
        png=report(
            report_file("validation.png"),
            caption="captions/validation.rst",
            category="3. Validation",
        ),
        csv=report(
            report_file("validation.csv"),
            caption="captions/validation.rst",
            category="3. Validation",
        ),
    log:
        "logs/report/validation.log",
    conda:
        ENV
    params:
        script=script("report_figures.py"),
        config=RESOLVED,
    shell:
        "python -u {params.script:q} validation --config {params.config}"
        " --out {output.png} --table {output.csv} 2>&1 | tee {log}"


rule report_training:
    input:
        TRAIN_LOG,
    output:
        report(
            report_file("training.png"),
            caption="captions/training.rst",
            category="4. Drafter",
        ),
    log:
        "logs/report/training.log",
    conda:
        ENV
    params:
        script=script("report_figures.py"),
    shell:
        "python -u {params.script:q} training --log {input} --out {output} 2>&1 | tee {log}"


rule report_acceptance:
    input:
        eval=EVAL_REPORT,
        live=LIVE_REPORT,
    output:
        png=report(
            report_file("acceptance.png"),
            caption="captions/acceptance.rst",
            category="4. Drafter",
        ),
        csv=report(
            report_file("acceptance.csv"),
            caption="captions/acceptance.rst",
            category="4. Drafter",
        ),
    log:
        "logs/report/acceptance.log",
    conda:
        ENV
    params:
        script=script("report_figures.py"),
    shell:
        "python -u {params.script:q} acceptance --eval {input.eval} --live {input.live}"
        " --out {output.png} --table {output.csv} 2>&1 | tee {log}"


rule report_benchmarks:
    """One table of every benchmark: per drafter, setting, category and turn."""
    input:
        benchmark_results,
    output:
        report(
            report_file("benchmarks.csv"),
            caption="captions/benchmark.rst",
            category="5. Benchmarks",
        ),
    log:
        "logs/report/benchmarks.log",
    conda:
        ENV
    params:
        script=script("report_figures.py"),
    shell:
        "python -u {params.script:q} benchmarks {input} --table {output} 2>&1 | tee {log}"
