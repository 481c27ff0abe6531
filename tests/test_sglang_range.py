"""The supported SGLang range without SGLang: which version the server would import (real
dist-info directories on the server's path), the one-line refusal outside the range, the capture
mechanism each release gets, the launch command and environment that follow, and the project's
SGLang plugin on stand-in model runners. The same paths are checked against both ends' source in
tests/test_sglang_contract.py."""

from __future__ import annotations

import json
import sys
import types
from pathlib import Path

import pytest

from eaglepipe.core.errors import PipelineError
from eaglepipe.core.run import resolve
from eaglepipe.server.sglang import plugin as sglang_plugin
from eaglepipe.server.sglang import recipe

REPO_ROOT = Path(__file__).resolve().parent.parent


def write_dist(root: Path, name: str, version: str, entry_points: str = "") -> Path:
    """A distribution as pip leaves it in a site directory: METADATA (+ entry_points.txt)."""
    dist = root / f"{name.replace('-', '_')}-{version}.dist-info"
    dist.mkdir(parents=True)
    (dist / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if entry_points:
        (dist / "entry_points.txt").write_text(entry_points)
    return root


PLUGIN_POINTS = f"[{recipe.PLUGIN_GROUP}]\n{recipe.PLUGIN_NAME} = {recipe.PLUGIN_ENTRY}\n"


@pytest.fixture
def server_site(tmp_path, monkeypatch):
    """An empty site directory on the SGLang server's path only (EAGLEPIPE_SGLANG_PYTHONPATH)."""
    site = tmp_path / "site-sglang"
    site.mkdir()
    monkeypatch.setenv(recipe.SGLANG_PATH_ENV, str(site))
    monkeypatch.delenv(sglang_plugin.CAPTURE_ENV, raising=False)
    monkeypatch.delenv(recipe.SGLANG_PLUGINS_ENV, raising=False)
    return site


def llama_config(tmp_path: Path) -> dict:
    from eaglepipe.core.config_files import load_config

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 64}
        )
    )
    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(model)
    config["server"]["engine"] = "sglang"
    config["server"]["sglang"] = {"tp_size": 1, "mem_fraction_static": 0.5, "extra_args": []}
    return config


def launch(config, tmp_path, **kwargs):
    return recipe.launch_command(
        resolve(config),
        host="127.0.0.1",
        port=31999,
        dump_dir=tmp_path / "d",
        instance_id="i",
        **kwargs,
    )


# ------------------------------------------------------------------------------ the range


def test_the_range_file_names_both_ends_and_a_recommended_release_inside():
    supported = recipe.supported_range()
    assert (supported.oldest, supported.newest, supported.recommended) == (
        "0.5.14",
        "0.5.23",
        "0.5.14",
    )
    assert str(supported) == "SGLang 0.5.14 to 0.5.23 (recommended 0.5.14)"


@pytest.mark.parametrize("version", ["0.5.14", "0.5.15.post1", "0.5.20", "0.5.23"])
def test_versions_inside_the_range_are_accepted(version):
    assert recipe.check_supported(version) == version


@pytest.mark.parametrize("version", ["0.5.13.post1", "0.5.24", "0.6.0", "not-a-version"])
def test_versions_outside_the_range_stop_in_one_line_naming_both(version):
    with pytest.raises(PipelineError) as error:
        recipe.check_supported(version)
    message = str(error.value)
    assert "\n" not in message
    assert f"SGLang {version} is installed" in message
    assert "SGLang 0.5.14 to 0.5.23 (recommended 0.5.14)" in message


def test_no_sglang_at_all_names_the_interpreter_and_the_range(server_site):
    with pytest.raises(PipelineError, match=r"no SGLang is installed for .*0\.5\.14 to 0\.5\.23"):
        recipe.check_supported(None)


@pytest.mark.parametrize(
    "version,mechanism",
    [("0.5.14", "plugin"), ("0.5.15.post1", "plugin"), ("0.5.22", "plugin"), ("0.5.23", "flags")],
)
def test_the_capture_mechanism_is_chosen_from_the_version(version, mechanism):
    assert recipe.capture_mechanism(version) == mechanism


