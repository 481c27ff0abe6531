"""The prepare stage: tokenize every source row, mask assistant tokens, choose the held-out split.

Writes, each only when its bytes change (so a rerun with the same inputs leaves every
downstream target up to date):

- `prepared/tokenized.parquet`: one row per kept source row, ordered by `row_id`
  (`row_id`, `split`, `num_tokens`, `input_ids`, `loss_mask`, `truncated`,
  `length_limited_turns`);
- `prepared/skipped.json`: count, per-reason counts and the skipped rows, what was lost per
  reason in rows, turns and assistant tokens (`data/loss_counts.py`: bad rows and the turns
  `dataset.turn_order: trim` dropped), and where a cut-off JSON array stops;
- `prepared/summary.json`: counts, length histogram, split and shard sizes, losses,
  provenance, and the size and xxh3-128 of the other two files (written last: the table's
  manifest).

The rows are tokenized by `workers` processes (`prepare/rows.py`) and the table is written one
shard's row group at a time into a temporary file, renamed over the old table only when its
bytes differ: memory holds a few batches of rows, whatever the dataset's size. The Parquet bytes
are deterministic: an explicit Arrow schema with no pandas metadata, one row group per shard.

Under `dataset.bad_rows: skip` the run stops when more than `dataset.unusable_limit` of the
rows or of the assistant tokens is lost, naming the top reasons; under `error`, at the first
bad row or a cut-off JSON array.

With `dataset.regenerate.enabled`, the conversations are read from the regenerated shards
(`regenerated/<shard>/rows.jsonl`, each checked against its manifest) instead of the source:
the same row ids, the target's own replies. Rows regeneration could not do are bad rows here.

The held-out rows (`split == "eval"`) are chosen here so vocabulary, training and evaluation
all read one split: `holdout.mode: fraction` takes the rows whose seeded hash of the row id
falls below `fraction`; `holdout.mode: shards` takes every row of the listed shards.
"""

from __future__ import annotations

import collections
import contextlib
import io
import json
import os
import tempfile
from collections import Counter
from pathlib import Path

import numpy as np

from ..core import config as config_mod
from ..core.atomic import dumps_json, fsync_dir, write_if_changed
from ..core.errors import PipelineError, set_aside_repair
from ..core.fingerprint import hash_bytes, hash_file
from ..core.progress import Progress
from ..core.run import RunSpec
from ..data.dataset import BadRow, Conversation, DatasetRows, bad_row_error, dataset_hash
from ..data.loss_counts import LossCounts, check_unusable_rows, check_unusable_tokens
from ..data.tokenizer import load_target_tokenizer
from ..plan.provenance import prepare_provenance
from ..plan.shard_plan import (
    DEFAULT_CACHE_DIR,
    count_source_rows,
    holdout_shard_indices,
    is_eval_row,
    plan_shards,
)
from .rows import prepared_rows

HISTOGRAM_BINS = 16
# summary.json's record of the other files' sizes and checksums.
SUMMARY_FILES_KEY = "files"
_SKIP_EXAMPLES_PRINTED = 10


def table_schema():
    import pyarrow as pa

    return pa.schema(
        [
            ("row_id", pa.int64()),
            ("split", pa.string()),
            ("num_tokens", pa.int32()),
            ("input_ids", pa.list_(pa.int32())),
            ("loss_mask", pa.list_(pa.uint8())),
            ("truncated", pa.bool_()),
            # Ordinals among the row's assistant turns of regenerated replies that hit
            # max_new_tokens (evaluation reports them apart).
            ("length_limited_turns", pa.list_(pa.int32())),
        ]
    )


