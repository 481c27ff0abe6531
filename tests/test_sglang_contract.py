"""Contract test: every SGLang assumption of patch/, eaglepipe/server/sglang/recipe.py and
eaglepipe/server/sglang/plugin.py, checked against the source of both ends of the supported
range (patch/sglang.toml: oldest and newest; parsed with ast, never imported). Every test that
reads a wheel runs once per end, with the launch command that release gets (capture-only flags,
or the project's plugin where the release has no such flags).

Where a piece of SGLang logic decides the outcome (the capture-only validation, the layer-id
arithmetic of set_eagle3_layers_to_capture, the hook manager's pattern matching, the aux
packer's layout, the plugin hook registry) the code is taken from the wheel's source and
executed on stand-in objects, so the test follows that release's code rather than a reading of it.
"""

from __future__ import annotations

import argparse
import ast
import fnmatch
import functools
import itertools
import json
import re
import sys
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

import pytest
import torch
from sglang_source import REPO_ROOT, range_ends, sglang_source_root
from torch import nn

from eaglepipe.core.errors import PipelineError
from eaglepipe.core.run import resolve
from eaglepipe.server.sglang import recipe

pytestmark = pytest.mark.network

# Where each supported architecture's class is defined in the wheel.
ARCHITECTURE_FILES = {
    "LlamaForCausalLM": "srt/models/llama.py",
    "MistralForCausalLM": "srt/models/mistral.py",
    "DeepseekV2ForCausalLM": "srt/models/deepseek_v2.py",
    "DeepseekV3ForCausalLM": "srt/models/deepseek_v2.py",
    "KimiK25ForConditionalGeneration": "srt/models/kimi_k25.py",
}


@pytest.fixture(scope="module", params=range_ends())
def version(request) -> str:
    return request.param


@pytest.fixture(scope="module")
def src(version) -> Path:
    return sglang_source_root(version)


@pytest.fixture(scope="module")
def mechanism(version) -> str:
    return recipe.capture_mechanism(version)


def write_plugin_dist(root: Path) -> Path:
    """A distribution declaring pyproject.toml's SGLang plugin entry points, as `pip install`
    writes it: where the launcher looks, whatever this test environment has installed."""
    declared = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    points = declared["entry-points"][recipe.PLUGIN_GROUP]
    dist = root / "eaglepipe_under_test-0.0.0.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: eaglepipe-under-test\nVersion: 0\n"
    )
    lines = [f"[{recipe.PLUGIN_GROUP}]"] + [f"{k} = {v}" for k, v in points.items()]
    (dist / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return root


@pytest.fixture(scope="module", autouse=True)
def plugin_on_server_path(tmp_path_factory):
    """The project's plugin registered on the server's path for this module's launches."""
    root = write_plugin_dist(tmp_path_factory.mktemp("plugin-dist"))
    with pytest.MonkeyPatch.context() as patcher:
        patcher.setenv(recipe.SGLANG_PATH_ENV, str(root))
        yield root


@functools.cache
def parse(src: Path, rel: str) -> ast.Module:
    return ast.parse((src / rel).read_text(), filename=str(src / rel))


def find_class(tree: ast.Module, name: str) -> ast.ClassDef:
    for node in tree.body:
        if isinstance(node, ast.ClassDef) and node.name == name:
            return node
    raise AssertionError(f"class {name} not found")


def find_function(body, name: str) -> ast.FunctionDef:
    for node in body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"function {name} not found")


def compile_function(node: ast.FunctionDef, namespace: dict) -> Any:
    """Execute one extracted function definition in `namespace` and return the function."""
    module = ast.Module(body=[node], type_ignores=[])
    exec(compile(ast.fix_missing_locations(module), "<sglang-extract>", "exec"), namespace)
    return namespace[node.name]


# ---------------------------------------------------------------------------------------------
# The CLI: flags derived from the namespace field declarations, as arg_utils does
# ---------------------------------------------------------------------------------------------


class Flag:
    def __init__(self, field: str, kind: str, elem: str | None = None, choices=None):
        self.field, self.kind, self.elem, self.choices = field, kind, elem, choices
        self.default: Any = None


def _unwrap(node: ast.expr, wrapper: str) -> ast.expr | None:
    if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name):
        if node.value.id == wrapper:
            return node.slice
    return None


def _field_flag(name: str, annotation: ast.expr) -> tuple[list[str], Flag] | None:
    """Mirror of arg_utils.add_cli_args_from_dataclass for one `A[T, meta]` field."""
    if not (isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "A"):
        return None
    parts = annotation.slice.elts
    raw_type, meta = parts[0], parts[1]
    kwargs: dict[str, ast.expr] = {}
    if isinstance(meta, ast.Call) and getattr(meta.func, "id", "") == "Arg":
        kwargs = {k.arg: k.value for k in meta.keywords}
    elif not (isinstance(meta, ast.Constant) and isinstance(meta.value, str)):
        return None
    if "no_cli" in kwargs and ast.literal_eval(kwargs["no_cli"]):
        return None
    cli = ast.literal_eval(kwargs["cli_name"]) if "cli_name" in kwargs else None
    names = [cli or "--" + name.replace("_", "-")]
    if "aliases" in kwargs:
        names += ast.literal_eval(kwargs["aliases"])
    if "action" in kwargs:
        return names, Flag(name, "action")
    inner = _unwrap(raw_type, "Optional") or raw_type
    type_parser = kwargs.get("type_parser")
    if _unwrap(inner, "Literal") is not None:
        return names, Flag(name, "choice", choices=ast.literal_eval(_unwrap(inner, "Literal")))
    elem = _unwrap(inner, "List")
    if elem is not None and type_parser is None:
        return names, Flag(name, "list", elem=ast.unparse(elem))
    if type_parser is not None:
        return names, Flag(name, "parser:" + ast.unparse(type_parser))
    type_name = ast.unparse(inner)
    if type_name == "bool":
        return names, Flag(name, "store_true")
    choices = kwargs.get("choices")
    try:
        choice_values = ast.literal_eval(choices) if choices is not None else None
    except ValueError:
        choice_values = None
    return names, Flag(name, type_name, choices=choice_values)


@pytest.fixture(scope="module")
def cli_flags(version) -> dict[str, Flag]:
    return flags_of(version)


@functools.cache
def flags_of(version: str) -> dict[str, Flag]:
    """Every `--flag` of that release's `sglang.launch_server`: field-derived plus
    add_cli_args' manual ones."""
    src = sglang_source_root(version)
    flags: dict[str, Flag] = {}
    for path in sorted((src / "srt/arg_groups/fields").glob("*.py")):
        for cls in ast.parse(path.read_text()).body:
            if not isinstance(cls, ast.ClassDef):
                continue
            has_ns = any(
                isinstance(n, ast.Assign) and n.targets[0].id == "_NS_PATH"
                for n in cls.body
                if isinstance(n, ast.Assign) and isinstance(n.targets[0], ast.Name)
            )
            if not has_ns:
                continue
            for node in cls.body:
                if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    derived = _field_flag(node.target.id, node.annotation)
                    if derived and node.value is not None:
                        try:
                            derived[1].default = ast.literal_eval(node.value)
                        except ValueError:
                            derived[1].default = None
                    if derived:
                        for flag_name in derived[0]:
                            flags[flag_name] = derived[1]
    server_args = parse(src, "srt/server_args.py")
    server_args_cls = find_class(server_args, "ServerArgs")
    # Releases before the field groups declare the fields on ServerArgs itself.
    for node in server_args_cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            derived = _field_flag(node.target.id, node.annotation)
            if derived and node.value is not None:
                try:
                    derived[1].default = ast.literal_eval(node.value)
                except ValueError:
                    derived[1].default = None
            if derived:
                for flag_name in derived[0]:
                    flags[flag_name] = derived[1]
    add_cli_args = find_function(server_args_cls.body, "add_cli_args")
    for call in ast.walk(add_cli_args):
        if isinstance(call, ast.Call) and getattr(call.func, "attr", "") == "add_argument":
            kw = {k.arg: k.value for k in call.keywords}
            action = ast.unparse(kw["action"]) if "action" in kw else None
            kind = {"'store_true'": "store_true"}.get(action, action or "manual")
            for arg in call.args:
                flags[ast.literal_eval(arg)] = Flag("manual", kind)
    # The fields collected above must be what the parser is built from.
    text = (src / "srt/server_args.py").read_text()
    assert (
        "collect_input_fields" in text
        or "add_cli_args_from_dataclass(parser, ServerArgs)" in ast.unparse(add_cli_args)
    )
    return flags


