"""What one live-acceptance run reads and records, shared by both harnesses: the held-out turns
it prompts with, the exported drafter as its engine reads it, the speculative setting it is
served with, each prompt's outcome, and the target's plain greedy outputs, which runs on the
same target and prompts can share (a file keyed by everything they depend on)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..core.atomic import atomic_write_json
from ..core.errors import PipelineError
from ..core.sealed import require_intact


@dataclass(frozen=True)
class LiveTurn:
    """One held-out assistant turn: the prompt before it and the reply the dataset holds."""

    row_id: int
    turn: int  # ordinal among the row's assistant turns (as eval.json's turns)
    prompt: list[int]
    reply: list[int]


@dataclass(frozen=True)
class ExportInfo:
    """An exported drafter directory as its engine reads it."""

    directory: Path
    engine: str
    written_layer_ids: list[int]  # as the engine reads them from config.json
    exported: dict  # its config.json

    @classmethod
    def read(cls, export_dir: str | Path) -> ExportInfo:
        directory = Path(export_dir)
        path = directory / "config.json"
        try:
            config = json.loads(path.read_text())
        except FileNotFoundError:
            raise PipelineError(f"{path} does not exist: run the export rule first") from None
        # Served as it is (SGLang reads the directory): a damaged export would be measured.
        require_intact(directory / "model.safetensors")
        engine = (config.get("eaglepipe") or {}).get("engine")
        if engine == "sglang":
            written = (config.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        elif engine == "vllm":
            written = config.get("eagle_aux_hidden_state_layer_ids")
        else:
            raise PipelineError(f"{path} names no export engine (eaglepipe.engine: {engine!r})")
        if not written:
            raise PipelineError(f"{path} holds no aux layer ids where {engine} reads them")
        return cls(directory, engine, [int(i) for i in written], config)


@dataclass(frozen=True)
class SpeculativeSetting:
    """SGLang's speculative decoding settings: draft steps, top-k and draft tokens per round
    (`--speculative-num-steps`, `--speculative-eagle-topk`, `--speculative-num-draft-tokens`)."""

    steps: int
    topk: int
    draft_tokens: int

    @classmethod
    def chain(cls, steps: int) -> SpeculativeSetting:
        """Greedy chain drafting of `steps` tokens: the default, `steps`/1/`steps + 1`."""
        return cls.parse(f"{steps}/1/{steps + 1}")

    @classmethod
    def parse(cls, text: str) -> SpeculativeSetting:
        """`STEPS/TOPK/DRAFT_TOKENS`, e.g. `7/1/8`; anything SGLang would not run as written is
        an error naming the setting."""
        parts = str(text).split("/")
        if len(parts) != 3 or not all(p.strip().isdigit() for p in parts):
            raise PipelineError(
                f"speculative setting {text!r}: expected STEPS/TOPK/DRAFT_TOKENS, e.g. 7/1/8"
            )
        steps, topk, draft_tokens = (int(p) for p in parts)
        if steps < 1 or topk < 1:
            raise PipelineError(f"speculative setting {text!r}: steps and top-k must be >= 1")
        if topk == 1 and draft_tokens != steps + 1:
            # SGLang 0.5.14 resets it to steps + 1 with a warning: the setting would not run.
            raise PipelineError(
                f"speculative setting {text!r}: with top-k 1 a round verifies steps + 1 = "
                f"{steps + 1} tokens (SGLang resets any other count)"
            )
        if topk > 1 and not 2 <= draft_tokens <= steps * topk + 1:
            raise PipelineError(
                f"speculative setting {text!r}: draft tokens must lie in [2, steps x top-k + 1]"
            )
        return cls(steps, topk, draft_tokens)

    @property
    def label(self) -> str:
        return f"{self.steps}/{self.topk}/{self.draft_tokens}"

    def record(self) -> dict:
        return {"steps": self.steps, "topk": self.topk, "draft_tokens": self.draft_tokens}


@dataclass
class PromptRun:
    """One held-out turn decoded with the drafter, and the target's plain greedy output."""

    row_id: int
    turn: int
    produced: list[int]
    greedy: list[int]
    completion_tokens: int  # tokens produced with the drafter, the stop token included
    rounds: int  # verification forwards of the target
    accepted: int  # draft tokens accepted over all rounds
    seconds: float = 0.0  # wall time of the decode with the drafter
    greedy_seconds: float = 0.0  # wall time of the plain greedy decode
    margin_at_difference: float | None = None  # target's top-1 minus top-2 at the first difference
    extra: dict = field(default_factory=dict)

    def record(self) -> dict:
        return {
            "row_id": self.row_id,
            "turn": self.turn,
            "completion_tokens": self.completion_tokens,
            "rounds": self.rounds,
            "accepted": self.accepted,
            "acceptance_length": (self.completion_tokens / self.rounds if self.rounds else None),
            "seconds": round(self.seconds, 4),
            "greedy_seconds": round(self.greedy_seconds, 4),
            "matches_greedy": self.produced == self.greedy,
            "first_difference": first_difference(self.produced, self.greedy),
            "target_logit_margin": self.margin_at_difference,
            **self.extra,
        }


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first position where two outputs differ (or the shorter one ends), None if equal."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def acceptance_length(accepted: int, rounds: int) -> float | None:
    """The accepted drafts plus the target's own token, per verification round."""
    return 1.0 + accepted / rounds if rounds else None


