# Helpers and input functions; the logic is in eaglepipe.plan (shard plan, provenance stamps,
# rerun policy) and eaglepipe.ops.snakefile_hooks (start and end of a run).
import os

import eaglepipe.ops.snakefile_hooks as hooks
import eaglepipe.plan.freshness as freshness
import eaglepipe.plan.provenance as provenance
import eaglepipe.core.config as config_paths
from eaglepipe.core.config import RESOLVED_CONFIG
from eaglepipe.core.run import resolve_at_workflow_start
from eaglepipe.drafter.live import live_export_engine
from eaglepipe.server.sglang.recipe import check_sglang_settings
from eaglepipe.server.handoff.dumps import check_dump_root
from eaglepipe.drafter.variants import check_draft_layer, check_export_support
from eaglepipe.data.tokenizer import check_chat_template_files
from eaglepipe.core.errors import one_line_errors
import eaglepipe.prompt_bench.checks as benchmark_checks
from eaglepipe.prompt_bench.measure import BENCHMARK_DIR, benchmark_export_engine
from snakemake.utils import validate

hooks.tune_gc_for_dag()
# A config or dataset error ends the parse with one `error:` line, not a traceback.
with one_line_errors():
    hooks.use_project_python()
    # Our check first: its message names the offending key; then Snakemake's, which fills
    # defaults. RUN is the run description every rule's wiring reads (eaglepipe/core/run.py).
    RUN = resolve_at_workflow_start(
        config,
        config_files=workflow.overwrite_configfiles,
        loaded_files=workflow.configfiles,
        command_line=workflow.config_settings.config,
    )
    validate(config, schema="../schemas/config.schema.yaml")
    # A drafter variant an exported engine cannot load is refused before anything runs.
    check_export_support(RUN.train.drafter.as_dict(), RUN.export.engines)
    # An MLA draft layer for a target without MLA (the toy is a Llama), not at the train job.
    check_draft_layer(
        RUN.train.drafter.layer, RUN.model.text_config if RUN.model.exists else {}
    )
    # A target without a chat template, before the toy build or a server start.
    check_chat_template_files(RUN)
    # And live acceptance without the export it serves, in one line, not as a rule's error.
    LIVE_EXPORT_ENGINE = live_export_engine(RUN)
    # SGLang flags the launcher sets itself or capture cannot take, before any job starts.
    check_sglang_settings(RUN)
    # A handoff root the server's start would refuse (a file, another user's directory).
    check_dump_root(RUN.server.handoff_root)
    SHARDS = provenance.shards(RUN)
    provenance.check_shard_plan(RUN)
    MODEL_CONFIG = provenance.model_config_file(RUN)
    provenance.write_stamps(RUN)
    REGENERATE = RUN.dataset.regenerate.enabled
    REGENERATION_IS_FRESH = (
        freshness.regeneration_freshness(RUN) if REGENERATE else None
    )
    SHARD_IS_FRESH = freshness.shard_freshness(RUN)
    PREPARE_IS_FRESH = freshness.prepare_is_fresh(RUN)
    STALE_VALIDATIONS = freshness.stale_validations(RUN, SHARDS)
    INCOMPLETE_TARGETS = freshness.incomplete_targets(SHARDS, regenerate=REGENERATE)
    # Benchmarks (benchmarks.run): an unknown name, a missing prompt file, a field mapping
    # the file lacks or a drafter SGLang would not load, before any job runs.
    BENCHMARKS = RUN.benchmarks.names
    benchmark_checks.check_benchmarks(RUN)
    benchmark_checks.write_benchmark_stamps(RUN)
    # The bytes the plan stores per stage, once the tokenized table exists (the run's start
    # refuses a plan that cannot fit, Snakefile onstart).
    DISK_PLAN = hooks.state_disk_plan(workflow, RUN)