def _argparse_from(flags: dict[str, Flag]) -> argparse.ArgumentParser:
    types_by_name = {"int": int, "float": float, "str": str}
    parser = argparse.ArgumentParser(add_help=False)
    by_field: dict[int, list[str]] = {}
    for name, flag in flags.items():
        by_field.setdefault(id(flag), []).append(name)
    for names in by_field.values():
        flag = flags[names[0]]
        kwargs: dict[str, Any] = {}
        if flag.field != "manual":
            kwargs.update(dest=flag.field, default=flag.default)
        if flag.kind in ("store_true", "DeprecatedStoreTrueAction"):
            kwargs["action"] = "store_true"
        elif flag.kind == "list":
            kwargs.update(nargs="+", type=types_by_name.get(flag.elem, str))
        elif flag.kind == "parser:json_list_type":
            kwargs["type"] = json.loads
        else:
            kwargs["type"] = types_by_name.get(flag.kind, str)
        parser.add_argument(*names, **kwargs)
    return parser


@pytest.fixture(scope="module")
def launch(tmp_path_factory, version):
    """launch_command for a 61-layer DeepSeek-V3 config with tp 8 (the motivating shape)."""
    model = tmp_path_factory.mktemp("dsv3")
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "num_hidden_layers": 61,
                "hidden_size": 7168,
            }
        )
    )
    config = _config(model, tp_size=8)
    argv, env = recipe.launch_command(
        resolve(config),
        host="127.0.0.1",
        port=31555,
        dump_dir="/dev/shm/x/inst1",
        instance_id="inst1",
        sglang_version=version,
    )
    return argv, env, config


def _config(model_dir: Path, *, tp_size: int = 1, extra_args=None, trust_remote_code=True):
    from eaglepipe.core.config_files import load_config

    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(model_dir)
    config["model"]["trust_remote_code"] = trust_remote_code
    config["server"]["engine"] = "sglang"
    config["server"]["dtype"] = "bfloat16"
    config["server"]["sglang"] = {
        "tp_size": tp_size,
        "mem_fraction_static": 0.85,
        "extra_args": list(extra_args or []),
    }
    return config


EXPECTED_FLAG_KINDS = {
    "--model-path": "str",
    "--tp-size": "int",
    "--host": "str",
    "--port": "int",
    "--mem-fraction-static": "float",
    "--trust-remote-code": "store_true",
    "--dtype": "str",
    "--forward-hooks": "parser:json_list_type",
    "--disable-radix-cache": "store_true",
    "--chunked-prefill-size": "int",
    "--disable-prefill-cuda-graph": "store_true",
    "--disable-decode-cuda-graph": "store_true",
}
# Capture-only EAGLE3, passed only to releases that have it.
CAPTURE_FLAG_KINDS = {
    "--speculative-algorithm": "str",
    "--enable-return-aux-hidden-states": "store_true",
    "--return-aux-hidden-state-layer-ids": "list",
}


def test_every_flag_the_launcher_passes_exists_with_the_expected_kind(
    cli_flags, launch, mechanism, version
):
    argv, _, _ = launch
    assert argv[1:3] == ["-m", "sglang.launch_server"]
    used = {token.split("=", 1)[0] for token in argv[3:] if token.startswith("--")}
    expected = dict(EXPECTED_FLAG_KINDS)
    if mechanism == recipe.CAPTURE_BY_FLAGS:
        expected |= CAPTURE_FLAG_KINDS
    assert used == set(expected)
    for flag in used:
        assert flag in cli_flags, f"{flag} is not a flag of sglang {version}"
        assert cli_flags[flag].kind == expected[flag], flag
    if mechanism == recipe.CAPTURE_BY_FLAGS:
        assert cli_flags["--return-aux-hidden-state-layer-ids"].elem == "int"
    assert {"bfloat16", "float16", "float32"} <= set(cli_flags["--dtype"].choices)


def test_the_capture_mechanism_follows_the_release(cli_flags, mechanism, version):
    """Capture-only flags where the release has them; the plugin exactly where it lacks them
    (0.5.14's parser refused them live: `unrecognized arguments`)."""
    has_flags = all(flag in cli_flags for flag in CAPTURE_FLAG_KINDS)
    assert has_flags == (mechanism == recipe.CAPTURE_BY_FLAGS), version
    if not has_flags:
        assert not any(flag in cli_flags for flag in list(CAPTURE_FLAG_KINDS)[1:])


def test_launch_argv_parses_to_the_intended_values(cli_flags, launch, mechanism):
    argv, env, config = launch
    ns = _argparse_from(cli_flags).parse_args(argv[3:])
    assert ns.tp_size == 8 and ns.port == 31555 and ns.host == "127.0.0.1"
    assert ns.mem_fraction_static == 0.85 and ns.trust_remote_code and ns.dtype == "bfloat16"
    # Ours are [1, 29, 57] for 61 layers; DeepSeek takes layer-input ids when the first is not 1.
    from eaglepipe.server.sglang.plugin import CAPTURE_ENV, capture_layer_ids

    if mechanism == recipe.CAPTURE_BY_FLAGS:
        assert ns.speculative_algorithm == "EAGLE3" and ns.enable_return_aux_hidden_states
        assert ns.return_aux_hidden_state_layer_ids == [2, 30, 58]
        assert env[CAPTURE_ENV] == "" and capture_layer_ids(env) is None
    else:
        # No speculative algorithm: 0.5.14 would load a draft model (none given) and crash.
        assert ns.speculative_algorithm is None
        assert capture_layer_ids(env) == [2, 30, 58]
    assert ns.disable_radix_cache and ns.chunked_prefill_size == -1
    assert ns.disable_prefill_cuda_graph and ns.disable_decode_cuda_graph
    [spec] = ns.forward_hooks
    assert spec["hook_factory"] == "eaglepipe_hook:make_dump_hook"
    assert spec["config"]["dump_dir"] == "/dev/shm/x/inst1"
    assert spec["config"]["aux_layer_ids"] == [1, 29, 57]
    assert spec["config"]["capture_layer_ids"] == [2, 30, 58]
    assert spec["config"]["request_prefix"] == config["extract"]["request_prefix"]
    assert env["PYTHONPATH"].split(":")[0] == str(REPO_ROOT / "patch")
    assert (REPO_ROOT / "patch" / "eaglepipe_hook.py").is_file()