def prepared_table_bytes(
    row_ids, splits, token_arrays, mask_arrays, truncated, limited, rows_per_shard: int
) -> bytes:
    """The prepared table's Parquet bytes: zstd, one row group per shard of `rows_per_shard`
    rows (what a shard job's read skips by; benchmarks write their tables with it too)."""
    import pyarrow.parquet as pq

    table = table_of(row_ids, splits, token_arrays, mask_arrays, truncated, limited)
    # One row group per shard, so a shard job reads only its own rows (load_prepared's range).
    shard_ids = np.asarray(row_ids, dtype=np.int64) // rows_per_shard
    group_starts = np.flatnonzero(np.diff(shard_ids, prepend=-1)).tolist() + [len(shard_ids)]
    buffer = io.BytesIO()
    with pq.ParquetWriter(buffer, table.schema, compression="zstd") as writer:
        if len(shard_ids) == 0:
            writer.write_table(table)
        for lo, hi in zip(group_starts, group_starts[1:], strict=False):
            writer.write_table(table.slice(lo, hi - lo), row_group_size=hi - lo)
    return buffer.getvalue()


def table_of(row_ids, splits, token_arrays, mask_arrays, truncated, limited):
    """The rows as an Arrow table of `table_schema()`."""
    import pyarrow as pa

    lengths = np.array([len(a) for a in token_arrays], dtype=np.int64)
    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    if lengths.sum() >= np.iinfo(np.int32).max:
        raise PipelineError("the prepared table exceeds 2^31 tokens: split the dataset")
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(token_arrays) if token_arrays else np.zeros(0, np.int32)
    masks = np.concatenate(mask_arrays) if mask_arrays else np.zeros(0, np.uint8)
    return pa.Table.from_arrays(
        [
            pa.array(np.asarray(row_ids, dtype=np.int64)),
            pa.array(splits, type=pa.string()),
            pa.array(lengths.astype(np.int32)),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int32())),
            pa.ListArray.from_arrays(pa.array(offsets), pa.array(masks, type=pa.uint8())),
            pa.array(np.asarray(truncated, dtype=bool)),
            pa.array([list(turns) for turns in limited], type=pa.list_(pa.int32())),
        ],
        schema=table_schema(),
    )


def _histogram(lengths: np.ndarray, max_length: int) -> dict:
    edges = np.unique(np.linspace(0, max_length, HISTOGRAM_BINS + 1).round().astype(np.int64))
    edges[-1] = max_length + 1  # the last bin includes rows of exactly max_length tokens
    counts, _ = np.histogram(lengths, bins=edges)
    return {"edges": edges.tolist(), "counts": counts.tolist()}


def conversation_rows(run: RunSpec, source_rows: DatasetRows | None = None):
    """Every row in row-id order: the source's, or with regeneration the regenerated shards'
    (carrying the turns the source row's turn order dropped, for counting)."""
    source_rows = source_rows or DatasetRows(
        run.dataset.path, run.dataset.format, run.dataset.turn_order
    )
    if not run.dataset.regenerate.enabled:
        yield from source_rows
        return
    from ..regenerate.store import iter_regenerated_rows
    from ..regenerate.summary import fresh_regenerated_manifests

    source = iter(source_rows)
    for _, path in fresh_regenerated_manifests(run):
        for record in iter_regenerated_rows(path):
            original = next(source, None)
            while original is not None and original.row_id < record["row_id"]:
                original = next(source, None)
            dropped = original.dropped if isinstance(original, Conversation) else ()
            bad = record.get("bad")
            if bad:
                messages = original.messages if original is not None else ()
                yield BadRow(
                    record["row_id"], bad["reason"], bad.get("detail", ""), messages=tuple(messages)
                )
            else:
                yield Conversation(
                    record["row_id"],
                    record["messages"],
                    length_limited_turns=assistant_ordinals(
                        record["messages"], record.get("length_limited_turns", ())
                    ),
                    dropped=dropped,
                )
    collections.deque(source, maxlen=0)  # read to the end, so a cut-off array's cut is known


