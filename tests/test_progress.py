"""The progress lines every long step prints: throttled, counts and rates of this process only,
an ETA from what is left."""

from __future__ import annotations

import eaglepipe.core.progress as progress_module
from eaglepipe.core.progress import Progress


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_rates_and_eta_count_only_this_processs_rows(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    lines: list[str] = []
    progress = Progress(
        "rows_0-10",
        10,
        done=4,  # kept from an earlier attempt
        counts=("turns",),
        rates=(("tokens", "tokens/s", 1), ("bytes", "MB/s", 1e-6)),
        log=lines.append,
        every_s=2.0,
    )
    clock.now += 1.0
    progress.advance(turns=2, tokens=100, bytes=3_000_000)
    assert lines == []  # within the interval: no line
    clock.now += 1.0
    progress.advance(turns=1, tokens=100, bytes=1_000_000)
    # 2 rows in 2 s, 4 rows left -> 4 s
    assert lines == ["rows_0-10: 6/10 rows, 3 turns, 100 tokens/s, 2.0 MB/s, ETA 4s"]
    for _ in range(4):
        progress.advance(tokens=10)
    assert lines[-1].startswith("rows_0-10: 10/10 rows")  # the last row always prints


def test_eta_from_another_counter_and_percent(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(progress_module.time, "monotonic", clock)
    lines: list[str] = []
    progress = Progress(
        "prepare",
        4,
        rates=(("tokens", "tokens/s", 1),),
        eta_counter="tokens",
        eta_total=1000,
        percent=True,
        log=lines.append,
    )
    clock.now += 10.0
    progress.advance(tokens=250)
    assert lines == ["prepare: 1/4 rows (25%), 25 tokens/s, ETA 30s"]
    progress.restart_clock()  # nothing done since: no rate, no ETA
    progress.advance(0, force=True)
    assert lines[-1] == "prepare: 1/4 rows (25%), 0 tokens/s, ETA ?"
