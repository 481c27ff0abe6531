"""The disk a run's plan will take, known before it starts: per stage, the bytes the whole plan
stores and what is still to be written, against the free space where that stage writes
(hidden_states, the server's dump root, regenerated, drafter).

`snakemake -n` and `eaglepipe status` state it once the tokenized table exists (token counts
are known only then); a run that executes jobs refuses, in one line at workflow start, a plan
that cannot fit, with what would make it fit. Stages that share a file system are judged
together. Each shard job still checks its own room when it starts (`core.space`), since other
writers share the disk.

Sizes are the project's own estimates: a shard's chunks as its extraction job plans them
(`extract.chunk_file`), one request's dump, and the drafter's files from its parameter count.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core.config import (
    DRAFTER_DIR,
    DRAFTER_MODEL,
    HIDDEN_STATES_DIR,
    PREPARED_TABLE,
    REGENERATED_DIR,
)
from ..core.errors import PipelineError
from ..core.hidden_store import FP8, HiddenStore
from ..core.jsonio import read_json_object
from ..core.run import RunSpec
from ..core.space import existing_ancestor, format_bytes, free_bytes
from ..extract.chunk_file import estimated_chunk_bytes, expected_bytes
from ..plan.freshness import Staleness
from ..plan.shard_plan import parse_shard_name

HIDDEN_STATES, DUMP_ROOT, REGENERATED, DRAFTER = (
    "hidden_states",
    "dump_root",
    "regenerated",
    "drafter",
)
# A regenerated shard holds its rows twice (journal and rows file), each about the size of the
# source rows it answers again.
REGENERATED_COPIES = 2
# Training keeps this many checkpoints and writes the next before removing the oldest
# (drafter/train.py KEEP_CHECKPOINTS, plus the one being written).
CHECKPOINTS_AT_PEAK = 3
DRAFTER_SIZE_CACHE = Path(".eaglepipe/cache/drafter_size.json")
# Bytes per trainable parameter: the model file (fp32), a checkpoint (fp32 weights and AdamW's
# two moments), an export (bf16).
MODEL_BYTES, CHECKPOINT_BYTES, EXPORT_BYTES = 4, 12, 2


@dataclass
class PreparedRows:
    """`row_id` and `num_tokens` of the prepared table (sorted by row id), for planning."""

    row_ids: np.ndarray
    num_tokens: np.ndarray

    @classmethod
    def read(cls, prepared_table: str | os.PathLike) -> PreparedRows | None:
        if not Path(prepared_table).exists():
            return None
        import pyarrow.parquet as pq

        table = pq.read_table(prepared_table, columns=["row_id", "num_tokens"])
        row_ids = table.column("row_id").to_numpy().astype("int64")
        order = np.argsort(row_ids, kind="stable")
        return cls(row_ids[order], table.column("num_tokens").to_numpy().astype("int64")[order])

    def of_rows(self, start: int, end: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = np.searchsorted(self.row_ids, [start, end])
        return self.row_ids[lo:hi], self.num_tokens[lo:hi]


@dataclass(frozen=True)
class StageSpace:
    """One stage's part of the plan, and the free space where it writes."""

    stage: str
    directory: Path
    planned_bytes: int  # what the whole plan stores there
    to_write: int  # what the remaining plan still adds
    free: int
    detail: str

    def line(self) -> str:
        return (
            f"  {self.stage}: {format_bytes(self.planned_bytes)} planned, "
            f"{format_bytes(self.to_write)} still to write ({self.detail}); "
            f"{format_bytes(self.free)} free on {existing_ancestor(self.directory)}"
        )


@dataclass(frozen=True)
class DiskPlan:
    stages: list[StageSpace]

    def overflows(self) -> list[tuple[list[StageSpace], int]]:
        """(stages, free) per file system whose stages together need more than is free."""
        by_device: dict[int, list[StageSpace]] = {}
        for stage in self.stages:
            device = os.stat(existing_ancestor(stage.directory)).st_dev
            by_device.setdefault(device, []).append(stage)
        return [
            (stages, stages[0].free)
            for stages in by_device.values()
            if sum(s.to_write for s in stages) > stages[0].free
        ]

    def text(self) -> str:
        verdict = "fits" if not self.overflows() else "DOES NOT FIT"
        head = f"disk plan: {verdict} (bytes per stage; stages sharing a file system add up)"
        return "\n".join([head, *(stage.line() for stage in self.stages)])

    def check(self, run: RunSpec) -> None:
        """Refuse, in one line, a plan whose stages cannot fit where they write."""
        overflows = self.overflows()
        if not overflows:
            return
        stages, free = overflows[0]
        needed = sum(s.to_write for s in stages)
        names = " and ".join(f"{s.stage} ({format_bytes(s.to_write)})" for s in stages)
        where = existing_ancestor(stages[0].directory)
        raise PipelineError(
            f"the plan cannot fit: {names} need {format_bytes(needed)} on the file system of "
            f"{where}, which has {format_bytes(free)} free; {_remedy(run, stages)}"
        )


