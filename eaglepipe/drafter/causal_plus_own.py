"""Training-time test attention on the CPU without the dense mask.

At TTT step k every query at position t attends to the step-0 keys 0..t (causal) and, of each
later step 1..k, only the key at its own position t. Through one boolean mask that costs
(k + 1)·L² scores for L²/2 + k·L that count: at the drafter's 7 steps, 95 % of a CPU training
step was this attention. Here the causal part runs through PyTorch's fused CPU flash kernel
(`is_causal`: the blocks above the diagonal are skipped, nothing L x L is stored), and the k
own-position keys are folded in through the logsumexp that kernel returns. The backward pass
reuses the kernel's own backward with the combined output and logsumexp (which is exactly the
causal part's gradient under the combined softmax) and adds the own-position terms, so outputs
and gradients equal the mask path's to float rounding (tests/test_drafter_units.py).
"""

from __future__ import annotations

import torch

_OPS = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
_BACKWARD = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu_backward", None)


def available(q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> bool:
    """Whether the fused path applies: CPU tensors, square causal part (queries = step-0 keys,
    as in training), one head width for queries, keys and values, and the kernel present."""
    return (
        _OPS is not None
        and _BACKWARD is not None
        and q.device.type == "cpu"
        and q.shape[2] == keys.shape[2]
        and q.shape[-1] == keys.shape[-1] == values.shape[-1]
        and q.dtype in (torch.float32, torch.bfloat16)
    )


class CausalPlusOwnAttention(torch.autograd.Function):
    """softmax over [step-0 keys 0..t, own keys of steps 1..k] for each query t.

    q, k0, v0: [B, heads, L, D]; own_k, own_v: [B, heads, k, L, D] (k may be 0)."""

    @staticmethod
    def forward(ctx, q, k0, v0, own_k, own_v, scale: float):
        causal_out, causal_lse = _OPS.default(q, k0, v0, 0.0, True, scale=scale)
        own_scores = (q.unsqueeze(2) * own_k).sum(-1, dtype=torch.float32) * scale
        lse = torch.logsumexp(torch.cat([causal_lse.unsqueeze(2), own_scores], dim=2), dim=2)
        causal_weight = torch.exp(causal_lse - lse).unsqueeze(-1)
        own_weights = torch.exp(own_scores - lse.unsqueeze(2))
        out = causal_weight * causal_out + (own_weights.unsqueeze(-1) * own_v).sum(2)
        out = out.to(q.dtype)
        ctx.save_for_backward(q, k0, v0, own_k, own_v, out, lse, own_weights)
        ctx.scale = scale
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k0, v0, own_k, own_v, out, lse, own_weights = ctx.saved_tensors
        scale = ctx.scale
        grad_out = grad_out.contiguous()
        grad_q, grad_k0, grad_v0 = _BACKWARD.default(
            grad_out, q, k0, v0, out, lse, 0.0, True, scale=scale
        )
        # Softmax backward for the own-position scores: p * (dO·v - dO·O).
        delta = (grad_out * out).sum(-1, dtype=torch.float32).unsqueeze(2)
        grad_scores = own_weights * ((grad_out.unsqueeze(2) * own_v).sum(-1) - delta)
        grad_q = grad_q + scale * (grad_scores.unsqueeze(-1) * own_k).sum(2).to(q.dtype)
        grad_own_k = (scale * grad_scores.unsqueeze(-1) * q.unsqueeze(2)).to(own_k.dtype)
        grad_own_v = (own_weights.unsqueeze(-1) * grad_out.unsqueeze(2)).to(own_v.dtype)
        return grad_q, grad_k0, grad_v0, grad_own_k, grad_own_v, None


def attend(q, kv_cache: list, scale: float) -> torch.Tensor:
    """The attention output [B, heads, L, D] for the last step of `kv_cache` (already repeated
    to the query heads), through the fused causal kernel."""
    (k0, v0), later = kv_cache[0], kv_cache[1:]
    if later:
        own_k = torch.stack([k for k, _ in later], dim=2)
        own_v = torch.stack([v for _, v in later], dim=2)
    else:
        shape = (*q.shape[:2], 0, *q.shape[2:])
        own_k = q.new_zeros(shape)
        own_v = v0.new_zeros((*v0.shape[:2], 0, *v0.shape[2:]))
    return CausalPlusOwnAttention.apply(q, k0, v0, own_k, own_v, scale)
