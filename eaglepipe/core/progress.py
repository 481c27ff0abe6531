"""Progress lines for long steps (prepare, regeneration, extraction): unbuffered, throttled,
done/total, the counts and rates each step cares about, and an ETA.

Plain lines rather than a redrawn bar: jobs write to log files, and a line per interval is what
`tail -f logs/...` and `eaglepipe status` readers want.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Sequence


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


class Progress:
    """`advance(**amounts)` per finished unit (a row); a line at most every `every_s` seconds and
    at the last unit.

    - `done`: units finished before this process (kept from an earlier attempt); rates and the
      ETA count only what this process does.
    - `counts`: counters shown as totals ("1,105 turns").
    - `rates`: (counter, text, scale) shown per second ("tokens/s", "MB/s" with scale 1e-6); the
      counter `unit` is the units themselves.
    - `eta_counter`, `eta_total`: the ETA is what is left of that counter at its current rate
      (default: the units).
    """

    def __init__(
        self,
        label: str,
        total: int,
        *,
        unit: str = "rows",
        done: int = 0,
        counts: Sequence[str] = (),
        rates: Sequence[tuple[str, str, float]] = (),
        eta_counter: str | None = None,
        eta_total: float | None = None,
        percent: bool = False,
        log: Callable[[str], None] = _stderr,
        every_s: float = 2.0,
    ):
        self.label, self.total, self.unit = label, total, unit
        self.done = self.kept = done
        self.counts, self.rates, self.percent = tuple(counts), tuple(rates), percent
        self.eta_counter, self.eta_total = eta_counter, eta_total
        self.log, self.every_s = log, every_s
        self.amounts: dict[str, float] = {}
        self.started = self.last = time.monotonic()

    def restart_clock(self) -> None:
        """Counts, rates and the ETA from now on (after a slow start-up that is not the step's
        own speed)."""
        self.started = time.monotonic()
        self.kept = self.done
        self.amounts.clear()

    def amount(self, counter: str) -> float:
        if counter == self.unit:
            return self.done - self.kept
        return self.amounts.get(counter, 0)

    def advance(self, units: int = 1, *, force: bool = False, **amounts: float) -> None:
        self.done += units
        for counter, value in amounts.items():
            self.amounts[counter] = self.amounts.get(counter, 0) + value
        now = time.monotonic()
        if force or now - self.last >= self.every_s or self.done >= self.total:
            self.last = now
            self.log(self.line())

    def line(self) -> str:
        elapsed = max(time.monotonic() - self.started, 1e-9)
        head = f"{self.label}: {self.done:,}/{self.total:,} {self.unit}"
        if self.percent:
            head += f" ({100.0 * self.done / self.total if self.total else 100.0:.0f}%)"
        parts = [head]
        parts += [f"{self.amount(counter):,.0f} {counter}" for counter in self.counts]
        parts += [
            f"{self.amount(counter) * scale / elapsed:,.{1 if scale < 1 else 0}f} {text}"
            for counter, text, scale in self.rates
        ]
        counter = self.eta_counter or self.unit
        total = self.eta_total if self.eta_total is not None else self.total - self.kept
        rate = self.amount(counter) / elapsed
        parts.append(f"ETA {(total - self.amount(counter)) / rate:.0f}s" if rate > 0 else "ETA ?")
        return ", ".join(parts)


def human_duration(seconds: float) -> str:
    """`1d 2h 03m`, `2h 03m` or `3m 04s`: an ETA or an age, for people."""
    seconds = int(round(seconds))
    days, rest = divmod(seconds, 86400)
    hours, rest = divmod(rest, 3600)
    minutes, secs = divmod(rest, 60)
    if days:
        return f"{days}d {hours}h {minutes:02d}m"
    if hours:
        return f"{hours}h {minutes:02d}m"
    return f"{minutes}m {secs:02d}s"