def test_a_generation_server_runs_sglangs_defaults_without_the_capture(
    cli_flags, tmp_path, version
):
    """Regeneration's server (server_lease(purpose="generation")): the same command without the
    capture and the four flags only the capture needs; the hook stays, inert, its config saying
    so (an extraction request there would be refused by the hook for want of aux states)."""
    from eaglepipe.server.sglang.plugin import CAPTURE_ENV, capture_layer_ids

    model = tmp_path / "dsv3"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {
                "architectures": ["DeepseekV3ForCausalLM"],
                "num_hidden_layers": 61,
                "hidden_size": 7168,
            }
        )
    )
    config = _config(model, tp_size=8)
    kwargs = dict(host="127.0.0.1", port=31555, dump_dir="/dev/shm/x/i", instance_id="i",
                  sglang_version=version)  # fmt: skip
    capture_argv, _ = recipe.launch_command(resolve(config), **kwargs)
    argv, env = recipe.launch_command(resolve(config), capture=False, **kwargs)
    parser = _argparse_from(cli_flags)
    ns, defaults = parser.parse_args(argv[3:]), parser.parse_args(argv[3:4] + ["x"])
    assert ns.speculative_algorithm is None and capture_layer_ids(env) is None
    assert env[CAPTURE_ENV] == ""
    for field in ("disable_radix_cache", "chunked_prefill_size", "disable_prefill_cuda_graph",
                  "disable_decode_cuda_graph"):  # fmt: skip
        assert getattr(ns, field) == getattr(defaults, field), field
    [spec] = ns.forward_hooks
    assert spec["config"]["capture"] is False and spec["config"]["capture_layer_ids"] is None
    # Otherwise the capture server's command, flag for flag.
    dropped = set(recipe.CAPTURE_ONLY_FLAGS) | {
        "--speculative-algorithm", "EAGLE3", "--enable-return-aux-hidden-states",
        "--return-aux-hidden-state-layer-ids", "2", "30", "58",
    }  # fmt: skip
    capture_hooks, hooks = capture_argv.index("--forward-hooks"), argv.index("--forward-hooks")
    assert [a for a in capture_argv[:capture_hooks] if a not in dropped] == argv[:hooks]
    assert [a for a in capture_argv[capture_hooks + 2 :] if a not in dropped] == argv[hooks + 2 :]
    assert (
        recipe.pipeline_server_info({"forward_hooks": [spec], "version": version})["capture"]
        is False
    )


def test_refused_and_launcher_owned_flags_are_real_flags():
    """A refusal list naming a flag no supported SGLang has would refuse nothing. A flag only
    newer releases have needs no refusal in older ones: their parser refuses it itself."""
    named = (
        set(recipe._REFUSED_FLAGS)
        | set(recipe._LAUNCHER_FLAGS)
        | set(recipe._MUST_BE_ONE)
        | {"--chunked-prefill-size", "--cuda-graph-backend-prefill"}
    )
    per_release = {v: flags_of(v) for v in range_ends()}
    missing = sorted(f for f in named if not any(f in flags for flags in per_release.values()))
    assert not missing, f"not flags of any supported sglang: {missing}"
    for flags in per_release.values():
        for flag in recipe._MUST_BE_ONE:
            if flag in flags:
                assert flags[flag].kind == "int", flag


@pytest.mark.parametrize(
    "extra",
    [
        ["--enable-dp-attention"],
        ["--dp-size", "2"],
        ["--attn-dp-size=4"],
        ["--pp-size", "2"],
        ["--pipeline-parallel-size", "2"],
        ["--chunked-prefill-size", "8192"],
        ["--cuda-graph-backend-prefill", "full"],
        ["--enable-hierarchical-cache"],
        ["--enable-prefill-cp"],
        ["--attn-cp-size", "2"],
        ["--speculative-draft-model-path", "/x"],
        ["--tp-size", "4"],
    ],
)
def test_launcher_refuses_extra_args_that_break_capture(tmp_path, extra, version):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8})
    )
    with pytest.raises(PipelineError, match=re.escape(extra[0].split("=")[0])):
        recipe.launch_command(
            resolve(_config(tmp_path, extra_args=extra)),
            host="127.0.0.1",
            port=1,
            dump_dir=tmp_path,
            instance_id="i",
            sglang_version=version,
        )


def test_launcher_keeps_harmless_extra_args(tmp_path, version):
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8})
    )
    extra = ["--dp-size", "1", "--log-level", "info", "--chunked-prefill-size=-1"]
    argv, _ = recipe.launch_command(
        resolve(_config(tmp_path, extra_args=extra)),
        host="h",
        port=2,
        dump_dir=tmp_path,
        instance_id="i",
        sglang_version=version,
    )
    assert argv[-len(extra) :] == extra


# ---------------------------------------------------------------------------------------------
# Capture-only validation (EAGLE3 + aux capture, no draft model)
# ---------------------------------------------------------------------------------------------


def _capture_validation(src: Path):
    tree = parse(src, "srt/arg_groups/validation_hook.py")
    namespace: dict[str, Any] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(
            isinstance(t, ast.Name) and t.id == "_AUX_HIDDEN_STATE_CAPTURE_METHODS"
            for t in node.targets
        ):
            exec(compile(ast.Module([node], []), "<c>", "exec"), namespace)
    declared: dict[str, Any] = {}
    namespace["resolving_view"] = lambda server_args: server_args
    namespace["declare_resolution"] = lambda _args, _name, **kw: declared.update(kw)
    namespace["Any"] = Any
    fn = compile_function(find_function(tree.body, "handle_aux_hidden_state_capture"), namespace)
    return fn, declared


def flags_release_only(mechanism: str, version: str) -> None:
    if mechanism != recipe.CAPTURE_BY_FLAGS:
        pytest.skip(f"sglang {version} has no capture-only flags (the plugin switches the capture)")


def test_capture_only_mode_is_accepted_without_a_draft_model(
    src, cli_flags, launch, mechanism, version
):
    flags_release_only(mechanism, version)
    argv, _, _ = launch
    ns = _argparse_from(cli_flags).parse_args(argv[3:])
    handle, declared = _capture_validation(src)
    handle(ns)
    # The algorithm only names the capture convention and is reset: no draft is loaded.
    assert declared == {"speculative_algorithm": None, "aux_hidden_state_capture": "eagle3"}
    ns.speculative_draft_model_path = "/some/draft"
    with pytest.raises(ValueError, match="without a draft"):
        _capture_validation(src)[0](ns)


def test_capture_validation_runs_before_speculative_setup(src, mechanism, version):
    flags_release_only(mechanism, version)
    text = (src / "srt/arg_groups/pipeline.py").read_text()
    assert "run_hook(handle_aux_hidden_state_capture, server_args)" in text
    runner = src / "srt/model_executor/model_runner_components/spec_aux_hidden_state.py"
    tree = ast.parse(runner.read_text())
    fn = find_function(tree.body, "_resolve_capture_only_aux_hidden_state")
    body = ast.unparse(fn)
    assert "config.eagle_use_aux_hidden_state = True" in body
    assert "features.return_aux_hidden_state_layer_ids" in body
    setup = parse(src, "srt/model_executor/model_runner_components/attention_backend_setup.py")
    configure = ast.unparse(find_function(setup.body, "configure_aux_hidden_state_capture"))
    assert "model.set_eagle3_layers_to_capture(eagle_aux_hidden_state_layer_ids)" in configure


# ---------------------------------------------------------------------------------------------
# --forward-hooks: registration, pattern matching, factory signature, eager-only
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hook_manager(src):
    """SGLang's hook_manager module, executed from the wheel's source (stdlib + torch only)."""
    path = src / "srt/model_executor/hook_manager.py"
    tree = ast.parse(path.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])
    }
    assert imported <= {"fnmatch", "importlib", "logging", "typing", "torch"}
    module = types.ModuleType("sglang_hook_manager_under_test")
    exec(compile(tree, str(path), "exec"), module.__dict__)
    return module


class _LogitsProcessorStandIn(nn.Module):
    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
        return hidden_states


class _CausalLMStandIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.model = nn.Linear(2, 2)
        self.logits_processor = _LogitsProcessorStandIn()


