"""What a shard job loads before its first request (issue 28, item 2): on a machine without a
GPU driver, the server it needs and the target's tokenizer come without importing torch, whose
import alone takes seconds per job; and the tokenizer is the one AutoTokenizer gives."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from conftest import REPO_ROOT, add_toy_tokenizer, build_tiny_llama
from pipeline_run import SAMPLE, default_config

from eaglepipe.core.config import validate_config
from eaglepipe.core.run import resolve
from eaglepipe.data.dataset import read_conversations
from eaglepipe.data.tokenizer import load_target_tokenizer, tokenizer_loader
from eaglepipe.server.lifecycle.identity import engine_identity
from eaglepipe.server.reference import settings as reference_settings

JOB_START = """
import json, sys
from eaglepipe.core.run import load_run
from eaglepipe.data.tokenizer import load_target_tokenizer
from eaglepipe.server.lifecycle.identity import engine_identity
run = load_run(sys.argv[1])
identity = engine_identity(run)
tokenizer = load_target_tokenizer(run)
print(json.dumps({"identity": identity, "tokenizer": type(tokenizer).__name__,
                  "torch": "torch" in sys.modules}))
"""


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    return add_toy_tokenizer(build_tiny_llama(tmp_path_factory.mktemp("target")))


def run_for(target, tmp_path, **server):
    config = default_config()
    config["model"]["path"] = str(target)
    config["server"].update(server)
    path = tmp_path / "config.json"
    path.write_text(json.dumps(validate_config(config)))
    return path


@pytest.mark.skipif(
    reference_settings.accelerator_driver_present(), reason="this machine has a GPU driver"
)
def test_a_job_on_a_cpu_machine_knows_its_server_and_tokenizer_without_importing_torch(
    target, tmp_path
):
    config = run_for(target, tmp_path, device="auto")
    out = subprocess.run(
        [sys.executable, "-c", JOB_START, str(config)],
        capture_output=True,
        text=True,
        cwd=REPO_ROOT,
        check=True,
    ).stdout
    job = json.loads(out.splitlines()[-1])
    assert job["torch"] is False
    assert job["identity"]["device"] == "cpu" and job["identity"]["dtype"] == "float32"
    # the same identity the server computes with torch at hand
    from eaglepipe.server.reference.settings import resolve_device

    assert job["identity"] == engine_identity(
        resolve(validate_config(json.loads(config.read_text())))
    )
    assert resolve_device("auto").type == "cpu"


def test_with_a_gpu_driver_present_auto_asks_torch(monkeypatch, tmp_path):
    # A driver node (here a stand-in) means torch decides; on this machine it finds no CUDA.
    import torch

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setattr(reference_settings, "ACCELERATOR_NODES", (str(tmp_path),))
    assert reference_settings.accelerator_driver_present()
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert reference_settings.resolve_device_type("auto") == expected
    monkeypatch.setattr(reference_settings, "ACCELERATOR_NODES", (str(tmp_path / "absent"),))
    assert reference_settings.resolve_device_type("auto") == "cpu"
    assert reference_settings.resolve_device_type("cpu") == "cpu"


ASK_AUTO = """
import json, sys
from eaglepipe.server.reference import settings as reference_settings
reference_settings.ACCELERATOR_NODES = (sys.argv[1],)
answer = reference_settings.resolve_device_type("auto")
print(json.dumps({"answer": answer, "torch": "torch" in sys.modules}))
"""


def ask_auto(tmp_path, **env) -> dict:
    # A stand-in driver node: the machine looks like one with a GPU driver.
    out = subprocess.run(
        [sys.executable, "-c", ASK_AUTO, str(tmp_path)],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), **env},
    ).stdout
    return json.loads(out.splitlines()[-1])


def test_with_a_gpu_driver_the_first_job_asks_torch_and_the_next_ones_read_its_answer(tmp_path):
    import torch

    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert ask_auto(tmp_path) == {"answer": expected, "torch": True}
    (kept,) = (tmp_path / "cache" / "eaglepipe" / "devices").iterdir()
    assert json.loads(kept.read_text()) == {"cuda_available": expected == "cuda"}
    assert ask_auto(tmp_path) == {"answer": expected, "torch": False}
    # other visible devices: torch is asked again
    assert ask_auto(tmp_path, CUDA_VISIBLE_DEVICES="") == {"answer": "cpu", "torch": True}
    assert len(list(kept.parent.iterdir())) == 2
    # a damaged answer is asked again, not trusted
    kept.write_text("{")
    assert ask_auto(tmp_path) == {"answer": expected, "torch": True}


def test_the_plain_tokenizer_class_gives_what_auto_tokenizer_gives(target, tmp_path):
    from transformers import AutoTokenizer

    run = resolve(validate_config(json.loads(run_for(target, tmp_path).read_text())))
    assert tokenizer_loader(target) is not AutoTokenizer
    fast, auto = load_target_tokenizer(run), AutoTokenizer.from_pretrained(target)
    assert type(fast) is type(auto) and len(fast) == len(auto)
    assert fast.chat_template == auto.chat_template
    assert fast.special_tokens_map == auto.special_tokens_map
    conversations, _ = read_conversations(SAMPLE, bad_rows="skip")
    for conversation in conversations[:20]:
        text = auto.apply_chat_template(conversation.messages, tokenize=False)
        assert fast.apply_chat_template(conversation.messages, tokenize=False) == text
        assert fast(text)["input_ids"] == auto(text)["input_ids"]


def test_a_tokenizer_with_its_own_code_or_class_goes_through_auto_tokenizer(target, tmp_path):
    from transformers import AutoTokenizer

    settings = json.loads((target / "tokenizer_config.json").read_text())
    for changed in (
        {**settings, "auto_map": {"AutoTokenizer": ["tok.MyTokenizer", None]}},
        {**settings, "tokenizer_class": "Qwen2Tokenizer"},
    ):
        other = tmp_path / f"other-{len(list(tmp_path.iterdir()))}"
        other.mkdir()
        (other / "tokenizer.json").write_text((target / "tokenizer.json").read_text())
        (other / "tokenizer_config.json").write_text(json.dumps(changed))
        assert tokenizer_loader(other) is AutoTokenizer
    (tmp_path / "no-config").mkdir()
    assert tokenizer_loader(tmp_path / "no-config") is AutoTokenizer


SEALED_READ = """
import json, sys
import eaglepipe.extract.shard, eaglepipe.regenerate.shard
from eaglepipe.core.run import config_from_arg
config = config_from_arg(".eaglepipe/config.json")
loaded = [m for m in ("jsonschema", "yaml", "eaglepipe.core.config_files") if m in sys.modules]
print(json.dumps({"config": config, "loaded": loaded}))
"""


def read_in_a_job(run_dir) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SEALED_READ], capture_output=True, text=True, cwd=run_dir, check=True
    ).stdout
    return json.loads(out.splitlines()[-1])


def test_a_job_takes_its_sealed_resolved_config_without_validating_it_again(tmp_path):
    """The workflow writes the resolved config validated and sealed to the schema's bytes; a
    job that reads it unchanged skips validating it again and so never imports jsonschema or
    yaml before its first request. Without the seal it validates, as before."""
    from eaglepipe.core.config import write_resolved

    resolved = write_resolved(default_config(), tmp_path / ".eaglepipe" / "config.json")
    job = read_in_a_job(tmp_path)
    assert job["loaded"] == []
    assert job["config"] == validate_config(default_config())

    resolved.with_name("config.json.validated").unlink()
    job = read_in_a_job(tmp_path)
    assert "jsonschema" in job["loaded"]
    assert job["config"] == validate_config(default_config())


def test_a_hand_edited_resolved_config_is_validated_and_named(tmp_path):
    from eaglepipe.core.config import read_resolved, write_resolved
    from eaglepipe.core.errors import PipelineError

    resolved = write_resolved(default_config(), tmp_path / "config.json")
    edited = json.loads(resolved.read_text())
    edited["shards"]["rows_per_shard"] = 0
    resolved.write_text(json.dumps(edited))
    with pytest.raises(PipelineError, match=r"config.json: config key shards.rows_per_shard"):
        read_resolved(resolved)


def test_a_sealed_resolved_config_is_validated_again_under_a_changed_schema(tmp_path, monkeypatch):
    """The seal covers the schema's bytes: code that changed the schema since the run wrote the
    file (an upgrade between a run and a job started by hand) validates it again."""
    import eaglepipe.core.config as cfg
    from eaglepipe.core.errors import PipelineError

    resolved = cfg.write_resolved(default_config(), tmp_path / "config.json")
    assert cfg.read_resolved(resolved)["dataset"]["max_length"] == 1024
    stricter = tmp_path / "schema.yaml"
    text = cfg.SCHEMA_PATH.read_text()
    bound = "max_length: {type: integer, minimum: 2, default: 4096}"
    assert bound in text
    stricter.write_text(text.replace(bound, "max_length: {type: integer, maximum: 512}"))
    monkeypatch.setattr(cfg, "SCHEMA_PATH", stricter)
    with pytest.raises(PipelineError, match="config key dataset.max_length"):
        cfg.read_resolved(resolved)
