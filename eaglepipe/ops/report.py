"""Figures and tables for Snakemake's report: what each stage produced, as pictures.

Every function reads a stage's documented outputs (docs/CONTRACTS.md), draws one PNG with
matplotlib's Agg backend, and writes it atomically (an interrupted report never leaves a
truncated image that looks finished). Tables are CSV, which Snakemake's report shows as
sortable tables. Figures are deterministic for the same inputs (no timestamps embedded).
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402

from ..core.atomic import atomic_write_bytes  # noqa: E402
from ..core.errors import PipelineError, set_aside_repair  # noqa: E402
from ..core.jsonio import read_json_object  # noqa: E402
from ..prompt_bench.summary import ALL as BENCH_ALL  # noqa: E402
from ..prompt_bench.summary import TABLE_COLUMNS as BENCH_TABLE_COLUMNS  # noqa: E402
from ..prompt_bench.summary import table_rows as bench_table_rows  # noqa: E402

LAYER_NAMES = ("aux_0", "aux_1", "aux_2", "final")
# Up to this many shards get one bar each; more are drawn as points so the figure stays legible.
MAX_BARS = 120
DPI = 110


# --- reading inputs --------------------------------------------------------------------------


def read_json(path: str | os.PathLike) -> dict:
    return read_json_object(path, what="report input")


def read_jsonl(path: str | os.PathLike) -> list[dict]:
    path = Path(path)
    try:
        lines = path.read_text().splitlines()
    except FileNotFoundError:
        raise PipelineError(f"report input {path} does not exist") from None
    records = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            records.append(json.loads(line))
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break  # a line torn by a killed writer: what was written before it stands
            raise PipelineError(f"{path} line {number} is not valid JSON: {exc}") from None
    return records


def require(record: dict, key: str, where: str):
    if key not in record:
        raise PipelineError(f"{where}: missing key {key!r}")
    return record[key]


def _shard_start(name: str) -> int:
    try:
        return int(name.split("_", 1)[1].split("-", 1)[0])
    except (IndexError, ValueError):
        return 0


def _parse_time(value: str | None) -> float | None:
    if not value:
        return None
    return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()


# --- writing outputs -------------------------------------------------------------------------


def save_figure(fig, out_png: str | os.PathLike) -> Path:
    """Render to memory, then write atomically; no timestamp, so equal inputs give equal bytes."""
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=DPI, metadata={"Software": None})
    plt.close(fig)
    atomic_write_bytes(out_png, buffer.getvalue())
    return Path(out_png)


def write_csv(rows: Sequence[dict], out_csv: str | os.PathLike, columns: Sequence[str]) -> Path:
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(columns), extrasaction="ignore")
    writer.writeheader()
    for row in rows:
        writer.writerow({k: _csv_value(row.get(k)) for k in columns})
    atomic_write_bytes(out_csv, buffer.getvalue().encode())
    return Path(out_csv)


def _csv_value(value):
    if isinstance(value, float):
        return f"{value:.6g}"
    if isinstance(value, bool):
        return "yes" if value else "no"
    return "" if value is None else value


def _empty_note(ax, text: str) -> None:
    ax.text(0.5, 0.5, text, ha="center", va="center", transform=ax.transAxes, color="0.4")
    ax.set_xticks([])
    ax.set_yticks([])


# --- dataset ---------------------------------------------------------------------------------


def dataset_figure(
    prepared_table: str | os.PathLike,
    summary_json: str | os.PathLike,
    skipped_json: str | os.PathLike,
    out_png: str | os.PathLike,
) -> Path:
    """Token-length histogram of the kept rows (train and eval split), and skipped-row reasons."""
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(prepared_table, columns=["num_tokens", "split", "truncated"])
    except FileNotFoundError:
        raise PipelineError(f"report input {prepared_table} does not exist") from None
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise PipelineError(
            f"report input {prepared_table} cannot be read ({exc}): "
            + set_aside_repair("prepares it again")
        ) from None
    summary = read_json(summary_json)
    skipped = read_json(skipped_json)
    lengths = table.column("num_tokens").to_numpy().astype(np.int64)
    splits = np.asarray(table.column("split").to_pylist())
    truncated = int(np.asarray(table.column("truncated").to_pylist(), dtype=bool).sum())
    reasons = dict(require(skipped, "reasons", str(skipped_json)))

    fig, (ax_len, ax_skip) = plt.subplots(
        1, 2, figsize=(11, 4), gridspec_kw={"width_ratios": [2.2, 1]}
    )
    if len(lengths):
        bins = np.histogram_bin_edges(lengths, bins=min(50, max(5, len(lengths) // 4)))
        parts = [
            (s, c, lengths[splits == s]) for s, c in (("train", "tab:blue"), ("eval", "tab:orange"))
        ]
        parts = [p for p in parts if len(p[2])]
        ax_len.hist(
            [p[2] for p in parts],
            bins=bins,
            stacked=True,
            color=[p[1] for p in parts],
            label=[f"{p[0]} ({len(p[2])})" for p in parts],
        )
        max_length = summary.get("max_length")
        if max_length:
            ax_len.axvline(max_length, color="0.3", ls="--", lw=1, label=f"max_length {max_length}")
        ax_len.set_xlabel("tokens per conversation")
        ax_len.set_ylabel("conversations")
        ax_len.legend(frameon=False)
    else:
        _empty_note(ax_len, "no rows kept")
    ax_len.set_title(
        f"{len(lengths)} conversations, {int(lengths.sum()):,} tokens, {truncated} truncated"
    )

    lost = skipped.get("lost") or {}
    if lost:
        # Per reason: assistant tokens lost (the bar), rows dropped whole and turns (its label).
        names = sorted(lost, key=lambda r: (-lost[r]["assistant_tokens"], -lost[r]["turns"], r))
        values = [lost[n]["assistant_tokens"] for n in names[::-1]]
        ax_skip.barh(names[::-1], values, color="tab:red")
        ax_skip.set_xlabel("assistant tokens lost")
        for y, name in enumerate(names[::-1]):
            c = lost[name]
            ax_skip.text(
                c["assistant_tokens"], y, f" {c['rows']} rows, {c['turns']} turns", va="center"
            )
        title = (
            f"lost: {sum(c['rows'] for c in lost.values())} rows, "
            f"{sum(c['turns'] for c in lost.values())} turns, "
            f"{sum(c['assistant_tokens'] for c in lost.values()):,} assistant tokens"
        )
    elif reasons:
        names = sorted(reasons, key=lambda r: (-reasons[r], r))
        ax_skip.barh(names[::-1], [reasons[n] for n in names[::-1]], color="tab:red")
        ax_skip.set_xlabel("rows")
        for y, name in enumerate(names[::-1]):
            ax_skip.text(reasons[name], y, f" {reasons[name]}", va="center")
        title = f"skipped rows: {int(skipped.get('count', sum(reasons.values())))}"
    else:
        _empty_note(ax_skip, "no rows skipped")
        title = "skipped rows: 0"
    if skipped.get("source_cut"):
        title += f"\nsource cut off after {skipped['source_cut']['whole_records']:,} records"
    ax_skip.set_title(title)
    fig.tight_layout()
    return save_figure(fig, out_png)


# --- extraction ------------------------------------------------------------------------------

EXTRACTION_COLUMNS = (
    "shard",
    "rows",
    "tokens",
    "bytes",
    "chunks",
    "seconds",
    "tokens_per_s",
    "mb_per_s",
    "engine",
    "started_at",
    "finished_at",
)


def extraction_rows(manifests: Iterable[str | os.PathLike]) -> list[dict]:
    rows = []
    for path in manifests:
        manifest = read_json(path)
        timing = require(manifest, "timing", str(path))
        rows.append(
            {
                "shard": require(manifest, "shard", str(path)),
                "rows": manifest.get("num_rows"),
                "tokens": manifest.get("num_tokens"),
                "bytes": manifest.get("num_bytes"),
                "chunks": len(manifest.get("chunks", [])),
                "seconds": timing.get("seconds"),
                "tokens_per_s": timing.get("tokens_per_s"),
                "mb_per_s": timing.get("mb_per_s"),
                "engine": (manifest.get("provenance") or {}).get("engine"),
                "started_at": timing.get("started_at"),
                "finished_at": timing.get("finished_at"),
            }
        )
    return sorted(rows, key=lambda r: _shard_start(r["shard"]))


def extraction_figure(
    manifests: Iterable[str | os.PathLike],
    out_png: str | os.PathLike,
    out_csv: str | os.PathLike | None = None,
) -> Path:
    """Throughput per shard (tokens/s and MB/s) and the shards' timeline, which shows how many
    ran at once and where the run stalled."""
    rows = extraction_rows(manifests)
    if out_csv is not None:
        write_csv(rows, out_csv, EXTRACTION_COLUMNS)
    fig, (ax_rate, ax_time) = plt.subplots(2, 1, figsize=(11, 7))
    if not rows:
        _empty_note(ax_rate, "no shard extracted yet")
        _empty_note(ax_time, "")
        return save_figure(fig, out_png)

    x = np.arange(len(rows))
    tokens_per_s = np.asarray([r["tokens_per_s"] or 0.0 for r in rows], dtype=float)
    mb_per_s = np.asarray([r["mb_per_s"] or 0.0 for r in rows], dtype=float)
    if len(rows) <= MAX_BARS:
        ax_rate.bar(x, tokens_per_s, color="tab:blue")
        ax_rate.set_xticks(x, [r["shard"] for r in rows], rotation=90, fontsize=7)
    else:
        ax_rate.plot(x, tokens_per_s, ".", ms=3, color="tab:blue")
        ax_rate.set_xlabel("shard (in row order)")
    median = float(np.median(tokens_per_s))
    ax_rate.axhline(median, color="0.3", ls="--", lw=1, label=f"median {median:,.0f} tokens/s")
    ax_rate.set_ylabel("tokens/s", color="tab:blue")
    ax_rate.legend(frameon=False, loc="lower right")
    ax_mb = ax_rate.twinx()
    ax_mb.plot(x, mb_per_s, "_" if len(rows) <= MAX_BARS else ",", color="tab:red", ms=10)
    ax_mb.set_ylabel("MB/s written", color="tab:red")
    ax_mb.set_ylim(bottom=0)
    total_tokens = sum(r["tokens"] or 0 for r in rows)
    total_bytes = sum(r["bytes"] or 0 for r in rows)
    ax_rate.set_title(
        f"{len(rows)} shards, {total_tokens:,} tokens, {total_bytes / 1e9:.2f} GB of hidden states"
    )

    starts = [_parse_time(r["started_at"]) for r in rows]
    ends = [_parse_time(r["finished_at"]) for r in rows]
    timed = [(i, s, e) for i, (s, e) in enumerate(zip(starts, ends, strict=True)) if s and e]
    if timed:
        origin = min(s for _, s, _ in timed)
        scale, unit = _time_unit(max(e for _, _, e in timed) - origin)
        for i, s, e in timed:
            ax_time.plot(
                [(s - origin) / scale, (e - origin) / scale], [i, i], lw=2, color="tab:green"
            )
        ax_time.set_xlabel(f"{unit} since the first shard started")
        ax_time.set_ylabel("shard (in row order)")
        ax_time.set_title("when each shard ran")
    else:
        _empty_note(ax_time, "manifests carry no start/finish times")
    fig.tight_layout()
    return save_figure(fig, out_png)


def _time_unit(span_s: float) -> tuple[float, str]:
    if span_s >= 2 * 86400:
        return 86400.0, "days"
    if span_s >= 2 * 3600:
        return 3600.0, "hours"
    if span_s >= 120:
        return 60.0, "minutes"
    return 1.0, "seconds"


# --- validation ------------------------------------------------------------------------------


def _spot_errors(spot_check: dict) -> dict[str, float]:
    """Per-layer relative L2 p99 of the re-extraction (the worst of any comparison made)."""
    worst: dict[str, float] = {}
    for comparison in spot_check.values():
        if not isinstance(comparison, dict):
            continue
        layers = comparison.get("per_layer", comparison)
        for name in LAYER_NAMES:
            value = (layers.get(name) or {}).get("rel_l2_p99") if isinstance(layers, dict) else None
            if isinstance(value, int | float):
                worst[name] = max(worst.get(name, 0.0), float(value))
    return worst


VALIDATION_COLUMNS = (
    "shard",
    "rows",
    "tokens",
    "gb_per_s",
    *(f"norm_{n}" for n in LAYER_NAMES),
    *(f"ratio_{n}" for n in LAYER_NAMES),
    *(f"spot_rel_l2_p99_{n}" for n in LAYER_NAMES),
    "checks_passed",
    "reference",
)


def validation_rows(reports: Iterable[str | os.PathLike]) -> list[dict]:
    rows = []
    for path in reports:
        report = read_json(path)
        where = str(path)
        norms = require(report, "layer_norms", where)
        checks = require(report, "checks", where)
        values = checks.get("values") or {}
        ratios = values.get("norm_ratio_to_reference") or {}
        spot = _spot_errors(checks.get("spot_check") or {})
        row = {
            "shard": require(report, "shard", where),
            "rows": report.get("num_rows"),
            "tokens": report.get("num_tokens"),
            "gb_per_s": report.get("gb_per_s"),
            "checks_passed": ", ".join(n for n, c in checks.items() if c.get("ok")),
            "reference": report.get("layer_norm_reference"),
            "norm_drift_factor": values.get("norm_drift_factor"),
        }
        for name in LAYER_NAMES:
            row[f"norm_{name}"] = norms.get(name)
            row[f"std_{name}"] = (values.get("norm_std") or {}).get(name)
            row[f"ratio_{name}"] = ratios.get(name)
            row[f"spot_rel_l2_p99_{name}"] = spot.get(name)
        rows.append(row)
    return sorted(rows, key=lambda r: _shard_start(r["shard"]))


def validation_figure(
    reports: Iterable[str | os.PathLike],
    out_png: str | os.PathLike,
    out_csv: str | os.PathLike | None = None,
) -> Path:
    """Per-layer mean hidden-state norm across shards (with the allowed drift band) and the
    spot check's per-layer error, so a drifting or broken shard stands out."""
    rows = validation_rows(reports)
    if out_csv is not None:
        write_csv(rows, out_csv, VALIDATION_COLUMNS)
    fig, (ax_norm, ax_spot) = plt.subplots(1, 2, figsize=(12, 4.2))
    if not rows:
        _empty_note(ax_norm, "no shard validated yet")
        _empty_note(ax_spot, "")
        return save_figure(fig, out_png)
    x = np.arange(len(rows))
    colors = dict(
        zip(LAYER_NAMES, ("tab:blue", "tab:orange", "tab:green", "tab:purple"), strict=True)
    )
    for name in LAYER_NAMES:
        means = np.asarray([r[f"norm_{name}"] or np.nan for r in rows], dtype=float)
        stds = np.asarray([r[f"std_{name}"] or 0.0 for r in rows], dtype=float)
        ax_norm.plot(
            x, means, ".-" if len(rows) <= MAX_BARS else ",-", color=colors[name], label=name
        )
        ax_norm.fill_between(x, means - stds, means + stds, color=colors[name], alpha=0.15)
    reference = next((r for r in rows if r["shard"] == rows[0]["reference"]), rows[0])
    factor = reference.get("norm_drift_factor")
    if factor:
        for name in LAYER_NAMES:
            ref = reference[f"norm_{name}"]
            if ref:
                ax_norm.axhspan(ref / factor, ref * factor, color=colors[name], alpha=0.04)
    ax_norm.set_yscale("log")
    ax_norm.set_xlabel("shard (in row order)")
    ax_norm.set_ylabel("mean L2 norm per token (± std)")
    band = f"; band: {factor:g}x of {reference['shard']}" if factor else ""
    ax_norm.set_title(f"{len(rows)} shards validated{band}")
    ax_norm.legend(frameon=False, fontsize=8)

    width = 0.2
    has_spot = False
    for k, name in enumerate(LAYER_NAMES):
        errors = np.asarray([r[f"spot_rel_l2_p99_{name}"] or np.nan for r in rows], dtype=float)
        if np.isfinite(errors).any():
            has_spot = True
            if len(rows) <= MAX_BARS:
                ax_spot.bar(x + (k - 1.5) * width, errors, width, color=colors[name], label=name)
            else:
                ax_spot.plot(x, errors, ".", ms=3, color=colors[name], label=name)
    if has_spot:
        ax_spot.set_xlabel("shard (in row order)")
        ax_spot.set_ylabel("relative L2 error, p99 per token")
        ax_spot.set_title("spot check: stored vs recomputed")
        ax_spot.legend(frameon=False, fontsize=8)
    else:
        _empty_note(ax_spot, "no spot-check errors recorded")
    fig.tight_layout()
    return save_figure(fig, out_png)