class _KimiStandIn(nn.Module):
    def __init__(self):
        super().__init__()
        self.vision_tower = nn.Linear(2, 2)
        self.language_model = _CausalLMStandIn()


@pytest.mark.parametrize(
    "model_cls,expected",
    [(_CausalLMStandIn, "logits_processor"), (_KimiStandIn, "language_model.logits_processor")],
)
def test_hook_spec_attaches_once_to_the_logits_processor(
    hook_manager, tmp_path, monkeypatch, model_cls, expected
):
    factory_module = tmp_path / "probe_factory.py"
    factory_module.write_text(
        "calls = []\nseen = []\n"
        "def make(config):\n"
        "    calls.append(config)\n"
        "    def hook(module, args, output):\n"
        "        seen.append((module, args))\n"
        "    return hook\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    spec = recipe.hook_spec(
        dump_dir="/d", request_prefix="p", aux_layer_ids=[1, 2, 3], instance_id="i"
    )
    spec["hook_factory"] = "probe_factory:make"
    model = model_cls()
    hook_manager.register_forward_hooks(model, [spec])
    import probe_factory

    assert probe_factory.calls == [spec["config"]]
    processor = dict(model.named_modules())[expected]
    fb, aux = object(), [torch.zeros(3, 2)]
    processor(None, torch.ones(3, 2), "lm_head", fb, aux)
    [(module, args)] = probe_factory.seen
    assert module is processor
    assert args[3] is fb and args[4] is aux and len(args) == 5
    sys.modules.pop("probe_factory", None)


def test_hook_factory_path_resolves_as_module_colon_function(hook_manager, monkeypatch):
    monkeypatch.syspath_prepend(str(REPO_ROOT / "patch"))
    factory = hook_manager.resolve_callable(recipe.HOOK_FACTORY)
    assert factory.__name__ == "make_dump_hook"
    assert factory.__module__ == recipe.HOOK_MODULE


def test_forward_hooks_are_registered_after_cuda_graph_capture(src, cli_flags):
    """Hooks fire on the eager path only: they are attached after every graph capture."""
    setup = src / "srt/model_executor/model_runner_components/cuda_graph_setup.py"
    if setup.is_file():  # the graph setup moved out of ModelRunner
        tree = parse(src, "srt/model_executor/model_runner_components/cuda_graph_setup.py")
        finalize = find_function(tree.body, "finalize_cuda_graph_capture")
        assert "register_forward_hooks(model_runner.model, get_observability().forward_hooks)" in (
            ast.unparse(finalize)
        )
        hook_call, captures = (
            "finalize_cuda_graph_capture",
            (
                "capture_prefill_graph",
                "capture_decode_graph",
            ),
        )
        functions = [fn for fn in tree.body if isinstance(fn, ast.FunctionDef)]
        observability = (src / "srt/arg_groups/fields/observability.py").read_text()
        assert "forward_hooks: A[" in observability
    else:
        runner = find_class(parse(src, "srt/model_executor/model_runner.py"), "ModelRunner")
        init_graphs = find_function(runner.body, "init_cuda_graphs")
        assert "register_forward_hooks(self.model, self.server_args.forward_hooks)" in (
            ast.unparse(init_graphs)
        )
        hook_call, captures = (
            "register_forward_hooks",
            (
                "self.init_prefill_cuda_graph",
                "self.init_decode_cuda_graph",
            ),
        )
        functions = [init_graphs]
    callers = [
        fn
        for fn in functions
        if any(isinstance(c, ast.Call) and ast.unparse(c.func) == hook_call for c in ast.walk(fn))
    ]
    assert callers
    for fn in callers:
        lines: dict[str, int] = {}
        for call in ast.walk(fn):
            if isinstance(call, ast.Call):
                lines.setdefault(ast.unparse(call.func), call.lineno)
        for capture in captures:
            if capture in lines:
                assert lines[capture] < lines[hook_call], fn.name
    assert cli_flags["--forward-hooks"].field == "forward_hooks"


def test_forwards_run_on_the_current_cuda_stream(src):
    """DumpWriter orders its copy after torch.cuda.current_stream(): the forward must run there."""
    text = (src / "srt/managers/scheduler.py").read_text()
    assert "with self.device_module.StreamContext(self.schedule_stream):" in text
    assert "self.forward_stream_ctx: CudaStreamContext = self.device_module.stream(" in text
    assert "with self.forward_stream_ctx:" in text


# ---------------------------------------------------------------------------------------------
# What the hook receives
# ---------------------------------------------------------------------------------------------


def test_logits_processor_forward_parameter_order(src):
    tree = parse(src, "srt/layers/logits_processor.py")
    cls = find_class(tree, "LogitsProcessor")
    assert any(ast.unparse(b) == "nn.Module" for b in cls.bases)
    params = [a.arg for a in find_function(cls.body, "forward").args.args]
    assert params[:6] == [
        "self",
        "input_ids",
        "hidden_states",
        "lm_head",
        "logits_metadata",
        "aux_hidden_states",
    ]


@pytest.mark.parametrize(
    "rel,cls_name",
    [
        ("srt/models/llama.py", "LlamaForCausalLM"),
        ("srt/models/deepseek_v2.py", "DeepseekV2ForCausalLM"),
    ],
)
def test_models_call_the_logits_processor_positionally_with_aux(src, rel, cls_name):
    forward = find_function(find_class(parse(src, rel), cls_name).body, "forward")
    calls = [
        c
        for c in ast.walk(forward)
        if isinstance(c, ast.Call) and ast.unparse(c.func) == "self.logits_processor"
    ]
    assert calls
    for call in calls:
        assert not call.keywords
        assert [ast.unparse(a) for a in call.args] == [
            "input_ids",
            "hidden_states",
            "self.lm_head",
            "forward_batch",
            "aux_hidden_states",
        ]


@pytest.mark.parametrize(
    "rel,model_cls,collector,packed_return",
    [
        ("srt/models/llama.py", "LlamaModel", "AuxHiddenStateList", None),
        (
            "srt/models/deepseek_v2.py",
            "DeepseekV2Model",
            "AuxHiddenStatePacker",
            "(hidden_states, aux_hidden_states.finalize())",
        ),
    ],
)
def test_final_is_post_norm_and_capture_precedes_each_layer(
    src, rel, model_cls, collector, packed_return
):
    forward = find_function(find_class(parse(src, rel), model_cls).body, "forward")
    text = ast.unparse(forward)
    if f"aux_hidden_states = {collector}(" in text:
        returned = packed_return or "(hidden_states, aux_hidden_states)"
    else:  # older releases collect a plain list, whatever the model
        assert "aux_hidden_states = []" in text
        returned = "(hidden_states, aux_hidden_states)"
    # The final norm is applied before the (hidden, aux) pair is returned.
    final_norms = (
        "residual_batch.final_norm(hidden_states, forward_batch, self.norm)",
        "hidden_states, _ = self.norm(hidden_states, residual)",
    )
    norm = min(text.index(n) for n in final_norms if n in text)
    assert text.rindex(f"return {returned}") > norm
    # Capture id i is the residual entering layer i, inside the loop over this rank's layers.
    loops = [n for n in ast.walk(forward) if isinstance(n, ast.For)]
    loop = next(n for n in loops if "self.layers_to_capture" in ast.unparse(n))
    assert ast.unparse(loop.iter).startswith("range(")
    assert "i in self.layers_to_capture" in ast.unparse(loop)


