"""The SGLang launch recipe: the command line, its environment, and the layer-id translation.

Every `sglang.launch_server` command the pipeline runs is built by `server_argv`: the capture
and generation servers of extraction and regeneration (`launch_command`) and the live
acceptance servers (`drafter/live_sglang.py`, with `draft_model_flags`).

SGLang captures aux hidden states and calls the project's hook (patch/eaglepipe_hook.py) through
`--forward-hooks`; nothing in SGLang is edited. The supported releases are a range
(patch/sglang.toml: oldest, newest, recommended); the launcher reads the installed version from
the server's environment and refuses one outside the range. How the capture is switched on is
the one thing that differs across the range, chosen here from the version:

- `flags` (from CAPTURE_FLAGS_SINCE on): SGLang's capture-only mode,
  `--speculative-algorithm EAGLE3 --enable-return-aux-hidden-states
  --return-aux-hidden-state-layer-ids ...` with no draft model.
- `plugin` (older releases, which lack those flags): the launcher passes the ids in
  EAGLEPIPE_SGLANG_CAPTURE_LAYER_IDS and the project's SGLang plugin
  (eaglepipe/server/sglang/plugin.py, entry point group `sglang.srt.plugins`, loaded by SGLang
  in every scheduler process) calls the target model's `set_eagle3_layers_to_capture(ids)` right
  after it is loaded, as capture-only mode does.

Every flag and behaviour used for a version is checked against that version's source by
tests/test_sglang_contract.py; docs/sglang.md records the live runs.

How the hook module is found: `patch/` is prepended to PYTHONPATH in the environment returned by
`launch_command`, so the server process (and its per-rank scheduler processes, which inherit the
environment) import it as the top-level module `eaglepipe_hook`. It imports
`eaglepipe.server.handoff.dump_writer`,
so SGLang must run where eaglepipe is importable (the `sglang` extra). SGLANG_PATH_ENV adds path
entries for the server only (an SGLang staged beside a Python whose own packages conflict).

What SGLang's own `/server_info` reports (not the reference server's schema): its resolved
arguments (`model_path`, `tp_size`, `return_aux_hidden_state_layer_ids` in SGLang's convention
on releases with capture-only flags, `forward_hooks` including our hook's `config` with
`dump_dir`, `request_prefix`, `aux_layer_ids` in our convention and SGLang's capture ids),
`launch_command`, and `version`. The lifecycle code takes dump_dir and the rest from its own
state file, not from that endpoint.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import random
import socket
import sys
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from packaging.version import InvalidVersion, Version

from ...core.errors import PipelineError
from ...core.hidden_store import BF16_STORE, HiddenStore
from ...core.layers import CONVENTION
from ...core.run import RunSpec

# The checkout's patch/ (the project runs from its repository, installed editable).
PATCH_DIR = Path(__file__).resolve().parents[3] / "patch"
HOOK_MODULE = "eaglepipe_hook"
HOOK_FACTORY = f"{HOOK_MODULE}:make_dump_hook"
HOOK_NAME = "eaglepipe-dump"
# The logits processor sits at the top of Llama/DeepSeek classes and under `language_model` in
# KimiK25ForConditionalGeneration; both names are fnmatch patterns in SGLang's hook manager.
HOOK_TARGET_MODULES = ["logits_processor", "language_model.logits_processor"]

# SGLang's LlamaForCausalLM.set_eagle3_layers_to_capture adds 1 to every explicit id: it takes
# ids in the layer-output convention, which is ours.
_ADDS_ONE = "adds-one"
# DeepseekV2ForCausalLM's adds 1 only when the first id is 1 and otherwise captures the ids as
# given (layer-input convention); DeepseekV3 inherits it and Kimi-K2.5 delegates to it.
_ADDS_ONE_IF_FIRST_IS_ONE = "adds-one-if-first-is-one"

# Architectures whose capture behaviour the contract test verified in both ends' source.
LAYER_ID_RULES = {
    "LlamaForCausalLM": _ADDS_ONE,
    "MistralForCausalLM": _ADDS_ONE,
    "DeepseekV2ForCausalLM": _ADDS_ONE_IF_FIRST_IS_ONE,
    "DeepseekV3ForCausalLM": _ADDS_ONE_IF_FIRST_IS_ONE,
    "KimiK25ForConditionalGeneration": _ADDS_ONE_IF_FIRST_IS_ONE,
}

_DTYPE_FLAG_VALUES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32"}


RANGE_FILE = PATCH_DIR / "sglang.toml"
# Extra path entries (os.pathsep-separated) for the SGLang server process only, ahead of the rest.
SGLANG_PATH_ENV = "EAGLEPIPE_SGLANG_PYTHONPATH"
# The first release with capture-only EAGLE3 (--enable-return-aux-hidden-states and
# --return-aux-hidden-state-layer-ids); 0.5.14 to 0.5.22 have neither flag.
CAPTURE_FLAGS_SINCE = "0.5.23"
CAPTURE_BY_FLAGS = "flags"
CAPTURE_BY_PLUGIN = "plugin"
# The project's SGLang general plugin: SGLang loads it through this entry point.
PLUGIN_GROUP = "sglang.srt.plugins"
PLUGIN_NAME = "eaglepipe"
PLUGIN_ENTRY = "eaglepipe.server.sglang.plugin:register"
# SGLang's whitelist of general plugins (comma-separated names); unset loads every plugin.
SGLANG_PLUGINS_ENV = "SGLANG_PLUGINS"


@dataclass(frozen=True)
class SupportedRange:
    oldest: str
    newest: str
    recommended: str

    def contains(self, version: str) -> bool:
        return Version(self.oldest) <= Version(version) <= Version(self.newest)

    def __str__(self) -> str:
        return f"SGLang {self.oldest} to {self.newest} (recommended {self.recommended})"


def supported_range() -> SupportedRange:
    """The SGLang releases the integration supports (patch/sglang.toml)."""
    try:
        data = tomllib.loads(RANGE_FILE.read_text())
        found = SupportedRange(str(data["oldest"]), str(data["newest"]), str(data["recommended"]))
    except FileNotFoundError:
        raise PipelineError(
            f"{RANGE_FILE} is missing: the SGLang range belongs to the checkout"
        ) from None
    except (tomllib.TOMLDecodeError, KeyError) as exc:
        raise PipelineError(f"{RANGE_FILE}: needs oldest, newest and recommended ({exc})") from None
    if not found.contains(found.recommended):
        raise PipelineError(f"{RANGE_FILE}: recommended {found.recommended} is outside the range")
    return found


def server_path_entries(environ: dict | None = None) -> list[str]:
    """The PYTHONPATH the SGLang server gets: patch/, SGLANG_PATH_ENV's entries, then the
    caller's own PYTHONPATH."""
    environ = os.environ if environ is None else environ
    entries = [str(PATCH_DIR)]
    for name in (SGLANG_PATH_ENV, "PYTHONPATH"):
        entries += [p for p in environ.get(name, "").split(os.pathsep) if p]
    return entries