# ------------------------------------------------------------------------------ what is installed


def test_the_installed_version_is_read_from_the_servers_path(server_site):
    assert recipe.installed_sglang_version() is None  # the test environment has no SGLang
    write_dist(server_site, "sglang", "0.5.14")
    assert recipe.installed_sglang_version() == "0.5.14"


def test_the_first_sglang_on_the_servers_path_wins(server_site, tmp_path, monkeypatch):
    later = write_dist(tmp_path / "later", "sglang", "0.5.23")
    write_dist(server_site, "sglang", "0.5.14")
    monkeypatch.setenv("PYTHONPATH", str(later))
    assert recipe.installed_sglang_version() == "0.5.14"
    monkeypatch.setenv(recipe.SGLANG_PATH_ENV, "")
    assert recipe.installed_sglang_version() == "0.5.23"


def test_the_plugin_counts_as_registered_only_with_our_entry_point(server_site, monkeypatch):
    monkeypatch.setattr(sys, "path", [])  # hide this environment's own install of the project
    assert not recipe.plugin_registered()
    wrong = f"[{recipe.PLUGIN_GROUP}]\n{recipe.PLUGIN_NAME} = elsewhere:register\n"
    write_dist(server_site / "a", "other", "1", wrong)
    monkeypatch.setenv(recipe.SGLANG_PATH_ENV, str(server_site / "a"))
    assert not recipe.plugin_registered()
    write_dist(server_site / "b", "eaglepipe", "0.1.0", PLUGIN_POINTS)
    monkeypatch.setenv(recipe.SGLANG_PATH_ENV, f"{server_site / 'a'}:{server_site / 'b'}")
    assert recipe.plugin_registered()


# ------------------------------------------------------------------------------ the launch


def test_a_plugin_release_gets_no_capture_flags_and_the_ids_in_the_environment(
    server_site, tmp_path
):
    write_dist(server_site, "sglang", "0.5.14")
    write_dist(server_site, "eaglepipe", "0.1.0", PLUGIN_POINTS)
    argv, env = launch(llama_config(tmp_path), tmp_path)
    assert "--speculative-algorithm" not in argv
    assert "--enable-return-aux-hidden-states" not in argv
    assert "--return-aux-hidden-state-layer-ids" not in argv
    assert sglang_plugin.capture_layer_ids(env) == [1, 3, 4]  # ours for 8 layers, Llama's rule
    spec = json.loads(argv[argv.index("--forward-hooks") + 1])[0]
    assert spec["config"]["capture_layer_ids"] == [1, 3, 4]
    assert env["PYTHONPATH"].split(":")[:2] == [str(REPO_ROOT / "patch"), str(server_site)]


def test_a_flags_release_gets_the_capture_only_flags_and_no_ids(server_site, tmp_path, monkeypatch):
    write_dist(server_site, "sglang", "0.5.23")
    monkeypatch.setenv(sglang_plugin.CAPTURE_ENV, "[9, 9, 9]")  # left over from elsewhere
    argv, env = launch(llama_config(tmp_path), tmp_path)
    at = argv.index("--speculative-algorithm")
    assert argv[at : at + 6] == [
        "--speculative-algorithm",
        "EAGLE3",
        "--enable-return-aux-hidden-states",
        "--return-aux-hidden-state-layer-ids",
        "1",
        "3",
    ]
    assert env[sglang_plugin.CAPTURE_ENV] == ""  # overrides the leftover for the server
    assert sglang_plugin.capture_layer_ids(env) is None


