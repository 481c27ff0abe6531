"""The spot check's rule (`eaglepipe.validate.spot_check_verdict`, docs/SPOT_CHECK.md) on the
numbers measured live on the H200 (SGLang 0.5.14 dumps against transformers, random Llama and
DeepSeek-V3 shapes), on simulated MoE routing flips, and on the slot layout of transformers'
hidden states. Validation's own use of it runs in tests/test_validate.py."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from eaglepipe.validate import hf_layer_references, rel_l2, spot_check_verdict, token_rel_l2

TOKENS, HIDDEN = 2317, 512  # the H200 Llama run's spot tokens and width

# /work/shared/sglang-h200/README.md, per slot: SGLang dump vs fp32 forward (rel L2, whole
# tensor), transformers' own bf16 vs fp32 (the floor), and the distance to the neighbouring
# layers of the fp32 forward.
H200_LLAMA = {
    "aux 1": (0.0185, 0.0222, (0.997, 0.579)),
    "aux 3": (0.0283, 0.0337, (0.579, 0.448)),
    "aux 4": (0.0327, 0.0389, (0.502, 0.409)),
    "final": (0.0448, 0.0534, (0.947,)),
}
H200_DEEPSEEK = {
    "aux 1": (0.0156, 0.0169, (1.003, 0.383)),
    "aux 3": (0.0312, 0.0317, (0.379, 0.336)),
    "aux 4": (0.0415, 0.0429, (0.357, 0.319)),
    "final": (0.0701, 0.0736, (0.926,)),
}
H200_SLOTS = [
    pytest.param(*values, id=f"{model} {slot}")
    for model, table in (("llama", H200_LLAMA), ("deepseek", H200_DEEPSEEK))
    for slot, values in table.items()
]


def at_distance(reference: torch.Tensor, distance: float, seed: int) -> torch.Tensor:
    """`reference` plus a random direction scaled so rel_l2(result, reference) == distance."""
    noise = torch.randn(reference.shape, generator=torch.Generator().manual_seed(seed))
    scale = distance * torch.linalg.vector_norm(reference) / torch.linalg.vector_norm(noise)
    return reference + noise * scale


def with_flipped_tokens(
    reference: torch.Tensor, distance: float, tokens: list[int], flip: float, seed: int
) -> torch.Tensor:
    """Like `at_distance`, but `tokens` carry a per-token error of `flip` (an MoE routing flip)
    and the rest shares what is left of `distance`."""
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn(reference.shape, generator=generator)
    noise /= torch.linalg.vector_norm(noise, dim=-1, keepdim=True)
    norms = torch.linalg.vector_norm(reference, dim=-1, keepdim=True)
    per_token = torch.zeros(len(reference), 1)
    per_token[tokens] = flip
    flipped = torch.linalg.vector_norm(per_token * norms) ** 2
    rest = (distance * torch.linalg.vector_norm(reference)) ** 2 - flipped
    assert rest > 0, "the flips alone exceed the whole-tensor distance"
    others = [t for t in range(len(reference)) if t not in set(tokens)]
    base = torch.sqrt(rest / (norms[others] ** 2).sum())
    per_token[others] = base
    return reference + noise * norms * per_token


@pytest.fixture(scope="module")
def reference() -> torch.Tensor:
    # Residual-stream-like: token norms vary.
    generator = torch.Generator().manual_seed(0)
    scales = 0.5 + torch.rand(TOKENS, 1, generator=generator) * 3
    return torch.randn(TOKENS, HIDDEN, generator=generator) * scales


@pytest.mark.parametrize(("measured", "floor", "neighbour_distances"), H200_SLOTS)
def test_correct_h200_dumps_pass(reference, measured, floor, neighbour_distances):
    stored = at_distance(reference, measured, seed=1)
    neighbours = [at_distance(reference, d, seed=2 + i) for i, d in enumerate(neighbour_distances)]
    verdict = spot_check_verdict(stored, reference, neighbours, floor)
    assert verdict.ok, verdict.failures()
    assert verdict.rel_l2 == pytest.approx(measured, rel=1e-3)
    assert verdict.neighbour_rel_l2 == pytest.approx(min(neighbour_distances), rel=1e-3)


@pytest.mark.parametrize(("measured", "floor", "neighbour_distances"), H200_SLOTS)
def test_a_layer_shifted_by_one_fails_on_the_h200_numbers(
    reference, measured, floor, neighbour_distances
):
    neighbours = [at_distance(reference, d, seed=2 + i) for i, d in enumerate(neighbour_distances)]
    for shifted in neighbours:
        # The dump of the neighbouring layer, with the engine's own bf16 noise on top.
        stored = at_distance(shifted, measured, seed=9)
        verdict = spot_check_verdict(stored, reference, neighbours, floor)
        assert not verdict.ok
        assert len(verdict.failures()) == 2  # both bounds see it
    # Without neighbours (a server-only comparison) the noise bound alone still sees it.
    assert not spot_check_verdict(at_distance(neighbours[-1], measured, 9), reference, (), floor).ok


def test_moe_routing_flips_pass_though_their_per_token_tail_is_large(reference):
    """DeepSeek-V3 shape on the H200: per-token p99 0.17-0.33 on MoE layers for correct data,
    and transformers' own bf16 forward has the same tails (on other tokens)."""
    flips = 0.3
    stored = with_flipped_tokens(reference, 0.0415, list(range(0, 2317, 60)), flips, seed=1)
    own_bf16 = with_flipped_tokens(reference, 0.0429, list(range(7, 2317, 60)), flips, seed=2)
    floor = rel_l2(own_bf16, reference)
    neighbours = [at_distance(reference, d, seed=3 + i) for i, d in enumerate((0.357, 0.319))]
    assert float(np.percentile(token_rel_l2(stored, reference), 99)) > 0.2
    verdict = spot_check_verdict(stored, reference, neighbours, floor)
    assert verdict.ok, verdict.failures()
    assert verdict.token_rel_l2_p99 > 0.2 and verdict.token_rel_l2_max == pytest.approx(flips)