def _server_search_path(environ: dict | None = None) -> list[str]:
    """Where the server's Python looks for packages: its PYTHONPATH, then this interpreter's
    own entries (the server runs this interpreter, `sys.executable`)."""
    return server_path_entries(environ) + [p for p in sys.path if p]


def installed_sglang_version(environ: dict | None = None) -> str | None:
    """The version of the SGLang the server would import (first on its path), or None."""
    for dist in importlib.metadata.distributions(name="sglang", path=_server_search_path(environ)):
        return dist.version
    return None


def plugin_registered(environ: dict | None = None) -> bool:
    """Whether SGLang's plugin loader would find the project's plugin in the server's path."""
    for dist in importlib.metadata.distributions(path=_server_search_path(environ)):
        for entry in dist.entry_points:
            if (entry.group, entry.name, entry.value) == (PLUGIN_GROUP, PLUGIN_NAME, PLUGIN_ENTRY):
                return True
    return False


def check_supported(version: str | None) -> str:
    """The installed version if the integration supports it; else one line naming both."""
    supported = supported_range()
    if version is None:
        raise PipelineError(
            f"server.engine sglang: no SGLang is installed for {sys.executable} (with "
            f"{SGLANG_PATH_ENV}={os.environ.get(SGLANG_PATH_ENV, '')!r}); "
            f"eaglepipe supports {supported}"
        )
    try:
        inside = supported.contains(version)
    except InvalidVersion:
        inside = False
    if not inside:
        raise PipelineError(
            f"server.engine sglang: SGLang {version} is installed; eaglepipe supports {supported}"
        )
    return version


