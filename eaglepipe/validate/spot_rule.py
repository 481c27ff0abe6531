"""The spot check's rule (docs/SPOT_CHECK.md): a stored layer, over all spot tokens at once, must
lie within `noise_margin` x the bf16 noise floor of its recomputation and within
`neighbour_fraction` x the distance to the nearest neighbouring layer; for validation and for
the GPU fidelity scripts alike."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from ..core.hidden_store import FP8_REL_L2
from ..core.layers import hf_hidden_state_index
from .checks import LAYER_NAMES

#
# The rule (docs/SPOT_CHECK.md). Per captured layer, pooled over every spot-check token, the
# relative L2 error of the stored tensor against a recomputation of the same tokens must be
#   noise:      at most `validate.noise_margin` times the bf16 noise floor of those tokens (how
#               far transformers' own bf16 forward lands from its fp32 forward), and
#   neighbour:  at most `validate.neighbour_fraction` times the distance from the recomputed
#               layer to its nearest neighbouring layer (a wrong layer is at least that far off).
# Whole tensors, not per-token percentiles: bf16 noise flips some tokens' MoE expert choice, so
# correct data has per-token tails of 0.2-0.3 on MoE targets, while a layer shifted by one is off
# by the neighbour distance (0.3-1.0 on the H200 runs) over the whole tensor.

DEFAULT_NOISE_MARGIN = 3.0
DEFAULT_NEIGHBOUR_FRACTION = 0.5


def fp8_floor(floor: float, roundings: int) -> float:
    """The noise floor of a layer compared after `roundings` e4m3 roundings (the stored one,
    and a re-extraction's own): each adds an independent error of relative L2 `FP8_REL_L2`
    (2^-3 / sqrt(12 E[m^2]), about 0.0245: core/hidden_store.py), so the variances add."""
    return math.sqrt(floor**2 + roundings * FP8_REL_L2**2)


def rel_l2(values: torch.Tensor, reference: torch.Tensor) -> float:
    """Whole-tensor relative L2 distance ||values - reference|| / ||reference|| (float64, on
    the reference's device)."""
    values, reference = values.to(reference.device).double(), reference.double()
    norm = torch.linalg.vector_norm(reference).item()
    return torch.linalg.vector_norm(values - reference).item() / max(norm, 1e-300)


def token_rel_l2(values: torch.Tensor, reference: torch.Tensor) -> np.ndarray:
    """Per-token (last dimension) relative L2 distance: the MoE routing-flip tails show here."""
    values, reference = values.to(reference.device).double(), reference.double()
    diff = torch.linalg.vector_norm(values - reference, dim=-1)
    return (diff / torch.linalg.vector_norm(reference, dim=-1).clamp_min(1e-300)).cpu().numpy()


@dataclass(frozen=True)
class SpotVerdict:
    """One captured layer judged against a recomputation of the same tokens (see module notes)."""

    rel_l2: float
    noise_floor: float | None
    noise_bound: float | None
    neighbour_rel_l2: float | None
    neighbour_bound: float | None
    tokens: int
    token_rel_l2_p99: float
    token_rel_l2_max: float
    worst_token: int

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        """Each bound the layer breaks, as a phrase naming the bound and its parts."""
        broken = []
        if self.noise_bound is not None and self.rel_l2 > self.noise_bound:
            broken.append(
                f"above the noise bound {self.noise_bound:.4g} "
                f"(noise margin x bf16 floor {self.noise_floor:.4g})"
            )
        if self.neighbour_bound is not None and self.rel_l2 > self.neighbour_bound:
            broken.append(
                f"above the neighbour bound {self.neighbour_bound:.4g} "
                f"(neighbour fraction x distance {self.neighbour_rel_l2:.4g} to the nearest "
                "neighbouring layer)"
            )
        return broken

    def as_dict(self) -> dict:
        return {
            "ok": self.ok,
            "rel_l2": self.rel_l2,
            "noise_floor": self.noise_floor,
            "noise_bound": self.noise_bound,
            "neighbour_rel_l2": self.neighbour_rel_l2,
            "neighbour_bound": self.neighbour_bound,
            "tokens": self.tokens,
            "rel_l2_p99": self.token_rel_l2_p99,
            "rel_l2_max": self.token_rel_l2_max,
            "worst_token": self.worst_token,
        }


def spot_check_verdict(
    stored: torch.Tensor,
    reference: torch.Tensor,
    neighbours: Sequence[torch.Tensor] = (),
    floor: float | None = None,
    *,
    noise_margin: float = DEFAULT_NOISE_MARGIN,
    neighbour_fraction: float = DEFAULT_NEIGHBOUR_FRACTION,
) -> SpotVerdict:
    """Judge `stored` ([T, H], the dumped layer) against `reference` (the same tokens recomputed).

    `neighbours`: the recomputation's adjacent layers of the same tokens; `floor`: the bf16 noise
    floor of these tokens, e.g. `rel_l2(bf16_forward_layer, fp32_forward_layer)`. Each given one
    adds its bound; at least one is needed. For GPU fidelity scripts as much as for validation:
    tensors may live on any device (the distances are taken on the reference's).
    """
    if floor is None and not neighbours:
        raise ValueError("spot_check_verdict needs a noise floor, neighbouring layers, or both")
    if stored.shape != reference.shape:
        raise ValueError(f"stored {list(stored.shape)} and reference {list(reference.shape)}")
    per_token = token_rel_l2(stored, reference)
    distances = [rel_l2(n, reference) for n in neighbours]
    nearest = min(distances) if distances else None
    return SpotVerdict(
        rel_l2=rel_l2(stored, reference),
        noise_floor=floor,
        noise_bound=None if floor is None else noise_margin * floor,
        neighbour_rel_l2=nearest,
        neighbour_bound=None if nearest is None else neighbour_fraction * nearest,
        tokens=len(per_token),
        token_rel_l2_p99=float(np.percentile(per_token, 99)) if len(per_token) else 0.0,
        token_rel_l2_max=float(per_token.max()) if len(per_token) else 0.0,
        worst_token=int(per_token.argmax()) if len(per_token) else 0,
    )


@dataclass
class LayerReference:
    """A recomputation of one captured layer over the spot-check tokens, and its yardsticks."""

    values: torch.Tensor  # [T, H]
    neighbours: list[torch.Tensor]  # the same computation's adjacent layers, [T, H] each
    floor: float | None  # bf16 noise floor of these tokens
    floor_source: str


def _flat(tensor: torch.Tensor) -> torch.Tensor:
    """[T, H] from [T, H] or an unpadded [B, T, H] (tokens of all rows in order), float32."""
    return tensor.reshape(-1, tensor.shape[-1]).float()


def hf_layer_references(
    fp32_states, bf16_states, aux_layer_ids: list[int], num_layers: int | None = None
) -> dict[str, LayerReference]:
    """References for the four captured slots from transformers' `output_hidden_states`.

    `fp32_states` / `bf16_states`: the same tokens through an fp32 and a bf16 forward, indexed
    like `hidden_states` (0 = embeddings, k + 1 = output of decoder layer k, `num_layers` =
    post-norm final); a tuple or a dict holding at least the indices used. Aux id k is judged
    against index k + 1 with neighbours k and k + 2 (pre-norm states only); the final state
    against index L with neighbour L - 1 (the previous layer's output). The floor of each slot is
    its bf16-vs-fp32 distance.
    """
    last = len(fp32_states) - 1 if num_layers is None else num_layers
    slots = [(hf_hidden_state_index(k), [k, k + 2]) for k in aux_layer_ids] + [(last, [last - 1])]
    references = {}
    for name, (index, around) in zip(LAYER_NAMES, slots, strict=True):
        values = _flat(fp32_states[index])
        neighbours = [_flat(fp32_states[j]) for j in around if 0 <= j < last]
        references[name] = LayerReference(
            values,
            neighbours,
            rel_l2(_flat(bf16_states[index]), values),
            "measured: transformers bf16 forward vs fp32 on the same tokens",
        )
    return references