# Output paths: the library's constants (eaglepipe/core/config.py, and the per-shard paths of
# eaglepipe/plan), so a rule and the code reading its output never disagree. Only logs are
# named in the rules themselves.
SHARD_WILDCARDS = "rows_{start}-{end}"
TOY_MODEL_CONFIG = str(config_paths.TOY_MODEL_CONFIG)
PREPARED_TABLE = str(config_paths.PREPARED_TABLE)
PREPARED_SUMMARY = str(config_paths.PREPARED_SUMMARY)
PREPARED_SKIPPED = str(config_paths.PREPARED_SKIPPED)
REGENERATED_MANIFEST = provenance.regenerated_manifest_path(SHARD_WILDCARDS)
REGENERATION_SUMMARY = str(config_paths.REGENERATION_SUMMARY)
SHARD_MANIFEST = freshness.manifest_path(SHARD_WILDCARDS)
VALIDATION_REPORT = freshness.validation_report_path(SHARD_WILDCARDS)
DRAFT_VOCAB = str(config_paths.DRAFT_VOCAB)
DRAFTER_MODEL = str(config_paths.DRAFTER_MODEL)
TRAIN_LOG = str(config_paths.TRAIN_LOG)
TRAIN_CHECKPOINTS = str(config_paths.TRAIN_CHECKPOINTS)
EVAL_REPORT = str(config_paths.EVAL_REPORT)
EVAL_PLOT = str(config_paths.EVAL_PLOT)
LIVE_REPORT = str(config_paths.LIVE_REPORT)
EXPORT_FILE = f"{config_paths.EXPORT_DIR}/{{engine}}/{{name}}"
REPORT_DIR = str(config_paths.REPORT_DIR)


def report_file(name):
    return f"{REPORT_DIR}/{name}"


# What extraction reads of prepare's outputs, and whether they exist at parse time.
PREPARED_INPUTS = {"table": PREPARED_TABLE, "summary": PREPARED_SUMMARY}
PREPARED_PRESENT = all(os.path.exists(path) for path in PREPARED_INPUTS.values())
RUN_TOKEN = hooks.run_token()
PER_SHARD_RESOURCES = hooks.per_shard_job_resources(workflow)
RESOLVED = str(RESOLVED_CONFIG)
ENV = "../envs/pipeline.yaml"
TOY_STAMP = str(provenance.TOY_STAMP)
DATASET = RUN.dataset.path


wildcard_constraints:
    start=r"\d+",
    end=r"\d+",
    engine=r"sglang|vllm",
    # Only configured benchmarks have a rule (names are [A-Za-z0-9_-], schema-checked).
    benchmark="|".join(BENCHMARKS) or "(?!)",


def script(name):
    return f"{workflow.basedir}/scripts/{name}"


def output_dir(wildcards, output):
    """The directory holding the rule's first output."""
    return os.path.dirname(output[0])


def export_root(wildcards, output):
    """drafter/export: the parent of the per-engine export directories."""
    return os.path.dirname(os.path.dirname(output[0]))


def shard_name(wildcards):
    return f"rows_{wildcards.start}-{wildcards.end}"


def when_stale(path, fresh):
    """A fresh stage's inputs are ancient(): only changed content may trigger it."""
    return ancient(path) if fresh else path


@hooks.known_parameters
def regenerate_inputs(wildcards):
    shard = shard_name(wildcards)
    fresh = REGENERATION_IS_FRESH(shard)
    # A stale shard takes every input plain: Snakemake does not check a job for reasons of its
    # own when it is reached only through ancient() inputs (eaglepipe/plan/provenance.py).
    return {
        "stamp": when_stale(str(provenance.regeneration_stamp(shard)), fresh),
        "dataset": ancient(DATASET),
        "model": when_stale(MODEL_CONFIG, fresh),
    }


@hooks.known_parameters
def extract_inputs(wildcards):
    shard = shard_name(wildcards)
    fresh = SHARD_IS_FRESH(shard)
    inputs = {
        "stamp": when_stale(str(provenance.shard_stamp(shard)), fresh),
        "model": ancient(MODEL_CONFIG),
    }
    # A fresh shard's own rows decide, not the table: while prepare makes the table again
    # (a failed prepare removed it), a fresh shard takes no input from it, since Snakemake
    # reruns every job with a missing input, ancient() or not (eaglepipe/plan/freshness.py).
    for name, path in PREPARED_INPUTS.items():
        if not fresh or PREPARED_PRESENT:
            inputs[name] = when_stale(path, fresh)
    return inputs


@hooks.known_parameters
def validate_inputs(wildcards):
    shard = shard_name(wildcards)
    inputs = {"manifest": freshness.manifest_path(shard)}
    if shard in STALE_VALIDATIONS:
        # A stale report: a new stamp reruns it.
        inputs["stamp"] = str(freshness.validation_stamp(shard))
    if shard in STALE_VALIDATIONS or not os.path.exists(
        freshness.validation_report_path(shard)
    ):
        # A report to (re)write gets the plain table input: when prepare reruns, Snakemake
        # never looks at the jobs behind it that only ancient() inputs link, not even for a
        # missing output, so without this edge the report would silently not be written.
        inputs["table"] = PREPARED_TABLE
    return inputs


def stage_stamp(stage):
    return str(provenance.stage_stamp(stage))


