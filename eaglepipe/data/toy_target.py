"""The embedded default target: a tiny Llama model and tokenizer built locally, no download.

`build_toy_target` trains a byte-level BPE tokenizer on the bundled conversations, gives it a
chat template whose turns are `<|system|>`, `<|user|>` and `<|assistant|>` headers closed by
the `<|end|>` end-of-turn token, initialises a `LlamaForCausalLM` of the configured shape from
the seed, pre-trains it briefly on the same conversations (so its next-token predictions are
learnable and a drafter trained on its hidden states gets a meaningful acceptance rate), and
saves model and tokenizer as a Hugging Face model directory. Deterministic given the seed and
thread count; the directory is built next to its destination and renamed into place. The
corpus is the configured dataset (the bundled sample by default), its first 5000 usable rows.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import time
from pathlib import Path

from ..core.atomic import atomic_write_json, fsync_dir
from ..core.errors import PipelineError
from ..core.run import check_toy_shape
from . import toy_cache
from .dataset import Conversation, read_conversations

BOS, EOS, PAD = "<|bos|>", "<|end|>", "<|pad|>"
ROLE_TOKENS = {"system": "<|system|>", "user": "<|user|>", "assistant": "<|assistant|>"}
SPECIAL_TOKENS = [PAD, BOS, EOS, *ROLE_TOKENS.values()]

# Each turn: role header + newline, content, <|end|> + newline. The assistant's <|end|> is what
# the model emits to stop, so it is part of the assistant span; the header is not.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] not in ['system', 'user', 'assistant'] %}"
    "{{ raise_exception('unknown role ' + message['role']) }}"
    "{% endif %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

TOY_KEYS = (
    "hidden_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "intermediate_size",
    "vocab_size",
    "max_position_embeddings",
    "seed",
    "train_steps",
    "train_seq_len",
    "train_batch_size",
)
BUILD_INFO = "eaglepipe_toy.json"

# A user dataset may be large; the toy target only needs a sample of it.
MAX_CORPUS_ROWS = 5000
LEARNING_RATE = 3e-3
WARMUP_FRACTION = 0.1


def _check_toy_config(toy_cfg: dict) -> None:
    missing = [k for k in TOY_KEYS if k not in toy_cfg]
    if missing:
        raise PipelineError(f"config key model.toy.{missing[0]} is missing")
    check_toy_shape(toy_cfg)


def corpus_texts(conversations: list[Conversation]) -> list[str]:
    """The plain texts the tokenizer learns its merges from (role headers are special tokens)."""
    return [m["content"] for c in conversations for m in c.messages]


def train_tokenizer(texts: list[str], vocab_size: int, model_max_length: int | None = None):
    """A byte-level BPE tokenizer with the chat special tokens, as a transformers tokenizer."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    # Untrimmed offsets: each token's character span is exactly the text it covers.
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(texts, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=list(ROLE_TOKENS.values()),
        model_max_length=model_max_length,
    )
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def _token_stream(tokenizer, conversations: list[Conversation]):
    import torch

    ids: list[int] = []
    for conversation in conversations:
        text = tokenizer.apply_chat_template(conversation.messages, tokenize=False)
        ids += tokenizer(text, add_special_tokens=False)["input_ids"]
    return torch.tensor(ids, dtype=torch.long)


def _learning_rate(step: int, total: int) -> float:
    warmup = max(1, int(total * WARMUP_FRACTION))
    if step < warmup:
        return LEARNING_RATE * (step + 1) / warmup
    progress = (step - warmup) / max(1, total - warmup)
    return LEARNING_RATE * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def pretrain(model, stream, toy_cfg: dict, log_every: int = 25) -> list[dict]:
    """Short seeded next-token training on random windows of the token stream; returns the log."""
    import torch

    steps = toy_cfg["train_steps"]
    seq_len = min(toy_cfg["train_seq_len"], len(stream) - 1)
    batch = toy_cfg["train_batch_size"]
    if steps == 0:
        return []
    if seq_len < 2:
        raise PipelineError("the toy target's training corpus is too small to train on")
    generator = torch.Generator().manual_seed(toy_cfg["seed"])
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=LEARNING_RATE, betas=(0.9, 0.95), weight_decay=0.0
    )
    offsets = torch.arange(seq_len + 1)
    log = []
    model.train()
    started = time.monotonic()
    for step in range(steps):
        for group in optimizer.param_groups:
            group["lr"] = _learning_rate(step, steps)
        starts = torch.randint(0, len(stream) - seq_len, (batch,), generator=generator)
        windows = stream[starts[:, None] + offsets]
        loss = model(input_ids=windows, labels=windows).loss
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        if step % log_every == 0 or step == steps - 1:
            elapsed = time.monotonic() - started
            rate = (step + 1) / elapsed if elapsed > 0 else 0.0
            eta = (steps - step - 1) / rate if rate else 0.0
            loss_value = loss.item()
            log.append({"step": step, "loss": round(loss_value, 4)})
            print(
                f"toy target: step {step + 1}/{steps} loss {loss_value:.3f} "
                f"({rate * batch * seq_len:,.0f} tokens/s, ETA {eta:.0f}s)",
                flush=True,
            )
    model.eval()
    return log