@pytest.mark.parametrize("version", ["0.5.14", "0.5.23"])
def test_regeneration_gets_a_server_of_its_own_without_the_capture(server_site, tmp_path, version):
    """With SGLang, a generation lease is another server (its own fingerprint) started without
    the capture and the flags it needs; the reference server does both, one fingerprint. A
    capture server's identity has no purpose key: running servers keep their fingerprint."""
    from eaglepipe.server.lifecycle.identity import CAPTURE, GENERATION, server_identity
    from eaglepipe.server.lifecycle.shared_server import engine_command, server_fingerprint

    write_dist(server_site, "sglang", version)
    write_dist(server_site, "eaglepipe", "0.1.0", PLUGIN_POINTS)
    run = resolve(llama_config(tmp_path))
    assert "purpose" not in server_identity(run, CAPTURE)
    assert server_identity(run, GENERATION)["purpose"] == GENERATION
    assert server_fingerprint(run, GENERATION) != server_fingerprint(run, CAPTURE)
    common = dict(host="127.0.0.1", port=31999, dump_dir=tmp_path / "d", instance_id="i")
    argv, env = engine_command(run, purpose=GENERATION, **common)
    for flag in (*recipe.CAPTURE_ONLY_FLAGS, "--speculative-algorithm"):
        assert flag not in argv
    assert sglang_plugin.capture_layer_ids(env) is None
    capture_argv, _ = engine_command(run, purpose=CAPTURE, **common)
    assert all(flag in capture_argv for flag in recipe.CAPTURE_ONLY_FLAGS)
    (tmp_path / "ref").mkdir()
    reference = llama_config(tmp_path / "ref")
    reference["server"]["engine"] = "reference"
    reference_run = resolve(reference)
    assert server_fingerprint(reference_run, GENERATION) == server_fingerprint(reference_run)


def test_an_sglang_outside_the_range_stops_the_launch(server_site, tmp_path):
    write_dist(server_site, "sglang", "0.5.24")
    with pytest.raises(PipelineError, match=r"^server.engine sglang: SGLang 0\.5\.24 is installed"):
        launch(llama_config(tmp_path), tmp_path)


def test_a_plugin_release_without_the_plugin_stops_the_launch(server_site, tmp_path, monkeypatch):
    write_dist(server_site, "sglang", "0.5.14")
    monkeypatch.setattr(sys, "path", [])  # hide this environment's own install of the project
    with pytest.raises(PipelineError, match="needs the eaglepipe SGLang plugin"):
        launch(llama_config(tmp_path), tmp_path)


@pytest.mark.parametrize(
    "allowed,expected",
    [("other", "other,eaglepipe"), ("eaglepipe,other", None), (None, None)],
)
def test_an_sglang_plugin_whitelist_keeps_ours(
    server_site, tmp_path, monkeypatch, allowed, expected
):
    write_dist(server_site, "sglang", "0.5.14")
    write_dist(server_site, "eaglepipe", "0.1.0", PLUGIN_POINTS)
    if allowed is not None:
        monkeypatch.setenv(recipe.SGLANG_PLUGINS_ENV, allowed)
    _, env = launch(llama_config(tmp_path), tmp_path)
    assert env.get(recipe.SGLANG_PLUGINS_ENV) == expected


def test_server_info_without_sglangs_own_capture_ids_reports_the_hooks():
    """SGLang 0.5.14's /server_info has no return_aux_hidden_state_layer_ids (seen live)."""
    spec = recipe.hook_spec(
        dump_dir="/d", request_prefix="eaglepipe", aux_layer_ids=[1, 3, 4], instance_id="i",
        hidden_size=512, capture_layer_ids=[1, 3, 4],
    )  # fmt: skip
    info = recipe.pipeline_server_info({"forward_hooks": [spec], "version": "0.5.14"})
    assert info["sglang_capture_layer_ids"] == [1, 3, 4]
    assert info["engine_version"] == "0.5.14"
    raw = {"forward_hooks": [spec], "version": "0.5.23", "return_aux_hidden_state_layer_ids": [7]}
    assert recipe.pipeline_server_info(raw)["sglang_capture_layer_ids"] == [7]


# ------------------------------------------------------------------------------ the plugin


@pytest.mark.parametrize(
    "raw,expected", [("", None), ("  ", None), ("[2, 4, 5]", [2, 4, 5]), ("[]", [])]
)
def test_capture_ids_from_the_environment(raw, expected):
    assert sglang_plugin.capture_layer_ids({sglang_plugin.CAPTURE_ENV: raw}) == expected