def _remedy(run: RunSpec, stages: list[StageSpace]) -> str:
    """What would make these stages fit, for the refusal's one line."""
    names = {s.stage for s in stages}
    ways = ["free space there"]
    if (HIDDEN_STATES in names or DUMP_ROOT in names) and run.extract.store != HiddenStore(
        aux=FP8, final=FP8
    ):
        ways.append(
            "store the states in FP8 at about half the bytes "
            "(extract.store: {aux: fp8_e4m3, final: fp8_e4m3})"
        )
    if HIDDEN_STATES in names or DUMP_ROOT in names:
        ways.append(f"capture fewer aux layers (aux_layer_ids: {len(run.aux_layer_ids)} now)")
    if DUMP_ROOT in names:
        ways.append("point server.dump_root at a larger file system")
    if names - {DUMP_ROOT}:
        ways.append("run the workflow in a directory on a larger disk (--directory)")
    return "to fit: " + "; ".join(ways[:-1]) + "; or " + ways[-1]


def _dir_bytes(directory: str) -> int:
    """Bytes of the files directly in `directory` (a shard's), 0 when it does not exist."""
    try:
        with os.scandir(directory) as entries:
            return sum(e.stat().st_size for e in entries if e.is_file(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return 0


def _hidden_state_bytes(
    num_tokens: np.ndarray, *, hidden_size: int, aux_layers: int, store: HiddenStore
) -> tuple[int, int]:
    """(bytes of one shard's chunks, bytes of its longest row's dump in the handoff): the one
    place this module calls the chunk format's estimates. The shard's rows are estimated as one
    chunk (as its job estimates each of its chunks): the job's chunks add 8 bytes each, a few
    bytes per gigabyte, and planning them row by row made the plan of 5,000 shards seconds."""
    if len(num_tokens) == 0:
        return 0, 0
    stored = estimated_chunk_bytes(
        num_tokens=num_tokens.tolist(),
        hidden_size=hidden_size,
        num_aux_layers=aux_layers,
        store=store,
    )
    longest = expected_bytes(
        num_tokens=int(num_tokens.max()),
        hidden_size=hidden_size,
        num_aux_layers=aux_layers,
        store=store,
    )
    return stored, longest


def _drafter_parameters(run: RunSpec, workdir: Path) -> int:
    """Trainable parameters of the run's drafter, counted on the meta device (nothing is
    allocated) and cached by what shapes it: a dry run then imports no torch."""
    from ..core.atomic import write_json_if_changed
    from ..core.fingerprint import hash_json

    key = hash_json(
        {
            "drafter": run.train.drafter.as_dict(),
            "draft_vocab_size": run.train.draft_vocab_size,
            "model": run.model.config_hash,
        }
    )
    cache_path = workdir / DRAFTER_SIZE_CACHE
    try:
        cached = read_json_object(cache_path)
    except PipelineError:
        cached = {}
    if cached.get("key") == key and isinstance(cached.get("parameters"), int):
        return cached["parameters"]
    import torch

    from ..drafter.model import Eagle3Drafter, drafter_config

    with torch.device("meta"):
        model = Eagle3Drafter(drafter_config(run, run.train.draft_vocab_size))
    parameters = sum(t.numel() for t in model.trainable_state_dict().values())
    write_json_if_changed(cache_path, {"key": key, "parameters": parameters}, durable=False)
    return parameters


def disk_plan(
    run: RunSpec,
    shard_names: Iterable[str],
    prepared: PreparedRows,
    *,
    to_extract: Iterable[str],
    to_regenerate: Iterable[str] = (),
    drafter_to_train: bool,
    workdir: str | os.PathLike = ".",
) -> DiskPlan:
    """The plan's bytes per stage for `run` in `workdir`: `to_extract` and `to_regenerate` are
    the shards the next run makes (again), `drafter_to_train` whether it trains."""
    workdir = Path(workdir)
    to_extract, to_regenerate = set(to_extract), set(to_regenerate)
    shard_names = list(shard_names)
    planned = to_write = longest = tokens_left = 0
    hidden_size, aux_layers = run.model.hidden_size, len(run.aux_layer_ids)
    hidden_states_dir = str(workdir / HIDDEN_STATES_DIR)
    for name in shard_names:
        shard = parse_shard_name(name)
        _, num_tokens = prepared.of_rows(shard.start, shard.end)
        stored, dump = _hidden_state_bytes(
            num_tokens, hidden_size=hidden_size, aux_layers=aux_layers, store=run.extract.store
        )
        planned += stored
        if name in to_extract:
            # Chunks already there are kept when they verify, or replaced: the shard ends at
            # its planned size either way.
            to_write += max(0, stored - _dir_bytes(os.path.join(hidden_states_dir, name)))
            longest = max(longest, dump)
            tokens_left += int(num_tokens.sum())
    stages = [
        StageSpace(
            HIDDEN_STATES,
            workdir / HIDDEN_STATES_DIR,
            planned,
            to_write,
            free_bytes(workdir / HIDDEN_STATES_DIR),
            f"{len(to_extract)} of {len(shard_names)} shards to extract, {tokens_left:,} tokens",
        )
    ]
    dump_root = Path(run.server.handoff_root)
    inflight = run.extract.max_inflight_bytes
    stages.append(
        StageSpace(
            DUMP_ROOT,
            dump_root,
            longest,
            longest,
            free_bytes(dump_root),
            "the longest row's dump, which must fit at once; in flight at most "
            + (
                format_bytes(inflight)
                if inflight
                else "a quarter of the free space (extract.max_inflight_bytes)"
            ),
        )
    )
    if run.dataset.regenerate.enabled:
        stages.append(_regenerated_space(run, shard_names, to_regenerate, workdir))
    stages.append(_drafter_space(run, drafter_to_train, workdir))
    return DiskPlan(stages)


def _regenerated_space(
    run: RunSpec, shard_names: list[str], to_regenerate: set[str], workdir: Path
) -> StageSpace:
    source = workdir / run.dataset.path
    rows = max(1, sum(parse_shard_name(n).end - parse_shard_name(n).start for n in shard_names))
    per_row = source.stat().st_size / rows * REGENERATED_COPIES
    planned = to_write = 0
    for name in shard_names:
        shard = parse_shard_name(name)
        estimate = int(per_row * (shard.end - shard.start))
        on_disk = _dir_bytes(str(workdir / REGENERATED_DIR / name))
        planned += estimate if name in to_regenerate else on_disk
        if name in to_regenerate:
            to_write += max(0, estimate - on_disk)
    return StageSpace(
        REGENERATED,
        workdir / REGENERATED_DIR,
        planned,
        to_write,
        free_bytes(workdir / REGENERATED_DIR),
        f"{len(to_regenerate)} of {len(shard_names)} shards to regenerate, at about twice "
        "their source rows' bytes",
    )


def _drafter_space(run: RunSpec, to_train: bool, workdir: Path) -> StageSpace:
    directory = workdir / DRAFTER_DIR
    on_disk = sum(_dir_bytes(root) for root, _, _ in os.walk(directory))
    if not to_train:
        return StageSpace(DRAFTER, directory, on_disk, 0, free_bytes(directory), "trained")
    parameters = _drafter_parameters(run, workdir)
    engines = len(run.export.engines)
    planned = parameters * (
        MODEL_BYTES + CHECKPOINTS_AT_PEAK * CHECKPOINT_BYTES + engines * EXPORT_BYTES
    )
    return StageSpace(
        DRAFTER,
        directory,
        planned,
        max(0, planned - on_disk),
        free_bytes(directory),
        f"{parameters:,} trainable parameters: the model, {CHECKPOINTS_AT_PEAK} checkpoints "
        f"at the peak, {engines} export(s)",
    )


def planned_disk(
    run: RunSpec,
    workdir: str | os.PathLike = ".",
    *,
    shard_names: list[str] | None = None,
    found: Staleness | None = None,
) -> DiskPlan | None:
    """The disk plan of the next run in `workdir`, judged as the workflow judges what it makes
    again (`plan.freshness.staleness`, or `found` when the caller has it); None until the
    tokenized table and the target exist."""
    from ..drafter.live import live_export_engine
    from ..plan.freshness import manifest_path, staleness
    from ..plan.provenance import regenerated_manifest_path, shards

    workdir = Path(workdir)
    prepared = PreparedRows.read(workdir / PREPARED_TABLE)
    if prepared is None:
        return None
    with contextlib.chdir(workdir):
        if not run.model.exists:
            return None
        names = shard_names if shard_names is not None else shards(run)
        if found is None:
            found = staleness(run, names, live_export_engine=live_export_engine(run))
        to_extract = {n for n in names if not os.path.exists(manifest_path(n))}
        to_extract |= set(found.hidden_states)
        to_regenerate = set()
        if run.dataset.regenerate.enabled:
            to_regenerate = set(found.regenerated) | {
                n for n in names if not os.path.exists(regenerated_manifest_path(n))
            }
            # A shard regenerated again is extracted again: its rows are new.
            to_extract |= to_regenerate
        trained = DRAFTER_MODEL.exists() and "train" not in found.single_job
    return disk_plan(
        run,
        names,
        prepared,
        to_extract=to_extract,
        to_regenerate=to_regenerate,
        drafter_to_train=not trained,
        workdir=workdir,
    )