def build_model(toy_cfg: dict, tokenizer):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=max(toy_cfg["vocab_size"], len(tokenizer)),
        hidden_size=toy_cfg["hidden_size"],
        intermediate_size=toy_cfg["intermediate_size"],
        num_hidden_layers=toy_cfg["num_layers"],
        num_attention_heads=toy_cfg["num_heads"],
        num_key_value_heads=toy_cfg["num_kv_heads"],
        max_position_embeddings=toy_cfg["max_position_embeddings"],
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
    )
    torch.manual_seed(toy_cfg["seed"])
    return LlamaForCausalLM(config)


def portable_tokenizer_class(path: Path) -> None:
    """Name the class every transformers version and engine knows for a tokenizer.json."""
    settings = json.loads(path.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    atomic_write_json(path, settings)


def _replace_dir(tmp_dir: Path, out_dir: Path) -> None:
    """Swap the finished `tmp_dir` in as `out_dir` (a directory cannot be os.replace'd over)."""
    old = out_dir.with_name(f".{out_dir.name}.old-{os.getpid()}")
    if out_dir.exists():
        os.rename(out_dir, old)
    os.rename(tmp_dir, out_dir)
    fsync_dir(out_dir.parent)
    shutil.rmtree(old, ignore_errors=True)


def _copy_in(source: Path, out_dir: Path) -> None:
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    toy_cache.copy_build(source, tmp_dir)
    _replace_dir(tmp_dir, out_dir)


def build_toy_target(
    out_dir: str | os.PathLike,
    toy_cfg: dict,
    corpus_path: str | os.PathLike,
    num_threads: int | None = None,
) -> Path:
    """Build the toy target into `out_dir`; returns it. Prints progress. With one thread (the
    default) a build of the same settings and corpus is copied from the machine's cache
    (`toy_cache.py`) when there is one, and a new build is kept there."""
    _check_toy_config(toy_cfg)
    out_dir = Path(out_dir)
    conversations, _ = read_conversations(corpus_path, bad_rows="skip")
    conversations = conversations[:MAX_CORPUS_ROWS]
    if not conversations:
        raise PipelineError(f"toy target corpus {corpus_path} holds no usable conversations")
    cache_key = None
    if (num_threads or 1) == 1:  # the build is reproducible with one thread only
        settings = {k: toy_cfg[k] for k in TOY_KEYS}
        cache_key = toy_cache.build_key(settings, [c.messages for c in conversations])
        cached = toy_cache.cached_build(cache_key, BUILD_INFO)
        if cached is not None:
            _copy_in(cached, out_dir)
            print(f"toy target: copied to {out_dir} from the cache ({cached})", flush=True)
            return out_dir

    import torch

    previous_threads = torch.get_num_threads()
    # One thread by default: the toy's matrices are so small that threading only adds
    # synchronisation, and on a busy machine OpenMP threads spinning on contended cores made
    # training 10-20x slower. A fixed count also keeps float reductions reproducible.
    torch.set_num_threads(num_threads or 1)
    try:
        started = time.monotonic()
        tokenizer = train_tokenizer(
            corpus_texts(conversations),
            toy_cfg["vocab_size"],
            model_max_length=toy_cfg["max_position_embeddings"],
        )
        print(
            f"toy target: tokenizer with {len(tokenizer)} tokens trained on "
            f"{len(conversations)} conversations",
            flush=True,
        )
        model = build_model(toy_cfg, tokenizer)
        stream = _token_stream(tokenizer, conversations)
        log = pretrain(model, stream, toy_cfg)
        model.generation_config.eos_token_id = tokenizer.eos_token_id
        model.generation_config.pad_token_id = tokenizer.pad_token_id

        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp_dir = out_dir.with_name(f".{out_dir.name}.tmp-{os.getpid()}")
        shutil.rmtree(tmp_dir, ignore_errors=True)
        model.save_pretrained(tmp_dir)
        tokenizer.save_pretrained(tmp_dir)
        portable_tokenizer_class(tmp_dir / "tokenizer_config.json")
        atomic_write_json(
            tmp_dir / BUILD_INFO,
            {
                "toy": {k: toy_cfg[k] for k in TOY_KEYS},
                "corpus_rows": len(conversations),
                "corpus_tokens": int(len(stream)),
                "train_log": log,
            },
        )
        if cache_key is not None:
            warning = toy_cache.store_build(cache_key, tmp_dir)
            if warning:
                print(warning, flush=True)
        _replace_dir(tmp_dir, out_dir)
        print(
            f"toy target: saved to {out_dir} in {time.monotonic() - started:.1f}s",
            flush=True,
        )
    finally:
        torch.set_num_threads(previous_threads)
    return out_dir


def read_build_info(model_dir: str | os.PathLike) -> dict:
    return json.loads((Path(model_dir) / BUILD_INFO).read_text())
