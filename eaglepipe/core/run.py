"""The run description: the validated configuration, resolved once into typed, frozen parts.

    config.yaml --config.validate_config (schema, defaults)--> dict --resolve()--> RunSpec

The Snakefile resolves the configuration when it is parsed and, when the run starts its jobs
(not in a dry run), writes the resolved config (`.eaglepipe/config.json`) and, beside it, the
facts derived from it (`.eaglepipe/run.json`, for people); every job loads the description
back with `load_run`. Stages take the parts they
need (`run.server`, `run.train`, `run.model`, ...); nothing downstream reads the raw YAML or
re-derives a fact from it.

What is derived here, and only here:
- the target (`TargetModel`): its directory (the user's, or the embedded toy's), its
  config.json and language-model part, depth, hidden size, and its fingerprints (config hash,
  weights, tokenizer). Facts of the model's files are read once per process on first use, not
  at workflow start: the embedded toy target is built during the run, after the parse;
- the aux layer ids, in the convention of `layers.py`;
- the handoff directory root.
Identity and provenance keys built from the description live in the server's `identity.py`
(what a server computes, when chunks are reused) and in `plan/provenance.py` with
`plan/freshness.py` (what makes a stage stale).
"""

from __future__ import annotations

import getpass
import json
import os
from dataclasses import asdict, dataclass, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from . import config as cfg
from .drafter_options import MLA_DIMS, drafter_options
from .errors import PipelineError
from .fingerprint import (
    hash_json,
    missing_weights,
    model_config_hash,
    tokenizer_files,
    tokenizer_fingerprint,
    weights_fingerprint,
)
from .hidden_store import HiddenStore

RUN_FACTS = cfg.STATE_DIR / "run.json"
# Requests in flight per job when `extract.max_inflight_requests` is null, by what the job does
# and where its server computes. Measured on the H200 (8B-shaped target, SGLang 0.5.14,
# BENCHMARKS.md "Throughput at scale"): two extraction jobs x 64 kept the prefill at 0.977x of
# bare SGLang with every job running (0.945x at 32); generation rose up to 256 requests in
# flight (bench_serving 4,171 / 4,885 / 5,496 / 5,694 output tok/s at 64 / 128 / 256 / 512), so
# two regeneration jobs x 128. A CPU server batches few tokens at once: more would only queue.
AUTO_INFLIGHT_REQUESTS = {
    "extract": {"gpu": 64, "cpu": 32},
    "regenerate": {"gpu": 128, "cpu": 32},
}


def _build(cls, values: dict):
    """A section dataclass from its validated dict (lists become tuples: frozen all the way)."""
    kwargs = {}
    for f in fields(cls):
        value = values[f.name]
        kwargs[f.name] = tuple(value) if isinstance(value, list) else value
    return cls(**kwargs)


class Section:
    """Settings of one config section; `as_dict()` is what provenance hashes."""

    def as_dict(self) -> dict:
        return json.loads(json.dumps(asdict(self)))


@dataclass(frozen=True)
class ToySettings(Section):
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    max_position_embeddings: int
    seed: int
    train_steps: int
    train_seq_len: int
    train_batch_size: int


def check_toy_shape(toy: dict) -> None:
    """Head counts the toy target's hidden size cannot be split into (also the build's check)."""
    if toy["hidden_size"] % toy["num_heads"]:
        raise PipelineError("config key model.toy.hidden_size must be divisible by num_heads")
    if toy["num_heads"] % toy["num_kv_heads"]:
        raise PipelineError("config key model.toy.num_heads must be divisible by num_kv_heads")


@dataclass(frozen=True)
class HoldoutSettings(Section):
    mode: str
    fraction: float
    seed: int
    shards: tuple[str, ...]


@dataclass(frozen=True)
class RegenerateSettings(Section):
    """`dataset.regenerate`: re-answer the assistant turns with the target before prepare."""

    enabled: bool
    max_new_tokens: int
    temperature: float
    top_p: float
    seed: int
    turns: str  # all | last
    on_length_limit: str  # keep | bad_row

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def sampling(self) -> dict:
        """The sampling settings a regenerated reply depends on. Greedy decoding ignores
        top_p and the seed, so they are left out: changing them reruns nothing."""
        if self.greedy:
            return {"greedy": True, "max_new_tokens": self.max_new_tokens}
        return {
            "greedy": False,
            "max_new_tokens": self.max_new_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "seed": self.seed,
        }

    def output_settings(self) -> dict:
        """Everything besides the model and the source rows that a regenerated shard depends on."""
        return {
            "sampling": self.sampling(),
            "turns": self.turns,
            "on_length_limit": self.on_length_limit,
        }


