"""Training-time-test targets and loss.

Alignment (our indexing; x = input_ids, h = aux hidden states, f = final hidden states, one
sample of T tokens). The drafter works at base positions t = 0..T-1. At step i, position t:

    consumes   token x[t+1+i] and hidden: fc(h[t]) at step 0, its own step-(i-1) output after
    predicts   the target's next-token distribution at q = t+1+i, softmax(lm_head(f[q])),
               i.e. the distribution of token x[q+1] given x[0..q]
    weighted   by loss_mask[q]: that distribution is one the target produces while it is
               generating the assistant turn (q is an assistant position), and by whether
               argmax(lm_head(f[q])) is in the draft vocab; 0 when q >= T.

So the loss mask is shifted together with the inputs and targets. Using the unshifted
loss_mask[t] instead is the off-by-one of SpecForge #885: it drops the first position of each
assistant turn and keeps one stale position past its end.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def shift_left(x: torch.Tensor, n: int, fill=0) -> torch.Tensor:
    """x[:, n:] padded at the end with `fill` back to length L (x is [B, L, ...])."""
    if n == 0:
        return x
    pad = torch.full_like(x[:, :n], fill)
    return torch.cat([x[:, n:], pad], dim=1)[:, : x.shape[1]]


@dataclass
class TargetDistribution:
    probs: torch.Tensor  # [B, L, Vd] target distribution at q, restricted + renormalised
    argmax: torch.Tensor  # [B, L] target greedy token (target id) at q
    in_draft_vocab: torch.Tensor  # [B, L] bool


@torch.no_grad()
def target_distribution(
    final_hidden: torch.Tensor,
    lm_head: torch.Tensor,
    draft_ids: torch.Tensor,
    t2d: torch.Tensor,
    chunk_tokens: int = 4096,
) -> TargetDistribution:
    """Target next-token distributions over the draft vocab from stored final hidden states.

    The full-vocab argmax is computed chunk by chunk so a 128k-vocab target never holds
    [tokens, V] logits for a whole batch at once.
    """
    b, length, h = final_hidden.shape
    flat = final_hidden.reshape(-1, h)
    head = lm_head.to(flat.dtype)
    draft_head = head[draft_ids]
    probs, argmax = [], []
    for start in range(0, flat.shape[0], chunk_tokens):
        part = flat[start : start + chunk_tokens]
        argmax.append((part @ head.T).argmax(-1))
        probs.append(F.softmax((part @ draft_head.T).float(), dim=-1))
    argmax_t = torch.cat(argmax).view(b, length)
    return TargetDistribution(
        probs=torch.cat(probs).view(b, length, -1),
        argmax=argmax_t,
        in_draft_vocab=t2d[argmax_t],
    )


@dataclass
class StepTargets:
    input_ids: torch.Tensor  # [B, L] token consumed at base t: x[t+1+i]
    probs: torch.Tensor  # [B, L, Vd]
    argmax: torch.Tensor  # [B, L] target id
    mask: torch.Tensor  # [B, L] bool: train/score this position at this step


def step_targets(
    input_ids: torch.Tensor,
    loss_mask: torch.Tensor,
    lengths: torch.Tensor,
    target: TargetDistribution,
    step: int,
    require_in_vocab: bool = True,
) -> StepTargets:
    """Inputs, targets and mask of TTT step `step` (see the module docstring)."""
    shift = step + 1
    length = input_ids.shape[1]
    q = torch.arange(length, device=input_ids.device) + shift
    inside = q[None, :] < lengths[:, None]
    mask = shift_left(loss_mask.bool(), shift, False) & inside
    if require_in_vocab:
        mask = mask & shift_left(target.in_draft_vocab, shift, False)
    return StepTargets(
        input_ids=shift_left(input_ids, shift, 0),
        probs=shift_left(target.probs, shift, 0.0),
        argmax=shift_left(target.argmax, shift, -1),
        mask=mask,
    )


def soft_cross_entropy(logits: torch.Tensor, probs: torch.Tensor, mask: torch.Tensor):
    """Mean over masked positions of -sum_v p(v) log q(v); 0 (with grad) when none is masked."""
    per_position = -(probs * F.log_softmax(logits.float(), dim=-1)).sum(-1)
    weights = mask.float()
    return (per_position * weights).sum() / weights.sum().clamp(min=1.0)


@dataclass
class TTTResult:
    loss: torch.Tensor
    step_losses: list[float]
    correct: list[int]
    counted: list[int]


def ttt_loss(
    model,
    batch: dict,
    lm_head: torch.Tensor,
    draft_ids: torch.Tensor,
    t2d: torch.Tensor,
    ttt_length: int,
    step_weight_decay: float,
) -> TTTResult:
    """Weighted sum over steps of the soft cross-entropy, plus per-step accuracy counts."""
    target = target_distribution(batch["final_hidden_states"], lm_head, draft_ids, t2d)
    steps = [
        step_targets(batch["input_ids"], batch["loss_mask"], batch["lengths"], target, i)
        for i in range(ttt_length)
    ]
    all_logits = model(batch["aux_hidden_states"], [s.input_ids for s in steps])
    total = 0.0
    step_losses, correct, counted = [], [], []
    for i, (s, logits) in enumerate(zip(steps, all_logits, strict=True)):
        loss_i = soft_cross_entropy(logits, s.probs, s.mask)
        total = total + (step_weight_decay**i) * loss_i
        predicted = draft_ids[logits.argmax(-1)]
        step_losses.append(float(loss_i.detach()))
        correct.append(int(((predicted == s.argmax) & s.mask).sum()))
        counted.append(int(s.mask.sum()))
    return TTTResult(loss=total, step_losses=step_losses, correct=correct, counted=counted)