def assistant_ordinals(messages: list[dict], message_indices) -> tuple[int, ...]:
    """Message indices of assistant turns as ordinals among the assistant turns."""
    ordinal = {}
    for index, message in enumerate(messages):
        if message.get("role") == "assistant":
            ordinal[index] = len(ordinal)
    return tuple(sorted(ordinal[i] for i in message_indices if i in ordinal))


class _TableWriter:
    """The prepared table written one shard's row group at a time into a temporary file beside
    the target, then renamed over it only when its bytes differ (else removed): memory holds
    one shard's rows, and an unchanged table keeps its mtime."""

    def __init__(self, path: Path, rows_per_shard: int):
        import pyarrow.parquet as pq

        self.path = path
        self.rows_per_shard = rows_per_shard
        # A prepared directory made here goes again if prepare stops: nothing half-written.
        self.made_dir = not path.parent.exists()
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        os.close(fd)
        self.tmp = Path(tmp)
        self.writer = pq.ParquetWriter(self.tmp, table_schema(), compression="zstd")
        self.group: list[tuple] = []
        self.shard: int | None = None

    def add(self, row_id: int, split: str, ids, mask, truncated: bool, limited) -> None:
        shard = row_id // self.rows_per_shard
        if shard != self.shard:
            self.flush()
            self.shard = shard
        self.group.append((row_id, split, ids, mask, truncated, limited))

    def flush(self) -> None:
        if self.group:
            columns = list(zip(*self.group, strict=True))
            table = table_of(*columns)
            self.writer.write_table(table, row_group_size=len(self.group))
            self.group = []

    def finish(self) -> tuple[int, str, bool]:
        """(bytes, xxh3-128, whether the target was replaced)."""
        self.flush()
        self.writer.close()
        size, digest = self.tmp.stat().st_size, hash_file(self.tmp)
        try:
            same = self.path.stat().st_size == size and hash_file(self.path) == digest
        except FileNotFoundError:
            same = False
        if same:
            self.tmp.unlink()
            return size, digest, False
        with open(self.tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(self.tmp, 0o666 & ~_umask())
        os.replace(self.tmp, self.path)
        fsync_dir(self.path.parent)
        return size, digest, True

    def abandon(self) -> None:
        try:
            self.writer.close()
        finally:
            self.tmp.unlink(missing_ok=True)
            if self.made_dir:
                with contextlib.suppress(OSError):
                    self.path.parent.rmdir()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


class _Tally:
    """What the summary needs of every kept row (a few bytes each, not its tokens)."""

    def __init__(self) -> None:
        self.row_ids: list[int] = []
        self.splits: list[str] = []
        self.lengths: list[int] = []
        self.assistant: list[int] = []
        self.truncated = 0

    def add(self, row_id: int, split: str, length: int, assistant: int, truncated: bool) -> None:
        self.row_ids.append(row_id)
        self.splits.append(split)
        self.lengths.append(length)
        self.assistant.append(assistant)
        self.truncated += bool(truncated)


def run_prepare(
    run: RunSpec,
    prepared_dir: str | os.PathLike | None = None,
    cache_dir: str | os.PathLike = DEFAULT_CACHE_DIR,
    workers: int = 1,
) -> dict:
    """Run the prepare stage with `workers` processes; returns the summary (also written to
    prepared/summary.json)."""
    prepared_dir = Path(prepared_dir) if prepared_dir is not None else config_mod.PREPARED_DIR
    dataset_cfg = run.dataset
    source = Path(dataset_cfg.path)
    max_length = dataset_cfg.max_length
    policy = dataset_cfg.bad_rows
    holdout = dataset_cfg.holdout
    mode = holdout.mode
    fraction = holdout.fraction
    seed = holdout.seed
    rows_per_shard = run.shards.rows_per_shard

    load_target_tokenizer(run)  # a tokenizer that cannot load stops here, in this process
    model_dir = run.model.directory
    total = count_source_rows(source, cache_dir)
    eval_shards = holdout_shard_indices(holdout, total, rows_per_shard)
    regenerated = " (assistant turns regenerated by the target)" * run.dataset.regenerate.enabled
    print(
        f"prepare: {total:,} source rows in {source}{regenerated}, tokenizer of {model_dir}, "
        f"max_length {max_length}, turn order: {dataset_cfg.turn_order}, bad rows: {policy}, "
        f"{workers} worker(s)",
        flush=True,
    )

    source_rows = DatasetRows(source, dataset_cfg.format, dataset_cfg.turn_order)
    tally = _Tally()
    skipped: list[BadRow] = []
    losses = LossCounts()
    trimmed_rows = 0
    progress = Progress(
        "prepare",
        total,
        counts=("tokens",),
        rates=(("rows", "rows/s", 1), ("tokens", "tokens/s", 1)),
        percent=True,
        log=lambda line: print(line, flush=True),
    )
    table = _TableWriter(prepared_dir / config_mod.PREPARED_TABLE.name, rows_per_shard)
    done = tokens = 0
    try:
        rows = prepared_rows(
            conversation_rows(run, source_rows),
            lambda: load_target_tokenizer(run),
            max_length,
            workers,
        )
        for row in rows:
            done += 1
            for reason, lost in row.lost:
                losses.add(reason, lost)
            if row.bad is not None:
                if policy == "error":
                    raise bad_row_error(source, row.bad)
                skipped.append(row.bad)
                if len(skipped) <= _SKIP_EXAMPLES_PRINTED:
                    print(f"prepare: skipping {row.bad.describe(source)}", flush=True)
                progress.advance()
                continue
            trimmed_rows += bool(row.lost)
            if mode == "shards":
                held_out = row.row_id // rows_per_shard in eval_shards
            else:
                held_out = is_eval_row(row.row_id, fraction, seed)
            split = "eval" if held_out else "train"
            table.add(
                row.row_id,
                split,
                row.input_ids,
                row.loss_mask,
                row.truncated,
                row.length_limited_turns,
            )
            tally.add(
                row.row_id, split, len(row.input_ids), int(row.loss_mask.sum()), row.truncated
            )
            tokens += len(row.input_ids)
            progress.advance(tokens=len(row.input_ids))
        if tokens >= np.iinfo(np.int32).max:
            raise PipelineError("the prepared table exceeds 2^31 tokens: split the dataset")
        if done != total:
            raise PipelineError(
                f"dataset.path {source} changed while it was read ({total} rows counted, "
                f"{done} read)"
            )
        cut = source_rows.cut
        if cut is not None and policy == "error":
            raise PipelineError(
                f"{cut.describe()} (set dataset.bad_rows: skip to use the whole records)"
            )
        require_training_rows(source, total, tally.splits, skipped)
        if policy == "skip":
            check_unusable_rows(
                source, total, dict(Counter(b.reason for b in skipped)), dataset_cfg.unusable_limit
            )
            check_unusable_tokens(source, sum(tally.assistant), losses, dataset_cfg.unusable_limit)
        table_bytes, table_hash, table_written = table.finish()
    except BaseException:
        table.abandon()
        raise

    summary = _summary(run, source, model_dir, total, tally)
    summary["skipped_rows"] = len(skipped)
    summary["trimmed_rows"] = trimmed_rows
    summary["lost"] = losses.as_dict()
    summary["source_cut"] = f"{cut.describe()}; only those are used" if cut is not None else None
    skipped_doc = {
        "count": len(skipped),
        "reasons": dict(sorted(Counter(b.reason for b in skipped).items())),
        "lost": losses.as_dict(),
        "trimmed_rows": trimmed_rows,
        "source_cut": (
            None
            if cut is None
            else {
                "message": cut.describe(),
                "offset": cut.offset,
                "whole_records": cut.whole_records,
                "why": cut.why,
            }
        ),
        "rows": [{"row_id": b.row_id, "reason": b.reason, "detail": b.detail} for b in skipped],
    }
    skipped_bytes = dumps_json(skipped_doc)
    # The summary, written last, is the manifest of the other two (`eaglepipe verify`).
    summary[SUMMARY_FILES_KEY] = {
        config_mod.PREPARED_TABLE.name: {"bytes": table_bytes, "xxh3_128": table_hash},
        config_mod.PREPARED_SKIPPED.name: {
            "bytes": len(skipped_bytes),
            "xxh3_128": hash_bytes(skipped_bytes),
        },
    }
    written = {config_mod.PREPARED_TABLE.name: table_written}
    for name, data in (
        (config_mod.PREPARED_SKIPPED.name, skipped_bytes),
        (config_mod.PREPARED_SUMMARY.name, dumps_json(summary)),
    ):
        written[name] = write_if_changed(prepared_dir / name, data)
    _print_outcome(summary, skipped_doc, prepared_dir, written)
    return summary


def require_training_rows(
    source: Path, total: int, splits: list[str], skipped: list[BadRow]
) -> None:
    """Stop here, before anything is written, when no row is left to train on."""
    if not splits:
        reasons = Counter(b.reason for b in skipped)
        why = ", ".join(f"{reason}: {n}" for reason, n in sorted(reasons.items()))
        raise PipelineError(
            f"dataset.path {source}: no usable rows (kept 0 of {total}"
            + (f"; skipped {why}" if why else "")
            + "): nothing to extract or train on"
        )
    if "train" not in splits:
        raise PipelineError(
            f"dataset.path {source}: all {len(splits)} kept rows are held out (see "
            "dataset.holdout): no rows left in the train split"
        )


def _summary(run, source, model_dir, total, tally: _Tally) -> dict:
    dataset_cfg = run.dataset
    max_length = dataset_cfg.max_length
    rows_per_shard = run.shards.rows_per_shard
    lengths = np.asarray(tally.lengths, dtype=np.int64)
    assistant = np.asarray(tally.assistant, dtype=np.int64)
    is_eval = np.array([s == "eval" for s in tally.splits], dtype=bool)
    shard_index = np.asarray(tally.row_ids, dtype=np.int64) // rows_per_shard
    shards = []
    for index, shard in enumerate(plan_shards(total, rows_per_shard)):
        in_shard = shard_index == index
        shards.append(
            {
                "shard": shard.name,
                "rows": int(in_shard.sum()),
                "tokens": int(lengths[in_shard].sum()),
                "eval_rows": int((in_shard & is_eval).sum()),
            }
        )
    return {
        "source_rows": total,
        "rows": len(tally.row_ids),
        "tokens": int(lengths.sum()),
        "assistant_tokens": int(assistant.sum()),
        "truncated_rows": tally.truncated,
        "max_length": max_length,
        "turn_order": dataset_cfg.turn_order,
        "length_histogram": _histogram(lengths, max_length),
        "length_stats": {
            "min": int(lengths.min()) if len(lengths) else 0,
            "mean": round(float(lengths.mean()), 2) if len(lengths) else 0.0,
            "max": int(lengths.max()) if len(lengths) else 0,
        },
        "split": {
            name: {
                "rows": int(selected.sum()),
                "tokens": int(lengths[selected].sum()),
                "assistant_tokens": int(assistant[selected].sum()),
            }
            for name, selected in (("train", ~is_eval), ("eval", is_eval))
        },
        "holdout": dataset_cfg.holdout.as_dict(),
        "rows_per_shard": rows_per_shard,
        "shards": shards,
        "provenance": {
            "dataset_path": str(source),
            "dataset_format": dataset_cfg.format,
            "dataset_hash": dataset_hash(source),
            "tokenizer_fingerprint": run.model.tokenizer_fingerprint,
            "model_config_hash": run.model.config_hash,
            "max_length": max_length,
            "regenerate": (
                dataset_cfg.regenerate.output_settings() if dataset_cfg.regenerate.enabled else None
            ),
            # What the workflow's rerun decision compares (eaglepipe.plan).
            "workflow": prepare_provenance(run),
        },
    }


def _print_outcome(summary: dict, skipped: dict, prepared_dir: Path, written: dict) -> None:
    split = summary["split"]
    print(
        f"prepare: kept {summary['rows']:,} of {summary['source_rows']:,} rows "
        f"({summary['tokens']:,} tokens, {summary['assistant_tokens']:,} assistant, "
        f"{summary['truncated_rows']:,} truncated); train {split['train']['rows']:,} rows, "
        f"eval {split['eval']['rows']:,} rows",
        flush=True,
    )
    if skipped["count"]:
        reasons = ", ".join(f"{reason}: {n}" for reason, n in skipped["reasons"].items())
        print(f"prepare: skipped {skipped['count']:,} bad rows ({reasons})", flush=True)
    for line in loss_lines(summary):
        print(f"prepare: {line}", flush=True)
    if summary["rows"] and not split["eval"]["rows"]:
        print("prepare: warning: the held-out split is empty (see dataset.holdout)", flush=True)
    changed = [name for name, was_written in written.items() if was_written]
    unchanged = [name for name, was_written in written.items() if not was_written]
    print(
        f"prepare: {prepared_dir}: wrote {', '.join(changed) or 'nothing'}"
        + (f"; unchanged {', '.join(unchanged)}" if unchanged else ""),
        flush=True,
    )


def loss_lines(summary: dict) -> list[str]:
    """What a prepared summary says was lost, per reason, and where the source was cut off
    (prepare's log, `eaglepipe status`)."""
    lines = []
    if summary.get("source_cut"):
        lines.append(summary["source_cut"])
    lost = summary.get("lost") or {}
    if lost:
        kept = summary.get("assistant_tokens", 0)
        whole = kept + sum(c["assistant_tokens"] for c in lost.values())
        lines.append(
            f"lost per reason (rows dropped whole, turns, assistant tokens; "
            f"{summary.get('trimmed_rows', 0):,} kept rows trimmed):"
        )
        for reason, c in sorted(lost.items(), key=lambda item: -item[1]["assistant_tokens"]):
            share = f" ({c['assistant_tokens'] / whole:.1%})" if whole else ""
            lines.append(
                f"  {reason}: {c['rows']:,} rows, {c['turns']:,} turns "
                f"({c['assistant_turns']:,} assistant), {c['assistant_tokens']:,} assistant "
                f"tokens{share}"
            )
    return lines


def listed_file_problem(path: Path, listed: dict, summary: Path) -> str | None:
    """Why a prepared file does not match the size and xxh3-128 its summary lists, or None."""
    size = path.stat().st_size
    if size != listed["bytes"]:
        return f"{path} is {size} bytes, {summary} lists {listed['bytes']}"
    digest = hash_file(path)
    if digest != listed["xxh3_128"]:
        return f"{path} re-hashes to xxh3-128 {digest}, {summary} lists {listed['xxh3_128']}"
    return None


def check_table_intact(path: Path) -> None:
    """The whole table against its summary (written last, beside it), before it is read whole:
    a flipped bit pyarrow still reads would move rows between the splits. A summary that lists
    no checksum (an older run) has nothing to check against."""
    summary = path.parent / "summary.json"
    try:
        listed = json.loads(summary.read_text())[SUMMARY_FILES_KEY][path.name]
    except (OSError, ValueError, KeyError, TypeError):
        return
    problem = listed_file_problem(path, listed, summary)
    if problem is not None:
        raise PipelineError(f"{problem}: {set_aside_repair('prepares it again')}")


def load_prepared(
    path: str | os.PathLike = config_mod.PREPARED_TABLE,
    start: int | None = None,
    end: int | None = None,
    columns: list[str] | None = None,
):
    """The prepared table as a pandas DataFrame ordered by row_id.

    With `start`/`end`, only rows `start <= row_id < end` are read; the table holds one row
    group per shard, so reading a shard's rows skips every other shard's bytes.
    """
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"prepared table {path} does not exist: run the prepare rule first")
    if start is None and end is None:
        # Whole-table readers (vocab, training, evaluation, live); a shard job reads its own
        # row group only, and hashing the whole table in each would cost its start.
        check_table_intact(path)
    filters = []
    if start is not None:
        filters.append(("row_id", ">=", start))
    if end is not None:
        filters.append(("row_id", "<", end))
    try:
        table = pq.read_table(path, columns=columns, filters=filters or None)
    except (OSError, ValueError) as exc:
        raise PipelineError(f"prepared table {path} cannot be read: {exc}") from None
    return table.to_pandas()