@dataclass(frozen=True)
class UnusableLimit(Section):
    """`dataset.unusable_limit`: the fractions of source rows and of assistant tokens that may
    be unusable under `bad_rows: skip` before the run stops (data/loss_counts.py)."""

    rows: float
    assistant_tokens: float


@dataclass(frozen=True)
class DatasetSettings(Section):
    path: str
    format: str
    max_length: int
    # trim: keep a conversation up to its first turn out of order (SpecForge, EAGLE); strict:
    # such a row is a bad row (data/dataset.py).
    turn_order: str
    bad_rows: str
    unusable_limit: UnusableLimit
    holdout: HoldoutSettings
    regenerate: RegenerateSettings


@dataclass(frozen=True)
class ShardSettings(Section):
    rows_per_shard: int
    chunk_max_bytes: int


@dataclass(frozen=True)
class SGLangSettings(Section):
    tp_size: int
    mem_fraction_static: float
    extra_args: tuple[str, ...]


@dataclass(frozen=True)
class ServerSettings(Section):
    engine: str
    host: str
    port: int | None  # None: a port drawn for the working directory (server/ports.py)
    device: str
    dtype: str
    max_batch_tokens: int
    attention: str
    health_timeout_s: float
    idle_timeout_s: float
    lease_ttl_s: float
    dump_root: str | None
    sglang: SGLangSettings

    @property
    def handoff_root(self) -> Path:
        """Where dump directories go: `dump_root`, else a per-user tmpfs directory."""
        if self.dump_root:
            return Path(self.dump_root)
        shm = Path("/dev/shm")
        if shm.is_dir() and os.access(shm, os.W_OK):
            return shm / f"eaglepipe-{getpass.getuser()}"
        return (cfg.STATE_DIR / "dumps").resolve()


@dataclass(frozen=True)
class ExtractSettings(Section):
    request_prefix: str
    max_inflight_requests: int | None  # None: AUTO_INFLIGHT_REQUESTS, by the server's device
    max_inflight_bytes: int | None
    lookahead_bytes: int | None
    chunk_writeback_mb: int  # 0: the kernel times the chunks' disk writes
    store: HiddenStore  # the stored dtype of the aux and the final states
    retries: int
    request_timeout_s: float

    def inflight_requests(self, job: str, server_info: dict) -> int:
        """Requests one `job` ("extract" or "regenerate") keeps in flight against the server
        whose `/server_info` (in the pipeline's terms) is `server_info`."""
        if self.max_inflight_requests is not None:
            return int(self.max_inflight_requests)
        return AUTO_INFLIGHT_REQUESTS[job]["gpu" if server_on_gpu(server_info) else "cpu"]


def server_on_gpu(server_info: dict) -> bool:
    """Whether the server computes on a GPU, from its `/server_info` in the pipeline's terms."""
    if server_info.get("engine") == "sglang":  # always on GPUs
        return True
    return str(server_info.get("device", "")).startswith("cuda")  # the reference server's torch


@dataclass(frozen=True)
class ValidateSettings(Section):
    spot_check_rows: int
    seed: int
    noise_margin: float
    neighbour_fraction: float
    server_noise_floor: float
    norm_drift_factor: float
    independent_forward: bool


@dataclass(frozen=True)
class MLASettings(Section):
    """The MLA draft layer's dimensions; None takes the target's (drafter/variants.py)."""

    q_lora_rank: int | None
    kv_lora_rank: int | None
    qk_nope_head_dim: int | None
    qk_rope_head_dim: int | None
    v_head_dim: int | None


@dataclass(frozen=True)
class DrafterSettings(Section):
    """The drafter variant (`train.drafter`, drafter/variants.py)."""

    layer: str
    fc_norm: bool
    norm_before_fc: bool
    norm_output: bool
    norm_before_residual: bool
    mla: MLASettings


@dataclass(frozen=True)
class TrainSettings(Section):
    draft_vocab_size: int
    ttt_length: int
    step_weight_decay: float
    batch_tokens: int
    max_len: int
    epochs: int
    lr: float
    warmup_steps: int
    weight_decay: float
    grad_clip: float
    checkpoint_every: int
    seed: int
    precision: str
    device: str
    drafter: DrafterSettings


@dataclass(frozen=True)
class EvaluateSettings(Section):
    max_rows: int
    live_prompts: int
    live_new_tokens: int