def capture_mechanism(version: str) -> str:
    """How the capture is switched on in `version`: capture-only flags, or the plugin."""
    if Version(version) >= Version(CAPTURE_FLAGS_SINCE):
        return CAPTURE_BY_FLAGS
    return CAPTURE_BY_PLUGIN


def sglang_layer_ids(
    architecture: str, our_ids: list[int], *, num_layers: int | None = None
) -> list[int]:
    """The capture ids that make SGLang capture `our_ids` (passed as
    `--return-aux-hidden-state-layer-ids`, or to the plugin, by release).

    Our id k is the output of decoder layer k, which SGLang captures as the input of layer
    k + 1 (`model.layers_to_capture`). With `num_layers`, the last layer's output is refused:
    nothing follows it, so SGLang cannot capture it.
    """
    rule = LAYER_ID_RULES.get(architecture)
    if rule is None:
        raise PipelineError(
            f"server.engine sglang: architecture {architecture} is not supported; its aux "
            f"capture convention is verified only for {', '.join(sorted(LAYER_ID_RULES))}"
        )
    ids = [int(i) for i in our_ids]
    if num_layers is not None and ids and ids[-1] >= num_layers - 1:
        raise PipelineError(
            f"aux_layer_ids {ids}: SGLang cannot capture the output of the last decoder layer "
            f"({num_layers - 1}) of a {num_layers}-layer model; choose a lower id"
        )
    if rule == _ADDS_ONE:
        return ids
    if ids and ids[0] == 0:
        # Passing 1 first would be shifted to 2; passing 0 captures the embedding output.
        raise PipelineError(
            f"aux_layer_ids {ids}: {architecture} in SGLang cannot capture the output of "
            "decoder layer 0 (its capture list shifts a leading 1 to 2); choose ids >= 1"
        )
    # The first id passed is then >= 2, so SGLang takes the list as layer-input ids as given.
    return [i + 1 for i in ids]


def hook_spec(
    *,
    dump_dir: str | os.PathLike,
    request_prefix: str,
    aux_layer_ids: list[int],
    instance_id: str,
    hidden_size: int | None = None,
    capture_layer_ids: list[int] | None = None,
    capture: bool = True,
    store: HiddenStore = BF16_STORE,
) -> dict:
    """The `--forward-hooks` entry: SGLang calls `make_dump_hook(spec["config"])` per rank.

    The config also carries what the pipeline's clients check (hidden size, instance) and the
    ids SGLang captures: SGLang echoes it in `/server_info`, which `pipeline_server_info` reads
    back (releases without capture-only flags report no capture ids of their own).
    """
    config = {
        "dump_dir": str(dump_dir),
        "request_prefix": request_prefix,
        "aux_layer_ids": list(aux_layer_ids),
        "instance_id": instance_id,
        "hidden_size": hidden_size,
        "capture_layer_ids": None if capture_layer_ids is None else list(capture_layer_ids),
    }
    if not store.is_default:
        # The hook quantizes on the GPU (core/hidden_store.py); absent, it writes bf16.
        config["store"] = store.as_dict()
    if not capture:
        # A generation-only server: it dumps nothing, and the hook refuses a prefixed
        # (extraction) request loudly, as it arrives without aux hidden states.
        config["capture"] = False
    return {
        "name": HOOK_NAME,
        "target_modules": list(HOOK_TARGET_MODULES),
        "hook_factory": HOOK_FACTORY,
        "config": config,
    }


def pipeline_server_info(raw: dict) -> dict:
    """SGLang's `/server_info` in the reference server's terms (docs/CONTRACTS.md, "Server").

    SGLang reports its resolved arguments; our hook's config among them names the layers (our
    convention), the dump dir and the instance. Clients check these before sending a request.
    """
    hooks = [h for h in raw.get("forward_hooks") or [] if h.get("name") == HOOK_NAME]
    if not hooks:
        raise PipelineError(
            f"SGLang at {raw.get('host')}:{raw.get('port')} runs without the eaglepipe forward "
            "hook: it was not started by this pipeline; stop it or use another server.port"
        )
    hook = hooks[0]["config"]
    capture_ids = raw.get("return_aux_hidden_state_layer_ids")
    if capture_ids is None:  # no capture-only flags in this release: the plugin's ids
        capture_ids = hook.get("capture_layer_ids")
    return {
        "engine": "sglang",
        "engine_version": raw.get("version"),
        "model_path": raw.get("model_path"),
        "aux_layer_ids": hook["aux_layer_ids"],
        "layer_convention": CONVENTION,
        "hidden_size": hook.get("hidden_size"),
        "dump_dir": hook["dump_dir"],
        "request_prefix": hook["request_prefix"],
        "instance_id": hook["instance_id"],
        "sglang_capture_layer_ids": capture_ids,
        "capture": hook.get("capture", True),
        "store": hook.get("store") or BF16_STORE.as_dict(),
    }


