"""Shared fixtures: tiny real models built locally (no downloads), and the project's Python."""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
PYTHON = sys.executable

# One compute thread per process, for this process and everything the tests start (servers,
# Snakemake jobs): the tests run several processes at once on a 2-core machine, and torch
# threads spinning on contended cores made CPU work 5-15x slower there. Set before anything
# imports torch; a value the caller set is kept.
for _variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
    os.environ.setdefault(_variable, "1")


# The longest modules first (measured with `pytest --durations=0`, docs/testing.md):
# pytest-xdist (`--dist loadfile --no-loadscope-reorder`) hands out whole modules in this
# order, so the last module to start decides when the suite ends.
LONGEST_FIRST = [
    "test_embedded_default.py",
    "test_slurm.py",
    "test_finished_run.py",
    "test_regenerate.py",
    "test_h200_tools.py",
    "test_workflow.py",
    "test_workflow_faults.py",
    "test_benchmarks.py",
    "test_lifecycle.py",
    "test_drafter_train.py",
    "test_live_acceptance.py",
    "test_prompt_bench.py",
    "test_extract.py",
]


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: order kept within


# The embedded default's pipeline is the suite's critical path: about 13 minutes of one core,
# started first, and the suite ends when it does. Every other module runs at a lower CPU
# priority (inherited by the servers and workflows it starts), so on two cores that pipeline
# keeps one core to itself and the other modules share what is left, instead of three workers
# splitting two cores evenly and the suite waiting on its slowest module at the end.
CRITICAL_PATH_MODULE = LONGEST_FIRST[0]
OTHER_MODULES_NICENESS = 10


def pytest_runtest_setup(item):
    if item.path.name == CRITICAL_PATH_MODULE:
        return
    current = os.nice(0)
    if current < OTHER_MODULES_NICENESS:
        os.nice(OTHER_MODULES_NICENESS - current)  # only ever raised: lowering needs root


# Ports for the tests' servers and stand-ins: each xdist worker takes them from a block of its
# own, below the kernel's ephemeral range (32768 on, where `bind(("", 0))` and every outgoing
# connection take theirs) and below the pipeline's drawn ports
# (eaglepipe.server.lifecycle.ports, from 20000). With ports from `bind(0)` two workers'
# servers once drew the same port: the second job found it held by the other worker's server.
TEST_PORTS_LOW = 10000
TEST_PORTS_PER_WORKER = 500
_port_cursor: list[int] = []


def free_port() -> int:
    """A port free on 127.0.0.1 now, from this worker's block, not handed out before in this
    process (until the block wraps)."""
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    index = int(worker) if worker.isdigit() else 0
    low = TEST_PORTS_LOW + (index % 20) * TEST_PORTS_PER_WORKER
    if not _port_cursor:  # a random start: suites run side by side rarely start together
        _port_cursor.append(random.randrange(TEST_PORTS_PER_WORKER))
    for _ in range(TEST_PORTS_PER_WORKER):
        port = low + _port_cursor[0] % TEST_PORTS_PER_WORKER
        _port_cursor[0] += 1
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        return port
    raise RuntimeError(f"no free port in {low}..{low + TEST_PORTS_PER_WORKER - 1}")


@pytest.fixture(scope="session", autouse=True)
def toy_cache_of_this_session(tmp_path_factory) -> Path:
    """Toy targets built by this test session are reused by its later runs of the same toy
    (eaglepipe/data/toy_cache.py), and never by another session: the suite proves each build
    at least once, leaves the user's ~/.cache alone, and the xdist workers share one cache."""
    base = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        base = base.parent  # pytest-N/, shared by popen-gw0, popen-gw1, ...
    cache = base / "toy-cache"
    os.environ.setdefault("EAGLEPIPE_TOY_CACHE", str(cache))
    return cache


_GREEDY_MODELS: dict = {}