@pytest.mark.parametrize("raw", ["[2, 4.5]", '{"a": 1}', "2,4"])
def test_malformed_capture_ids_are_an_error(raw):
    with pytest.raises(ValueError):
        sglang_plugin.capture_layer_ids({sglang_plugin.CAPTURE_ENV: raw})


def test_the_plugin_does_nothing_unless_asked(monkeypatch):
    """Without either variable register() returns before importing SGLang (not installed
    here: an import would fail), so any other use of SGLang in the environment is untouched."""
    monkeypatch.delenv(sglang_plugin.CAPTURE_ENV, raising=False)
    monkeypatch.delenv(sglang_plugin.SLIM_FLASHINFER_ENV, raising=False)
    assert "sglang" not in sys.modules
    sglang_plugin.register()
    assert "sglang" not in sys.modules


class Model:
    def __init__(self):
        self.model = types.SimpleNamespace(layers_to_capture=[])

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.model.layers_to_capture = [i + 1 for i in layer_ids]  # Llama's arithmetic


class KimiModel:
    """KimiK25ForConditionalGeneration's shape: the capture is its language model's."""

    def __init__(self):
        self.language_model = Model()

    def set_eagle3_layers_to_capture(self, layer_ids=None):
        self.language_model.set_eagle3_layers_to_capture(layer_ids)


def runner(model, *, draft=False, algorithm=None):
    return types.SimpleNamespace(
        model=model,
        is_draft_worker=draft,
        spec_algorithm=types.SimpleNamespace(is_none=lambda: algorithm is None),
    )


@pytest.mark.parametrize("model_cls", [Model, KimiModel])
def test_the_target_captures_the_ids(model_cls, capfd):
    target = runner(model_cls())
    assert sglang_plugin.switch_capture_on(target, [1, 3, 4])
    language_model = getattr(target.model, "language_model", target.model)
    assert language_model.model.layers_to_capture == [2, 4, 5]
    assert "layers_to_capture = [2, 4, 5]" in capfd.readouterr().err


@pytest.mark.parametrize("kind", ["draft", "speculative"])
def test_a_draft_or_a_target_with_a_real_draft_is_left_alone(kind):
    model = Model()
    if kind == "draft":
        target = runner(model, draft=True)
    else:
        target = runner(model, algorithm="EAGLE3")
    assert not sglang_plugin.switch_capture_on(target, [1, 3, 4])
    assert model.model.layers_to_capture == []


def test_the_slim_flashinfer_switch_routes_to_sgl_kernels(monkeypatch):
    elementwise = types.SimpleNamespace(_has_flashinfer=True)
    sampling = types.SimpleNamespace(_has_flashinfer=True)
    topk = types.ModuleType("sglang.srt.layers.moe.topk")
    topk.fused_topk_deepseek = object()
    fakes = {
        "sgl_kernel": types.ModuleType("sgl_kernel"),
        "sgl_kernel.elementwise": elementwise,
        "sgl_kernel.sampling": sampling,
        "sglang": types.ModuleType("sglang"),
        "sglang.srt": types.ModuleType("sglang.srt"),
        "sglang.srt.layers": types.ModuleType("sglang.srt.layers"),
        "sglang.srt.layers.moe": types.ModuleType("sglang.srt.layers.moe"),
        "sglang.srt.layers.moe.topk": topk,
    }
    for name, module in fakes.items():
        monkeypatch.setitem(sys.modules, name, module)
    fakes["sgl_kernel"].elementwise, fakes["sgl_kernel"].sampling = elementwise, sampling
    fakes["sglang"].srt = fakes["sglang.srt"]
    fakes["sglang.srt"].layers = fakes["sglang.srt.layers"]
    fakes["sglang.srt.layers"].moe = fakes["sglang.srt.layers.moe"]
    fakes["sglang.srt.layers.moe"].topk = topk
    target = runner(Model())
    result = sglang_plugin.after_load_model(
        "loaded", target, capture_ids=None, slim_flashinfer=True
    )
    assert result is None
    assert elementwise._has_flashinfer is False and sampling._has_flashinfer is False
    assert topk.fused_topk_deepseek is None
    assert target.model.model.layers_to_capture == []  # no ids: the capture is not touched