# What the capture needs besides switching it on: every request whole in one eager prefill,
# where forward hooks fire. A generation-only server runs without them.
CAPTURE_ONLY_FLAGS = (
    "--disable-radix-cache",
    "--chunked-prefill-size=-1",
    "--disable-prefill-cuda-graph",
    "--disable-decode-cuda-graph",
)

# Extra args that would break per-request capture; each maps to why.
_REFUSED_FLAGS = {
    "--enable-dp-attention": "data-parallel attention splits the batch across ranks, so TP "
    "rank 0 would miss tokens",
    "--enable-layernorm-sp": "sequence parallelism shards tokens across ranks",
    "--enable-two-batch-overlap": "the overlapped micro-batch skips the capture loop",
    "--enable-pdmux": "split prefill runs the logits processor without aux hidden states",
    "--enable-hierarchical-cache": "the hierarchical cache is a prefix cache",
    "--enable-hicache": "the hierarchical cache is a prefix cache",
    "--enable-mixed-chunk": "mixed chunks put partial prefills in a batch",
    "--enable-torch-compile": "compiled forwards may bypass Python forward hooks",
    "--cuda-graph-config": "it can re-enable the prefill CUDA graph, where hooks do not fire",
    "--enable-prefill-cp": "prefill context parallelism splits each request's tokens across ranks",
}
# Flags the launcher sets itself: from the named config key, or always (None).
_LAUNCHER_FLAGS = {
    "--model-path": "model.path",
    "--model": "model.path",
    "--tp-size": "server.sglang.tp_size",
    "--tensor-parallel-size": "server.sglang.tp_size",
    "--host": "server.host",
    "--port": "server.port",
    "--mem-fraction-static": "server.sglang.mem_fraction_static",
    "--trust-remote-code": "model.trust_remote_code",
    "--dtype": "server.dtype",
    "--return-aux-hidden-state-layer-ids": "aux_layer_ids",
    "--speculative-algorithm": None,
    "--speculative-draft-model-path": None,
    "--speculative-draft-model": None,
    "--enable-return-aux-hidden-states": None,
    "--forward-hooks": None,
    "--disable-radix-cache": None,
    "--disable-prefill-cuda-graph": None,
    "--disable-decode-cuda-graph": None,
}
# Flags allowed only at the value that keeps a single tensor-parallel group.
_MUST_BE_ONE = {
    "--dp-size": "data parallelism gives each replica its own requests and ranks",
    "--data-parallel-size": "data parallelism gives each replica its own requests and ranks",
    "--attn-dp-size": "data-parallel attention splits the batch across ranks",
    "--attention-data-parallel-size": "data-parallel attention splits the batch across ranks",
    "--pp-size": "pipeline parallelism leaves the aux layers on other ranks",
    "--pipeline-parallel-size": "pipeline parallelism leaves the aux layers on other ranks",
    "--attn-cp-size": "context parallelism splits each request's tokens across ranks",
    "--attention-context-parallel-size": "context parallelism splits each request's tokens "
    "across ranks",
}


def _flag_values(extra_args: list[str]) -> list[tuple[str, str | None]]:
    """(flag, value) pairs from `--flag value` / `--flag=value` / bare `--flag` tokens."""
    pairs = []
    i = 0
    while i < len(extra_args):
        token = extra_args[i]
        if not token.startswith("--"):
            i += 1
            continue
        if "=" in token:
            flag, value = token.split("=", 1)
            pairs.append((flag, value))
            i += 1
            continue
        nxt = extra_args[i + 1] if i + 1 < len(extra_args) else None
        if nxt is not None and not nxt.startswith("--"):
            pairs.append((token, nxt))
            i += 2
        else:
            pairs.append((token, None))
            i += 1
    return pairs


