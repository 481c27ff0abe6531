"""What one live-acceptance run reads and records, shared by both harnesses: the exported
drafter as its engine reads it, and each prompt's outcome."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import PipelineError


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