def test_the_captured_value_is_the_residual_stream_entering_the_layer(src):
    """Llama adds the pending residual before layer i; DeepSeek's layer communicator hands over
    the residual it fused in before attention (releases without the collector classes)."""
    llama = ast.unparse(
        find_function(find_class(parse(src, "srt/models/llama.py"), "LlamaModel").body, "forward")
    )
    if "AuxHiddenStateList(" in llama:
        # The layer hands its input to the collector it is given.
        capture = "capture_output=aux_hidden_states.capture if i in self.layers_to_capture"
        assert capture in llama
    else:
        capture = "if i in self.layers_to_capture:\n            aux_hidden_states.append("
        assert capture + "hidden_states + residual)" in llama
        assert llama.index(capture) < llama.index("hidden_states, residual = layer(")
    deepseek = ast.unparse(
        find_function(
            find_class(parse(src, "srt/models/deepseek_v2.py"), "DeepseekV2Model").body, "forward"
        )
    )
    assert "captured_last_layer_outputs=aux_hidden_states if i in self.layers_to_capture" in (
        deepseek
    )
    communicator = src / "srt/layers/communicator.py"
    if communicator.is_file():
        fn = ast.unparse(
            find_function(
                find_class(parse(src, "srt/layers/communicator.py"), "LayerCommunicator").body,
                "prepare_attn_and_capture_last_layer_outputs",
            )
        )
        assert "hidden_states=residual" in fn and "captured_last_layer_outputs.append(" in fn
        assert fn.index("self.prepare_attn(") < fn.index("captured_last_layer_outputs.append(")
    else:  # the layer's attention boundary gathers and captures its input
        layer = (src / "srt/models/deepseek_v2.py").read_text()
        assert "capture_gathered=captured_last_layer_outputs" in layer


def test_aux_packer_layout_is_concatenation_in_capture_order(src):
    path = src / "srt/layers/aux_hidden_states.py"
    if not path.is_file():
        # No packer in this release: both families hand the logits processor a list of
        # [T, H] tensors in capture order, which the hook concatenates (test_sglang_hook.py).
        for rel, cls in (("srt/models/llama.py", "LlamaModel"),
                         ("srt/models/deepseek_v2.py", "DeepseekV2Model")):  # fmt: skip
            forward = ast.unparse(find_function(find_class(parse(src, rel), cls).body, "forward"))
            assert "aux_hidden_states = []" in forward, rel
        return
    module = types.ModuleType("sglang_aux_under_test")
    exec(compile(path.read_text(), str(path), "exec"), module.__dict__)
    captures = [torch.randn(5, 4) for _ in range(3)]
    packer = module.AuxHiddenStatePacker(3)
    for c in captures:
        packer.capture(c)
    assert torch.equal(packer.finalize(), torch.cat(captures, dim=-1))
    listed = module.AuxHiddenStateList()
    for c in captures:
        listed.capture(c)
    assert isinstance(listed, list) and len(listed) == 3
    assert torch.equal(module.pack_aux_hidden_states(listed), torch.cat(captures, dim=-1))


def test_forward_batch_fields_the_hook_reads(src):
    tree = parse(src, "srt/model_executor/forward_batch_info.py")
    fields = {
        n.target.id
        for n in find_class(tree, "ForwardBatch").body
        if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)
    }
    wanted = {
        "forward_mode",
        "rids",
        "extend_seq_lens",
        "extend_prefix_lens",
        "extend_seq_lens_cpu",
        "extend_prefix_lens_cpu",
    }
    assert wanted <= fields
    if "contains_last_prefill_chunk" not in fields:
        # Older releases lack the flag; the hook reads it with a default (no chunking: the
        # launcher passes --chunked-prefill-size=-1 and refuses any other value).
        hook_text = (REPO_ROOT / "patch" / "eaglepipe_hook.py").read_text()
        assert 'getattr(forward_batch, "contains_last_prefill_chunk", True)' in hook_text
    text = (src / "srt/model_executor/forward_batch_info.py").read_text()
    assert "rids=[req.rid for req in batch.reqs]" in text
    mode = find_class(tree, "ForwardMode")
    members = {t.id for n in mode.body if isinstance(n, ast.Assign) for t in n.targets}
    assert {"EXTEND", "DECODE", "IDLE", "MIXED"} <= members
    # Speculative decoding's steps, which the hook passes by: set by the speculative workers.
    sys.path.insert(0, str(REPO_ROOT / "patch"))
    try:
        import eaglepipe_hook
    finally:
        sys.path.remove(str(REPO_ROOT / "patch"))
    assert set(eaglepipe_hook.SPECULATIVE_DECODE_MODES) <= members
    speculative = "".join(p.read_text() for p in sorted((src / "srt/speculative").glob("*.py")))
    for name in eaglepipe_hook.SPECULATIVE_DECODE_MODES:
        assert f"ForwardMode.{name}" in speculative, name
    is_decode_or_idle = ast.unparse(find_function(mode.body, "is_decode_or_idle"))
    assert "self == ForwardMode.DECODE or self == ForwardMode.IDLE" in is_decode_or_idle


def test_tensor_parallel_rank_function(src):
    """The hook reads `get_parallel().tp_rank` from sglang.srt.runtime_context."""
    tree = parse(src, "srt/runtime_context.py")
    get_parallel = ast.unparse(find_function(tree.body, "get_parallel"))
    assert "return _PARALLEL" in get_parallel
    assert any(
        isinstance(n, ast.Assign)
        and ast.unparse(n.targets[0]) == "_PARALLEL"
        and ast.unparse(n.value) == "ParallelContext()"
        for n in tree.body
    )
    context = find_class(tree, "ParallelContext")
    tp_rank = next(
        (n for n in context.body if isinstance(n, ast.FunctionDef) and n.name == "tp_rank"), None
    )
    if tp_rank is not None:
        # A read-through property onto parallel_state's getter.
        assert "get_tensor_model_parallel_rank" in ast.unparse(tp_rank)
        assert any(ast.unparse(d) == "property" for d in tp_rank.decorator_list)
        state = (src / "srt/distributed/parallel_state.py").read_text()
        assert "def get_tensor_model_parallel_rank(" in state
    else:
        # Ranks published by the launcher for each spawned process.
        spawn = find_function(tree.body, "derive_spawn_ranks")
        returned = next(n.value for n in ast.walk(spawn) if isinstance(n, ast.Return))
        keys = {k.value for k in returned.keys}
        assert "tp_rank" in keys and "pp_rank" in keys
        # The older getter is deprecated and excluded from `from sglang.srt.distributed import *`.
        state = (src / "srt/distributed/parallel_state.py").read_text()
        assert '"get_tensor_model_parallel_rank": "tp_rank"' in state
        assert "_public not in _CONTEXT_NAME_OF" in state
    # SGLang itself reads the TP rank this way (its vocab-parallel embedding, in both ends).
    embedding = (src / "srt/layers/vocab_parallel_embedding.py").read_text()
    assert "get_parallel().tp_rank" in embedding
    hook_text = (REPO_ROOT / "patch" / "eaglepipe_hook.py").read_text()
    assert "from sglang.srt.runtime_context import get_parallel" in hook_text
    assert "get_parallel().tp_rank" in hook_text