def test_a_few_wrong_tokens_beyond_the_noise_fail(reference):
    """Not every bug is a whole-layer shift: wrong values on a tenth of the tokens (e.g. one
    request of a batch taken from another) are far beyond the bf16 floor."""
    stored = reference.clone()
    stored[:230] = torch.roll(reference, 1, dims=0)[:230]
    verdict = spot_check_verdict(stored, reference, floor=0.03)
    assert not verdict.ok and "noise bound" in verdict.failures()[0]


def test_the_bounds_follow_the_configured_factors(reference):
    stored = at_distance(reference, 0.05, seed=1)
    neighbour = at_distance(reference, 0.3, seed=2)
    verdict = spot_check_verdict(stored, reference, [neighbour], 0.02, noise_margin=3.0)
    assert verdict.noise_bound == pytest.approx(0.06, rel=1e-6) and verdict.ok
    assert not spot_check_verdict(stored, reference, [neighbour], 0.02, noise_margin=2.0).ok
    tight = spot_check_verdict(stored, reference, [neighbour], None, neighbour_fraction=0.1)
    assert tight.neighbour_bound == pytest.approx(0.03, rel=1e-4) and not tight.ok
    assert tight.as_dict()["noise_bound"] is None


def test_a_verdict_needs_a_yardstick(reference):
    with pytest.raises(ValueError, match="noise floor, neighbouring layers"):
        spot_check_verdict(reference, reference)
    with pytest.raises(ValueError, match="stored"):
        spot_check_verdict(reference[:10], reference, floor=0.1)


def test_hf_layer_references_take_each_slot_and_its_neighbours():
    """Aux id k is hidden_states[k + 1] with neighbours k and k + 2 (pre-norm states only);
    the final state is hidden_states[L] with neighbour L - 1."""
    layers = 8
    fp32 = [torch.full((3, 4), float(i)) for i in range(layers + 1)]
    bf16 = [t * 1.01 for t in fp32]
    references = hf_layer_references(fp32, bf16, [0, 3, 6])
    values = {name: ref.values[0, 0].item() for name, ref in references.items()}
    assert values == {"aux_0": 1.0, "aux_1": 4.0, "aux_2": 7.0, "final": 8.0}
    around = {n: [x[0, 0].item() for x in r.neighbours] for n, r in references.items()}
    # aux id 6 would neighbour hidden_states[8], the post-norm final: not a neighbour.
    assert around == {"aux_0": [0.0, 2.0], "aux_1": [3.0, 5.0], "aux_2": [6.0], "final": [7.0]}
    assert all(r.floor == pytest.approx(0.01, rel=1e-4) for r in references.values())
    # A batch dimension is flattened; a dict of the needed indices works with num_layers.
    batched = hf_layer_references(
        {i: fp32[i][None] for i in (0, 1, 2, 7, 8)},
        {i: bf16[i][None] for i in (0, 1, 2, 7, 8)},
        [0, 0, 0],
        num_layers=layers,
    )
    assert batched["final"].values.shape == (3, 4)
