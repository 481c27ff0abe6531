"""The embedded toy target: builds locally, deterministic, loads as a Hugging Face model; the
machine's cache of builds (`toy_cache.py`) copies a build only where a new one would be equal."""

from __future__ import annotations

import subprocess

import pytest
import yaml
from conftest import PYTHON, REPO_ROOT

from eaglepipe.core.config_files import load_config
from eaglepipe.core.errors import PipelineError
from eaglepipe.data import toy_cache
from eaglepipe.data.chat_mask import tokenize_conversation
from eaglepipe.data.dataset import read_conversations
from eaglepipe.data.toy_target import CHAT_TEMPLATE, build_toy_target, read_build_info

SAMPLE = REPO_ROOT / "data" / "sample" / "conversations.jsonl"


def _toy(**overrides):
    toy = dict(load_config(REPO_ROOT / "config.yaml")["model"]["toy"])
    toy.update(train_steps=20, train_seq_len=32, train_batch_size=4)
    toy.update(overrides)
    return toy


@pytest.fixture(scope="module", autouse=True)
def no_cache():
    # These tests are about the build itself: every build here trains.
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(toy_cache.CACHE_ENV, "off")
        yield


@pytest.fixture(scope="module")
def toy_dir(tmp_path_factory, no_cache):
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


# ---------------------------------------------------------------- the machine's cache of builds


def build_files(directory):
    return {p.name: p.read_bytes() for p in sorted(directory.iterdir())}


def test_a_second_build_of_the_same_toy_is_copied_from_the_cache(
    tmp_path, monkeypatch, capsys, toy_dir
):
    monkeypatch.setenv(toy_cache.CACHE_ENV, str(tmp_path / "cache"))
    first = build_toy_target(tmp_path / "a" / "toy-target", _toy(), SAMPLE)
    assert "toy target: step 20/20" in capsys.readouterr().out
    # what it built equals a build without the cache, and the cache holds one entry
    assert build_files(first) == build_files(toy_dir)
    (entry,) = (tmp_path / "cache").iterdir()
    second = build_toy_target(tmp_path / "b" / "toy-target", _toy(), SAMPLE)
    out = capsys.readouterr().out
    assert "step" not in out and f"from the cache ({entry})" in out
    assert build_files(second) == build_files(first)
    assert sorted(p.name for p in (tmp_path / "b").iterdir()) == ["toy-target"]


def test_a_changed_setting_or_corpus_row_builds_anew(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv(toy_cache.CACHE_ENV, str(tmp_path / "cache"))
    build_toy_target(tmp_path / "a", _toy(train_steps=2), SAMPLE)
    build_toy_target(tmp_path / "b", _toy(train_steps=3), SAMPLE)
    edited = tmp_path / "edited.jsonl"
    lines = SAMPLE.read_text().splitlines(keepends=True)
    edited.write_text(
        lines[0].replace('"content": "', '"content": "Well, ', 1) + "".join(lines[1:])
    )
    assert edited.read_text() != SAMPLE.read_text()
    build_toy_target(tmp_path / "c", _toy(train_steps=2), edited)
    out = capsys.readouterr().out
    assert out.count("step 2/2") == 2 and out.count("step 3/3") == 1
    assert "from the cache" not in out
    assert len(list((tmp_path / "cache").iterdir())) == 3
    # more threads: not reproducible, so neither read nor written
    build_toy_target(tmp_path / "d", _toy(train_steps=2), SAMPLE, num_threads=2)
    assert "step 2/2" in capsys.readouterr().out
    assert len(list((tmp_path / "cache").iterdir())) == 3


def test_a_half_written_entry_is_never_used(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv(toy_cache.CACHE_ENV, str(cache))
    build_toy_target(tmp_path / "a", _toy(train_steps=2), SAMPLE)
    (entry,) = cache.iterdir()
    (entry / "eaglepipe_toy.json").unlink()  # as a copy killed before its last file
    (entry / "model.safetensors").write_bytes(b"partial")
    capsys.readouterr()
    built = build_toy_target(tmp_path / "b", _toy(train_steps=2), SAMPLE)
    assert "step 2/2" in capsys.readouterr().out
    assert (built / "model.safetensors").read_bytes() == (
        tmp_path / "a" / "model.safetensors"
    ).read_bytes()


def test_a_damaged_entry_is_passed_over_and_built_again(tmp_path, monkeypatch, capsys):
    cache = tmp_path / "cache"
    monkeypatch.setenv(toy_cache.CACHE_ENV, str(cache))
    first = build_toy_target(tmp_path / "a", _toy(train_steps=2), SAMPLE)
    (entry,) = cache.iterdir()
    weights = bytearray((entry / "model.safetensors").read_bytes())
    weights[-1] ^= 0xFF  # a flipped byte, the entry otherwise complete
    (entry / "model.safetensors").write_bytes(bytes(weights))
    capsys.readouterr()
    again = build_toy_target(tmp_path / "b", _toy(train_steps=2), SAMPLE)
    out = capsys.readouterr().out
    assert "step 2/2" in out and "from the cache" not in out
    assert build_files(again) == build_files(first)


def test_an_unwritable_cache_warns_and_the_build_goes_on(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "not-a-directory"
    blocker.write_text("a file where the cache would be")
    monkeypatch.setenv(toy_cache.CACHE_ENV, str(blocker / "cache"))
    built = build_toy_target(tmp_path / "a", _toy(train_steps=2), SAMPLE)
    out = capsys.readouterr().out
    assert f"not kept in the cache {blocker / 'cache'}" in out
    assert (built / "eaglepipe_toy.json").is_file()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a", "not-a-directory"]


def test_the_cache_is_off_or_under_the_users_cache_directory(tmp_path, monkeypatch):
    monkeypatch.setenv(toy_cache.CACHE_ENV, "off")
    assert toy_cache.cache_root() is None
    build_toy_target(tmp_path / "a", _toy(train_steps=2), SAMPLE)
    monkeypatch.delenv(toy_cache.CACHE_ENV)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert toy_cache.cache_root() == tmp_path / "xdg" / "eaglepipe" / "toy-targets"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a"]