def test_health_check_and_warmup_rids_are_never_dumped(src):
    sys.path.insert(0, str(REPO_ROOT / "patch"))
    try:
        import eaglepipe_hook
    finally:
        sys.path.remove(str(REPO_ROOT / "patch"))
    constants = parse(src, "srt/constants.py")
    value = next(
        ast.literal_eval(n.value)
        for n in constants.body
        if isinstance(n, ast.Assign)
        and getattr(n.targets[0], "id", "") == "HEALTH_CHECK_RID_PREFIX"
    )
    assert value == eaglepipe_hook.HEALTH_CHECK_RID_PREFIX
    http = (src / "srt/entrypoints/http_server.py").read_text()
    assert 'rid = f"{HEALTH_CHECK_RID_PREFIX}_{uuid.uuid4().hex}"' in http
    # Warm-up requests carry no rid, so SGLang gives them uuid4().hex: no "-" in it.
    warmup = find_function(
        parse(src, "srt/entrypoints/http_server.py").body, "_execute_server_warmup"
    )
    strings = {n.value for n in ast.walk(warmup) if isinstance(n, ast.Constant)}
    assert "input_ids" in strings and "rid" not in strings
    io_struct = (src / "srt/managers/io_struct.py").read_text()
    assert "self.rid = uuid.uuid4().hex" in io_struct
    # Any prefix the config schema accepts: health-check rids never start with "<prefix>-".
    schema_pattern = re.compile(r"^[A-Za-z][A-Za-z0-9]*$")
    for prefix in ("HEALTH", "HEALTHCHECK", "eaglepipe", "H"):
        assert schema_pattern.match(prefix)
        assert not f"{value}_0123abcd".startswith(f"{prefix}-")


# ---------------------------------------------------------------------------------------------
# Layer ids: our convention through SGLang's set_eagle3_layers_to_capture
# ---------------------------------------------------------------------------------------------


def _model_imports(tree: ast.Module) -> dict[str, str]:
    """Names imported from sglang.srt.models.* -> the wheel-relative file defining them."""
    return {
        alias.asname or alias.name: node.module[len("sglang.") :].replace(".", "/") + ".py"
        for node in tree.body
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sglang.srt.models")
        for alias in node.names
    }


def _method_of(src: Path, rel: str, cls_name: str, method: str):
    """Follow the class's bases (same file or imported model file) to where `method` is defined."""
    tree = parse(src, rel)
    if cls_name in _model_imports(tree):
        return _method_of(src, _model_imports(tree)[cls_name], cls_name, method)
    cls = find_class(tree, cls_name)
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == method:
            return cls, node, rel
    for base in cls.bases:
        name = ast.unparse(base)
        if name in _model_imports(tree) or any(
            isinstance(n, ast.ClassDef) and n.name == name for n in tree.body
        ):
            return _method_of(src, rel, name, method)
    raise AssertionError(f"{cls_name} has no {method}")


@functools.cache
def _capture_setter(src: Path, rel: str, cls_name: str):
    """SGLang's set_eagle3_layers_to_capture for `cls_name`, run on a stand-in model.

    Returns f(passed_ids, num_layers) -> the resulting `model.layers_to_capture`.
    """
    cls, method, _ = _method_of(src, rel, cls_name, "set_eagle3_layers_to_capture")
    fn = compile_function(method, dict(vars(typing)))
    if "self.language_model.set_eagle3_layers_to_capture" in ast.unparse(method):
        # A wrapper: run the setter of the class its __init__ builds as language_model.
        init = find_function(cls.body, "__init__")
        built = next(
            ast.unparse(n.value.func)
            for n in ast.walk(init)
            if isinstance(n, ast.Assign)
            and ast.unparse(n.targets[0]) == "self.language_model"
            and isinstance(n.value, ast.Call)
        )
        inner = _capture_setter(src, rel, built)

        def run_wrapper(passed_ids, num_layers):
            result = {}
            language_model = types.SimpleNamespace(
                set_eagle3_layers_to_capture=lambda ids: result.update(v=inner(ids, num_layers))
            )
            fn(types.SimpleNamespace(language_model=language_model), passed_ids)
            return result["v"]

        return run_wrapper

    def run(passed_ids, num_layers):
        target = types.SimpleNamespace(
            pp_group=types.SimpleNamespace(is_last_rank=True),
            config=types.SimpleNamespace(num_hidden_layers=num_layers),
            model=types.SimpleNamespace(layers_to_capture=[]),
            capture_aux_hidden_states=False,
        )
        fn(target, passed_ids)
        assert target.capture_aux_hidden_states
        return list(target.model.layers_to_capture)

    return run


def _capture_of(src: Path, architecture: str, passed_ids, num_layers: int) -> list[int]:
    """What `--return-aux-hidden-state-layer-ids passed_ids` makes `architecture` capture."""
    setter = _capture_setter(src, ARCHITECTURE_FILES[architecture], architecture)
    return setter(passed_ids, num_layers)


def _range_check(src: Path):
    """What the release accepts as capture ids: its capture-only range check where it has one;
    without it (the plugin's releases) any list reaches set_eagle3_layers_to_capture, and an id
    at or past the last layer is never reached by the layer loop (the `wanted` check below)."""
    path = src / "srt/model_executor/model_runner_components/spec_aux_hidden_state.py"
    text = path.read_text() if path.is_file() else ""
    if "def _check_capture_layer_ids_in_range" not in text:
        return lambda ids, num_layers: True
    tree = parse(src, "srt/model_executor/model_runner_components/spec_aux_hidden_state.py")
    fn = compile_function(find_function(tree.body, "_check_capture_layer_ids_in_range"), {})

    def accepts(ids, num_layers):
        config = types.SimpleNamespace(
            hf_text_config=types.SimpleNamespace(num_hidden_layers=num_layers)
        )
        try:
            fn(ids, config)
        except ValueError:
            return False
        return True

    return accepts


@pytest.mark.parametrize("architecture", sorted(recipe.LAYER_ID_RULES))
def test_layer_id_translation_captures_our_layers(src, architecture):
    """Every id triple of an 8-layer model: translated ids capture exactly our layers, and a
    refused triple is one that no id list SGLang accepts can capture."""
    accepts = _range_check(src)
    num_layers = 8
    for ours in itertools.combinations(range(num_layers), 3):
        # SGLang captures layer inputs (the loop over range(L)): output of k enters k + 1.
        wanted = [k + 1 for k in ours]
        try:
            passed = recipe.sglang_layer_ids(architecture, list(ours), num_layers=num_layers)
        except PipelineError:
            reachable = [
                list(p)
                for p in itertools.permutations(range(num_layers), 3)
                if accepts(list(p), num_layers)
                and max(wanted) < num_layers
                and _capture_of(src, architecture, list(p), num_layers) == wanted
            ]
            assert not reachable, (architecture, ours, reachable)
            continue
        assert accepts(passed, num_layers), (architecture, ours, passed)
        assert _capture_of(src, architecture, passed, num_layers) == wanted, (architecture, ours)


@pytest.mark.parametrize("architecture", sorted(recipe.LAYER_ID_RULES))
def test_layer_id_translation_for_the_kimi_depth(src, architecture):
    accepts = _range_check(src)
    for ours in ([1, 29, 57], [3, 30, 59], [2, 5, 9]):
        passed = recipe.sglang_layer_ids(architecture, ours, num_layers=61)
        assert accepts(passed, 61)
        assert _capture_of(src, architecture, passed, 61) == [k + 1 for k in ours]
    with pytest.raises(PipelineError, match="last decoder layer"):
        recipe.sglang_layer_ids(architecture, [1, 2, 60], num_layers=61)


def test_default_capture_matches_our_default_layers(src):
    """SGLang's default ([2, L//2, L-3] as inputs) is our default [1, L//2-1, L-4]."""
    from eaglepipe.core.layers import default_aux_layer_ids

    for architecture in recipe.LAYER_ID_RULES:
        captured = _capture_of(src, architecture, None, 61)
        assert captured == [k + 1 for k in default_aux_layer_ids(61)]


