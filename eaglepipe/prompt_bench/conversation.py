"""Each prompt's turns as the target is asked them, and the target's plain greedy answers.

A prompt of several user turns is one conversation: turn k is asked after the target's OWN
plain greedy answers to turns 1..k-1 (as MT-bench is asked), rendered by the target's chat
template (`[user 1, assistant 1, ..., user k]` with the generation prompt). The answers are the
plain reference every drafter's output must equal, so they are made once per target, serving
settings, prompts and budget, and kept in a checksummed cache file: a second drafter, another
setting or a rerun reuses them (a damaged or out-of-date file is made again, saying why).

A turn whose prompt and reply budget do not fit in the target's context is not asked (nor are
the conversation's later turns, which build on it); each is counted and named in the results.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import xxhash

from ..core.atomic import atomic_write_json
from ..core.errors import PipelineError
from ..core.run import RunSpec
from ..data.chat_mask import render
from ..data.dataset import RowProblem
from ..drafter.live import LiveTurn, before_stop
from ..drafter.live_run import PlainOutput
from .prompt_file import BenchPrompt, PromptSet


@dataclass
class AskedTurns:
    """The turns asked (LiveTurn: row_id = the prompt's index, turn = 0-based turn), their
    plain answers by (row_id, turn), and the turns that did not fit."""

    turns: list[LiveTurn]
    plain: dict[tuple[int, int], PlainOutput]
    too_long: list[dict] = field(default_factory=list)
    reference: str = "computed"


def turn_prompt(tokenizer, questions: list[str], answers: list[str], where: str) -> list[int]:
    """Token ids of the last question after the earlier questions and answers."""
    messages = []
    for i, question in enumerate(questions):
        messages.append({"role": "user", "content": question})
        if i < len(answers):
            messages.append({"role": "assistant", "content": answers[i]})
    try:
        text = render(tokenizer, messages, add_generation_prompt=True)
    except RowProblem as exc:
        raise PipelineError(f"{where}: the target's chat template fails: {exc}") from None
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def answer_text(tokenizer, output_ids: list[int], stops) -> str:
    """A plain answer as the next turn's history holds it: the text before the end of turn, as
    a server's detokenizer returns it (special tokens skipped)."""
    return tokenizer.decode(before_stop(output_ids, stops), skip_special_tokens=True)


def cache_key(run: RunSpec, harness: str, prompt_set: PromptSet, stops, budget: int) -> dict:
    """What the plain answers depend on: the target's files, how it is served, the prompts and
    their reply budget, the stop tokens."""
    server, model = run.server, run.model
    prompts = [[p.index, p.id, list(p.turns)] for p in prompt_set.prompts]
    key = {
        "benchmark": prompt_set.source.name,
        "harness": harness,
        "model_dir": str(model.directory.resolve()),
        "model_config_hash": model.config_hash,
        "weights_fingerprint": model.weights_fingerprint,
        "tokenizer_fingerprint": model.tokenizer_fingerprint,
        "dtype": server.dtype,
        "device": server.device if harness == "transformers" else None,
        "sglang": server.sglang.as_dict() if harness == "sglang" else None,
        "max_new_tokens": budget,
        "stop_token_ids": sorted(int(t) for t in stops),
        "prompts_xxh3_128": xxhash.xxh3_128_hexdigest(json.dumps(prompts).encode()),
    }
    return json.loads(json.dumps(key))


def _checksum(key: dict, outputs: dict) -> str:
    text = json.dumps({"key": key, "outputs": outputs}, sort_keys=True)
    return xxhash.xxh3_128_hexdigest(text.encode())


def read_cache(path: Path, key: dict) -> tuple[dict | None, str]:
    """The cached plain answers by (row_id, turn) when made under `key` and intact; else None
    and why not."""
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"{path} does not exist yet"
    except (OSError, ValueError) as exc:
        return None, f"{path} cannot be read ({type(exc).__name__})"
    if not isinstance(stored, dict) or not isinstance(stored.get("outputs"), dict):
        return None, f"{path} is not a plain-answer cache"
    if stored.get("checksum") != _checksum(stored.get("key"), stored["outputs"]):
        return None, f"{path} does not match its checksum"
    old = stored.get("key") if isinstance(stored.get("key"), dict) else {}
    changed = sorted(k for k in key if old.get(k) != key[k])
    if changed:
        return None, f"{path} was made for another target, server, prompts or budget ({changed})"
    plain = {}
    for name, entry in stored["outputs"].items():
        row_id, turn = (int(x) for x in name.split(":"))
        plain[(row_id, turn)] = PlainOutput(
            [int(t) for t in entry["output_ids"]], float(entry["seconds"]), entry.get("margins")
        )
    return plain, "reused"


def write_cache(path: Path, key: dict, plain: dict) -> None:
    outputs = {
        f"{row_id}:{turn}": {"output_ids": o.output_ids, "seconds": o.seconds, "margins": o.margins}
        for (row_id, turn), o in sorted(plain.items())
    }
    atomic_write_json(path, {"key": key, "outputs": outputs, "checksum": _checksum(key, outputs)})


def plain_decoder(run: RunSpec, harness: str, stops, budget: int):
    """The engine's plain greedy decoder (a context manager yielding `decode(ids)`)."""
    if harness == "sglang":
        from ..drafter.live_sglang import plain_decoder as engine_decoder
    else:
        from ..drafter.live_transformers import plain_decoder as engine_decoder
    return engine_decoder(run, stops, budget)


def ask_turns(
    run: RunSpec,
    harness: str,
    prompt_set: PromptSet,
    tokenizer,
    stops,
    *,
    budget: int,
    cache_path: Path,
) -> AskedTurns:
    """Every prompt's turns, each after the target's own plain answers to the earlier ones."""
    key = cache_key(run, harness, prompt_set, stops, budget)
    cached, why = read_cache(cache_path, key)
    note = f"read from {cache_path}" if cached is not None else f"computed: {why}"
    print(f"plain greedy answers {note}", flush=True)
    limit = run.model.max_positions
    asked = AskedTurns([], {}, reference=note)
    if cached is not None:

        def from_cache(name, ids):
            if name not in cached:  # never under a matching checksummed key
                raise PipelineError(f"{cache_path} lacks the answer to {name}: remove it")
            return cached[name]

        for prompt in prompt_set.prompts:
            ask_conversation(prompt, tokenizer, stops, budget, limit, from_cache, asked)
        return asked
    with plain_decoder(run, harness, stops, budget) as decode:
        for prompt in prompt_set.prompts:
            ask_conversation(
                prompt, tokenizer, stops, budget, limit, lambda _, ids: decode(ids), asked
            )
    write_cache(cache_path, key, asked.plain)
    return asked


def ask_conversation(
    prompt: BenchPrompt, tokenizer, stops, budget, limit, answer, asked: AskedTurns
) -> None:
    """The prompt's turns in order, `answer((row_id, turn), ids)` giving each plain answer."""
    answers: list[str] = []
    for turn in range(len(prompt.turns)):
        where = f"prompt {prompt.id} turn {turn + 1}"
        ids = turn_prompt(tokenizer, list(prompt.turns[: turn + 1]), answers, where)
        if limit is not None and len(ids) + budget > limit:
            asked.too_long.extend(
                {
                    "id": prompt.id,
                    "turn": later + 1,
                    "prompt_tokens": len(ids) if later == turn else None,
                    "why": (
                        f"{len(ids)} prompt tokens + {budget} reply tokens exceed the context "
                        f"({limit})"
                        if later == turn
                        else f"follows turn {turn + 1}, which did not fit"
                    ),
                }
                for later in range(turn, len(prompt.turns))
            )
            return
        name = (prompt.index, turn)
        output = answer(name, ids)
        asked.plain[name] = output
        asked.turns.append(LiveTurn(prompt.index, turn, ids, []))
        answers.append(answer_text(tokenizer, output.output_ids, stops))
