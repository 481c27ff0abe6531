"""The 8B-shape comparison (scale_steps.py): (c) the two feature sets compared row by row,
and (b) the training rates read from both trainers' logs."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from benchmarks.studies.specforge.scale_kill import SPECFORGE_FILES

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