@dataclass(frozen=True)
class ExportSettings(Section):
    engines: tuple[str, ...]


# ---------------------------------------------------------------- benchmarks


@dataclass(frozen=True)
class BenchmarkFields(Section):
    """Which field of a prompt file's row is the prompt, the category and the id (None: the
    known benchmark's, or none)."""

    prompt: str | None
    category: str | None
    id: str | None


@dataclass(frozen=True)
class BenchmarkSettings(Section):
    """One configured benchmark (`benchmarks.run.<name>`): its prompt file, how to read it, the
    subset and the reply budget."""

    name: str
    path: str | None  # None: the known benchmark's bundled copy
    fields: BenchmarkFields
    per_category: int | None
    max_new_tokens: int
    sha256: str | None
    count: int | None


@dataclass(frozen=True)
class BenchmarksSettings(Section):
    """The benchmark stage: which benchmarks, at which speculative settings, for which drafters
    besides ours (name -> draft directory, in config order)."""

    run: tuple[BenchmarkSettings, ...]
    speculative: tuple[str, ...]
    drafters: tuple[tuple[str, str], ...]

    @property
    def names(self) -> list[str]:
        return [b.name for b in self.run]

    def get(self, name: str) -> BenchmarkSettings:
        for benchmark in self.run:
            if benchmark.name == name:
                return benchmark
        raise PipelineError(f"config key benchmarks.run: no benchmark named {name!r}")


def resolve_benchmarks(section: dict) -> BenchmarksSettings:
    """The `benchmarks` section (defaults filled by the schema) as typed settings."""
    run = []
    for name, entry in (section.get("run") or {}).items():
        values = {**entry, "name": name, "fields": _build(BenchmarkFields, entry["fields"])}
        run.append(_build(BenchmarkSettings, values))
    return BenchmarksSettings(
        run=tuple(run),
        speculative=tuple(section["speculative"]),
        drafters=tuple((name, str(path)) for name, path in section["drafters"].items()),
    )


@dataclass(frozen=True)
class TargetModel:
    """The target model: where it is and what its files say (read once, on first use)."""

    directory: Path
    is_toy: bool
    trust_remote_code: bool
    toy: ToySettings | None  # the toy target's settings (set when is_toy)

    @property
    def config_file(self) -> Path:
        return self.directory / "config.json"

    @property
    def exists(self) -> bool:
        return self.config_file.is_file()

    @cached_property
    def config(self) -> dict:
        """The model's config.json."""
        try:
            config = json.loads(self.config_file.read_text())
        except (FileNotFoundError, NotADirectoryError):
            raise PipelineError(f"model.path: {self.config_file} does not exist") from None
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise PipelineError(
                f"model.path: {self.config_file} is not valid JSON ({exc})"
            ) from None
        if not isinstance(config, dict):
            raise PipelineError(f"model.path: {self.config_file} holds no JSON object")
        return config

    def _text_config_int(self, key: str) -> int:
        if key not in self.text_config:
            raise PipelineError(
                f"model.path: {self.config_file} has no {key!r} (for the language model)"
            )
        return self._whole_number(key)

    def _whole_number(self, key: str) -> int:
        """The config's `key` as an integer: a whole float (2048.0) is one, text ("8") or a
        fraction is not (transformers would fail on it, or the checks would pass wrongly)."""
        value = self.text_config[key]
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, bool) or not isinstance(value, int):
            raise PipelineError(
                f"model.path: {self.config_file}: {key!r} is {value!r}, not an integer"
            )
        return value

    @property
    def text_config(self) -> dict:
        """The language-model part (multimodal wrappers such as Kimi-K2.5 nest it)."""
        return cfg.text_config(self.config)

    @property
    def architecture(self) -> str | None:
        return (self.config.get("architectures") or [None])[0]

    @property
    def num_layers(self) -> int:
        """Decoder depth; the toy's is known from its settings before it is built."""
        if self.is_toy and not self.exists:
            return self.toy.num_layers
        return self._text_config_int("num_hidden_layers")

    @property
    def hidden_size(self) -> int:
        if self.is_toy and not self.exists:
            return self.toy.hidden_size
        return self._text_config_int("hidden_size")

    @property
    def max_positions(self) -> int | None:
        """The target's max_position_embeddings (the toy's from its settings before it is
        built), or None when its config does not say."""
        if self.is_toy and not self.exists:
            return self.toy.max_position_embeddings
        if self.text_config.get("max_position_embeddings") is None:
            return None
        return self._whole_number("max_position_embeddings")

    @cached_property
    def config_hash(self) -> str:
        return model_config_hash(self.directory)

    @cached_property
    def weights_fingerprint(self) -> str:
        return weights_fingerprint(self.directory)

    @cached_property
    def tokenizer_fingerprint(self) -> str:
        return tokenizer_fingerprint(self.directory)

    @property
    def has_tokenizer(self) -> bool:
        return bool(tokenizer_files(self.directory))

    def require_weights(self) -> None:
        """Refuse a user's model directory `from_pretrained` would find no weights in (the toy's
        are built by the run), before the server fails on it."""
        if self.is_toy:
            return
        problem = missing_weights(self.directory)
        if problem:
            raise PipelineError(
                f"model.path {self.directory} {problem}: the server could not load the model; "
                "copy the weights there or point model.path at the full model directory"
            )