def prepare_inputs(wildcards):
    fresh = PREPARE_IS_FRESH
    inputs = {
        "stamp": when_stale(str(provenance.PREPARE_STAMP), fresh),
        "dataset": ancient(DATASET),
        "model": when_stale(MODEL_CONFIG, fresh),
    }
    # Prepare reads the regenerated rows of every shard (its provenance holds their checksums:
    # a shard regenerated with other rows makes it stale); the summary stands for all of them.
    # A fresh prepare takes no input from a deleted summary, which `all` makes again: a missing
    # input would rerun prepare, ancient() or not.
    if REGENERATE and (not fresh or os.path.exists(REGENERATION_SUMMARY)):
        inputs["regenerated"] = when_stale(REGENERATION_SUMMARY, fresh)
    return inputs


def regenerated_manifests():
    return [
        when_stale(provenance.regenerated_manifest_path(shard), PREPARE_IS_FRESH)
        for shard in SHARDS
    ]


def prepared_table(wildcards=None):
    return when_stale(PREPARED_TABLE, PREPARE_IS_FRESH)


def all_manifests(wildcards=None):
    return [freshness.manifest_path(shard) for shard in SHARDS]


def all_validations(wildcards=None):
    return [freshness.validation_report_path(shard) for shard in SHARDS]


def export_targets(wildcards=None):
    return expand(
        EXPORT_FILE, engine=RUN.export.engines, name=config_paths.EXPORT_FILES
    )


def live_acceptance_inputs(wildcards):
    """The export live acceptance reads follows server.engine and export.engines; none when
    evaluate.live_prompts is 0 (the stage then only records the skip)."""
    inputs = {
        "table": prepared_table(),
        "offline": EVAL_REPORT,
        "settings": stage_stamp("live_acceptance"),
    }
    if LIVE_EXPORT_ENGINE:
        inputs["export"] = EXPORT_FILE.format(
            engine=LIVE_EXPORT_ENGINE, name="model.safetensors"
        )
    return inputs


def live_export_arg(wildcards, input):
    if "export" not in input.keys():
        return ""
    return f"--export-dir {os.path.dirname(input.export)}"


def benchmark_engine():
    return benchmark_export_engine(RUN)


def benchmark_inputs(wildcards):
    """The export the benchmark serves, its stamp, the prompt file and the other drafters'
    files (content decides: their checksums are in the stamp)."""
    name = wildcards.benchmark
    inputs = {
        "export": f"{config_paths.EXPORT_DIR}/{benchmark_engine()}/model.safetensors",
        "settings": str(benchmark_checks.stamp_path(name)),
    }
    for drafter, path in RUN.benchmarks.drafters:
        inputs[f"drafter_{drafter}"] = ancient(f"{path}/model.safetensors")
    # One live server (or CPU decode) at a time, and timings not shared with another: after
    # live acceptance and the benchmark before this one (order only: ancient).
    earlier = BENCHMARKS[: BENCHMARKS.index(name)]
    inputs["after"] = ancient(
        benchmark_file(earlier[-1], "json") if earlier else LIVE_REPORT
    )
    return inputs


def benchmark_file(name, suffix):
    return f"{BENCHMARK_DIR}/{name}.{suffix}"


def benchmark_export_dir(wildcards, input):
    return os.path.dirname(input.export)


def benchmark_results(wildcards=None):
    return [benchmark_file(name, "json") for name in BENCHMARKS]


def benchmark_targets():
    if not BENCHMARKS:
        return []
    plots = [benchmark_file(name, "png") for name in BENCHMARKS]
    return [*benchmark_results(), *plots, report_file("benchmarks.csv")]


def report_figures(wildcards=None):
    return [
        report_file(name)
        for name in (
            "dataset.png",
            "extraction.png",
            "extraction.csv",
            "validation.png",
            "validation.csv",
            "training.png",
            "acceptance.png",
            "acceptance.csv",
        )
    ]


def final_targets():
    # Every shard's validation is an input of train, so `all` need not list 5,000 of them again:
    # each extra listing is one more edge Snakemake resolves and checks per shard. Missing
    # intermediates are targets, though: Snakemake would not rebuild them otherwise
    # (eaglepipe/plan/freshness.py, "runs left inconsistent").
    return [
        MODEL_CONFIG,
        *([REGENERATION_SUMMARY] if REGENERATE else []),
        PREPARED_TABLE,
        PREPARED_SUMMARY,
        PREPARED_SKIPPED,
        DRAFT_VOCAB,
        DRAFTER_MODEL,
        TRAIN_LOG,
        EVAL_REPORT,
        EVAL_PLOT,
        LIVE_REPORT,
        *export_targets(),
        *report_figures(),
        *benchmark_targets(),
        *INCOMPLETE_TARGETS,
    ]