def rows_in_range(table, start: int, end: int):
    """The rows with `start <= row_id < end` (a shard's rows), as a new DataFrame."""
    row_ids = table["row_id"].to_numpy()
    lo, hi = np.searchsorted(row_ids, [start, end], side="left")
    return table.iloc[lo:hi].reset_index(drop=True)


def read_token_rows(
    path: str | os.PathLike, start: int, end: int
) -> tuple[list[int], list[np.ndarray], list[np.ndarray]]:
    """The rows `start <= row_id < end` as (row ids, int32 input ids, uint8 loss masks), in
    row-id order: a shard job's start-up read.

    Only the row groups whose row_id statistics overlap the range are read (one group per
    shard), straight from the Parquet file into numpy: no pandas and no pyarrow.dataset, whose
    imports alone took longer than the read.
    """
    import pyarrow.parquet as pq

    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"prepared table {path} does not exist: run the prepare rule first")
    try:
        parquet = pq.ParquetFile(path)
        groups = _row_groups_overlapping(parquet.metadata, start, end)
        table = parquet.read_row_groups(groups, columns=["row_id", "input_ids", "loss_mask"])
    except (OSError, ValueError) as exc:
        raise PipelineError(f"prepared table {path} cannot be read: {exc}") from None
    chunks = table.column("row_id").chunks
    row_ids = np.concatenate([_numpy_of(c, np.int64) for c in chunks] or [np.zeros(0, np.int64)])
    wanted = np.flatnonzero((row_ids >= start) & (row_ids < end))
    wanted = wanted[np.argsort(row_ids[wanted], kind="stable")]
    lists = {}
    for name, dtype in (("input_ids", np.int32), ("loss_mask", np.uint8)):
        rows: list[np.ndarray] = []
        for chunk in table.column(name).chunks:
            offsets = _numpy_of(chunk.offsets, np.int32)
            values = _numpy_of(chunk.values, dtype)
            rows += [values[offsets[i] : offsets[i + 1]] for i in range(len(chunk))]
        lists[name] = [np.array(rows[i], dtype=dtype) for i in wanted]
    return [int(row_ids[i]) for i in wanted], lists["input_ids"], lists["loss_mask"]


def _numpy_of(array, dtype) -> np.ndarray:
    """A null-free primitive Arrow array as a numpy view of its data buffer (pyarrow's own
    to_numpy imports pandas, which takes longer than the shard's read)."""
    if array.null_count:
        raise PipelineError(f"the prepared table holds nulls in a {array.type} column")
    item = np.dtype(dtype).itemsize
    return np.frombuffer(
        array.buffers()[1], dtype=dtype, count=len(array), offset=array.offset * item
    )


def _row_groups_overlapping(metadata, start: int, end: int) -> list[int]:
    """Row groups whose row_id min/max may fall in [start, end) (all of them without stats)."""
    groups = []
    for index in range(metadata.num_row_groups):
        group = metadata.row_group(index)
        stats = None
        for column in range(group.num_columns):
            if group.column(column).path_in_schema == "row_id":
                stats = group.column(column).statistics
        if stats is None or not stats.has_min_max or (stats.min < end and stats.max >= start):
            groups.append(index)
    return groups
