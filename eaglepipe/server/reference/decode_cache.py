"""The key/value cache of a decode batch (`generate.DecodeSession`), with room to grow.

transformers' DynamicCache appends each step's keys and values with `torch.cat`, copying every
layer's whole cache once per generated token: about a sixth of the reference server's CPU time
in regeneration. Here each layer's keys and values are views into buffers with spare positions,
so a step writes only its new position, and a buffer is copied only when it is full. The model
attends over the same values, so what is generated does not change.

The batch operations of continuous batching build such caches directly: rows leaving
(`select`), a joining batch merged in (`merged`, both left-padded to one width) and leading
positions that are padding in every row dropped (`trimmed`).
"""

from __future__ import annotations

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

# Spare positions a buffer gets: an eighth of its length, at least this many.
MIN_ROOM = 64


def _room_for(length: int) -> int:
    return length + max(MIN_ROOM, length // 8)


def _with_room(tensor: torch.Tensor, add: int = 0) -> torch.Tensor:
    """A buffer of `tensor`'s shape with room for `add` positions (dim -2) and spare ones,
    `tensor` at its start."""
    shape = list(tensor.shape)
    shape[-2] = _room_for(tensor.shape[-2] + add)
    buffer = tensor.new_empty(shape)
    buffer[..., : tensor.shape[-2], :] = tensor
    return buffer


class GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are the first positions of larger buffers."""

    _key_buffer: torch.Tensor | None = None
    _value_buffer: torch.Tensor | None = None

    def _length(self) -> int:
        keys = self.keys if self.is_initialized else None
        return 0 if keys is None or keys.numel() == 0 else keys.shape[-2]

    def _buffers_hold_keys(self) -> bool:
        """Whether keys and values are still views of this layer's buffers (another operation,
        a reorder or an offload, may have replaced them; a crop keeps them)."""
        buffer = self._key_buffer
        return (
            buffer is not None
            and self._length() > 0
            and self.keys.data_ptr() == buffer.data_ptr()
            and self.keys.stride() == buffer.stride()
            and self.keys.shape[:-2] == buffer.shape[:-2]
            and self.values.data_ptr() == self._value_buffer.data_ptr()
            and self.values.stride() == self._value_buffer.stride()
        )

    def update(self, key_states, value_states, *args, **kwargs):
        start, add = self._length(), key_states.shape[-2]
        if not self._buffers_hold_keys() or start + add > self._key_buffer.shape[-2]:
            keys = self.keys if start else key_states[..., :0, :]
            values = self.values if start else value_states[..., :0, :]
            self.adopt(_with_room(keys, add), _with_room(values, add), start)
        self._key_buffer[..., start : start + add, :] = key_states
        self._value_buffer[..., start : start + add, :] = value_states
        self.keys = self._key_buffer[..., : start + add, :]
        self.values = self._value_buffer[..., : start + add, :]
        return self.keys, self.values

    def adopt(self, key_buffer: torch.Tensor, value_buffer: torch.Tensor, length: int) -> None:
        """Take buffers whose first `length` positions are this layer's keys and values."""
        self.device = key_buffer.device
        self.is_initialized = True
        self._key_buffer, self._value_buffer = key_buffer, value_buffer
        self.keys = key_buffer[..., :length, :]
        self.values = value_buffer[..., :length, :]

    def buffers(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Key and value buffers whose first positions are this layer's keys and values."""
        if not self._buffers_hold_keys():
            self.adopt(_with_room(self.keys), _with_room(self.values), self._length())
        return self._key_buffer, self._value_buffer


def new_cache() -> DynamicCache:
    """An empty cache whose layers grow in place (for the model's forward)."""
    cache = DynamicCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


def _from_buffers(buffers: list[tuple[torch.Tensor, torch.Tensor]], length: int) -> DynamicCache:
    cache = new_cache()
    for key_buffer, value_buffer in buffers:
        layer = GrowingLayer()
        layer.adopt(key_buffer, value_buffer, length)
        cache.layers.append(layer)
    return cache


def select(cache, index: torch.Tensor) -> DynamicCache:
    """The cache of the batch rows `index`, in that order."""
    length = cache.layers[0].keys.shape[-2]
    buffers = []
    for layer in cache.layers:
        # Whole buffers are selected, so the rows keep their spare positions.
        pair = layer.buffers() if isinstance(layer, GrowingLayer) else (layer.keys, layer.values)
        buffers.append(tuple(t.index_select(0, index) for t in pair))
    return _from_buffers(buffers, length)


def merged(cache_a, mask_a: torch.Tensor, cache_b, mask_b: torch.Tensor):
    """Two left-padded batches (cache layers [B, heads, T, D], mask [B, T]) as one."""
    width = max(mask_a.shape[1], mask_b.shape[1])
    rows_a = mask_a.shape[0]
    buffers = []
    for layer_a, layer_b in zip(cache_a.layers, cache_b.layers, strict=True):
        pair = []
        for a, b in ((layer_a.keys, layer_b.keys), (layer_a.values, layer_b.values)):
            shape = (rows_a + b.shape[0], *a.shape[1:-2], _room_for(width), a.shape[-1])
            buffer = a.new_empty(shape)
            for rows, part in ((slice(0, rows_a), a), (slice(rows_a, None), b)):
                start = width - part.shape[-2]
                buffer[rows, ..., :start, :] = 0  # masked, but a NaN there would still leak
                buffer[rows, ..., start:width, :] = part
            pair.append(buffer)
        buffers.append((pair[0], pair[1]))
    mask = torch.cat([_left_padded(mask_a, width), _left_padded(mask_b, width)])
    return _from_buffers(buffers, width), mask


def _left_padded(mask: torch.Tensor, width: int) -> torch.Tensor:
    missing = width - mask.shape[1]
    if missing == 0:
        return mask
    return torch.cat([mask.new_zeros((mask.shape[0], missing)), mask], dim=1)


def trimmed(cache, mask: torch.Tensor):
    """Without the leading positions that are padding in every row (left by requests that
    ended): later steps need not attend over them."""
    used = mask.any(dim=0).nonzero()
    first = int(used[0]) if len(used) else 0
    if first == 0:
        return cache, mask
    buffers = [
        (_with_room(layer.keys[..., first:, :]), _with_room(layer.values[..., first:, :]))
        for layer in cache.layers
    ]
    return _from_buffers(buffers, mask.shape[1] - first), mask[:, first:]
