"""Training the drafter on validated shards: AdamW, warmup + cosine, TTT loss, resumable.

One script for one process or many: under `torchrun` (WORLD_SIZE > 1) every rank trains a
DDP replica on its own slice of each epoch's batch plan (batch k goes to rank k % world), and
only rank 0 writes checkpoints, the log and the model. Checkpoints are written atomically every
`train.checkpoint_every` steps; a rerun resumes from the newest one that belongs to the same
inputs and reaches the same total step count, because the batch plan depends only on the seed.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save

from ..core.atomic import atomic_write_bytes
from ..core.errors import PipelineError
from ..core.fingerprint import hash_bytes, hash_file, hash_json
from ..core.hidden_store import HIDDEN_KEYS, dequantize, scale_key
from ..core.jsonio import read_json_object
from ..core.run import RunSpec, TrainSettings
from ..core.sealed import seal, seal_metadata
from ..core.space import disk_full_error, is_disk_full
from ..plan.freshness import failed_checks
from .chunks import Chunk, check_chunks, damage_error, list_chunks
from .data import BatchStream, index_rows, plan_batches, split_row_ids
from .loss import ttt_loss
from .model import Eagle3Drafter, drafter_config
from .target_head import load_target_head
from .variants import check_export_support, check_mla_serving
from .vocab import load_vocab

CHECKPOINT_RE = re.compile(r"step-(\d{8})\.pt$")
KEEP_CHECKPOINTS = 2


# ---------------------------------------------------------------------------------------------
# The validation gate


def check_validated(manifests: list[str], validated: list[str]) -> None:
    """Every manifest needs a validation report for the same shard and the same manifest bytes."""
    reports: dict[str, dict] = {}
    for path in validated:
        report = read_json_object(
            path,
            what="validation report",
            missing="does not exist: validate its shard first (training needs every report)",
        )
        if "shard" not in report or "manifest_xxh3_128" not in report:
            raise PipelineError(f"validation report {path} lacks shard/manifest_xxh3_128")
        failed = failed_checks(report)
        if failed != []:
            what = (
                f"records check(s) {', '.join(failed)} as not passed"
                if failed
                else "records no checks"
            )
            raise PipelineError(
                f"validation report {path} {what}: its shard was not validated; "
                f"`rm {path}`, then `snakemake --cores N` validates it again"
            )
        reports[report["shard"]] = report
    for manifest in manifests:
        shard = Path(manifest).parent.name
        try:
            digest = hash_file(manifest)
        except FileNotFoundError:
            raise PipelineError(
                f"shard {shard}: {manifest} does not exist: the shard has not finished "
                "extraction; run snakemake to extract and validate it"
            ) from None
        except OSError as exc:
            raise PipelineError(f"shard {shard}: cannot read {manifest}: {exc.strerror}") from None
        report = reports.get(shard)
        if report is None:
            raise PipelineError(
                f"shard {shard} ({manifest}) has no validation report: run the validate step "
                "first; training only reads validated shards"
            )
        if report["manifest_xxh3_128"] != digest:
            raise PipelineError(
                f"shard {shard}: {manifest} changed after it was validated; validate it again"
            )


# ---------------------------------------------------------------------------------------------
# Setup


@dataclass
class Distributed:
    rank: int
    world_size: int
    local_rank: int
    local_world_size: int  # ranks on this node

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_kind: str) -> Distributed:
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    local = int(os.environ.get("LOCAL_RANK", "0"))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    if world > 1 and not torch.distributed.is_initialized():
        backend = "nccl" if device_kind == "cuda" else "gloo"
        torch.distributed.init_process_group(backend=backend)
    return Distributed(rank=rank, world_size=world, local_rank=local, local_world_size=local_world)


def resolve_device(train: TrainSettings, local_rank: int = 0) -> torch.device:
    wanted = train.device
    if wanted == "cuda" and not torch.cuda.is_available():
        raise PipelineError("train.device is cuda but no CUDA device is visible")
    if wanted == "cuda" or (wanted == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def resolve_dtype(train: TrainSettings, device: torch.device) -> torch.dtype:
    precision = train.precision
    if precision == "bf16" or (precision == "auto" and device.type == "cuda"):
        return torch.bfloat16
    return torch.float32


def lr_at(step: int, total_steps: int, peak: float, warmup: int) -> float:
    """Linear warmup to `peak`, then cosine decay to zero at `total_steps`."""
    if warmup and step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))


def build_drafter(run: RunSpec, vocab, target_head, seed: int) -> Eagle3Drafter:
    torch.manual_seed(seed)
    model = Eagle3Drafter(drafter_config(run, vocab.size))
    with torch.no_grad():
        model.embed_tokens.weight.copy_(target_head.embed_tokens.float())
        model.d2t.copy_(vocab.d2t)
        model.t2d.copy_(vocab.t2d)
    return model


def verify_chunks(chunks: list[Chunk], dist: Distributed, device: torch.device, log) -> None:
    """Check every chunk against its manifest before training reads it; stop every rank if any
    is damaged. The ranks of a node split the chunks (they share its disks), so each chunk is
    read once per node; the verdicts are combined across all ranks."""
    statuses = torch.zeros(len(chunks), dtype=torch.int64)
    mine = list(range(dist.local_rank, len(chunks), dist.local_world_size))
    for i, status in zip(mine, check_chunks([chunks[i] for i in mine], log), strict=True):
        statuses[i] = status
    if dist.world_size > 1:
        statuses = statuses.to(device)
        torch.distributed.all_reduce(statuses, op=torch.distributed.ReduceOp.MAX)
    error = damage_error(chunks, statuses.tolist())
    if error is not None:
        raise error


def to_device(batch: dict, device: torch.device, dtype: torch.dtype) -> dict:
    """The batch on `device`, hidden states as `dtype`: an FP8 store's e4m3 bytes and scales
    are moved as they are and dequantized there (half the bytes cross to the GPU)."""
    out = {k: v.to(device, non_blocking=True) for k, v in batch.items()}
    for name in HIDDEN_KEYS:
        scale = out.pop(scale_key(name), None)
        out[name] = out[name].to(dtype) if scale is None else dequantize(out[name], scale, dtype)
    return out


def save_drafter(model: Eagle3Drafter, path: str | os.PathLike, metadata: dict) -> None:
    tensors = {
        k: v.detach().float().cpu().contiguous() for k, v in model.trainable_state_dict().items()
    }
    tensors["d2t"] = model.d2t.cpu()
    tensors["t2d"] = model.t2d.cpu()
    meta = {"drafter_config": model.config.to_json(), **{k: str(v) for k, v in metadata.items()}}
    atomic_write_bytes(path, seal(save(tensors, metadata=seal_metadata(meta))))


# ---------------------------------------------------------------------------------------------
# Checkpoints


def list_checkpoints(directory: Path) -> list[tuple[int, Path]]:
    if not directory.is_dir():
        return []
    found = []
    for path in directory.iterdir():
        match = CHECKPOINT_RE.search(path.name)
        if match:
            found.append((int(match.group(1)), path))
    return sorted(found)


def save_checkpoint(directory: Path, step: int, model, optimizer, run_key: str) -> Path:
    buffer = io.BytesIO()
    torch.save(
        {
            "step": step,
            "run_key": run_key,
            "model": model.trainable_state_dict(),
            "optimizer": optimizer.state_dict(),
        },
        buffer,
    )
    path = directory / f"step-{step:08d}.pt"
    data = buffer.getvalue()
    atomic_write_bytes(path, data)
    # Its checksum beside it: torch.load reads a flipped bit in a tensor without complaint.
    atomic_write_bytes(checksum_path(path), hash_bytes(data).encode())
    for _, old in list_checkpoints(directory)[:-KEEP_CHECKPOINTS]:
        old.unlink(missing_ok=True)
        checksum_path(old).unlink(missing_ok=True)
    return path


def checksum_path(checkpoint: Path) -> Path:
    return checkpoint.with_name(checkpoint.name + ".xxh3")


def checkpoint_problem(path: Path) -> str | None:
    """Why a checkpoint does not match the checksum written beside it, or None (also for one
    without a checksum: written by an older version)."""
    try:
        recorded = checksum_path(path).read_text().strip()
    except FileNotFoundError:
        return None
    actual = hash_file(path)
    if actual != recorded:
        return f"re-hashes to xxh3-128 {actual}, {checksum_path(path).name} records {recorded}"
    return None


def latest_checkpoint(directory: Path, run_key: str, log) -> dict | None:
    """The newest readable checkpoint of this run; checkpoints of other inputs are removed.

    Checkpoints hold only tensors, numbers and strings, so they load with `weights_only=True`:
    a file that needs anything else (code to run when unpickled) is refused, never executed.
    """
    for step, path in reversed(list_checkpoints(directory)):
        if problem := checkpoint_problem(path):
            log(f"checkpoint {path} is damaged ({problem}); ignoring it")
            continue
        try:
            state = torch.load(path, map_location="cpu", weights_only=True)
        except Exception as exc:  # not ours, or damaged (our writes are atomic)
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            log(f"checkpoint {path} is not a plain-tensor checkpoint ({reason}); ignoring it")
            continue
        if state.get("run_key") != run_key:
            log(f"checkpoint {path} was made from other inputs or settings; removing it")
            path.unlink(missing_ok=True)
            checksum_path(path).unlink(missing_ok=True)
            continue
        log(f"resuming from {path} (step {step})")
        return state
    return None


# The steps log kept beside the checkpoints. The log the caller names is a Snakemake output,
# which Snakemake deletes before it reruns a job: a resumed training would lose the history of
# the steps before its checkpoint. This copy is no output, so it survives the rerun.
HISTORY_NAME = "train_log.jsonl"


def logged_steps(path: Path, last_step: int) -> bytes:
    """The log lines of steps up to `last_step` (a torn or foreign line is dropped)."""
    if not path.exists():
        return b""
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (json.JSONDecodeError, KeyError, TypeError):
            continue
    return ("\n".join(kept) + "\n" if kept else "").encode()


def start_logs(log_file: Path, history: Path, start_step: int) -> None:
    """Both logs hold the steps before `start_step` (the resumed checkpoint's) and nothing after.

    The history beside the checkpoints is the source; a log from before it existed (a rerun by
    hand keeps its output) is the fallback."""
    source = history if history.exists() or not log_file.exists() else log_file
    kept = logged_steps(source, start_step) if start_step else b""
    atomic_write_bytes(history, kept)
    atomic_write_bytes(log_file, kept)


def append_log_line(log_out, path: Path, line: str) -> None:
    """One step's line on the unbuffered training log. A full disk ends in one line naming
    the log; a torn last line is dropped when the next run resumes (`logged_steps`)."""
    data = (line + "\n").encode()
    try:
        while data:
            data = data[log_out.write(data) :]
    except OSError as exc:
        if is_disk_full(exc):
            raise disk_full_error(path) from None
        raise


# ---------------------------------------------------------------------------------------------
# The training run


def train(
    run: RunSpec,
    *,
    vocab_path: str,
    table_path: str,
    manifests: list[str],
    validated: list[str],
    out_path: str,
    log_path: str,
    checkpoint_dir: str,
    stop_after_steps: int | None = None,
) -> dict:
    """Train and write the drafter; returns a summary. `stop_after_steps` is for benchmarks."""
    check_validated(manifests, validated)
    tc = run.train
    probe_device = resolve_device(tc)
    dist = init_distributed(probe_device.type)
    device = resolve_device(tc, dist.local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dtype = resolve_dtype(tc, device)

    def log(message: str) -> None:
        if dist.is_main:
            print(message, flush=True)

    vocab = load_vocab(vocab_path)
    # The variant's mistakes end the run before any data is read, not hours later at export.
    config = drafter_config(run, vocab.size)
    check_export_support(run.train.drafter.as_dict(), run.export.engines)
    check_mla_serving(run.export.engines, config)
    head = load_target_head(run.model.directory)
    train_ids = split_row_ids(table_path, "train")
    chunks, facts = list_chunks(manifests, train_ids)
    if not chunks:
        raise PipelineError("the listed shards hold no rows of the train split")
    verify_chunks(chunks, dist, device, log)
    rows = index_rows(chunks, train_ids)
    expected_ids = run.aux_layer_ids
    if list(facts["aux_layer_ids"]) != list(expected_ids):
        raise PipelineError(
            f"shards were extracted at aux layers {facts['aux_layer_ids']}, the config resolves "
            f"to {expected_ids}: re-extract or fix aux_layer_ids"
        )
    if facts["hidden_size"] != head.lm_head.shape[1]:
        raise PipelineError(
            f"shards have hidden_size {facts['hidden_size']}, the target {head.lm_head.shape[1]}"
        )
    if facts["stored_dtypes"] != run.extract.store.manifest_dtypes():
        raise PipelineError(
            f"shards store {facts['stored_dtypes']}, the config's extract.store is "
            f"{run.extract.store.label()}: re-extract or fix extract.store"
        )

    model = build_drafter(run, vocab, head, tc.seed).to(device)
    lm_head = head.lm_head.to(device=device, dtype=dtype)
    draft_ids = vocab.draft_ids.to(device)
    t2d = vocab.t2d.to(device)
    del head

    plans_by_epoch = [
        plan_batches(rows, tc.batch_tokens, tc.max_len, tc.seed, epoch)
        for epoch in range(tc.epochs)
    ]
    steps_per_epoch = min(len(p) for p in plans_by_epoch) // dist.world_size
    if steps_per_epoch == 0:
        raise PipelineError(
            f"{len(rows)} train rows make fewer batches than the {dist.world_size} ranks"
        )
    total_steps = steps_per_epoch * tc.epochs
    run_key = hash_json(
        {
            "train": tc.as_dict(),
            "drafter": model.config.to_json(),
            "vocab": hash_file(vocab_path),
            "manifests": sorted(hash_file(m) for m in manifests),
            "world_size": dist.world_size,
        }
    )

    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=tc.lr,
        weight_decay=tc.weight_decay,
        betas=(0.9, 0.95),
    )
    ckpt_dir = Path(checkpoint_dir)
    log_file = Path(log_path)
    start_step = 0
    state = latest_checkpoint(ckpt_dir, run_key, log)
    if state is not None:
        model.load_state_dict(state["model"], strict=False)
        optimizer.load_state_dict(state["optimizer"])
        start_step = int(state["step"])
    history = ckpt_dir / HISTORY_NAME
    if dist.is_main:
        ckpt_dir.mkdir(parents=True, exist_ok=True)
        log_file.parent.mkdir(parents=True, exist_ok=True)
        start_logs(log_file, history, start_step)

    ddp_model = model
    if dist.world_size > 1:
        ddp_model = torch.nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    log(
        f"training drafter: {len(rows)} rows, {total_steps} steps "
        f"({steps_per_epoch}/epoch x {tc.epochs}), world {dist.world_size}, "
        f"device {device}, {dtype}, from step {start_step}"
    )

    end_step = total_steps if stop_after_steps is None else min(total_steps, stop_after_steps)
    step = start_step
    began = time.perf_counter()
    tokens_done = 0
    wait_total = 0.0
    last_loss = float("nan")
    # Unbuffered: a write a full disk refuses fails here, not again when the file closes.
    with (
        open(log_file if dist.is_main else os.devnull, "ab", buffering=0) as log_out,
        open(history if dist.is_main else os.devnull, "ab", buffering=0) as history_out,
    ):
        # One stream over every remaining step, so reading ahead crosses epoch boundaries.
        mine = [
            batch_refs
            for plans in plans_by_epoch
            for batch_refs in plans[dist.rank :: dist.world_size][:steps_per_epoch]
        ]
        stream = BatchStream(
            mine[start_step:end_step], tc.max_len, pin_memory=device.type == "cuda"
        )
        try:
            seen_wait = 0.0
            for batch in stream:
                epoch = step // steps_per_epoch
                step_began = time.perf_counter()
                waited, seen_wait = stream.wait_seconds - seen_wait, stream.wait_seconds
                batch = to_device(batch, device, dtype)
                lr = lr_at(step, total_steps, tc.lr, tc.warmup_steps)
                for group in optimizer.param_groups:
                    group["lr"] = lr
                with torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32):
                    result = ttt_loss(
                        ddp_model,
                        batch,
                        lm_head,
                        draft_ids,
                        t2d,
                        tc.ttt_length,
                        tc.step_weight_decay,
                    )
                optimizer.zero_grad(set_to_none=True)
                result.loss.backward()
                grad_norm = torch.nn.utils.clip_grad_norm_(
                    [p for p in model.parameters() if p.requires_grad], tc.grad_clip
                )
                optimizer.step()
                step += 1
                stats = torch.tensor(
                    [float(result.loss.detach()), *result.correct, *result.counted],
                    dtype=torch.float64,
                    device=device,
                )
                if dist.world_size > 1:
                    torch.distributed.all_reduce(stats)
                    stats[0] /= dist.world_size
                k = tc.ttt_length
                correct, counted = stats[1 : 1 + k].tolist(), stats[1 + k :].tolist()
                tokens = int(batch["lengths"].sum()) * dist.world_size
                tokens_done += tokens
                seconds = time.perf_counter() - step_began
                wait_total += waited
                last_loss = float(stats[0])
                record = {
                    "step": step,
                    "total_steps": total_steps,
                    "epoch": epoch,
                    "loss": last_loss,
                    "step_losses": result.step_losses,
                    "acc": [c / n if n else None for c, n in zip(correct, counted, strict=True)],
                    "counted": [int(n) for n in counted],
                    "lr": lr,
                    "grad_norm": float(grad_norm),
                    "tokens": tokens,
                    "seconds": seconds,
                    "data_wait_s": waited,
                }
                line = json.dumps(record)
                append_log_line(log_out, log_file, line)
                append_log_line(history_out, history, line)
                if dist.is_main and (step % 10 == 0 or step == end_step or step == 1):
                    elapsed = time.perf_counter() - began
                    rate = tokens_done / max(elapsed, 1e-9)
                    eta = (end_step - step) * elapsed / max(1, step - start_step)
                    acc0 = record["acc"][0]
                    print(
                        f"step {step}/{total_steps} loss {last_loss:.4f} "
                        f"acc0 {acc0 if acc0 is None else round(acc0, 3)} lr {lr:.2e} "
                        f"{rate:,.0f} tok/s ETA {eta:.0f}s",
                        flush=True,
                    )
                if dist.is_main and step % tc.checkpoint_every == 0 and step < total_steps:
                    save_checkpoint(ckpt_dir, step, model, optimizer, run_key)
        finally:
            stream.close()

    elapsed = time.perf_counter() - began
    summary = {
        "steps": step,
        "total_steps": total_steps,
        "resumed_from": start_step,
        "final_loss": last_loss,
        "tokens": tokens_done,
        "tokens_per_s": tokens_done / max(elapsed, 1e-9),
        "data_wait_fraction": wait_total / max(elapsed, 1e-9),
        "seconds": elapsed,
    }
    if dist.is_main and step >= total_steps:
        save_drafter(
            model,
            out_path,
            {
                "aux_layer_ids": json.dumps(list(facts["aux_layer_ids"])),
                "total_steps": total_steps,
                "final_loss": last_loss,
            },
        )
        log(f"wrote {out_path} after {step} steps (final loss {last_loss:.4f})")
    if dist.world_size > 1:
        torch.distributed.barrier()
    sys.stdout.flush()
    return summary
