"""Held-out, teacher-forced evaluation of a drafter.

On rows with split == eval (the first `evaluate.max_rows` by row id), the TTT unroll is run
exactly as in training (loss.py has the alignment). For step i at base position t, with
q = t+1+i, a position counts when loss_mask[q] is set and q is inside the row (unlike
training, tokens outside the draft vocabulary count, as misses). Reported per step:

- accuracy: drafter's greedy token == target's greedy token;
- conditional accuracy: the same among positions whose steps 0..i-1 were all right;
- simulated acceptance length of greedy chain drafting of `ttt_length` tokens: per base
  position with step 0 counted, the number of leading right steps (a chain stops at the first
  miss or uncounted step), plus one for the target's own token; then the mean.
"""

from __future__ import annotations

import os

import torch

from ..core.atomic import atomic_write_bytes, atomic_write_json
from ..core.errors import PipelineError
from ..core.run import RunSpec
from .chunks import list_chunks, require_intact
from .data import BatchStream, index_rows, plan_batches, split_row_ids
from .loss import step_targets, target_distribution
from .model import Eagle3Drafter, load_drafter
from .target_head import load_target_head
from .train import resolve_device, to_device
from .vocab import DraftVocab, load_vocab


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
) -> dict:
    model = model.to(device).eval()
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
    finally:
        stream.close()
    if chains == 0:
        raise PipelineError(
            "no held-out position to evaluate: eval rows have no loss-masked tokens"
        )

    def ratio(a, b):
        return [float(x / y) if y else None for x, y in zip(a.tolist(), b.tolist(), strict=True)]

    return {
        "rows": len(rows),
        "positions": chains,
        "ttt_length": ttt_length,
        "accuracy": ratio(correct, counted),
        "conditional_accuracy": ratio(chain_correct, chain_counted),
        "counted": [int(x) for x in counted.tolist()],
        "acceptance_length": 1.0 + accepted_sum / chains,
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
        f"held-out drafter accuracy ({result['rows']} rows); "
        f"simulated acceptance length {result['acceptance_length']:.2f}"
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
    result = evaluate_model(
        model,
        vocab,
        head.lm_head,
        rows,
        ttt_length=tc.ttt_length,
        batch_tokens=tc.batch_tokens,
        max_len=tc.max_len,
        device=device,
    )
    atomic_write_json(out_path, result)
    if plot_path:
        plot_eval(result, plot_path)
    print(
        f"step accuracy {[round(a or 0, 3) for a in result['accuracy']]}, "
        f"simulated acceptance length {result['acceptance_length']:.3f}",
        flush=True,
    )
    return result