def _is_one(value: str | None) -> bool:
    try:
        return value is None or int(value) == 1
    except ValueError:
        return False


def check_sglang_settings(run: RunSpec) -> None:
    """The SGLang settings a server start would refuse, refused when the workflow starts."""
    if run.server.engine == "sglang":
        check_extra_args([str(a) for a in run.server.sglang.extra_args])


def check_extra_args(extra_args: list[str]) -> None:
    """Refuse extra args that break per-request capture or fight the launcher's own flags."""
    key = "server.sglang.extra_args"
    for flag, value in _flag_values(extra_args):
        if flag in _REFUSED_FLAGS:
            raise PipelineError(f"{key}: {flag} is not supported: {_REFUSED_FLAGS[flag]}")
        if flag in _LAUNCHER_FLAGS:
            source = _LAUNCHER_FLAGS[flag]
            how = f"from config key {source}" if source else "itself, for capture"
            raise PipelineError(f"{key}: {flag} is set by the launcher {how}")
        if flag in _MUST_BE_ONE and not _is_one(value):
            raise PipelineError(
                f"{key}: {flag} {value} is not supported (tensor parallelism only): "
                f"{_MUST_BE_ONE[flag]}"
            )
        if flag == "--chunked-prefill-size" and value != "-1":
            raise PipelineError(
                f"{key}: {flag} {value} re-enables chunked prefill, which splits a request "
                "across forwards; only -1 is accepted"
            )
        if flag == "--cuda-graph-backend-prefill" and value != "disabled":
            raise PipelineError(
                f"{key}: {flag} {value} re-enables the prefill CUDA graph, where forward hooks "
                "do not fire; only 'disabled' is accepted"
            )


# SGLang (0.5.14 on) derives a gRPC port, `--port` + 10000, and refuses to start when that is
# past 65535 unless SGLANG_GRPC_PORT names another: so a server port must stay at or below this.
GRPC_PORT_OFFSET = 10000
MAX_SERVER_PORT = 65535 - GRPC_PORT_OFFSET
GRPC_PORT_ENV = "SGLANG_GRPC_PORT"


def check_port(port: int, what: str = "server.port") -> None:
    if port > MAX_SERVER_PORT and not os.environ.get(GRPC_PORT_ENV):
        raise PipelineError(
            f"{what} {port}: SGLang also uses port {port} + {GRPC_PORT_OFFSET} (gRPC), past "
            f"65535; choose a port up to {MAX_SERVER_PORT} (or set {GRPC_PORT_ENV})"
        )


