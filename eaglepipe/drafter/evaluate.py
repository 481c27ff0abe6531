"""Held-out, teacher-forced evaluation of a drafter.

On rows with split == eval (the first `evaluate.max_rows` by row id), the TTT unroll is run
exactly as in training (loss.py has the alignment). For step i at base position t, with
q = t+1+i, a position counts when loss_mask[q] is set and q is inside the row (unlike
training, tokens outside the draft vocabulary count, as misses).

The headline, `acceptance_length`, is what a decoder gets: every held-out assistant turn walked
in decode order (decode_order.py), chain drafting with top-k 1 at the serving setting the export
recommends (steps = `train.ttt_length`), completion tokens per verification round as SGLang
counts them, pooled over the turns that are whole replies (a regenerated reply that hit
max_new_tokens is reported apart). `decode_order` has it at the published settings (3 and 7
steps) too, per subset, pooled and per-turn. Diagnostics:

- accuracy per step: drafter's greedy token == target's greedy token;
- conditional accuracy: the same among positions whose steps 0..i-1 were all right;
- `per_position_mean_chain`: 1 + the mean number of leading right steps of a chain started at
  every position (chains overlap). It is not what a decoder gets: a decoder advances by a
  whole accepted chain per round, so it overstates acceptance where a few easy stretches hold
  many positions.
"""

from __future__ import annotations

import os

import torch

from ..core.atomic import atomic_write_bytes, atomic_write_json
from ..core.errors import PipelineError
from ..core.run import RunSpec
from ..prepare.table import load_prepared
from .chunks import list_chunks, require_intact
from .data import BatchStream, index_rows, plan_batches, split_row_ids
from .decode_order import PUBLISHED_STEPS, summarize, walk_row
from .loss import step_targets, target_distribution
from .model import Eagle3Drafter, load_drafter
from .target_head import load_target_head
from .train import resolve_device, to_device
from .vocab import DraftVocab, load_vocab

TURN_SUBSETS = {
    "without_length_limited": "the whole replies (turns not cut at max_new_tokens)",
    "all_turns": "every turn (each is a reply cut at max_new_tokens)",
}


@torch.no_grad()
def evaluate_model(
    model: Eagle3Drafter,
    vocab: DraftVocab,
    lm_head: torch.Tensor,
    rows,
    *,
    ttt_length: int,
    batch_tokens: int,
    max_len: int,
    device: torch.device,
    length_limited: dict[int, list[int]] | None = None,
) -> dict:
    """`length_limited`: per row id, the ordinals of its assistant turns that are regenerated
    replies cut at max_new_tokens."""
    model = model.to(device).eval()
    length_limited = length_limited or {}
    chain_steps = sorted({k for k in (*PUBLISHED_STEPS, ttt_length) if k <= ttt_length})
    turns = []
    lm_head = lm_head.to(device=device, dtype=torch.float32)
    draft_ids = vocab.draft_ids.to(device)
    t2d = vocab.t2d.to(device)
    correct = torch.zeros(ttt_length, dtype=torch.float64)
    counted = torch.zeros(ttt_length, dtype=torch.float64)
    chain_correct = torch.zeros(ttt_length, dtype=torch.float64)
    chain_counted = torch.zeros(ttt_length, dtype=torch.float64)
    accepted_sum = 0.0
    chains = 0
    stream = BatchStream(plan_batches(rows, batch_tokens, max_len, seed=0, epoch=0), max_len)
    try:
        for batch in stream:
            batch = to_device(batch, device, torch.float32)
            target = target_distribution(batch["final_hidden_states"], lm_head, draft_ids, t2d)
            steps = [
                step_targets(
                    batch["input_ids"],
                    batch["loss_mask"],
                    batch["lengths"],
                    target,
                    i,
                    require_in_vocab=False,
                )
                for i in range(ttt_length)
            ]
            all_logits = model(batch["aux_hidden_states"], [s.input_ids for s in steps])
            alive = steps[0].mask.clone()  # chains still unbroken at this step
            accepted = torch.zeros_like(alive, dtype=torch.float64)
            for i, (s, logits) in enumerate(zip(steps, all_logits, strict=True)):
                right = (draft_ids[logits.argmax(-1)] == s.argmax) & s.mask
                correct[i] += right.sum().item()
                counted[i] += s.mask.sum().item()
                chain_counted[i] += (alive & s.mask).sum().item()
                alive = alive & right
                chain_correct[i] += alive.sum().item()
                accepted += alive.double()
            accepted_sum += accepted[steps[0].mask].sum().item()
            chains += int(steps[0].mask.sum())
            lead = accepted.long().cpu()
            masks = batch["loss_mask"].cpu()
            for b, (row_id, length) in enumerate(
                zip(batch["row_ids"].tolist(), batch["lengths"].tolist(), strict=True)
            ):
                turns += walk_row(
                    row_id,
                    lead[b, :length].tolist(),
                    masks[b, :length].tolist(),
                    chain_steps,
                    length_limited.get(row_id, ()),
                )
    finally:
        stream.close()
    if chains == 0:
        raise PipelineError(
            "no held-out position to evaluate: eval rows have no loss-masked tokens"
        )

    def ratio(a, b):
        return [float(x / y) if y else None for x, y in zip(a.tolist(), b.tolist(), strict=True)]

    decode_order = summarize(turns, chain_steps)
    headline = decode_order[str(ttt_length)]
    chosen = "without_length_limited"
    if headline[chosen]["acceptance_length"] is None:
        chosen = "all_turns"  # every turn is length-limited: nothing else to report
    return {
        "rows": len(rows),
        "positions": chains,
        "ttt_length": ttt_length,
        "acceptance_length": headline[chosen]["acceptance_length"],
        "acceptance_length_definition": (
            f"decode order, chains of {ttt_length} drafts (top-k 1), completion tokens per "
            f"verification round, pooled over {TURN_SUBSETS[chosen]}"
        ),
        "headline_turns": chosen,
        "decode_order": decode_order,
        "per_position_mean_chain": 1.0 + accepted_sum / chains,
        "accuracy": ratio(correct, counted),
        "conditional_accuracy": ratio(chain_correct, chain_counted),
        "counted": [int(x) for x in counted.tolist()],
        "turns": [t.record() for t in turns],
    }


