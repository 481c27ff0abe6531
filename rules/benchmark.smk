rule benchmark:
    """A configured benchmark (benchmarks.run) served live through server.engine's harness, for
    our export and benchmarks.drafters, at every benchmarks.speculative setting."""
    input:
        unpack(benchmark_inputs),
    output:
        json=benchmark_file("{benchmark}", "json"),
        plot=report(
            benchmark_file("{benchmark}", "png"),
            caption="captions/benchmark.rst",
            category="5. Benchmarks",
        ),
    log:
        "logs/benchmark/{benchmark}.log",
    benchmark:
        "logs/benchmarks/benchmark-{benchmark}.tsv"
    conda:
        ENV
    params:
        script=script("benchmark.py"),
        config=RESOLVED,
        export=benchmark_export_dir,
    shell:
        "python -u {params.script:q} --config {params.config} --benchmark {wildcards.benchmark}"
        " --export-dir {params.export} --out {output.json} --plot {output.plot} 2>&1 | tee {log}"