def free_server_port(host: str, low: int = 20000) -> int:
    """A port free on `host` that SGLang accepts (see `check_port`)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    for port in random.sample(range(low, MAX_SERVER_PORT + 1), 200):
        with socket.socket(family, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((host, port))
            except OSError:
                continue
            return port
    raise PipelineError(f"no free port between {low} and {MAX_SERVER_PORT} on {host}")


def server_argv(run: RunSpec, *, host: str, port: int, flags: Sequence[str] = ()) -> list[str]:
    """`python -m sglang.launch_server` for the target: the flags every server of the pipeline
    gets from the configuration, then `flags` (what makes it a capture, generation or drafting
    server), then `server.sglang.extra_args` (refused where they break the capture or fight
    these flags)."""
    sglang_cfg = run.server.sglang
    extra_args = [str(a) for a in sglang_cfg.extra_args]
    check_extra_args(extra_args)
    check_port(port)
    argv = [
        sys.executable,
        "-m",
        "sglang.launch_server",
        "--model-path",
        str(run.model.directory.resolve()),
        "--tp-size",
        str(sglang_cfg.tp_size),
        "--host",
        host,
        "--port",
        str(port),
        "--mem-fraction-static",
        str(sglang_cfg.mem_fraction_static),
    ]
    if run.model.trust_remote_code:
        argv.append("--trust-remote-code")
    dtype = _DTYPE_FLAG_VALUES.get(run.server.dtype)
    if dtype:
        argv += ["--dtype", dtype]
    return [*argv, *flags, *extra_args]


def draft_model_flags(
    draft_dir: str | os.PathLike, *, steps: int, topk: int, draft_tokens: int
) -> list[str]:
    """The flags that serve the target with an EAGLE-3 draft model (live acceptance): `steps`
    draft steps of top-`topk`, `draft_tokens` verified per round."""
    return [
        "--speculative-algorithm",
        "EAGLE3",
        "--speculative-draft-model-path",
        str(Path(draft_dir).resolve()),
        "--speculative-num-steps",
        str(steps),
        "--speculative-eagle-topk",
        str(topk),
        "--speculative-num-draft-tokens",
        str(draft_tokens),
    ]


def launch_command(
    run: RunSpec,
    *,
    host: str,
    port: int,
    dump_dir: str | os.PathLike,
    instance_id: str,
    sglang_version: str | None = None,
    capture: bool = True,
) -> tuple[list[str], dict[str, str]]:
    """The SGLang server command for `config`, and the extra environment it needs.

    `dump_dir` (`<dump_root>/<instance_id>/`, made by the caller) and `instance_id` travel in
    the hook's config; the hook logs both when SGLang registers it. `sglang_version` defaults to
    the SGLang installed for the server (`installed_sglang_version`); it decides the capture
    mechanism, and a version outside patch/sglang.toml's range is refused.

    `capture=False` is a generation-only server (regeneration): the same command without the
    capture and without the four flags only the capture needs, so SGLang keeps its radix cache,
    chunked prefill and CUDA graphs (decode with CUDA graphs ran 1.58x the eager decode on the
    H200, BENCHMARKS.md); the hook stays, inert, for `/server_info` and as a guard.
    """
    from ...core import config as cfg
    from .plugin import CAPTURE_ENV

    if not (PATCH_DIR / f"{HOOK_MODULE}.py").is_file():
        raise PipelineError(f"{PATCH_DIR / (HOOK_MODULE + '.py')} is missing from the checkout")
    # What `server_argv` refuses, refused before the installed SGLang is looked up.
    check_extra_args([str(a) for a in run.server.sglang.extra_args])
    check_port(port)
    version = check_supported(
        sglang_version if sglang_version is not None else installed_sglang_version()
    )
    mechanism = capture_mechanism(version)
    if capture and mechanism == CAPTURE_BY_PLUGIN and not plugin_registered():
        raise PipelineError(
            f"server.engine sglang: SGLang {version} needs the eaglepipe SGLang plugin (entry "
            f"point {PLUGIN_GROUP}: {PLUGIN_NAME}), which is not installed for {sys.executable}: "
            "install the project into that environment (pip install -e .)"
        )

    model_path = run.model.directory.resolve()
    model_config = run.model.config
    architectures = model_config.get("architectures") or []
    if not architectures:
        raise PipelineError(f"model.path: {model_path}/config.json names no architectures")
    num_layers = run.model.num_layers
    our_ids = run.aux_layer_ids
    capture_ids = sglang_layer_ids(architectures[0], our_ids, num_layers=num_layers)
    spec = hook_spec(
        dump_dir=dump_dir,
        request_prefix=run.extract.request_prefix,
        aux_layer_ids=our_ids,
        instance_id=instance_id,
        hidden_size=cfg.text_config(model_config).get("hidden_size"),
        capture_layer_ids=capture_ids if capture else None,
        capture=capture,
        store=run.extract.store,
    )

    flags = []
    if capture and mechanism == CAPTURE_BY_FLAGS:
        flags += [
            "--speculative-algorithm",
            "EAGLE3",
            "--enable-return-aux-hidden-states",
            "--return-aux-hidden-state-layer-ids",
            *[str(i) for i in capture_ids],
        ]
    flags += ["--forward-hooks", json.dumps([spec], separators=(",", ":"))]
    if capture:
        flags += list(CAPTURE_ONLY_FLAGS)
    argv = server_argv(run, host=host, port=port, flags=flags)

    # Extra environment, merged over os.environ by the lifecycle code. The capture ids are
    # always set (empty with the flags), so none left in the caller's environment leaks in.
    env = {
        "PYTHONPATH": os.pathsep.join(server_path_entries()),
        "PYTHONUNBUFFERED": "1",
        CAPTURE_ENV: json.dumps(capture_ids) if capture and mechanism == CAPTURE_BY_PLUGIN else "",
    }
    allowed = os.environ.get(SGLANG_PLUGINS_ENV)
    if allowed and PLUGIN_NAME not in [name.strip() for name in allowed.split(",")]:
        env[SGLANG_PLUGINS_ENV] = f"{allowed},{PLUGIN_NAME}"
    return argv, env