def eval_rows(table_path, manifests, max_rows: int, log=print):
    """The first `max_rows` held-out rows by row id; only their chunks are checked and read."""
    eval_ids = split_row_ids(table_path, "eval")
    chunks, facts = list_chunks(manifests, eval_ids)
    chosen = set(sorted(i for c in chunks for i in c.row_ids if i in eval_ids)[:max_rows])
    if not chosen:
        raise PipelineError(
            "the listed shards hold no rows of the eval split: nothing to evaluate on"
        )
    chunks = [c for c in chunks if not chosen.isdisjoint(c.row_ids)]
    require_intact(chunks, log)
    return sorted(index_rows(chunks, chosen), key=lambda r: r.row_id), facts


def length_limited_turns(table_path, row_ids: set[int]) -> dict[int, list[int]]:
    """Per row, the assistant turns that are regenerated replies cut at max_new_tokens (empty
    for a table written before prepare recorded them)."""
    import pyarrow.parquet as pq

    if "length_limited_turns" not in pq.read_schema(table_path).names:
        return {}
    table = load_prepared(table_path, columns=["row_id", "length_limited_turns"])
    return {
        int(row_id): [int(t) for t in turns]
        for row_id, turns in zip(table["row_id"], table["length_limited_turns"], strict=True)
        if int(row_id) in row_ids and len(turns)
    }


def plot_eval(result: dict, path: str | os.PathLike) -> None:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = list(range(result["ttt_length"]))
    width = 0.4
    fig, ax = plt.subplots(figsize=(7, 4))
    full = [a or 0.0 for a in result["accuracy"]]
    cond = [a or 0.0 for a in result["conditional_accuracy"]]
    ax.bar([s - width / 2 for s in steps], full, width, label="accuracy")
    ax.bar([s + width / 2 for s in steps], cond, width, label="conditional on earlier steps")
    ax.set_xlabel("draft position (TTT step)")
    ax.set_ylabel("agreement with target greedy token")
    ax.set_ylim(0, 1)
    ax.set_xticks(steps)
    ax.set_title(
        f"held-out drafter accuracy ({result['rows']} rows); acceptance length "
        f"{result['acceptance_length']:.2f} in decode order ({result['ttt_length']} steps)"
    )
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=120)
    plt.close(fig)
    atomic_write_bytes(path, buffer.getvalue())


def evaluate(
    run: RunSpec,
    *,
    model_path: str,
    vocab_path: str,
    table_path: str,
    manifests: list[str],
    out_path: str,
    plot_path: str | None,
) -> dict:
    tc, ec = run.train, run.evaluate
    device = resolve_device(tc)
    vocab = load_vocab(vocab_path)
    head = load_target_head(run.model.directory)
    model = load_drafter(model_path)
    with torch.no_grad():
        model.embed_tokens.weight.copy_(head.embed_tokens.float())
    rows, _ = eval_rows(
        table_path, manifests, ec.max_rows, log=lambda line: print(line, flush=True)
    )
    print(f"evaluating {model_path} on {len(rows)} held-out rows", flush=True)
    limited = length_limited_turns(table_path, {r.row_id for r in rows})
    result = evaluate_model(
        model,
        vocab,
        head.lm_head,
        rows,
        ttt_length=tc.ttt_length,
        batch_tokens=tc.batch_tokens,
        max_len=tc.max_len,
        device=device,
        length_limited=limited,
    )
    atomic_write_json(out_path, result)
    if plot_path:
        plot_eval(result, plot_path)
    settings = ", ".join(
        f"{k} steps {v[result['headline_turns']]['acceptance_length']:.3f}"
        for k, v in result["decode_order"].items()
    )
    print(
        f"step accuracy {[round(a or 0, 3) for a in result['accuracy']]}; acceptance length in "
        f"decode order {result['acceptance_length']:.3f} ({settings}; per-position mean chain "
        f"{result['per_position_mean_chain']:.3f}, not what a decoder gets)",
        flush=True,
    )
    return result
