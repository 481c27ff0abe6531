"""The rows of issue 27 still open, on the 8B-shaped random Llama (benchmarks/
bench_specforge_scale.py drives them on the lent H200; nothing here imports SpecForge):

(a) hidden-state generation on the same rows: SpecForge 0.2's own generator
    (scripts/prepare_hidden_states.py, SGLang in-process, as specforge_capture.py runs it)
    against this pipeline's extraction through its SGLang server (scripts/extract.py shard
    jobs): tokens/s, bytes stored per token, and a `kill -9` at half the rows followed by the
    same command again: what the rerun kept, what it redid, and whether the result is whole
    and right. SpecForge resumes by "the file exists" (a row whose file is there is skipped);
    the pipeline keeps a chunk only when its journal vouches for it and it re-hashes;
(b) training tokens/s of both trainers on those features, the same drafter (one Llama layer of
    the target's width, draft vocabulary 32,000) and TTT length 7, a fixed number of steps each;
(c) the two feature sets compared row by row (`compare_features`).

The rows: one user turn and one assistant turn of word tokens `t<id>` of the word-level
tokenizer bench_sglang_extraction.py saves, rendered by a chat template of our own
(`CHAT_TEMPLATE`): `t3 <user words> t4 <assistant words> t5 `. SpecForge tokenizes the
rendering and masks by its rule (the reply and its end of turn); the pipeline's prepared table
holds the same ids and mask, written directly (`scale_rows`). Content ids start at 16, so the
markers never occur inside a turn. Every row has the same length, so a SpecForge training step
(batch 1) is exactly one row's tokens.

What each stores as the final hidden state, from the sources (SGLang 0.5.14's
layers/logits_processor.py and models/llama.py, SpecForge 0.2.0's offline_capture/
sglang_backend): both take the logits processor's inputs. SpecForge's `hidden_state` is its
`pruned_states` of `hidden_states` (all tokens, forward mode switched to decode), which Llama
hands over after `model.norm` and without a pre-norm copy: post-norm. Its `aux_hidden_state` is
SGLang's `aux_hidden_states` concatenated in layer order, captured at `layers_to_capture = id +
1`, i.e. the residual stream entering layer id + 1 = the output of decoder layer id. The
pipeline's hook (patch/eaglepipe_hook.py) stores the same two tensors: aux id k = output of
decoder layer k, final = post-norm (docs/layers.md). So aux block i is compared with aux block
i, and final with hidden_state. A random model's norm weights are ones, so a pre-norm and a
post-norm state point the same way (cosine 1) and differ only in scale: the comparison reports
max |diff| and each side's mean per-token RMS (about 1 after a unit-weight RMSNorm) beside the
cosines.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
import zipfile
from dataclasses import dataclass
from pathlib import Path

from common import REPO_ROOT, log, working_directory
from specforge_data import draft_config, target_view, write_json, write_specforge_jsonl
from specforge_steps import (
    MARGIN_S,
    SERVING_DTYPE,
    Command,
    Context,
    Paths,
    Step,
    StepFailed,
    capture_command,
    install_specforge,
    run_commands,
    show,
    tail,
    training_command,
)

# The word tokenizer's ids used as markers; content ids start at FIRST_CONTENT_ID.
USER, ASSISTANT, END_OF_TURN = 3, 4, 5
FIRST_CONTENT_ID = 16
TEMPLATE_NAME = "eaglepipe-target"  # the name capture_command passes to SpecForge
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}t3 {{ message['content'] }} "
    "{% elif message['role'] == 'assistant' %}t4 {{ message['content'] }} t5 "
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}t4 {% endif %}"
)
# SpecForge's ChatTemplate fields for CHAT_TEMPLATE (registered by specforge_capture.py).
TEMPLATE_SPEC = {
    "name": TEMPLATE_NAME,
    "assistant_header": "t4 ",
    "user_header": "t3 ",
    "end_of_turn_token": "t5 ",
    "system_prompt": None,
}
SPECFORGE_FILES = "rows_*/data_*.ckpt*"


class ScalePaths(Paths):
    """specforge_steps.Paths (SpecForge's inputs, features and runs under WORK/specforge-files,
    the pipeline's run under WORK/pipeline-run) and the random target."""

    @property
    def model(self) -> Path:
        return self.work / "model"

    @property
    def logs(self) -> Path:
        return self.work / "logs"

    @property
    def hidden_states(self) -> Path:
        return self.run / "hidden_states"


# ---------------------------------------------------------------- the rows


@dataclass(frozen=True)
class ScaleRow:
    row_id: int
    input_ids: list[int]
    loss_mask: list[int]

    def messages(self) -> list[dict]:
        """The conversation whose rendering by CHAT_TEMPLATE tokenizes to `input_ids`."""
        header = self.input_ids.index(ASSISTANT)
        words = [f"t{i}" for i in self.input_ids]
        return [
            {"role": "user", "content": " ".join(words[1:header])},
            {"role": "assistant", "content": " ".join(words[header + 1 : -1])},
        ]


def scale_rows(count: int, tokens: int, vocab: int, seed: int) -> list[ScaleRow]:
    """`count` seeded rows of exactly `tokens` ids: USER, a quarter of user words, ASSISTANT,
    the assistant's words, END_OF_TURN; the loss mask covers the reply and END_OF_TURN."""
    import numpy as np

    if tokens < 8:
        raise ValueError(f"rows of {tokens} tokens: at least 8")
    rng = np.random.default_rng(seed)
    user = tokens // 4
    reply = tokens - 3 - user
    rows = []
    for row_id in range(count):
        words = rng.integers(FIRST_CONTENT_ID, vocab, user + reply).tolist()
        ids = [USER, *words[:user], ASSISTANT, *words[user:], END_OF_TURN]
        mask = [0] * (user + 2) + [1] * (reply + 1)
        rows.append(ScaleRow(row_id, ids, mask))
    return rows


# ---------------------------------------------------------------- killing half-way


@dataclass(frozen=True)
class KillPlan:
    """When to `kill -9`: once `fraction` of the rows are stored, at the first poll that sees
    a file being written (so the kill lands inside a write), or `wait_for_write_s` later."""

    fraction: float = 0.5
    poll_s: float = 0.002
    wait_for_write_s: float = 5.0
    # Looks are that fast only from `fraction - near` of the rows on; before, every idle_poll_s.
    near: float = 0.1
    idle_poll_s: float = 0.05

    def pause(self, done: int, total: int) -> float:
        return self.poll_s if done >= (self.fraction - self.near) * total else self.idle_poll_s


def kill_due(
    done: int, total: int, writing: bool, reached_at: float | None, now: float, plan: KillPlan
) -> tuple[bool, float | None]:
    """(kill now?, when the fraction was first reached)."""
    if done < plan.fraction * total:
        return False, None
    reached_at = now if reached_at is None else reached_at
    return writing or now - reached_at >= plan.wait_for_write_s, reached_at


class SpecforgeWatch:
    """SpecForge's progress: the feature files present, and whether one appeared since the last
    look (its writer creates a file and then fills it: a new file is one being written)."""

    def __init__(self, features: Path):
        self.features = Path(features)
        self.seen: set[str] = set()

    def __call__(self) -> tuple[int, bool]:
        names = {p.name for p in self.features.glob(SPECFORGE_FILES)}
        appeared = bool(names - self.seen)
        self.seen = names
        return len(names), appeared


class PipelineWatch:
    """The pipeline's progress: rows of journalled chunks, and whether a chunk is being written
    (its temporary file exists)."""

    def __init__(self, shard_dirs: list[Path]):
        self.shard_dirs = [Path(d) for d in shard_dirs]

    def __call__(self) -> tuple[int, bool]:
        from eaglepipe.extract.shard_files import read_journal

        done = sum(
            len(entry.get("row_ids", ()))
            for shard_dir in self.shard_dirs
            for entry in read_journal(shard_dir).values()
        )
        writing = any(any(d.glob(".chunk-*.tmp")) for d in self.shard_dirs if d.is_dir())
        return done, writing


def start(command: Command) -> subprocess.Popen:
    command.log_path.parent.mkdir(parents=True, exist_ok=True)
    log(f"[{command.name}] {' '.join(command.argv)}  (log {command.log_path})")
    with open(command.log_path, "ab") as out:
        return subprocess.Popen(
            command.argv, cwd=command.cwd, env=command.env, stdout=out,
            stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip


def kill_trees(procs: list[subprocess.Popen], wait_s: float = 30.0) -> None:
    """SIGKILL every process of each command's tree, and wait until they are gone (the GPU
    memory of a killed process is free once it is). The tree, not the process group: torchrun
    starts its workers in sessions of their own, so killing its group would leave SpecForge's
    worker running."""
    import psutil

    victims = []
    for proc in procs:
        try:
            parent = psutil.Process(proc.pid)
            victims += [parent, *parent.children(recursive=True)]
        except psutil.NoSuchProcess:
            continue
    for victim in victims:
        try:
            victim.kill()
        except psutil.NoSuchProcess:
            continue
    for proc in procs:
        # Also what left the tree but kept the group (reparented workers).
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    psutil.wait_procs(victims, timeout=wait_s)
    for proc in procs:
        proc.poll()


def run_and_kill(ctx: Context, commands: list[Command], watch, total: int, plan: KillPlan) -> dict:
    """Start the commands, and `kill -9` all of them when `kill_due` says so (or at the deadline);
    what was stored at that moment, and the seconds from the start."""
    if ctx.args.dry_run:
        for command in commands:
            show(ctx, command)
        log(f"[{commands[0].name}] kill -9 once {plan.fraction:.0%} of {total} rows are stored")
        return {}
    started, wall_started = time.monotonic(), time.time()
    procs = [start(c) for c in commands]
    reached_at, done, writing, killed = None, 0, False, False
    try:
        while True:
            done, writing = watch()
            due, reached_at = kill_due(done, total, writing, reached_at, time.monotonic(), plan)
            if due:
                killed = True
                break
            if all(p.poll() is not None for p in procs):
                break
            if ctx.left() < MARGIN_S:
                raise StepFailed(f"{commands[0].name}: out of time before the kill", 124)
            time.sleep(plan.pause(done, total))
    finally:
        kill_trees(procs)
    seconds = time.monotonic() - started
    codes = [p.returncode for p in procs]
    if not killed:
        tails = "\n".join(tail(c.log_path, 15) for c in commands)
        raise StepFailed(f"{commands[0].name}: ended (exit {codes}) before the kill:\n{tails}")
    log(f"[{commands[0].name}] kill -9 after {seconds:.1f}s: {done}/{total} rows stored, "
        f"a write in flight: {writing}")  # fmt: skip
    return {
        "started_at": wall_started,
        "killed_after_s": round(seconds, 2),
        "rows_stored_at_kill": done,
        "rows": total,
        "write_in_flight_at_kill": writing,
        "fraction_reached_s": None if reached_at is None else round(reached_at - started, 2),
    }


# ---------------------------------------------------------------- what the rerun kept


def specforge_file_complete(path: Path) -> bool:
    """Whether a SpecForge feature file was written to its end: torch.save writes a zip whose
    central directory comes last, so a file cut short has none."""
    return zipfile.is_zipfile(path)


def specforge_snapshot(features: Path) -> dict[str, dict]:
    """Each feature file (path under `features`): bytes, mtime, written to its end or not."""
    snapshot = {}
    for path in sorted(Path(features).glob(SPECFORGE_FILES)):
        stat = path.stat()
        snapshot[str(path.relative_to(features))] = {
            "bytes": stat.st_size,
            "mtime_ns": stat.st_mtime_ns,
            "complete": specforge_file_complete(path),
        }
    return snapshot


def _same(a: dict, b: dict) -> bool:
    return a["bytes"] == b["bytes"] and a["mtime_ns"] == b["mtime_ns"]


def _names(names, limit: int = 20) -> list[str]:
    return sorted(names)[:limit]


def specforge_resume_report(at_kill: dict, after: dict, expected: int) -> dict:
    """What SpecForge's rerun did with the files the kill left: kept (untouched), rewritten,
    new; a file cut short at the kill and left as it was is one the rerun took as done."""
    kept = {n for n in at_kill if n in after and _same(at_kill[n], after[n])}
    rewritten = {n for n in at_kill if n in after and not _same(at_kill[n], after[n])}
    new = set(after) - set(at_kill)
    torn = {n for n, f in at_kill.items() if not f["complete"]}
    incomplete = {n for n, f in after.items() if not f["complete"]}
    return {
        "files_at_kill": len(at_kill),
        "torn_at_kill": len(torn),
        "torn_files": _names(torn),
        "kept": len(kept),
        "rewritten": len(rewritten),
        "new": len(new),
        "removed": len(set(at_kill) - set(after)),
        "torn_taken_as_done": len(torn & kept),
        "files_after": len(after),
        "expected_files": expected,
        "incomplete_after": len(incomplete),
        "incomplete_files": _names(incomplete),
        "complete": len(after) == expected and not incomplete,
    }


def shard_snapshot(shard_dir: Path) -> dict:
    """A shard directory as a kill left it: chunk files (bytes, mtime), the chunks the journal
    vouches for (with their rows and tokens), temporary files, whether a manifest exists."""
    from eaglepipe.extract.shard_files import MANIFEST_NAME, read_journal

    shard_dir = Path(shard_dir)
    if not shard_dir.is_dir():
        return {"chunks": {}, "journal": {}, "tmp": [], "manifest": False}
    chunks = {}
    for path in sorted(shard_dir.glob("chunk-*.safetensors")):
        stat = path.stat()
        chunks[path.name] = {"bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}
    journal = {
        name: {"rows": len(e.get("row_ids", ())), "tokens": int(e.get("num_tokens", 0))}
        for name, e in read_journal(shard_dir).items()
    }
    return {
        "chunks": chunks,
        "journal": journal,
        "tmp": sorted(p.name for p in shard_dir.glob(".*.tmp")),
        "manifest": (shard_dir / MANIFEST_NAME).is_file(),
    }


def chunk_fates(before: dict, now: dict, manifest: dict) -> tuple[list[dict], list[dict]]:
    """The manifest's chunks the rerun kept (journalled at the kill and untouched since) and
    those it wrote."""
    kept, written = [], []
    for chunk in manifest["chunks"]:
        name = chunk["file"]
        was = before["chunks"].get(name)
        if name in before["journal"] and was is not None and _same(was, now["chunks"][name]):
            kept.append(chunk)
        else:
            written.append(chunk)
    return kept, written


def pipeline_resume_report(at_kill: dict[str, dict], after: dict[str, dict], manifests) -> dict:
    """Per shard and in all: the chunks the rerun kept, those it wrote (again or for the first
    time), the rows it had to request, and what the kill had left that the rerun removed
    (temporary files, chunks the journal did not vouch for)."""
    keys = ("chunks_kept", "chunks_written", "rows_kept", "rows_redone", "tmp_at_kill",
            "unjournalled_at_kill", "tmp_after", "requests_sent")  # fmt: skip
    shards, totals = {}, dict.fromkeys(keys, 0)
    for shard, manifest in manifests.items():
        before, now = at_kill[shard], after[shard]
        kept, written = chunk_fates(before, now, manifest)
        entry = {
            "chunks": len(manifest["chunks"]),
            "chunks_kept": len(kept),
            "chunks_written": len(written),
            "rows_kept": sum(len(c["row_ids"]) for c in kept),
            "rows_redone": sum(len(c["row_ids"]) for c in written),
            "tmp_at_kill": len(before["tmp"]),
            "unjournalled_at_kill": sum(1 for n in before["chunks"] if n not in before["journal"]),
            "tmp_after": len(now["tmp"]),
            "requests_sent": int(manifest.get("timing", {}).get("requests_sent", 0)),
        }
        shards[shard] = entry
        for key in keys:
            totals[key] += entry[key]
    return {"shards": shards, **totals}


def pipeline_completions(at_kill: dict, after: dict, manifests: dict) -> tuple[list, list]:
    """(time, tokens) of the chunks finished before the kill (journalled then) and of those
    the rerun wrote, from the chunk files' mtimes."""
    killed, resumed = [], []
    for shard, manifest in manifests.items():
        before = at_kill[shard]
        for name, entry in before["journal"].items():
            if name in before["chunks"]:
                killed.append((before["chunks"][name]["mtime_ns"] / 1e9, entry["tokens"]))
        _, written = chunk_fates(before, after[shard], manifest)
        for chunk in written:
            mtime = after[shard]["chunks"][chunk["file"]]["mtime_ns"] / 1e9
            resumed.append((mtime, chunk["num_tokens"]))
    return killed, resumed


def verify_shards(shard_dirs: list[Path], row_tokens: dict[int, int]) -> dict:
    """The validation stage's integrity checks of every shard (each listed chunk there with its
    size, re-hashed against the manifest, no unlisted chunk), and the rows they hold against
    the prepared table's: the result is whole and right when `ok`."""
    from eaglepipe.validate.integrity import (
        check_chunk_checksum,
        check_chunk_file,
        check_no_stray_chunks,
        read_manifest,
    )

    errors, rows, tokens, chunk_bytes, all_bytes = [], {}, 0, 0, 0
    for shard_dir in shard_dirs:
        shard = Path(shard_dir).name
        try:
            manifest = read_manifest(Path(shard_dir), shard)
            for entry in manifest["chunks"]:
                check_chunk_file(Path(shard_dir), shard, entry)
                check_chunk_checksum(Path(shard_dir), shard, entry)
                chunk_bytes += entry["bytes"]
                for row_id in entry["row_ids"]:
                    rows[row_id] = rows.get(row_id, 0) + 1
            check_no_stray_chunks(Path(shard_dir), shard, manifest)
            tokens += manifest["num_tokens"]
        except Exception as exc:  # noqa: BLE001 - every failed check is reported, not raised
            errors.append(f"{shard}: {exc}"[:500])
        all_bytes += sum(p.stat().st_size for p in Path(shard_dir).rglob("*") if p.is_file())
    missing = sorted(set(row_tokens) - set(rows))
    twice = sorted(r for r, n in rows.items() if n > 1)
    expected_tokens = sum(row_tokens.values())
    return {
        "ok": not errors and not missing and not twice and tokens == expected_tokens,
        "errors": errors,
        "rows": len(rows),
        "missing_rows": missing[:20],
        "rows_twice": twice[:20],
        "tokens": tokens,
        "expected_tokens": expected_tokens,
        "chunk_bytes": chunk_bytes,
        "dir_bytes": all_bytes,
    }


# ---------------------------------------------------------------- rates


def steady_rate(completions: list[tuple[float, int]]) -> dict:
    """Tokens stored per second between the first and the last file finished in a run (file
    mtimes): the generator's rate once it runs, start-up left out. The first file's tokens are
    not counted (its work began before the span)."""
    done = sorted(completions)
    if len(done) < 2 or done[-1][0] <= done[0][0]:
        return {"files": len(done), "tokens": None, "seconds": None, "tokens_per_s": None}
    tokens = sum(t for _, t in done[1:])
    seconds = done[-1][0] - done[0][0]
    return {
        "files": len(done),
        "tokens": tokens,
        "seconds": round(seconds, 3),
        "tokens_per_s": round(tokens / seconds, 1),
    }


def combined_rate(rates: list[dict]) -> float | None:
    """Tokens over seconds summed over runs (each run's own span)."""
    parts = [r for r in rates if r.get("tokens_per_s")]
    if not parts:
        return None
    return round(sum(r["tokens"] for r in parts) / sum(r["seconds"] for r in parts), 1)


def specforge_completions(snapshot: dict, names, tokens_per_file: int) -> list[tuple[float, int]]:
    return [
        (snapshot[n]["mtime_ns"] / 1e9, tokens_per_file) for n in names if snapshot[n]["complete"]
    ]


# ---------------------------------------------------------------- (c) the two feature sets


@dataclass
class BlockStats:
    """max |diff|, per-token cosine (min, mean) and mean per-token RMS of both sides, over
    every token compared."""

    max_abs_diff: float = 0.0
    min_cos: float = 1.0
    cos_sum: float = 0.0
    tokens: int = 0
    rms_ours: float = 0.0
    rms_theirs: float = 0.0

    def add(self, ours, theirs) -> None:
        import torch

        x, y = ours.float(), theirs.float()
        cos = torch.nn.functional.cosine_similarity(x, y, dim=-1)
        self.max_abs_diff = max(self.max_abs_diff, float((x - y).abs().max()))
        self.min_cos = min(self.min_cos, float(cos.min()))
        self.cos_sum += float(cos.sum())
        self.tokens += x.shape[0]
        self.rms_ours += float(x.pow(2).mean(-1).sqrt().sum())
        self.rms_theirs += float(y.pow(2).mean(-1).sqrt().sum())

    def summary(self) -> dict:
        n = max(self.tokens, 1)
        return {
            "max_abs_diff": self.max_abs_diff,
            "min_cos": round(self.min_cos, 6),
            "mean_cos": round(self.cos_sum / n, 6),
            "tokens": self.tokens,
            "rms_ours": round(self.rms_ours / n, 4),
            "rms_specforge": round(self.rms_theirs / n, 4),
        }


def specforge_index(features: Path) -> tuple[dict[tuple[int, ...], Path], list[str]]:
    """SpecForge's feature files by their input ids (memory-mapped: only the ids are read),
    and the files that do not load (cut short)."""
    import torch

    index, unreadable = {}, []
    for path in sorted(Path(features).glob(SPECFORGE_FILES)):
        try:
            record = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception:  # noqa: BLE001 - a torn file: reported by name
            unreadable.append(str(path.relative_to(features)))
            continue
        index[tuple(int(t) for t in record["input_ids"].reshape(-1).tolist())] = path
    return index, unreadable


def compare_features(
    features: Path,
    shard_dirs: list[Path],
    *,
    specforge_aux_ids: list[int],
    shard_aux_ids: list[int],
    device: str = "cpu",
    min_cos: float = 0.999,
) -> dict:
    """Rows both stored, matched by their input ids: SpecForge's `aux_hidden_state` [1, T, kH]
    block i against the shard's `aux_hidden_states` [T, kH] block i, its `hidden_state`
    [1, T, H] against `final_hidden_states` [T, H]; max |diff|, min and mean per-token cosine,
    the loss masks; and, as a control that the check can tell layers apart, each aux block
    against the next layer's block of the other side (`shifted`)."""
    import torch

    from eaglepipe.extract.shard_files import iter_rows

    index, unreadable = specforge_index(features)
    k = len(shard_aux_ids)
    blocks = {f"aux{i} (layer {shard_aux_ids[i]})": BlockStats() for i in range(k)}
    blocks["final (post-norm)"] = BlockStats()
    shifted = {
        f"aux{i} vs specforge aux{(i + 1) % k}": BlockStats() for i in range(k)
    }  # fmt: skip
    rows, matched, mask_equal, mismatched = 0, 0, 0, []
    for shard_dir in shard_dirs:
        for _row_id, tensors in iter_rows(shard_dir):
            rows += 1
            path = index.get(tuple(int(t) for t in tensors["input_ids"].tolist()))
            if path is None:
                continue
            record = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
            sizes = (record["aux_hidden_state"].numel(), record["hidden_state"].numel())
            if sizes != (
                tensors["aux_hidden_states"].numel(),
                tensors["final_hidden_states"].numel(),
            ):
                mismatched.append(str(path.relative_to(features)))
                continue
            matched += 1
            mask = record["loss_mask"].reshape(-1).to(torch.uint8)
            mask_equal += bool(torch.equal(mask, tensors["loss_mask"].to(torch.uint8)))
            ours_aux = tensors["aux_hidden_states"].to(device)
            theirs_aux = record["aux_hidden_state"].reshape(ours_aux.shape).to(device)
            width = ours_aux.shape[1] // k
            for i, stats in enumerate(blocks.values()):
                if i == k:
                    ours = tensors["final_hidden_states"].to(device)
                    stats.add(ours, record["hidden_state"].reshape(ours.shape).to(device))
                else:
                    stats.add(ours_aux[:, i * width : (i + 1) * width],
                              theirs_aux[:, i * width : (i + 1) * width])  # fmt: skip
            for i, stats in enumerate(shifted.values()):
                j = (i + 1) % k
                stats.add(ours_aux[:, i * width : (i + 1) * width],
                          theirs_aux[:, j * width : (j + 1) * width])  # fmt: skip
    result = {
        "aux_layer_ids": {"specforge": list(specforge_aux_ids), "eaglepipe": list(shard_aux_ids)},
        "specforge_files": len(index) + len(unreadable),
        "specforge_unreadable": unreadable[:20],
        "shard_rows": rows,
        "rows_compared": matched,
        "shape_mismatch": mismatched[:20],
        "loss_mask_equal": mask_equal,
        "blocks": {name: s.summary() for name, s in blocks.items()},
        "shifted": {name: s.summary() for name, s in shifted.items()},
        "min_cos_threshold": min_cos,
    }
    result["verdict"] = fidelity_verdict(result)
    return result


def fidelity_verdict(result: dict) -> str:
    """identical; equal within bf16 rounding (every block's min per-token cosine at or above
    the threshold); or what differs. Says so when the control could not tell layers apart."""
    threshold = result["min_cos_threshold"]
    ids = result["aux_layer_ids"]
    if ids["specforge"] != ids["eaglepipe"]:
        return f"different layers: SpecForge {ids['specforge']}, eaglepipe {ids['eaglepipe']}"
    if not result["rows_compared"]:
        return "no row in common"
    problems = []
    if result.get("shape_mismatch"):
        problems.append(f"other shapes in {len(result['shape_mismatch'])}+ rows")
    if result["loss_mask_equal"] != result["rows_compared"]:
        problems.append(
            f"loss masks differ on {result['rows_compared'] - result['loss_mask_equal']} rows"
        )
    blocks = result["blocks"]
    below = [n for n, s in blocks.items() if s["min_cos"] < threshold]
    if below:
        problems.append(f"below cosine {threshold} in {', '.join(below)}")
    control = all(s["min_cos"] < threshold for s in result["shifted"].values())
    note = "" if control else " (the shifted-layer control also passed: the check cannot tell)"
    if problems:
        return "differ: " + "; ".join(problems) + note
    if all(s["max_abs_diff"] == 0.0 for s in blocks.values()):
        return f"identical on {result['rows_compared']} rows" + note
    return f"equal within bf16 rounding on {result['rows_compared']} rows" + note


# ---------------------------------------------------------------- (b) training figures


def specforge_step_times(train_log: Path) -> list[tuple[int, float]]:
    """(step, seconds) from `specforge train`'s "step N: {...}" lines (training.log_interval=1):
    its `perf/optimizer_step_time_s`, which includes waiting for data."""
    import ast
    import re

    line_re = re.compile(r"^step (\d+): (\{.*\})\s*$")
    steps = []
    for line in Path(train_log).read_text(errors="replace").splitlines():
        match = line_re.match(line)
        if not match:
            continue
        try:
            metrics = ast.literal_eval(match.group(2))
        except (ValueError, SyntaxError):
            continue
        if "perf/optimizer_step_time_s" in metrics:
            steps.append((int(match.group(1)), float(metrics["perf/optimizer_step_time_s"])))
    return steps


def training_rate(step_seconds: list[float], tokens_per_step: list[int], warmup: int) -> dict:
    """Tokens/s over the steps after the first `warmup`, and the median step."""
    import statistics

    timed = list(zip(step_seconds, tokens_per_step, strict=True))[warmup:]
    if not timed:
        return {"timed_steps": 0, "tokens_per_s": None}
    seconds = sum(s for s, _ in timed)
    tokens = sum(t for _, t in timed)
    return {
        "timed_steps": len(timed),
        "timed_tokens": tokens,
        "tokens_per_s": round(tokens / seconds, 1),
        "median_step_s": round(statistics.median(s for s, _ in timed), 4),
    }


# ---------------------------------------------------------------- steps


def note(ctx: Context, name: str, text: str) -> None:
    """An in-process step's line in a dry run (and its record among the commands)."""
    ctx.dry.append({"step": name, "in_process": text})
    log(f"[{name}] (in process) {text}")


def shape() -> dict:
    from bench_sglang_extraction import SHAPES

    return SHAPES["8b"]


def step_model(ctx: Context, step: Step) -> dict:
    """The random 8B-shaped Llama in bf16, made on the GPU and saved once (with the word
    tokenizer and CHAT_TEMPLATE); a half-saved model is never taken: it is saved beside and
    renamed."""
    paths = ctx.paths
    note(ctx, step.name, f"random Llama-3.1-8B-shaped target (bf16, seed 0) -> {paths.model}")
    if ctx.args.dry_run:
        return {}
    import torch
    from bench_sglang_extraction import save_word_tokenizer
    from common import random_llama

    if (paths.model / "config.json").is_file():
        return {"reused": True}
    if not torch.cuda.is_available():
        raise StepFailed("the 8B-shaped target is made on the GPU: no CUDA here")
    partial = paths.work / "model.partial"
    shutil.rmtree(partial, ignore_errors=True)
    began = time.monotonic()
    model = random_llama("cuda", torch.bfloat16, seed=0, **shape())
    model.save_pretrained(partial, max_shard_size="5GB")
    del model
    torch.cuda.empty_cache()
    save_word_tokenizer(partial, shape()["vocab"], CHAT_TEMPLATE)
    partial.rename(paths.model)
    files = [p for p in paths.model.iterdir() if p.is_file()]
    return {"seconds": round(time.monotonic() - began, 1),
            "bytes": sum(p.stat().st_size for p in files)}  # fmt: skip


def step_inputs(ctx: Context, step: Step) -> dict:
    """The same rows for both: SpecForge's JSONL, template JSON, target view and draft config;
    the pipeline's dataset and prepared table with the same ids and loss masks. A few rows are
    tokenized by SpecForge's rule (specforge_data.specforge_tokenize) with the target's own
    tokenizer and template first: they must give the table's ids and mask. SpecForge's wheels
    are installed here too."""
    paths, args = ctx.paths, ctx.args
    aux_ids = default_aux_ids()
    ctx.state.update(max_length=args.row_tokens + 64, aux_layer_ids=aux_ids)
    note(ctx, step.name, f"{args.rows} rows x {args.row_tokens} tokens -> {paths.data} and "
         f"{paths.run}/prepared/tokenized.parquet; target view {paths.target}")  # fmt: skip
    if not args.dry_run:
        import numpy as np
        from common import write_prepared
        from specforge_data import specforge_tokenize
        from transformers import AutoTokenizer

        rows = scale_rows(args.rows, args.row_tokens, shape()["vocab"], args.seed)
        tokenizer = AutoTokenizer.from_pretrained(paths.model)
        for row in rows[:4]:
            theirs = specforge_tokenize(tokenizer, row.messages(), TEMPLATE_SPEC, 10**6)
            if theirs != (row.input_ids, row.loss_mask):
                raise StepFailed(f"row {row.row_id}: SpecForge's rule tokenizes it otherwise")
        shutil.rmtree(paths.specforge, ignore_errors=True)
        shutil.rmtree(paths.run, ignore_errors=True)
        paths.specforge.mkdir(parents=True)
        write_specforge_jsonl([(r.row_id, r.messages()) for r in rows], paths.data)
        write_json(paths.template, TEMPLATE_SPEC)
        view = target_view(paths.model, paths.target, dtype=SERVING_DTYPE)
        write_json(paths.draft_config, draft_config(paths.model, aux_ids, args.draft_vocab))
        paths.run.mkdir(parents=True)
        write_prepared(
            paths.run, [np.asarray(r.input_ids, dtype=np.int32) for r in rows],
            [r.loss_mask for r in rows],
        )  # fmt: skip
        ctx.state["lm_head_key"] = view["lm_head_key"]
    install_specforge(ctx)
    return {"rows": args.rows, "row_tokens": args.row_tokens, "aux_layer_ids": aux_ids}


def default_aux_ids() -> list[int]:
    from eaglepipe.core.layers import default_aux_layer_ids

    return list(default_aux_layer_ids(shape()["layers"]))


def specforge_capture(ctx: Context, name: str) -> Command:
    argv, env = capture_command(ctx, "sglang")
    return Command(name, argv, ctx.paths.logs / f"{name}.log", env=env)


def step_specforge_kill(ctx: Context, step: Step) -> dict:
    """SpecForge's generator from a fresh output directory and cache, `kill -9` at half the
    rows; the files as the kill left them."""
    paths, args = ctx.paths, ctx.args
    if not args.dry_run:  # a fresh output directory and cache (SpecForge caches by path)
        shutil.rmtree(paths.features, ignore_errors=True)
        shutil.rmtree(paths.specforge / "cache", ignore_errors=True)
        shutil.rmtree(paths.specforge / "scripts" / "cache", ignore_errors=True)
        (paths.logs / f"{step.name}.log").unlink(missing_ok=True)
    run = run_and_kill(ctx, [specforge_capture(ctx, step.name)], SpecforgeWatch(paths.features),
                       args.rows, KillPlan(fraction=args.kill_at))  # fmt: skip
    if args.dry_run:
        return {}
    at_kill = specforge_snapshot(paths.features)
    complete = [n for n, f in at_kill.items() if f["complete"]]
    return {
        **run,
        "snapshot": at_kill,
        "rate": steady_rate(specforge_completions(at_kill, complete, args.row_tokens)),
        "first_file_s": first_after(at_kill, complete, run["started_at"]),
        "complete_at_kill": len(complete),
    }


def first_after(snapshot: dict, names, started_at: float) -> float | None:
    times = [snapshot[n]["mtime_ns"] / 1e9 for n in names]
    return round(min(times) - started_at, 2) if times else None


def step_specforge_resume(ctx: Context, step: Step) -> dict:
    """The same command again, run to its end: what it kept and redid, and the result."""
    paths, args = ctx.paths, ctx.args
    if not args.dry_run:
        (paths.logs / f"{step.name}.log").unlink(missing_ok=True)
    command = specforge_capture(ctx, step.name)
    began, wall_began = time.monotonic(), time.time()
    (code,) = run_commands(ctx, [command])
    if args.dry_run:
        return {}
    if code != 0:
        raise StepFailed(f"{step.name}: exit {code}:\n{tail(command.log_path)}", code)
    at_kill = ctx.state["steps"]["specforge-kill"]["result"]["snapshot"]
    after = specforge_snapshot(paths.features)
    report = specforge_resume_report(at_kill, after, args.rows)
    written = [n for n in after if n not in at_kill or not _same(at_kill[n], after[n])]
    files = [paths.features / n for n in after]
    return {
        "wall_s": round(time.monotonic() - began, 1),
        "rate": steady_rate(specforge_completions(after, written, args.row_tokens)),
        "first_file_s": first_after(after, written, wall_began),
        "accounting": report,
        "feature_bytes": sum(p.stat().st_size for p in files),
        "dir_bytes": sum(p.stat().st_size for p in paths.features.rglob("*") if p.is_file()),
        "snapshot_after": after,
    }


def pipeline_config_for(ctx: Context, model_dir: Path, run_dir: Path, dataset: Path) -> dict:
    """bench_sglang_extraction.py's server and extraction settings (the flags that ran on the
    H200), with --shards shards and --chunk-mb chunks."""
    from argparse import Namespace

    import numpy as np
    from bench_sglang_extraction import pipeline_config

    from eaglepipe.core.config import validate_config

    args = ctx.args
    rows = [np.zeros(args.row_tokens, dtype=np.int32)] * args.rows
    settings = Namespace(
        shard_tokens=None, shard_gb=2.5, tiny=False, engine="sglang",
        mem_fraction_static=args.mem_fraction_static, health_s=300.0, chunk_mb=args.chunk_mb,
        inflight_requests=args.inflight_requests,
    )  # fmt: skip
    config = pipeline_config(run_dir, model_dir, dataset, rows, settings, shape())
    config["shards"]["rows_per_shard"] = math.ceil(args.rows / args.shards)
    config["aux_layer_ids"] = list(ctx.state.get("aux_layer_ids") or default_aux_ids())
    return validate_config(config)


def extract_command(ctx: Context, config_path: Path, shard: str, name: str) -> Command:
    argv = [sys.executable, "-u", str(REPO_ROOT / "scripts" / "extract.py"),
            "--config", str(config_path), "--shard", shard]  # fmt: skip
    return Command(f"{name}:{shard}", argv, ctx.paths.logs / f"{name}-{shard}.log",
                   cwd=ctx.paths.run)  # fmt: skip


def step_pipeline(ctx: Context, step: Step) -> dict:
    """The pipeline's capture server started once; every shard's extract job at once, `kill
    -9` at half the rows; the same jobs again for the shards without a manifest; the shards
    checked as the validate stage checks them; the server stopped."""
    if ctx.args.dry_run:
        return pipeline_dry_run(ctx, step)
    from eaglepipe.core.config import write_resolved
    from eaglepipe.core.run import resolve
    from eaglepipe.plan.provenance import shards
    from eaglepipe.server.lifecycle import start_server, stop_server

    paths, args = ctx.paths, ctx.args
    shutil.rmtree(paths.hidden_states, ignore_errors=True)
    for old in paths.logs.glob("pipeline-*.log"):
        old.unlink()
    config = pipeline_config_for(ctx, paths.model, paths.run, paths.run / "conversations.jsonl")
    resolved = write_resolved(config, paths.run / ".eaglepipe" / "config.json")
    result: dict = {}
    with working_directory(paths.run):
        names = shards(resolve(config))
        shard_dirs = [paths.hidden_states / n for n in names]
        began = time.monotonic()
        handle = start_server(resolve(config))
        try:
            result["server_start_s"] = round(time.monotonic() - began, 1)
            result["engine_version"] = handle.info.get("engine_version")
            commands = [extract_command(ctx, resolved, n, "pipeline-kill") for n in names]
            kill = run_and_kill(ctx, commands, PipelineWatch(shard_dirs), args.rows,
                                KillPlan(fraction=args.kill_at))  # fmt: skip
            at_kill = {n: shard_snapshot(d) for n, d in zip(names, shard_dirs, strict=True)}
            todo = [n for n in names if not at_kill[n]["manifest"]]
            began, wall_began = time.monotonic(), time.time()
            commands = [extract_command(ctx, resolved, n, "pipeline-resume") for n in todo]
            codes = run_commands(ctx, commands)
            wall = round(time.monotonic() - began, 1)
            if any(codes):
                tails = "\n".join(tail(c.log_path, 15) for c in commands)
                raise StepFailed(f"{step.name}: the rerun's jobs exited {codes}:\n{tails}")
            handoff = Path(config["server"]["dump_root"])
            leftovers = sum(1 for p in handoff.rglob("*") if p.is_file())
        finally:
            stop_server()
            shutil.rmtree(config["server"]["dump_root"], ignore_errors=True)
    after = {n: shard_snapshot(d) for n, d in zip(names, shard_dirs, strict=True)}
    manifests = {n: json.loads((d / "manifest.json").read_text())
                 for n, d in zip(names, shard_dirs, strict=True)}  # fmt: skip
    killed, resumed = pipeline_completions(at_kill, after, manifests)
    first = min((t for t, _ in resumed), default=None)
    return {
        **result,
        "shards": names,
        "kill": {
            **kill,
            "rate": steady_rate(killed),
            "journal_at_kill": {n: len(s["journal"]) for n, s in at_kill.items()},
            "tmp_at_kill": {n: s["tmp"] for n, s in at_kill.items()},
        },  # fmt: skip
        "resume": {
            "wall_s": wall,
            "rate": steady_rate(resumed),
            "first_chunk_s": None if first is None else round(first - wall_began, 2),
        },
        "accounting": pipeline_resume_report(at_kill, after, manifests),
        "verify": verify_shards(shard_dirs, {r: args.row_tokens for r in range(args.rows)}),
        "handoff_files_left": leftovers,
    }


def pipeline_dry_run(ctx: Context, step: Step) -> dict:
    """The server's command and the jobs' commands, built on a stand-in of the target (its
    config.json) and of the run in a temporary folder; shown with the real paths."""
    import tempfile

    import numpy as np
    from common import write_prepared
    from transformers import LlamaConfig

    from eaglepipe.core.config import write_resolved
    from eaglepipe.core.run import resolve
    from eaglepipe.plan.provenance import shards
    from eaglepipe.server.sglang import launch_command, supported_range

    paths, args = ctx.paths, ctx.args
    s = shape()
    with tempfile.TemporaryDirectory(prefix="eaglepipe-scale-dry-") as tmp:
        model, run = Path(tmp) / "model", Path(tmp) / "run"
        LlamaConfig(
            vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["intermediate"],
            num_hidden_layers=s["layers"], num_attention_heads=s["heads"],
            num_key_value_heads=s["kv_heads"], max_position_embeddings=s["max_pos"],
            architectures=["LlamaForCausalLM"],
        ).save_pretrained(model)  # fmt: skip
        run.mkdir()
        dataset = write_prepared(run, [np.zeros(args.row_tokens, dtype=np.int32)] * args.rows)
        config = pipeline_config_for(ctx, model, run, dataset)
        try:
            resolved = write_resolved(config, run / ".eaglepipe" / "config.json")
            with working_directory(run):
                names = shards(resolve(config))
            argv, env = launch_command(
                resolve(config), host="127.0.0.1", port=config["server"]["port"],
                dump_dir=Path(config["server"]["dump_root"]) / "dry-run", instance_id="dry-run",
                sglang_version=supported_range().recommended,
            )  # fmt: skip
        finally:
            shutil.rmtree(config["server"]["dump_root"], ignore_errors=True)
        real = {str(model.resolve()): str(paths.model), str(run): str(paths.run),
                str(resolved): str(paths.run / ".eaglepipe" / "config.json")}  # fmt: skip

        def relocate(argv: list[str]) -> list[str]:
            out = []
            for arg in argv:
                for old, new in sorted(real.items(), key=lambda kv: -len(kv[0])):
                    arg = arg.replace(old, new)
                out.append(arg)
            return out

        env = {k: v for k, v in env.items() if k != "PYTHONPATH"}
        show(ctx, Command(f"{step.name}:server", relocate(argv), paths.logs / "server.log",
                          cwd=paths.run, env=env))  # fmt: skip
        for name in ("pipeline-kill", "pipeline-resume"):
            commands = [extract_command(ctx, paths.run / ".eaglepipe" / "config.json", n, name)
                        for n in names]  # fmt: skip
            if name == "pipeline-kill":
                run_and_kill(ctx, commands, None, args.rows, KillPlan(fraction=args.kill_at))
            else:
                run_commands(ctx, commands)
    note(ctx, step.name, "the shards checked (integrity, every row once), the server stopped")
    return {}


def step_fidelity(ctx: Context, step: Step) -> dict:
    paths = ctx.paths
    note(ctx, step.name, f"{paths.features} against {paths.hidden_states}/*: compare_features")
    if ctx.args.dry_run:
        return {}
    import torch

    config = json.loads(paths.draft_config.read_text())
    shard_dirs = sorted(p.parent for p in paths.hidden_states.glob("*/manifest.json"))
    manifest = json.loads((shard_dirs[0] / "manifest.json").read_text())
    began = time.monotonic()
    result = compare_features(
        paths.features, shard_dirs,
        specforge_aux_ids=config["eagle_config"]["eagle_aux_hidden_state_layer_ids"],
        shard_aux_ids=manifest["aux_layer_ids"],
        device="cuda" if torch.cuda.is_available() else "cpu",
    )  # fmt: skip
    result["seconds"] = round(time.monotonic() - began, 1)
    return result


def run_one(ctx: Context, step: Step, command: Command) -> bool:
    """Run one step's command; False on a dry run (nothing to read), StepFailed on an exit."""
    (code,) = run_commands(ctx, [command])
    if ctx.args.dry_run:
        return False
    if code != 0:
        raise StepFailed(f"{step.name}: exit {code}:\n{tail(command.log_path)}", code)
    return True


def step_train_specforge(ctx: Context, step: Step) -> dict:
    """`specforge train` (its Llama-3.1-8B offline recipe: batch 1, TTT 7) for --specforge-steps
    steps, one log line a step. Feature files the kill left cut short are set aside first
    (renamed *.torn, which SpecForge's reader skips): its loader would fail on them."""
    paths, args = ctx.paths, ctx.args
    set_aside = []
    if not args.dry_run:
        for path in sorted(paths.features.glob(SPECFORGE_FILES)):
            if path.suffix == ".ckpt" and not specforge_file_complete(path):
                path.rename(path.with_name(path.name + ".torn"))
                set_aside.append(path.name)
    args.epochs = max(1, math.ceil(args.specforge_steps / args.rows))
    command = training_command(ctx, step)
    command.argv += [f"training.max_steps={args.specforge_steps}", "training.log_interval=1"]
    began = time.monotonic()
    if not run_one(ctx, step, command):
        return {}
    steps = specforge_step_times(command.log_path)
    rate = training_rate([s for _, s in steps], [args.row_tokens] * len(steps), args.warmup_steps)
    shutil.rmtree(paths.specforge / step.tag / "run", ignore_errors=True)  # its checkpoint
    return {"wall_s": round(time.monotonic() - began, 1), "steps": len(steps),
            "tokens_per_step": args.row_tokens, "batch_rows": 1, "set_aside": set_aside,
            **rate}  # fmt: skip


def step_train_eaglepipe(ctx: Context, step: Step) -> dict:
    """benchmarks/bench_train.py (the 8B shape's batch of 16,384 tokens, TTT 7) on the
    pipeline's shards of the same rows, --eaglepipe-steps steps."""
    paths, args = ctx.paths, ctx.args
    out = paths.work / "train-eaglepipe.json"
    argv = [sys.executable, "-u", str(REPO_ROOT / "benchmarks" / "bench_train.py"),
            "--run-dir", str(paths.run), "--model-dir", str(paths.model),
            "--steps", str(args.eaglepipe_steps), "--warmup-steps", str(args.warmup_steps),
            "--work-dir", str(paths.work / "train-eaglepipe"), "--out", str(out)]  # fmt: skip
    command = Command(step.name, argv, paths.logs / f"{step.name}.log")
    began = time.monotonic()
    if not run_one(ctx, step, command):
        return {}
    return {"wall_s": round(time.monotonic() - began, 1), **json.loads(out.read_text())}


# Usual lengths on the H200 (estimates from the 2026-12-01..03 runs: a 45 s model build, 57-87 s
# per SGLang start, ~60 s for SpecForge's generator to start on the toy; 0.83 s a training step
# of 16,384 tokens on the 8B shape): a step starts only when the time left covers it, and only
# once the steps it needs are done.
STEPS = (
    # name, runner, usual seconds, the steps it needs
    ("model", step_model, 60, ()),
    ("inputs", step_inputs, 25, ("model",)),
    ("specforge-kill", step_specforge_kill, 90, ("inputs",)),
    ("specforge-resume", step_specforge_resume, 90, ("specforge-kill",)),
    ("pipeline", step_pipeline, 120, ("inputs",)),
    ("fidelity", step_fidelity, 40, ("specforge-resume", "pipeline")),
    ("train-specforge", step_train_specforge, 90, ("specforge-resume",)),
    ("train-eaglepipe", step_train_eaglepipe, 50, ("pipeline",)),
)
RUNNERS = {name: runner for name, runner, _, _ in STEPS}
NEEDS = {name: needs for name, _, _, needs in STEPS}
EXIT_LEFT_FOR_LATER = 3
# What makes the data: a state written with other values is another comparison's.
DATA_SETTINGS = ("rows", "row_tokens", "seed", "shards", "chunk_mb", "draft_vocab", "kill_at")
# Deleted once every step is done (unless --keep-data): the target and both feature sets.
BIG_DATA = ("model", "model.partial", "specforge-files/features", "specforge-files/scale",
            "pipeline-run/hidden_states", "train-eaglepipe")  # fmt: skip


def plan_steps() -> list[Step]:
    return [Step(name, name, "scale", 0, needs_s=needs) for name, _, needs, _ in STEPS]


def status(ctx: Context, name: str) -> str | None:
    return ctx.state["steps"].get(name, {}).get("status")


def run_plan(args) -> int:
    """Every step not done yet, in order, each once the steps it needs are done and the time
    left covers it; the state after each (WORK/state.json) and the results (--out). Exit 0 when
    all are done, 3 when some are left for a later call, 1 when one failed (a later call
    retries it)."""
    paths = ScalePaths(Path(args.work_root).resolve())
    if args.fresh and not args.dry_run:
        shutil.rmtree(paths.work, ignore_errors=True)
    ctx = Context(args, paths, time.monotonic() + args.deadline_s)
    setup = {k: getattr(args, k) for k in DATA_SETTINGS}
    if paths.state.is_file() and not args.dry_run:
        ctx.state = json.loads(paths.state.read_text())
        if ctx.state.get("setup", setup) != setup:
            log(f"{paths.state} holds a comparison of {ctx.state['setup']}, not {setup}: "
                "give the same settings, or --fresh")  # fmt: skip
            return 2
    ctx.state.setdefault("steps", {})
    ctx.state["setup"] = setup
    if not args.dry_run:
        paths.logs.mkdir(parents=True, exist_ok=True)
    code = 0
    for step in plan_steps():
        if status(ctx, step.name) == "done" and not args.dry_run:
            log(f"[{step.name}] done in an earlier call")
            continue
        waiting = [n for n in NEEDS[step.name] if status(ctx, n) != "done"]
        if waiting and not args.dry_run:
            log(f"[{step.name}] not started: it needs {', '.join(waiting)}")
            continue
        if ctx.left() < step.needs_s and not args.dry_run:
            log(f"[{step.name}] not started: {ctx.left():.0f}s left, it needs ~{step.needs_s}s")
            code = max(code, EXIT_LEFT_FOR_LATER)
            continue
        log(f"[{step.name}] start ({ctx.left():.0f}s left)")
        began = time.monotonic()
        try:
            entry = {"status": "done", "result": RUNNERS[step.name](ctx, step)}
        except StepFailed as exc:
            entry = {"status": "timed out" if exc.code == 124 else "failed", "error": str(exc)}
            log(f"[{step.name}] {entry['status']}: {exc}")
        except Exception as exc:  # noqa: BLE001 - recorded; the steps that do not need it go on
            traceback.print_exc()
            entry = {"status": "failed", "error": f"{type(exc).__name__}: {exc}"[:3000]}
            log(f"[{step.name}] failed: {entry['error']}")
        entry.update(seconds=round(time.monotonic() - began, 1),
                     ended_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))  # fmt: skip
        if entry["status"] != "done":
            code = 1 if entry["status"] == "failed" or code == 1 else EXIT_LEFT_FOR_LATER
        if not args.dry_run:
            ctx.state["steps"][step.name] = entry
            write_state(paths, ctx.state)
            write(ctx)
    remaining = [s.name for s in plan_steps() if status(ctx, s.name) != "done"]
    if not args.dry_run and not remaining and not args.keep_data:
        for name in BIG_DATA:
            shutil.rmtree(paths.work / name, ignore_errors=True)
        log(f"every step done: the target and both feature sets removed from {paths.work}")
    write(ctx)
    if not args.dry_run:
        log(f"bench_specforge_scale: exit {code}; left for a later call: {remaining or 'nothing'}")
    return code


def write_state(paths: ScalePaths, state: dict) -> None:
    from eaglepipe.core.atomic import atomic_write_json

    atomic_write_json(paths.state, state)


# ---------------------------------------------------------------- the results


def result_of(ctx: Context, name: str) -> dict:
    entry = ctx.state["steps"].get(name, {})
    return entry.get("result") or {} if entry.get("status") == "done" else {}


def generation_summary(ctx: Context) -> dict:
    """(a) per tool: steady tokens/s over both runs, start-up, bytes stored per token, and
    what the kill and the rerun left."""
    args = ctx.args
    tokens = args.rows * args.row_tokens
    kill, resume = result_of(ctx, "specforge-kill"), result_of(ctx, "specforge-resume")
    specforge = {}
    if kill:
        specforge["kill_run"] = {k: kill.get(k) for k in (
            "killed_after_s", "rows_stored_at_kill", "complete_at_kill",
            "write_in_flight_at_kill", "first_file_s", "rate")}  # fmt: skip
    if resume:
        accounting = resume["accounting"]
        specforge.update(
            rerun={k: resume.get(k) for k in ("wall_s", "first_file_s", "rate")},
            tokens_per_s=combined_rate([kill.get("rate", {}), resume["rate"]]),
            # what a user waits for, the kill's lost work and both start-ups included
            end_to_end_tokens_per_s=end_to_end(
                tokens, kill.get("killed_after_s"), resume["wall_s"]
            ),  # fmt: skip
            bytes_per_token=round(resume["feature_bytes"] / tokens, 1),
            dir_bytes_per_token=round(resume["dir_bytes"] / tokens, 1),
            after_kill_and_rerun=accounting,
        )
    pipeline = result_of(ctx, "pipeline")
    eaglepipe = {}
    if pipeline:
        verify = pipeline["verify"]
        eaglepipe = {
            "server_start_s": pipeline["server_start_s"],
            "engine_version": pipeline.get("engine_version"),
            "kill_run": {
                k: pipeline["kill"].get(k)
                for k in (
                    "killed_after_s",
                    "rows_stored_at_kill",
                    "write_in_flight_at_kill",
                    "rate",
                    "journal_at_kill",
                    "tmp_at_kill",
                )
            },  # fmt: skip
            "rerun": pipeline["resume"],
            "tokens_per_s": combined_rate([pipeline["kill"]["rate"], pipeline["resume"]["rate"]]),
            "end_to_end_tokens_per_s": end_to_end(
                tokens,
                pipeline["server_start_s"],
                pipeline["kill"].get("killed_after_s"),
                pipeline["resume"]["wall_s"],
            ),
            "bytes_per_token": round(verify["chunk_bytes"] / tokens, 1),
            "dir_bytes_per_token": round(verify["dir_bytes"] / tokens, 1),
            "after_kill_and_rerun": pipeline["accounting"],
            "verify": verify,
            "handoff_files_left": pipeline.get("handoff_files_left"),
        }
    return {"rows": args.rows, "tokens": tokens, "specforge": specforge, "eaglepipe": eaglepipe}


def end_to_end(tokens: int, *seconds) -> float | None:
    """Tokens over the whole wall time of the runs (start-ups, the killed run, the rerun)."""
    if any(s is None for s in seconds) or not sum(seconds):
        return None
    return round(tokens / sum(seconds), 1)


def training_summary(ctx: Context) -> dict:
    keys = ("tokens_per_s", "timed_steps", "timed_tokens", "median_step_s", "wall_s", "steps")
    out = {}
    theirs = result_of(ctx, "train-specforge")
    if theirs:
        out["specforge"] = {k: theirs.get(k) for k in keys} | {
            "batch": f"1 row ({theirs['tokens_per_step']} tokens)",
            "set_aside": theirs.get("set_aside"),
        }
    ours = result_of(ctx, "train-eaglepipe")
    if ours:
        out["eaglepipe"] = {k: ours.get(k) for k in keys} | {
            "batch": f"{ours['batch_tokens']} tokens",
            "peak_gpu_memory_gib": ours.get("peak_gpu_memory_gib"),
            "data_wait_fraction": ours.get("data_wait_fraction"),
        }
    if len(out) == 2 and out["specforge"]["tokens_per_s"] and out["eaglepipe"]["tokens_per_s"]:
        out["eaglepipe_over_specforge"] = round(
            out["eaglepipe"]["tokens_per_s"] / out["specforge"]["tokens_per_s"], 3
        )
    return out


WHAT_WAS_COMPARED = (
    "aux: SpecForge's aux_hidden_state [1, T, 3H] (SGLang's aux_hidden_states captured at "
    "layers_to_capture = id + 1: the output of decoder layer id, in id order) block by block "
    "against eaglepipe's aux_hidden_states [T, 3H] (the same SGLang tensors through the "
    "logits-processor hook; aux id k = output of decoder layer k); final: SpecForge's "
    "hidden_state (the logits processor's hidden_states, after model.norm: post-norm) against "
    "eaglepipe's final_hidden_states (post-norm). Rows matched by their input ids. The random "
    "target's norm weights are ones, so pre- and post-norm states differ only in scale: the "
    "cosine cannot tell them apart, max |diff| and the per-token RMS (about 1 post-norm) can."
)


def write(ctx: Context) -> None:
    from common import command_line, write_results

    args = ctx.args
    results = {
        "benchmark": "specforge_scale",
        "command": command_line(),
        "setup": {
            **ctx.state.get("setup", {}),
            "shape": "8b (Llama-3.1-8B: hidden 4096, 32 layers, 32/8 heads, vocab 128256), bf16",
            "aux_layer_ids": ctx.state.get("aux_layer_ids")
            or result_of(ctx, "inputs").get("aux_layer_ids"),
            "specforge_capture_batch": 1,
            "specforge_steps": args.specforge_steps,
            "eaglepipe_steps": args.eaglepipe_steps,
            "warmup_steps": args.warmup_steps,
            "work": str(ctx.paths.work),
            "dry_run": args.dry_run,
        },
        "steps": {  # in the plan's order
            step.name: {k: v for k, v in ctx.state["steps"][step.name].items() if k != "result"}
            for step in plan_steps()
            if step.name in ctx.state.get("steps", {})
        },
        "generation": generation_summary(ctx),
        "fidelity": {
            "what_was_compared": WHAT_WAS_COMPARED,
            **{k: v for k, v in result_of(ctx, "fidelity").items()},
        },
        "training": training_summary(ctx),
        "remaining": [s.name for s in plan_steps() if status(ctx, s.name) != "done"],
    }
    if args.dry_run:
        results["commands"] = ctx.dry
    write_results(args.out, results, markdown(results))


def na(cell):
    """A cell of the results table: n/a for a figure not measured (yet)."""
    if cell is None:
        return "n/a"
    return cell.replace("None", "n/a") if isinstance(cell, str) else cell


def _rate(entry: dict, *keys):
    for key in keys:
        entry = (entry or {}).get(key)
    return entry


def markdown(results: dict) -> str:
    from common import markdown_table

    gen = results["generation"]
    sf, ep = gen["specforge"], gen["eaglepipe"]
    sfa, epa = sf.get("after_kill_and_rerun", {}), ep.get("after_kill_and_rerun", {})
    rows = [
        ["tokens/s (steady: file mtimes, both runs)", sf.get("tokens_per_s"),
         ep.get("tokens_per_s")],
        ["tokens/s end to end (start-ups, killed run, rerun)",
         sf.get("end_to_end_tokens_per_s"), ep.get("end_to_end_tokens_per_s")],
        ["tokens/s, killed run / rerun", f"{_rate(sf, 'kill_run', 'rate', 'tokens_per_s')} / "
         f"{_rate(sf, 'rerun', 'rate', 'tokens_per_s')}",
         f"{_rate(ep, 'kill_run', 'rate', 'tokens_per_s')} / "
         f"{_rate(ep, 'rerun', 'rate', 'tokens_per_s')}"],
        ["start to first file (s), killed run / rerun",
         f"{_rate(sf, 'kill_run', 'first_file_s')} / {_rate(sf, 'rerun', 'first_file_s')}",
         f"server start {ep.get('server_start_s')}; rerun {_rate(ep, 'rerun', 'first_chunk_s')}"],
        ["rerun wall s", _rate(sf, "rerun", "wall_s"), _rate(ep, "rerun", "wall_s")],
        ["bytes stored per token (files / whole dir)",
         f"{sf.get('bytes_per_token')} / {sf.get('dir_bytes_per_token')}",
         f"{ep.get('bytes_per_token')} / {ep.get('dir_bytes_per_token')}"],
        ["rows stored at the kill (files present / complete; journalled)",
         f"{_rate(sf, 'kill_run', 'rows_stored_at_kill')} / "
         f"{_rate(sf, 'kill_run', 'complete_at_kill')}",
         _rate(ep, "kill_run", "rows_stored_at_kill")],
        ["cut short at the kill", f"{sfa.get('torn_at_kill')} file(s)",
         f"{epa.get('tmp_at_kill')} temp chunk(s), {epa.get('unjournalled_at_kill')} unjournalled"],
        ["rerun kept / redid", f"{sfa.get('kept')} files / {sfa.get('new')} new, "
         f"{sfa.get('rewritten')} rewritten",
         f"{epa.get('chunks_kept')} chunks ({epa.get('rows_kept')} rows) / "
         f"{epa.get('chunks_written')} chunks ({epa.get('rows_redone')} rows)"],
        ["cut-short file taken as done", sfa.get("torn_taken_as_done"),
         f"0 by design; temp files left {epa.get('tmp_after')}"],
        ["result whole and right", sfa.get("complete"), _rate(ep, "verify", "ok")],
    ]  # fmt: skip
    text = (f"# SpecForge 0.2.0 vs eaglepipe on the 8B shape (issue 27)\n\n"
            f"{gen['rows']} rows x {results['setup'].get('row_tokens')} tokens "
            f"({gen['tokens']:,} tokens), aux layers {results['setup'].get('aux_layer_ids')}\n\n"
            "## (a) hidden-state generation, kill -9 half-way\n\n")  # fmt: skip
    rows = [[na(cell) for cell in row] for row in rows]
    text += markdown_table(["", "SpecForge prepare_hidden_states.py", "eaglepipe extract"], rows)
    fid = results["fidelity"]
    text += "\n## (c) the two feature sets\n\n"
    if fid.get("blocks"):
        keys = ("max_abs_diff", "min_cos", "mean_cos", "rms_ours", "rms_specforge")
        every = {**fid["blocks"], **fid["shifted"]}
        table = [[name, *(s[k] for k in keys)] for name, s in every.items()]
        text += markdown_table(
            ["block", "max abs diff", "min cos", "mean cos", "RMS eaglepipe", "RMS SpecForge"],
            table,
        )
        text += (f"\nRows compared: {fid['rows_compared']} of {fid['shard_rows']}; loss masks "
                 f"equal: {fid['loss_mask_equal']}. **Verdict: {fid['verdict']}**\n")  # fmt: skip
    text += f"\n{fid['what_was_compared']}\n"
    train = results["training"]
    text += "\n## (b) training tokens/s (TTT 7, draft vocab 32,000)\n\n"
    text += markdown_table(
        ["trainer", "batch", "timed steps", "tokens/s", "median step s", "wall s"],
        [[name, t.get("batch"), t.get("timed_steps"), t.get("tokens_per_s"),
          t.get("median_step_s"), t.get("wall_s")]
         for name, t in train.items() if isinstance(t, dict)],
    )  # fmt: skip
    text += "\n" + markdown_table(
        ["step", "status", "seconds"],
        [[n, s.get("status"), s.get("seconds")] for n, s in results["steps"].items()],
    )
    return text + f"\nCommand: `{results['command']}`\n"
