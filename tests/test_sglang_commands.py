"""The exact `sglang.launch_server` command line of every SGLang server the pipeline starts, from
one configuration: the capture server (both capture mechanisms), the generation server
(regeneration) and the two live-acceptance servers (plain, and drafting with the export).
Written out in full, so that a change to how any of them is built shows here as a diff."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from test_sglang_range import PLUGIN_POINTS, write_dist

from eaglepipe.core.config_files import load_config
from eaglepipe.core.run import resolve
from eaglepipe.drafter.live_run import SpeculativeSetting
from eaglepipe.drafter.live_sglang import serve_command
from eaglepipe.server.lifecycle.identity import CAPTURE, GENERATION
from eaglepipe.server.lifecycle.launch import engine_command
from eaglepipe.server.sglang import plugin as sglang_plugin
from eaglepipe.server.sglang import recipe

REPO_ROOT = Path(__file__).resolve().parent.parent
EXTRA_ARGS = ["--max-running-requests", "8", "--log-level=info"]


@pytest.fixture
def run(tmp_path, monkeypatch):
    """One SGLang configuration for all servers: a Llama of 8 layers, bf16, TP 2."""
    site = tmp_path / "site-sglang"
    site.mkdir()
    monkeypatch.setenv(recipe.SGLANG_PATH_ENV, str(site))
    monkeypatch.delenv(sglang_plugin.CAPTURE_ENV, raising=False)
    monkeypatch.delenv(recipe.SGLANG_PLUGINS_ENV, raising=False)
    monkeypatch.delenv("PYTHONPATH", raising=False)
    write_dist(site, "eaglepipe", "0.1.0", PLUGIN_POINTS)
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(
        json.dumps(
            {"architectures": ["LlamaForCausalLM"], "num_hidden_layers": 8, "hidden_size": 64}
        )
    )
    config = load_config(REPO_ROOT / "config.yaml")
    config["model"].update(path=str(model), trust_remote_code=True)
    config["server"].update(engine="sglang", dtype="bfloat16")
    config["server"]["sglang"] = {
        "tp_size": 2,
        "mem_fraction_static": 0.7,
        "extra_args": EXTRA_ARGS,
    }
    return resolve(config), site, model


def common_head(model: Path) -> list[str]:
    return [
        sys.executable, "-m", "sglang.launch_server",
        "--model-path", str(model.resolve()), "--tp-size", "2",
        "--host", "127.0.0.1", "--port", "31999",
        "--mem-fraction-static", "0.7", "--trust-remote-code", "--dtype", "bfloat16",
    ]  # fmt: skip


def hooks(dump_dir: Path, capture_ids: list[int] | None, capture: bool = True) -> list[str]:
    config = {
        "dump_dir": str(dump_dir),
        "request_prefix": "eaglepipe",
        "aux_layer_ids": [1, 3, 4],
        "instance_id": "inst-1",
        "hidden_size": 64,
        "capture_layer_ids": capture_ids,
    }
    if not capture:
        config["capture"] = False
    spec = {
        "name": "eaglepipe-dump",
        "target_modules": ["logits_processor", "language_model.logits_processor"],
        "hook_factory": "eaglepipe_hook:make_dump_hook",
        "config": config,
    }
    return ["--forward-hooks", json.dumps([spec], separators=(",", ":"))]


CAPTURE_ONLY = [
    "--disable-radix-cache",
    "--chunked-prefill-size=-1",
    "--disable-prefill-cuda-graph",
    "--disable-decode-cuda-graph",
]


def engine(run, tmp_path, purpose):
    return engine_command(
        run,
        host="127.0.0.1",
        port=31999,
        dump_dir=tmp_path / "dumps",
        instance_id="inst-1",
        purpose=purpose,
    )


def test_the_capture_server_with_capture_only_flags(run, tmp_path):
    run, site, model = run
    write_dist(site, "sglang", "0.5.23")
    argv, env = engine(run, tmp_path, CAPTURE)
    assert argv == [
        *common_head(model),
        "--speculative-algorithm", "EAGLE3", "--enable-return-aux-hidden-states",
        "--return-aux-hidden-state-layer-ids", "1", "3", "4",
        *hooks(tmp_path / "dumps", [1, 3, 4]),
        *CAPTURE_ONLY,
        *EXTRA_ARGS,
    ]  # fmt: skip
    assert env == {
        "PYTHONPATH": f"{REPO_ROOT / 'patch'}:{site}",
        "PYTHONUNBUFFERED": "1",
        sglang_plugin.CAPTURE_ENV: "",
    }


def test_the_capture_server_through_the_plugin(run, tmp_path):
    run, site, model = run
    write_dist(site, "sglang", "0.5.14")
    argv, env = engine(run, tmp_path, CAPTURE)
    assert argv == [
        *common_head(model), *hooks(tmp_path / "dumps", [1, 3, 4]), *CAPTURE_ONLY, *EXTRA_ARGS
    ]  # fmt: skip
    assert env[sglang_plugin.CAPTURE_ENV] == "[1, 3, 4]"


@pytest.mark.parametrize("version", ["0.5.14", "0.5.23"])
def test_the_generation_server(run, tmp_path, version):
    run, site, model = run
    write_dist(site, "sglang", version)
    argv, env = engine(run, tmp_path, GENERATION)
    assert argv == [*common_head(model), *hooks(tmp_path / "dumps", None, False), *EXTRA_ARGS]
    assert env[sglang_plugin.CAPTURE_ENV] == ""


def test_the_live_servers(run, tmp_path):
    run, _, model = run
    assert serve_command(run, host="127.0.0.1", port=31999) == [*common_head(model), *EXTRA_ARGS]
    draft = tmp_path / "export" / "sglang"
    drafting = serve_command(
        run,
        host="127.0.0.1",
        port=31999,
        draft_dir=draft,
        speculative=SpeculativeSetting.parse("3/1/4"),
    )
    assert drafting == [
        *common_head(model),
        "--speculative-algorithm", "EAGLE3", "--speculative-draft-model-path", str(draft.resolve()),
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4",
        *EXTRA_ARGS,
    ]  # fmt: skip
    default = serve_command(run, host="127.0.0.1", port=31999, draft_dir=draft)
    assert default[default.index("--speculative-num-steps") :][:6] == [
        "--speculative-num-steps", "7", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "8",
    ]  # fmt: skip