def plain_greedy(model_dir, prompt: list[int], budget: int, stops=()) -> list[int]:
    """Greedy decoding the plain way: one unbatched fp32 forward of the whole sequence per token,
    up to and including a stop token, or `budget` tokens."""
    import torch
    from transformers import AutoModelForCausalLM

    if model_dir not in _GREEDY_MODELS:
        _GREEDY_MODELS[model_dir] = AutoModelForCausalLM.from_pretrained(
            model_dir, dtype=torch.float32
        ).eval()
    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(budget):
            logits = _GREEDY_MODELS[model_dir](torch.tensor([ids]), use_cache=False).logits[0, -1]
            token = int(logits.argmax())
            out.append(token)
            ids.append(token)
            if token in stops:
                break
    return out


def build_tiny_llama(out_dir: Path, *, num_layers: int = 8, hidden_size: int = 32) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=300,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(out_dir)
    return out_dir


def add_toy_tokenizer(model_dir: Path, vocab_size: int = 300) -> Path:
    """The toy target's kind of tokenizer (chat template, end-of-turn token) for a bare test
    model of `vocab_size` ids, trained on the sample conversations."""
    from eaglepipe.data.dataset import read_conversations
    from eaglepipe.data.toy_target import corpus_texts, train_tokenizer

    conversations, _ = read_conversations(
        REPO_ROOT / "data" / "sample" / "conversations.jsonl", bad_rows="skip"
    )
    train_tokenizer(corpus_texts(conversations), vocab_size).save_pretrained(model_dir)
    return model_dir


def build_tiny_deepseek_v3(out_dir: Path, *, num_layers: int = 8, hidden_size: int = 32) -> Path:
    """A DeepSeek-V3-architecture target (MLA attention, MoE layers after the first dense one)."""
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    config = DeepseekV3Config(
        vocab_size=300,
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        moe_intermediate_size=16,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_shared_experts=1,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        first_k_dense_replace=1,
        q_lora_rank=16,
        kv_lora_rank=16,
        qk_rope_head_dim=8,
        qk_nope_head_dim=8,
        v_head_dim=8,
        max_position_embeddings=1024,
        tie_word_embeddings=False,
    )
    model = DeepseekV3ForCausalLM(config)
    model.save_pretrained(out_dir)
    return out_dir


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A random 8-layer Llama target (weights only, no tokenizer): for server-side tests."""
    return build_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


@pytest.fixture(scope="session")
def tiny_deepseek_dir(tmp_path_factory) -> Path:
    return build_tiny_deepseek_v3(tmp_path_factory.mktemp("tiny-deepseek-v3"))


@contextmanager
def shard_lock_held_elsewhere(shard_dir: Path) -> Iterator[subprocess.Popen]:
    """Another process holds the shard's writer lock for the block; it is killed afterwards."""
    holder = subprocess.Popen(
        [
            PYTHON,
            "-c",
            textwrap.dedent(
                f"""
                import time
                from eaglepipe.core.shard_job import ShardLock
                ShardLock({str(shard_dir)!r}).acquire()
                print("locked", flush=True)
                time.sleep(120)
                """
            ),
        ],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    try:
        assert holder.stdout.readline().strip() == "locked"
        yield holder
    finally:
        os.killpg(holder.pid, signal.SIGKILL)
        holder.wait()


@contextmanager
def small_filesystem(path: Path, size: int) -> Iterator:
    """A tmpfs of `size` bytes (whole pages) mounted at `path` for the block, to fill up: yields
    `resize(bytes)`, which frees space (or takes it) as a user would. Skips the test where
    mounting is not allowed (not root)."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "eaglepipe-test", str(path)],
        capture_output=True,
        text=True,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {mounted.stderr.strip()}")

    def resize(new_size: int) -> None:
        subprocess.run(["mount", "-o", f"remount,size={new_size}", str(path)], check=True)

    try:
        yield resize
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], check=False)