def _module_names_of(src: Path, rel: str, cls_name: str, prefix: str = "") -> list[str]:
    """Dotted names of the LogitsProcessor modules an instance of `cls_name` holds (from the
    `self.<attr> = ...(...)` assignments of its resolved __init__), one level of wrapping deep."""
    _, init, init_rel = _method_of(src, rel, cls_name, "__init__")
    names = []
    for node in ast.walk(init):
        if not (isinstance(node, ast.Assign) and isinstance(node.value, ast.Call)):
            continue
        target = ast.unparse(node.targets[0])
        if not target.startswith("self."):
            continue
        built = ast.unparse(node.value.func)
        if built == "LogitsProcessor":
            names.append(prefix + target[len("self.") :])
        elif built in ARCHITECTURE_FILES and not prefix:
            names += _module_names_of(src, init_rel, built, target[len("self.") :] + ".")
    return names


@pytest.mark.parametrize("architecture", sorted(ARCHITECTURE_FILES))
def test_hook_patterns_match_exactly_one_logits_processor_per_architecture(src, architecture):
    names = _module_names_of(src, ARCHITECTURE_FILES[architecture], architecture)
    matched = [n for n in names if any(fnmatch.fnmatch(n, p) for p in recipe.HOOK_TARGET_MODULES)]
    assert len(matched) == 1, (architecture, names)
    expected = (
        "language_model.logits_processor"
        if architecture == "KimiK25ForConditionalGeneration"
        else "logits_processor"
    )
    assert matched == [expected]


@pytest.mark.parametrize(
    "architecture,defined_by",
    [
        ("MistralForCausalLM", "LlamaForCausalLM"),
        ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM"),
    ],
)
def test_subclasses_inherit_the_verified_forward_and_capture(src, architecture, defined_by):
    for method in ("__init__", "forward", "set_eagle3_layers_to_capture"):
        cls, _, _ = _method_of(src, ARCHITECTURE_FILES[architecture], architecture, method)
        assert cls.name == defined_by, (architecture, method, cls.name)


def test_unverified_architecture_is_refused():
    with pytest.raises(PipelineError, match="Qwen3ForCausalLM"):
        recipe.sglang_layer_ids("Qwen3ForCausalLM", [1, 2, 3])


def test_supported_architectures_are_registered_model_classes(src):
    for architecture, rel in ARCHITECTURE_FILES.items():
        tree = parse(src, rel)
        find_class(tree, architecture)
        entry = next(
            ast.unparse(n.value)
            for n in tree.body
            if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "EntryClass"
        )
        assert architecture in entry
    assert set(ARCHITECTURE_FILES) == set(recipe.LAYER_ID_RULES)


# ---------------------------------------------------------------------------------------------
# The project's SGLang plugin (capture switch where the release has no capture-only flags)
# ---------------------------------------------------------------------------------------------


def test_sglang_loads_general_plugins_from_our_entry_point_group(src):
    """SGLang's loader reads the `sglang.srt.plugins` entry points (filtered by SGLANG_PLUGINS)
    and runs them first in the launcher and in every scheduler process."""
    plugins = parse(src, "srt/plugins/__init__.py")
    group = next(
        ast.literal_eval(n.value)
        for n in plugins.body
        if isinstance(n, ast.Assign) and ast.unparse(n.targets[0]) == "GENERAL_PLUGINS_GROUP"
    )
    assert group == recipe.PLUGIN_GROUP
    by_group = ast.unparse(find_function(plugins.body, "load_plugins_by_group"))
    assert "entry_points(group=group)" in by_group and "envs.SGLANG_PLUGINS.get()" in by_group
    assert "ep.name not in allowed_set" in by_group
    load = ast.unparse(find_function(plugins.body, "load_plugins"))
    assert "HookRegistry.apply_hooks()" in load
    environ = (src / "srt/environ.py").read_text()
    assert f"{recipe.SGLANG_PLUGINS_ENV} = EnvStr(" in environ
    scheduler = find_function(parse(src, "srt/managers/scheduler.py").body, "run_scheduler_process")
    assert ast.unparse(scheduler.body[0]) == "load_plugins()"
    launch = (src / "launch_server.py").read_text()
    assert launch.index("load_plugins()") < launch.index("prepare_server_args(sys.argv[1:])")


def test_the_model_runner_attributes_the_plugin_reads(src):
    from eaglepipe.server.sglang.plugin import LOAD_MODEL

    module_path, cls_name, method = LOAD_MODEL.rsplit(".", 2)
    rel = module_path.removeprefix("sglang.").replace(".", "/") + ".py"
    runner = find_class(parse(src, rel), cls_name)
    init = find_function(runner.body, "__init__")
    lines = {}
    for node in ast.walk(init):
        if isinstance(node, ast.Assign):
            lines.setdefault(ast.unparse(node.targets[0]), node.lineno)
        if isinstance(node, ast.Call) and ast.unparse(node.func) == "self.initialize":
            lines["initialize"] = node.lineno
    assert lines["self.is_draft_worker"] < lines["initialize"]
    assert lines["self.spec_algorithm"] < lines["initialize"]
    load_model = ast.unparse(find_function(runner.body, method))
    assert "self.model = " in load_model
    initialize = ast.unparse(find_function(runner.body, "initialize"))
    assert "self.load_model()" in initialize
    spec_info = parse(src, "srt/speculative/spec_info.py")
    algorithm = find_class(spec_info, "SpeculativeAlgorithm")
    assert "return self == SpeculativeAlgorithm.NONE" in ast.unparse(
        find_function(algorithm.body, "is_none")
    )
    from_string = ast.unparse(find_function(algorithm.body, "from_string"))
    assert "if name is None:\n        return cls.NONE" in from_string


def test_nothing_after_model_loading_resets_the_capture(src):
    """The release's own capture configuration calls set_eagle3_layers_to_capture only when a
    draft (or capture-only mode) asks for it; the models start with nothing to capture."""
    calls = []
    for path in sorted((src / "srt/model_executor").rglob("*.py")):
        text = path.read_text()
        if ".set_eagle3_layers_to_capture(" not in text:
            continue
        for fn in ast.walk(ast.parse(text)):
            if not isinstance(fn, ast.FunctionDef):
                continue
            for node in ast.walk(fn):
                if isinstance(node, ast.If) and ".set_eagle3_layers_to_capture(" in ast.unparse(
                    node
                ):
                    calls.append(ast.unparse(node.test))
    assert calls and all("eagle_use_aux_hidden_state" in test for test in calls), calls
    for rel, cls in (("srt/models/llama.py", "LlamaModel"),
                     ("srt/models/deepseek_v2.py", "DeepseekV2Model")):  # fmt: skip
        init = ast.unparse(find_function(find_class(parse(src, rel), cls).body, "__init__"))
        assert "self.layers_to_capture = []" in init, rel


def test_the_kernel_workaround_names_exist(src):
    """The slim-flashinfer workaround sets topk.fused_topk_deepseek to None; SGLang then takes
    the sgl_kernel path (sgl_kernel's own `_has_flashinfer` flags ran live on 0.5.14)."""
    topk = (src / "srt/layers/moe/topk.py").read_text()
    assert "fused_topk_deepseek = None" in topk
    assert "fused_topk_deepseek is not None" in topk


class _ModelStandIn:
    def __init__(self):
        self.calls: list[list[int]] = []

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.calls.append(layer_ids)


class _AlgorithmStandIn:
    def __init__(self, name):
        self.name = name

    def is_none(self):
        return self.name is None