@dataclass(frozen=True)
class RunSpec:
    """One run, resolved: every section typed and frozen, the target and its layers derived."""

    model: TargetModel
    dataset: DatasetSettings
    shards: ShardSettings
    aux_layer_ids_setting: tuple[int, ...] | None
    server: ServerSettings
    extract: ExtractSettings
    validate: ValidateSettings
    train: TrainSettings
    evaluate: EvaluateSettings
    export: ExportSettings
    benchmarks: BenchmarksSettings
    # The resolved config as canonical JSON: what is written for jobs and hashed as a whole.
    resolved_json: str

    @cached_property
    def aux_layer_ids(self) -> list[int]:
        """The three captured layers (0-based decoder-layer outputs; layers.py)."""
        from .layers import resolve_aux_layer_ids

        setting = list(self.aux_layer_ids_setting) if self.aux_layer_ids_setting else None
        return resolve_aux_layer_ids(setting, self.model.num_layers)

    @cached_property
    def config_hash(self) -> str:
        """Hash of the whole resolved configuration."""
        return hash_json(json.loads(self.resolved_json))

    def resolved_config(self) -> dict:
        """A fresh copy of the resolved configuration (for writing, or a changed copy)."""
        return json.loads(self.resolved_json)

    def facts(self) -> dict:
        """What the description derives, for people (`.eaglepipe/run.json`)."""
        model = self.model
        facts: dict[str, Any] = {
            "model_dir": str(model.directory),
            "toy_target": model.is_toy,
            "num_layers": model.num_layers,
            "hidden_size": model.hidden_size,
            "aux_layer_ids": self.aux_layer_ids,
            "engine": self.server.engine,
            "handoff_root": str(self.server.handoff_root),
        }
        if model.exists:
            facts["architecture"] = model.architecture
        return facts


def resolve(config: dict) -> RunSpec:
    """The run description of a validated configuration (`config.validate_config`'s result)."""
    model_cfg = config["model"]
    path = model_cfg["path"]
    if not path and not model_cfg.get("toy"):
        raise PipelineError("config key model.toy: needed when model.path is null (the toy target)")
    toy = _build(ToySettings, model_cfg["toy"]) if model_cfg.get("toy") else None
    if toy is not None and not path:
        check_toy_shape(model_cfg["toy"])
    dataset = dict(config["dataset"])
    dataset["holdout"] = _build(HoldoutSettings, dataset["holdout"])
    dataset["unusable_limit"] = _build(UnusableLimit, dataset["unusable_limit"])
    dataset["regenerate"] = _build(RegenerateSettings, dataset["regenerate"])
    server = dict(config["server"])
    server["sglang"] = _build(SGLangSettings, server["sglang"])
    ids = config.get("aux_layer_ids")
    extract = dict(config["extract"])
    extract["store"] = HiddenStore(**extract["store"])
    train = dict(config["train"])
    drafter = drafter_options(train["drafter"])  # its defaults, and options that contradict
    drafter["mla"] = _build(MLASettings, {k: drafter["mla"].get(k) for k in MLA_DIMS})
    train["drafter"] = _build(DrafterSettings, drafter)
    return RunSpec(
        model=TargetModel(
            directory=Path(path) if path else cfg.TOY_MODEL_DIR,
            is_toy=not path,
            trust_remote_code=bool(model_cfg["trust_remote_code"]),
            toy=toy,
        ),
        dataset=_build(DatasetSettings, dataset),
        shards=_build(ShardSettings, config["shards"]),
        aux_layer_ids_setting=tuple(ids) if ids else None,
        server=_build(ServerSettings, server),
        extract=_build(ExtractSettings, extract),
        validate=_build(ValidateSettings, config["validate"]),
        train=_build(TrainSettings, train),
        evaluate=_build(EvaluateSettings, config["evaluate"]),
        export=_build(ExportSettings, config["export"]),
        benchmarks=resolve_benchmarks(config["benchmarks"]),
        resolved_json=json.dumps(config, sort_keys=True),
    )


