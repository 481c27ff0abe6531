"""What the benchmark stage needs, checked when the workflow starts (`snakemake -n` included),
each problem in one line naming the benchmark and its config key: an unknown benchmark (the
known ones listed), a missing prompt file (how to get it), a field mapping the file does not
match, a speculative setting the engine would not run, a drafter directory SGLang would not
load. Also the settings each benchmark's results depend on, as a stamp its rule takes."""

from __future__ import annotations

from ..core.errors import PipelineError
from ..core.fingerprint import hash_file
from ..core.run import RunSpec
from ..drafter.live_run import SpeculativeSetting
from ..plan.provenance import PROVENANCE_DIR
from .drafters import check_draft_dir
from .measure import benchmark_export_engine
from .prompt_file import check_fields, prompt_source


def check_benchmarks(run: RunSpec) -> None:
    settings = run.benchmarks
    if not settings.run:
        return
    for text in settings.speculative:
        try:
            setting = SpeculativeSetting.parse(text)
        except PipelineError as exc:
            raise PipelineError(f"config key benchmarks.speculative: {exc}") from None
        if setting.topk != 1 and run.server.engine != "sglang":
            raise PipelineError(
                f"config key benchmarks.speculative: {text} drafts a tree (top-k "
                f"{setting.topk}); the reference engine's harness drafts chains (top-k 1): "
                "use server.engine sglang or a top-k 1 setting"
            )
    benchmark_export_engine(run)
    for benchmark in settings.run:
        check_fields(prompt_source(benchmark))
    for name, directory in settings.drafters:
        check_draft_dir(name, directory)


def stamp_path(name: str):
    return PROVENANCE_DIR / f"benchmark-{name}.json"


def benchmark_stamp(run: RunSpec, name: str) -> dict:
    """Everything a benchmark's results depend on besides the export: its settings and prompt
    file's content, the speculative settings, the other drafters' files, how the target is
    served."""
    benchmark = run.benchmarks.get(name)
    server = run.server
    source = prompt_source(benchmark)
    drafters = {
        drafter: {f: hash_file(f"{path}/{f}") for f in ("config.json", "model.safetensors")}
        for drafter, path in run.benchmarks.drafters
    }
    return {
        "benchmark": benchmark.as_dict(),
        "prompt_file_xxh3_128": hash_file(source.path),
        "speculative": list(run.benchmarks.speculative),
        "drafters": drafters,
        "bad_rows": run.dataset.bad_rows,
        "engine": server.engine,
        "device": server.device,
        "dtype": server.dtype,
        "sglang": server.sglang.as_dict() if server.engine == "sglang" else None,
    }


def write_benchmark_stamps(run: RunSpec) -> None:
    """Rewrite each benchmark's stamp whose content changed (its mtime moves only then)."""
    from ..core.atomic import write_json_if_changed

    for name in run.benchmarks.names:
        write_json_if_changed(
            stamp_path(name), {"settings": benchmark_stamp(run, name)}, durable=False
        )
