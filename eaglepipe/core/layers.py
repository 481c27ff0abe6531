"""The aux-layer convention, stated once.

An aux layer id k is the 0-based index of a decoder layer *output*: the pre-norm residual
stream leaving decoder layer k, which is `hidden_states[k + 1]` of a Hugging Face forward with
`output_hidden_states=True` (index 0 there is the embedding output). SGLang's capture list
names the layer whose *input* is captured, so our id k is SGLang's `k + 1`.

The final hidden state is post-norm: what the target's lm_head consumes, which is
`hidden_states[-1]` in Hugging Face (transformers applies the final norm to the last entry).
"""

from __future__ import annotations

from .errors import PipelineError

CONVENTION = "decoder-layer-output-0based"
FINAL_CONVENTION = "post-final-norm"


def default_aux_layer_ids(num_layers: int) -> list[int]:
    """[1, L//2 - 1, L - 4]: the layers SGLang captures by default ([2, L//2, L-3] as inputs)."""
    return [1, num_layers // 2 - 1, num_layers - 4]


def resolve_aux_layer_ids(configured: list[int] | None, num_layers: int) -> list[int]:
    """The configured ids, or the default for this depth; validated either way."""
    ids = default_aux_layer_ids(num_layers) if configured is None else list(configured)
    validate_aux_layer_ids(ids, num_layers)
    return ids


def validate_aux_layer_ids(ids: list[int], num_layers: int) -> None:
    where = f"aux_layer_ids {ids} for a {num_layers}-layer model"
    if len(ids) != 3:
        raise PipelineError(f"{where}: exactly three ids are needed (low, middle, high)")
    if any(not isinstance(i, int) for i in ids):
        raise PipelineError(f"{where}: ids must be integers")
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)):
        raise PipelineError(f"{where}: ids must be distinct and increasing")
    if ids[0] < 0 or ids[-1] >= num_layers:
        raise PipelineError(f"{where}: ids must lie in 0..{num_layers - 1}")


def hf_hidden_state_index(aux_id: int) -> int:
    """Index into Hugging Face `output_hidden_states` for our aux id."""
    return aux_id + 1