def config_from_arg(path: str | os.PathLike) -> dict:
    """What a script's or `eaglepipe`'s `--config` names: the resolved JSON the workflow wrote,
    or a config file as `snakemake --configfile` takes one (YAML or JSON): read over the
    working directory's config.yaml, which the Snakefile loads first, so one that sets only a
    few keys describes the same run as the workflow does."""
    path = Path(path)
    if path.suffix == ".json" and path.resolve() == cfg.RESOLVED_CONFIG.resolve():
        return cfg.read_resolved(path)
    # Only a config file means yaml (a job reads the resolved JSON: eaglepipe.core.config).
    from .config_files import load_config

    base = cfg.WORKFLOW_CONFIG
    if not base.is_file() or base.resolve() == path.resolve():
        base = None
    return load_config(path, base=base)


def load_run(path: str | os.PathLike = cfg.RESOLVED_CONFIG) -> RunSpec:
    """The description a job runs under: the resolved JSON its run wrote, or a YAML config."""
    return resolve(config_from_arg(path))


def write_run(run: RunSpec) -> None:
    """Write the resolved config for jobs and the derived facts for people (each only when its
    content changes)."""
    from .atomic import write_json_if_changed

    cfg.write_resolved(run.resolved_config())
    write_json_if_changed(RUN_FACTS, run.facts())


def resolve_at_workflow_start(
    config: dict, *, config_files=(), loaded_files=(), command_line: dict | None = None
) -> RunSpec:
    """Snakemake's `config`, validated and resolved when the Snakefile is parsed: what can be
    checked before any job runs is (the aux layer ids against the target's depth, a missing
    model directory or weights). Nothing is written: every parse resolves, dry runs included,
    and only a run that executes jobs records its description (`write_run`, from the
    Snakefile's onstart), so `snakemake -n` with another config never changes what a running or
    finished run recorded.

    `config_files` are the files given with `--configfile`, `loaded_files` every config file
    Snakemake read (the Snakefile's `configfile:` too), and `command_line` what `--config` set
    (Snakemake's `workflow.overwrite_configfiles`, `workflow.configfiles`,
    `workflow.config_settings.config`): a key given twice in a file and a target read as a
    config file are named, and `--config` values get their schema types (`config` is changed
    in place, for Snakemake's own validation after this one)."""
    # Reading config files means yaml: imported here, at workflow start, and never by a job.
    from .config_files import check_config_files, type_command_line_values

    check_config_files(config_files, loaded_files)
    type_command_line_values(config, command_line or {})
    run = resolve(cfg.validate_config(config))
    run.facts()  # reads the target's depth and checks the aux layer ids: one clear error here
    run.model.require_weights()
    check_token_budgets(run)
    return run


def check_token_budgets(run: RunSpec) -> None:
    """Lengths the target cannot hold, refused at the start: every regenerate request failed
    on them, each blamed on its row (and `bad_rows: skip` would have dropped every row)."""
    limit = run.model.max_positions
    if limit is None:
        return
    where = "model.toy" if run.model.is_toy and not run.model.exists else run.model.config_file
    if run.dataset.max_length > limit:
        raise PipelineError(
            f"config key dataset.max_length: {run.dataset.max_length} is more than the target's "
            f"max_position_embeddings, {limit} ({where}): lower it"
        )
    regenerate = run.dataset.regenerate
    if regenerate.enabled and regenerate.max_new_tokens >= limit:
        raise PipelineError(
            f"config key dataset.regenerate.max_new_tokens: {regenerate.max_new_tokens} leaves "
            f"no room for a prompt within the target's max_position_embeddings, {limit} "
            f"({where}): lower it"
        )
    evaluate = run.evaluate
    if evaluate.live_prompts and evaluate.live_new_tokens >= limit:
        # Found by live acceptance, the last stage, after the whole run.
        raise PipelineError(
            f"config key evaluate.live_new_tokens: {evaluate.live_new_tokens} leaves no room "
            f"for a prompt within the target's max_position_embeddings, {limit} ({where}): "
            "lower it"
        )
