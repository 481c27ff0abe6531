"""Capture a Hugging Face causal LM's aux layers and final hidden state with forward hooks.

Only the hooked modules' outputs are kept (not `output_hidden_states=True` for every layer):
decoder layer k's output is aux id k (eaglepipe.core.layers), and the final norm's output is the
post-norm final hidden state. Each hook gathers the real (unpadded) tokens on the device right
away, so padded activations are never held and what leaves the device is exactly the packed
[T_total, H] per layer that the dump writer takes.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from ...core.errors import PipelineError

_LAYER_LIST_NAMES = ("layers", "h", "blocks")
_FINAL_NORM_NAMES = ("norm", "final_layernorm", "ln_f", "norm_f", "final_norm")


def text_config(model: nn.Module):
    config = model.config
    getter = getattr(config, "get_text_config", None)
    return getter() if callable(getter) else config


def _architecture(model: nn.Module) -> str:
    names = getattr(model.config, "architectures", None) or [type(model).__name__]
    return ", ".join(names)


def find_decoder_stack(model: nn.Module) -> tuple[nn.ModuleList, nn.Module]:
    """The decoder layer list and the final norm beside it (model.model.layers / .norm for
    Llama and DeepSeek-V3; nested under language_model for multimodal wrappers)."""
    num_layers = getattr(text_config(model), "num_hidden_layers", None)
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if not isinstance(module, nn.ModuleList) or leaf not in _LAYER_LIST_NAMES:
            continue
        if num_layers is not None and len(module) != num_layers:
            continue
        parent = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        for norm_name in _FINAL_NORM_NAMES:
            norm = getattr(parent, norm_name, None)
            if isinstance(norm, nn.Module):
                return module, norm
    raise PipelineError(
        f"cannot find the decoder layers and final norm of {_architecture(model)}: expected a "
        f"ModuleList named one of {_LAYER_LIST_NAMES} with {num_layers} layers beside a norm "
        f"named one of {_FINAL_NORM_NAMES} (e.g. model.model.layers and model.model.norm)"
    )


def packed_token_index(lengths: Sequence[int], padded_len: int, *, device) -> torch.Tensor:
    """Flat indices of the real tokens of a right-padded [B, padded_len] batch, in order."""
    pieces = [
        torch.arange(row * padded_len, row * padded_len + length, dtype=torch.long)
        for row, length in enumerate(lengths)
    ]
    index = torch.cat(pieces) if pieces else torch.empty(0, dtype=torch.long)
    return index.to(device, non_blocking=True)


class HiddenStateCapture:
    """Forward hooks on decoder layers `layer_ids` and on the final norm.

    `run(sequences, aux_ids)` does a whole padded batch. Lower level: `with
    capture.capturing(token_index): model(...)`, then `aux(ids)` ([T, len(ids)*H]) and `final`
    ([T, H]); `token_index` selects the real tokens of the flattened [B*S] batch (None keeps
    every position).
    """

    def __init__(self, model: nn.Module, layer_ids: Sequence[int]):
        layers, norm = find_decoder_stack(model)
        self.model = model
        forward_params = inspect.signature(model.forward).parameters
        # Only the last position's logits: the lm_head over every token is wasted work.
        self._forward_extra = {"logits_to_keep": 1} if "logits_to_keep" in forward_params else {}
        self.num_layers = len(layers)
        self.layer_ids = sorted(set(int(i) for i in layer_ids))
        for layer_id in self.layer_ids:
            if not 0 <= layer_id < self.num_layers:
                raise PipelineError(
                    f"cannot capture layer {layer_id} of a {self.num_layers}-layer model"
                )
        self.layers: dict[int, torch.Tensor] = {}
        self.final: torch.Tensor | None = None
        self._token_index: torch.Tensor | None = None
        # Hooks keep nothing outside `capturing()` (e.g. the forwards of text generation).
        self._active = False
        self._handles = [
            layers[i].register_forward_hook(self._layer_hook(i)) for i in self.layer_ids
        ]
        self._handles.append(norm.register_forward_hook(self._final_hook))

    def _gather(self, output) -> torch.Tensor:
        hidden = output[0] if isinstance(output, tuple) else output
        flat = hidden.reshape(-1, hidden.shape[-1])
        return flat if self._token_index is None else flat.index_select(0, self._token_index)

    def _layer_hook(self, layer_id: int):
        def hook(_module, _args, output):
            if self._active:
                self.layers[layer_id] = self._gather(output)

        return hook

    def _final_hook(self, _module, _args, output):
        if self._active:
            self.final = self._gather(output)

    @contextmanager
    def capturing(self, token_index: torch.Tensor | None) -> Iterator[HiddenStateCapture]:
        self.layers, self.final = {}, None
        self._token_index = token_index
        self._active = True
        try:
            yield self
        finally:
            self._token_index = None
            self._active = False

    def run(
        self, sequences: Sequence[Sequence[int]], aux_ids: Sequence[int], *, drop_last: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """One right-padded forward over `sequences`: packed aux [T, len(aux_ids)*H], final
        [T, H] (real tokens only, on the model's device) and the per-request token counts.

        Right padding with an attention mask: causal attention keeps each real token's result
        independent of the padding after it. `drop_last` leaves out each request's last token
        (the wrong_token_count fault)."""
        device = next(self.model.parameters()).device
        lengths = [len(s) for s in sequences]
        padded_len = max(lengths)
        input_ids = torch.zeros((len(sequences), padded_len), dtype=torch.long)
        attention_mask = torch.zeros_like(input_ids)
        for row, seq in enumerate(sequences):
            input_ids[row, : len(seq)] = torch.as_tensor(seq, dtype=torch.long)
            attention_mask[row, : len(seq)] = 1
        kept = [n - 1 if drop_last and n > 1 else n for n in lengths]
        index = packed_token_index(kept, padded_len, device=device)
        with torch.inference_mode(), self.capturing(index):
            self.model(
                input_ids=input_ids.to(device, non_blocking=True),
                attention_mask=attention_mask.to(device, non_blocking=True),
                use_cache=False,
                **self._forward_extra,
            )
            aux = self.aux(aux_ids)
        return aux, self.final, kept

    def run_packed(
        self,
        sequences: Sequence[Sequence[int]],
        aux_ids: Sequence[int],
        *,
        capacity: int | None = None,
        drop_last: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """One forward over `sequences` packed end to end in a single row, each with positions
        from 0: same results as `run`, without computing any padding between requests.

        transformers reads the packing from `position_ids` (no attention mask, no cache) and
        restricts attention to each request's own tokens (block-diagonal causal), with
        flex_attention as a block mask and with sdpa as a dense mask. The row is padded to
        `capacity` as a segment of its own, so every batch has one shape and a compiled
        attention kernel is reused rather than rebuilt per batch."""
        device = next(self.model.parameters()).device
        lengths = [len(s) for s in sequences]
        total = sum(lengths)
        width = max(total, capacity or 0)
        input_ids = torch.zeros(width, dtype=torch.long)
        position_ids = torch.empty(width, dtype=torch.long)
        kept, pieces, start = [], [], 0
        for seq, n in zip(sequences, lengths, strict=True):
            input_ids[start : start + n] = torch.as_tensor(seq, dtype=torch.long)
            position_ids[start : start + n] = torch.arange(n)
            keep = n - 1 if drop_last and n > 1 else n
            kept.append(keep)
            pieces.append(torch.arange(start, start + keep))
            start += n
        # The padding segment's positions wrap so they stay within the model's position range.
        limit = getattr(text_config(self.model), "max_position_embeddings", None) or width
        position_ids[total:] = torch.arange(width - total) % limit
        index = None if sum(kept) == width else torch.cat(pieces).to(device, non_blocking=True)
        with torch.inference_mode(), self.capturing(index):
            self.model(
                input_ids=input_ids[None].to(device, non_blocking=True),
                position_ids=position_ids[None].to(device, non_blocking=True),
                use_cache=False,
                **self._forward_extra,
            )
            aux = self.aux(aux_ids)
        return aux, self.final, kept

    def aux(self, ids: Sequence[int]) -> torch.Tensor:
        missing = [i for i in ids if i not in self.layers]
        if missing or self.final is None:
            raise PipelineError(f"forward pass did not reach captured layer(s) {missing or 'norm'}")
        return torch.cat([self.layers[i] for i in ids], dim=-1)

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