# --- training --------------------------------------------------------------------------------


def _smooth(values: np.ndarray, window: int) -> np.ndarray:
    """Trailing mean that skips missing values (a position with no tokens in a step is NaN)."""
    import pandas as pd

    return pd.Series(values).rolling(window, min_periods=1).mean().to_numpy()


def training_figure(train_log: str | os.PathLike, out_png: str | os.PathLike) -> Path:
    """Loss and per-position accuracy over training steps (smoothed; raw loss kept faint)."""
    records = [r for r in read_jsonl(train_log) if "loss" in r]
    fig, (ax_loss, ax_acc) = plt.subplots(1, 2, figsize=(12, 4.2))
    if not records:
        _empty_note(ax_loss, "no training steps logged")
        _empty_note(ax_acc, "")
        return save_figure(fig, out_png)
    where = str(train_log)
    steps = np.asarray([require(r, "step", where) for r in records], dtype=float)
    loss = np.asarray([r["loss"] for r in records], dtype=float)
    window = max(1, len(records) // 40)
    ax_loss.plot(steps, loss, color="tab:blue", alpha=0.25, lw=1)
    ax_loss.plot(steps, _smooth(loss, window), color="tab:blue", lw=2, label="train loss")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("weighted soft cross-entropy")
    if np.all(loss > 0):
        ax_loss.set_yscale("log")
    ax_loss.set_title(f"loss: {loss[0]:.3g} -> {loss[-1]:.3g} over {int(steps[-1])} steps")
    ax_loss.legend(frameon=False)

    acc_rows = [r for r in records if isinstance(r.get("acc"), list) and r["acc"]]
    if acc_rows:
        acc_steps = np.asarray([r["step"] for r in acc_rows], dtype=float)
        positions = max(len(r["acc"]) for r in acc_rows)
        cmap = plt.get_cmap("viridis")
        for p in range(positions):
            acc = np.asarray(
                [r["acc"][p] if p < len(r["acc"]) else np.nan for r in acc_rows], dtype=float
            )
            ax_acc.plot(
                acc_steps,
                _smooth(acc, window),
                color=cmap(p / max(positions - 1, 1)),
                label=f"position {p}",
            )
        ax_acc.set_ylim(0, 1)
        ax_acc.set_xlabel("step")
        ax_acc.set_ylabel("top-1 accuracy vs target")
        ax_acc.set_title("accuracy per unrolled position")
        ax_acc.legend(frameon=False, fontsize=7, ncol=2)
    else:
        _empty_note(ax_acc, "no per-position accuracy logged")
    fig.tight_layout()
    return save_figure(fig, out_png)


# --- acceptance ------------------------------------------------------------------------------


def _fractions(values: list, where: str, key: str) -> list[float]:
    """Per-position fractions; a position never reached (None in the JSON) reads as 0."""
    if not isinstance(values, list):
        raise PipelineError(f"{where}: {key!r} must be a list of per-position fractions")
    return [0.0 if v is None else float(v) for v in values]


def acceptance_figure(
    eval_json: str | os.PathLike,
    out_png: str | os.PathLike,
    live_json: str | os.PathLike | None = None,
    out_csv: str | os.PathLike | None = None,
) -> Path:
    """Per draft position on the held-out rows (drafter/eval.json): agreement with the target
    with the true prefix (teacher-forced), agreement given every earlier draft was accepted,
    and the chance the whole chain up to it is accepted; plus the acceptance length a decoder
    gets offline (decode order) and live (drafter/live.json)."""
    evaluation = read_json(eval_json)
    where = str(eval_json)
    accuracy = _fractions(require(evaluation, "accuracy", where), where, "accuracy")
    conditional = _fractions(
        require(evaluation, "conditional_accuracy", where), where, "conditional_accuracy"
    )
    if len(conditional) != len(accuracy):
        raise PipelineError(f"{where}: 'accuracy' and 'conditional_accuracy' differ in length")
    offline = evaluation.get("acceptance_length")
    live_length = read_json(live_json).get("acceptance_length") if live_json else None
    # The chance that drafts 1..k are all accepted: the product of the conditional rates.
    reach = np.cumprod(conditional) if conditional else np.asarray([])
    if out_csv is not None:
        write_csv(
            [
                {"position": p + 1, "accuracy": a, "conditional_accuracy": c, "accepted_through": r}
                for p, (a, c, r) in enumerate(zip(accuracy, conditional, reach, strict=True))
            ],
            out_csv,
            ("position", "accuracy", "conditional_accuracy", "accepted_through"),
        )
    fig, ax = plt.subplots(figsize=(9, 4.4))
    if not accuracy:
        _empty_note(ax, "no positions evaluated")
        return save_figure(fig, out_png)
    x = np.arange(len(accuracy))
    width = 0.27
    ax.bar(x - width, accuracy, width, color="tab:blue", label="accuracy (true prefix)")
    ax.bar(x, conditional, width, color="tab:orange", label="given earlier drafts accepted")
    ax.bar(x + width, reach, width, color="tab:green", label="whole chain accepted")
    for xi, c in zip(x, conditional, strict=True):
        ax.text(xi, c + 0.01, f"{c:.2f}", ha="center", fontsize=7)
    ax.set_xticks(x, [str(p + 1) for p in x])
    ax.set_xlabel("draft position")
    ax.set_ylim(0, 1.1)
    ax.set_ylabel("fraction of held-out positions")
    title = []
    if isinstance(offline, int | float) and math.isfinite(offline):
        title.append(f"acceptance length {offline:.2f} offline (decode order)")
    if isinstance(live_length, int | float) and math.isfinite(live_length):
        title.append(f"live {live_length:.2f}")
    rows = evaluation.get("rows")
    ax.set_title(
        (", ".join(title) or "acceptance per draft position")
        + (f" ({rows} held-out rows)" if rows else "")
    )
    ax.legend(frameon=False, fontsize=8, loc="upper right")
    fig.tight_layout()
    return save_figure(fig, out_png)


# --- benchmarks ------------------------------------------------------------------------------


def benchmark_figure(result: dict, out_png: str | os.PathLike) -> Path:
    """A benchmark's bar chart (drafter/benchmarks/<name>.json): acceptance length per
    category, per turn and over all turns, one bar per drafter and speculative setting."""
    measured = result.get("results") or []
    groups: list[tuple[str, str]] = []  # (label, how to find it)
    if measured:
        first = measured[0]
        # The file's order of categories (the JSON's keys are written sorted).
        order = result.get("categories") or list(first["by_category"])
        groups += [(c, c) for c in order if c in first["by_category"]]
        groups += [(f"turn {t}", f"turn:{t}") for t in first["by_turn"]]
        groups.append((BENCH_ALL, BENCH_ALL))
    fig, ax = plt.subplots(figsize=(max(7.0, 0.9 * len(groups) + 3), 4.4))
    width = 0.8 / max(1, len(measured))
    for i, m in enumerate(measured):
        values = []
        for _, where in groups:
            if where == BENCH_ALL:
                figures = m[BENCH_ALL]
            elif where.startswith("turn:"):
                figures = m["by_turn"].get(where.split(":", 1)[1])
            else:
                figures = m["by_category"].get(where)
            length = (figures or {}).get("acceptance_length")
            values.append(0.0 if length is None else float(length))
        xs = [g + (i - (len(measured) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, values, width, label=f"{m['drafter']} {m['setting']}")
    if not measured:
        ax.text(0.5, 0.5, "nothing measured", ha="center", va="center", transform=ax.transAxes)
    ax.set_xticks(range(len(groups)), [label for label, _ in groups], rotation=30, ha="right")
    ax.set_ylabel("acceptance length (tokens per round)")
    ax.axhline(1.0, color="0.6", lw=0.8)
    ax.set_title(
        f"{result['benchmark']}: live acceptance length per category ({result.get('harness')},"
        f" {result.get('turns_asked', 0)} turns)"
    )
    if measured:
        ax.legend(frameon=False, fontsize=8, loc="upper right")
    fig.tight_layout()
    return save_figure(fig, out_png)


def benchmark_table(results: Iterable[str | os.PathLike], out_csv: str | os.PathLike) -> Path:
    """One table of every benchmark (drafter/benchmarks/<name>.json): per drafter, setting and
    group of turns, the acceptance length, tokens/s with and without the drafter, the lossless
    check."""
    rows = [row for path in results for row in bench_table_rows(read_json(path))]
    return write_csv(rows, out_csv, BENCH_TABLE_COLUMNS)