# ---------------------------------------------------------------- the greedy reference


@dataclass(frozen=True)
class PlainOutput:
    """A turn decoded plainly (no drafter): the reference speculative decoding must equal."""

    output_ids: list[int]
    seconds: float  # wall time of the decode (the speed-up's denominator)
    margins: list[float | None] | None = None  # top-1 minus top-2 per position, when known


def greedy_reference_key(run, harness: str, turns, stops) -> dict:
    """What the target's plain greedy outputs depend on: the target's files, how it is served,
    the turns, the stop tokens and the token budget. Live runs with the same key share them."""
    server = run.server
    key = {
        "harness": harness,
        "model_dir": str(run.model.directory.resolve()),
        "model_config_hash": run.model.config_hash,
        "weights_fingerprint": run.model.weights_fingerprint,
        "dtype": server.dtype,
        "device": server.device if harness == "transformers" else None,
        "sglang": server.sglang.as_dict() if harness == "sglang" else None,
        "max_new_tokens": run.evaluate.live_new_tokens,
        "stop_token_ids": sorted(int(t) for t in stops),
        "turns": [[t.row_id, t.turn, [int(i) for i in t.prompt]] for t in turns],
    }
    return json.loads(json.dumps(key))  # the form it has once read back


def read_greedy_reference(path, key: dict) -> tuple[dict | None, str]:
    """The plain outputs stored at `path`, by (row id, turn), when they were made under `key`;
    else None and why not."""
    path = Path(path)
    try:
        stored = json.loads(path.read_text())
    except FileNotFoundError:
        return None, f"{path} does not exist yet"
    except (OSError, ValueError) as exc:
        return None, f"{path} cannot be read ({type(exc).__name__})"
    if not isinstance(stored, dict) or stored.get("key") != key:
        old = stored.get("key") if isinstance(stored, dict) else None
        changed = sorted(k for k in key if not isinstance(old, dict) or old.get(k) != key[k])
        return None, f"{path} was made for another target, server or turns ({changed})"
    outputs = stored.get("outputs") or {}
    wanted = [f"{row_id}:{turn}" for row_id, turn, _ in key["turns"]]
    if sorted(outputs) != sorted(wanted):
        return None, f"{path} does not hold every turn's output"
    plain = {}
    for name in wanted:
        row_id, turn = (int(x) for x in name.split(":"))
        entry = outputs[name]
        plain[(row_id, turn)] = PlainOutput(
            [int(t) for t in entry["output_ids"]], float(entry["seconds"]), entry.get("margins")
        )
    return plain, "reused"


def write_greedy_reference(path, key: dict, plain: dict) -> None:
    outputs = {
        f"{row_id}:{turn}": {"output_ids": o.output_ids, "seconds": o.seconds, "margins": o.margins}
        for (row_id, turn), o in plain.items()
    }
    atomic_write_json(path, {"key": key, "outputs": outputs})