def test_the_plugin_switches_the_capture_on_for_the_target_only(src, monkeypatch, capfd):
    """The wheel's own plugin hook registry applies the plugin's hook to a model-runner
    stand-in at the plugin's target path: the target's model captures the launcher's ids, a
    draft runner and a target serving a real EAGLE-3 draft are left alone."""
    from eaglepipe.server.sglang import plugin as sglang_plugin

    path = src / "srt/plugins/hook_registry.py"
    tree = ast.parse(path.read_text())
    imported = {
        alias.name.split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in (node.names if isinstance(node, ast.Import) else [ast.alias(node.module)])
    }
    assert imported <= set(sys.stdlib_module_names) | {"__future__"}
    registry = types.ModuleType("sglang.srt.plugins.hook_registry")
    monkeypatch.setitem(sys.modules, registry.__name__, registry)
    exec(compile(tree, str(path), "exec"), registry.__dict__)

    class ModelRunner:
        def __init__(self, *, is_draft_worker=False, spec=None):
            self.is_draft_worker = is_draft_worker
            self.spec_algorithm = _AlgorithmStandIn(spec)

        def load_model(self):
            self.model = _ModelStandIn()
            return "loaded"

    module_path, cls_name, _ = sglang_plugin.LOAD_MODEL.rsplit(".", 2)
    parts = module_path.split(".")
    for depth in range(1, len(parts) + 1):
        name = ".".join(parts[:depth])
        module = sys.modules.get(name) if name == registry.__name__ else types.ModuleType(name)
        monkeypatch.setitem(sys.modules, name, module)
        if depth > 1:
            setattr(sys.modules[".".join(parts[: depth - 1])], parts[depth - 1], module)
    setattr(sys.modules[module_path], cls_name, ModelRunner)
    monkeypatch.setitem(sys.modules, "sglang.srt.plugins", types.ModuleType("sglang.srt.plugins"))
    sys.modules["sglang.srt.plugins"].hook_registry = registry
    monkeypatch.setenv(sglang_plugin.CAPTURE_ENV, "[2, 30, 58]")
    monkeypatch.delenv(sglang_plugin.SLIM_FLASHINFER_ENV, raising=False)

    sglang_plugin.register()
    registry.HookRegistry.apply_hooks()
    target = ModelRunner()
    assert target.load_model() == "loaded"  # the AFTER hook keeps load_model's result
    assert target.model.calls == [[2, 30, 58]]
    draft = ModelRunner(is_draft_worker=True)
    draft.load_model()
    served_with_draft = ModelRunner(spec="EAGLE3")
    served_with_draft.load_model()
    assert draft.model.calls == [] and served_with_draft.model.calls == []
    err = capfd.readouterr().err
    assert "set_eagle3_layers_to_capture([2, 30, 58])" in err
    assert "speculative draft model's runner" in err


# ---------------------------------------------------------------------------------------------
# The range
# ---------------------------------------------------------------------------------------------


def test_the_range_ends_are_the_wheels_tested(version):
    from sglang_source import wheel_metadata_version

    assert wheel_metadata_version(version) == version
    supported = recipe.supported_range()
    assert version in (supported.oldest, supported.newest)


def test_recommended_pin_agrees_everywhere():
    recommended = recipe.supported_range().recommended
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    assert pyproject["project"]["optional-dependencies"]["sglang"] == [f"sglang=={recommended}"]
    for env_file in sorted((REPO_ROOT / "envs").glob("*.y*ml")):
        for pin in re.findall(r"sglang(?:\[[^\]]*\])?\s*=+\s*([0-9][\w.]*)", env_file.read_text()):
            assert pin == recommended, (
                f"{env_file} pins sglang {pin}, patch/ recommends {recommended}"
            )
    staged = (REPO_ROOT / "tools" / "h200_wheels.txt").read_text()
    assert re.search(rf"^sglang=={re.escape(recommended)}\s", staged, re.MULTILINE)
    points = pyproject["project"]["entry-points"][recipe.PLUGIN_GROUP]
    assert points == {recipe.PLUGIN_NAME: recipe.PLUGIN_ENTRY}


def test_launch_server_module_exists(src):
    text = (src / "launch_server.py").read_text()
    assert "prepare_server_args" in text


# ---------------------------------------------------------------- /server_info


def test_server_info_echoes_the_hook_config_clients_check(src, launch, version, mechanism):
    """SGLang's /server_info is the server arguments (0.5.23: `build_server_info` =
    `server_args.resolved_dict()`; older: `dataclasses.asdict(server_args)`) plus `version`;
    `forward_hooks` is a field holding the parsed JSON list, so our hook's config (layers,
    hidden size, dump dir, instance, capture ids) comes back to the pipeline's clients."""
    http = (src / "srt/entrypoints/http_server.py").read_text()
    assert '@app.get("/server_info")' in http and '"version": __version__' in http
    if "build_server_info(server_args" in http:
        common = (src / "srt/utils/common.py").read_text()
        assert "result = server_args.resolved_dict()" in common
        fields = (src / "srt/arg_groups/fields/observability.py").read_text()
    else:
        server_info = next(
            ast.unparse(n)
            for n in parse(src, "srt/entrypoints/http_server.py").body
            if isinstance(n, ast.AsyncFunctionDef) and n.name == "server_info"
        )
        assert "**dataclasses.asdict(server_args)" in server_info
        fields = (src / "srt/server_args.py").read_text()
    assert re.search(r"forward_hooks: A\[\s*Optional\[List\[dict\[str, Any\]\]\]", fields)

    argv, _env, config = launch
    hooks = json.loads(argv[argv.index("--forward-hooks") + 1])
    raw = {"forward_hooks": hooks, "version": version, "model_path": config["model"]["path"]}
    if mechanism == recipe.CAPTURE_BY_FLAGS:
        ids_at = argv.index("--return-aux-hidden-state-layer-ids") + 1
        raw["return_aux_hidden_state_layer_ids"] = [int(i) for i in argv[ids_at : ids_at + 3]]
    info = recipe.pipeline_server_info(raw)
    assert info["engine"] == "sglang" and info["engine_version"] == version
    assert info["instance_id"] == "inst1" and info["dump_dir"] == "/dev/shm/x/inst1"
    assert info["hidden_size"] == 7168
    # Reported by SGLang itself where it has the flag, by our hook's config where it does not.
    assert info["sglang_capture_layer_ids"] == [2, 30, 58]

    from eaglepipe.extract.shard import check_server_info

    assert info["capture"] is True
    check_server_info(info, resolve(config).aux_layer_ids, 7168, "http://127.0.0.1:31555")
    # A generation-only server (regeneration's) is refused by an extraction job, in one line.
    with pytest.raises(PipelineError, match="is a generation-only server"):
        check_server_info(
            {**info, "capture": False}, resolve(config).aux_layer_ids, 7168, "http://h:1"
        )


def test_an_sglang_server_without_our_hook_is_refused():
    with pytest.raises(PipelineError, match="without the eaglepipe forward hook"):
        recipe.pipeline_server_info({"forward_hooks": None, "version": "0.5.23"})


def test_health_waits_a_second_and_server_info_asks_the_scheduler(src):
    """Why a lease on a running SGLang asks /server_info only (lifecycle): /health (by default)
    sends a one-token generation and sleeps a second before its first look at the answer, while
    /server_info awaits the scheduler's internal state."""
    tree = parse(src, "srt/entrypoints/http_server.py")
    handlers = {n.name: n for n in tree.body if isinstance(n, ast.AsyncFunctionDef)}
    health = handlers["health_generate"]
    routes = {
        d.args[0].value
        for d in health.decorator_list
        if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant)
    }
    assert "/health" in routes
    loop = next(n for n in ast.walk(health) if isinstance(n, ast.While))
    first = loop.body[0]
    assert ast.unparse(first) == "await asyncio.sleep(1)"
    environ = (src / "srt/environ.py").read_text()
    assert "SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION = EnvBool(True)" in environ
    info = handlers["server_info"]
    calls = [ast.unparse(n.func) for n in ast.walk(info) if isinstance(n, ast.Call)]
    assert "_global_state.tokenizer_manager.get_internal_state" in calls
