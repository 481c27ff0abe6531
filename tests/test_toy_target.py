"""The embedded toy target: builds locally, deterministic, loads as a Hugging Face model."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from conftest import PYTHON, REPO_ROOT

from eaglepipe.core.config import load_config
from eaglepipe.core.errors import PipelineError
from eaglepipe.data.chat_mask import tokenize_conversation
from eaglepipe.data.dataset import read_conversations
from eaglepipe.data.toy_target import CHAT_TEMPLATE, build_toy_target, read_build_info

SAMPLE = REPO_ROOT / "data" / "sample" / "conversations.jsonl"


def _toy(**overrides):
    toy = dict(load_config(REPO_ROOT / "config.yaml")["model"]["toy"])
    toy.update(train_steps=20, train_seq_len=32, train_batch_size=4)
    toy.update(overrides)
    return toy


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory):
    return build_toy_target(tmp_path_factory.mktemp("toy") / "toy-target", _toy(), SAMPLE, 1)


def test_builds_a_loadable_llama_with_chat_template(toy_dir):
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    toy = _toy()
    config = AutoConfig.from_pretrained(toy_dir)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.num_hidden_layers == toy["num_layers"] >= 8
    assert config.hidden_size == toy["hidden_size"]
    assert config.vocab_size == toy["vocab_size"]
    tokenizer = AutoTokenizer.from_pretrained(toy_dir)
    assert len(tokenizer) == toy["vocab_size"]
    assert tokenizer.chat_template == CHAT_TEMPLATE
    assert (tokenizer.bos_token, tokenizer.eos_token, tokenizer.pad_token) == (
        "<|bos|>",
        "<|end|>",
        "<|pad|>",
    )
    assert config.eos_token_id == tokenizer.eos_token_id
    model = AutoModelForCausalLM.from_pretrained(toy_dir)
    messages = [{"role": "user", "content": "What is 2 + 3?"}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<|bos|><|user|>\nWhat is 2 + 3?<|end|>\n<|assistant|>\n"
    ids = tokenizer(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], toy["vocab_size"])


def test_every_bundled_conversation_tokenizes_with_assistant_tokens(toy_dir):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(toy_dir)
    conversations, bad = read_conversations(SAMPLE)
    assert len(conversations) >= 250 and not bad
    lengths = []
    for conversation in conversations:
        result = tokenize_conversation(tokenizer, conversation.messages, 1024)
        assert any(result.loss_mask)
        lengths.append(result.num_tokens)
    # The bundled data has some long conversations (several hundred to ~1000 tokens).
    assert max(lengths) >= 800
    assert sum(n >= 400 for n in lengths) >= 10


def test_pretraining_lowers_the_loss(toy_dir):
    log = read_build_info(toy_dir)["train_log"]
    assert log[0]["step"] == 0 and log[-1]["step"] == 19
    assert log[-1]["loss"] < log[0]["loss"] - 0.5


def test_build_is_deterministic_and_replaces_the_directory(tmp_path, toy_dir):
    out = tmp_path / "again"
    out.mkdir()
    (out / "stale.txt").write_text("left over from an older build")
    build_toy_target(out, _toy(), SAMPLE, 1)
    assert not (out / "stale.txt").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again"]  # no temp dirs left
    names = sorted(p.name for p in toy_dir.iterdir())
    assert names == sorted(p.name for p in out.iterdir())
    for name in names:
        assert (toy_dir / name).read_bytes() == (out / name).read_bytes(), name


def test_different_seed_gives_different_weights(tmp_path, toy_dir):
    other = build_toy_target(tmp_path / "seed1", _toy(seed=1, train_steps=0), SAMPLE, 1)
    same_tokenizer = (other / "tokenizer.json").read_bytes() == (
        toy_dir / "tokenizer.json"
    ).read_bytes()
    assert same_tokenizer  # the tokenizer depends on the corpus only
    assert (other / "model.safetensors").read_bytes() != (
        toy_dir / "model.safetensors"
    ).read_bytes()


def test_missing_toy_key_is_named(tmp_path):
    toy = _toy()
    del toy["num_heads"]
    with pytest.raises(PipelineError, match="model.toy.num_heads"):
        build_toy_target(tmp_path / "x", toy, SAMPLE)


def test_script_builds_from_a_config_file(tmp_path):
    config = yaml.safe_load((REPO_ROOT / "config.yaml").read_text())
    config["model"]["toy"].update(train_steps=2, train_seq_len=16, train_batch_size=2)
    config["dataset"]["path"] = str(SAMPLE)
    config_path = tmp_path / "config.yaml"
    config_path.write_text(yaml.safe_dump(config))
    out = tmp_path / "models" / "toy-target"
    result = subprocess.run(
        [PYTHON, "-u", str(REPO_ROOT / "scripts" / "build_toy_target.py"), "--config",
         str(config_path), "--out", str(out), "--threads", "1"],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    assert "toy target: step 2/2" in result.stdout
    assert (out / "model.safetensors").is_file() and (out / "tokenizer.json").is_file()

    config["dataset"]["path"] = str(tmp_path / "missing.jsonl")
    config_path.write_text(yaml.safe_dump(config))
    result = subprocess.run(
        [PYTHON, "-u", str(REPO_ROOT / "scripts" / "build_toy_target.py"), "--config",
         str(config_path), "--out", str(out)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: dataset.path {tmp_path / 'missing.jsonl'} does not exist"
    )
