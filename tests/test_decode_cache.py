"""The decode batch's growing key/value cache (eaglepipe/server/reference/decode_cache.py).

Its keys and values equal DynamicCache's concatenations through appends, crops, reorders, row
selection, merging and trimming, and a model decoding through it produces the same logits."""

from __future__ import annotations

import inspect

import torch
from transformers import AutoModelForCausalLM, DynamicCache

from eaglepipe.server.reference import decode_cache
from eaglepipe.server.reference.decode_cache import GrowingLayer


def kv(batch: int, length: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    shape = (batch, 2, length, 4)
    return torch.randn(shape, generator=g), torch.randn(shape, generator=g)


def filled(batch: int, lengths: list[int]) -> tuple[GrowingLayer, torch.Tensor, torch.Tensor]:
    """A layer fed updates of `lengths` positions, and the plain concatenation of them."""
    layer, keys, values = GrowingLayer(), [], []
    for seed, length in enumerate(lengths):
        k, v = kv(batch, length, seed)
        layer.update(k, v)
        keys.append(k)
        values.append(v)
    return layer, torch.cat(keys, dim=2), torch.cat(values, dim=2)


def test_updates_equal_concatenation_and_write_in_place_while_there_is_room():
    layer, keys, values = filled(3, [10, 1, 1, 5])
    assert torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
    pointer = layer.keys.data_ptr()
    layer.update(*kv(3, 1, 9))
    assert layer.keys.data_ptr() == pointer  # no copy of the cache for a decode step
    layer.update(*kv(3, 200, 10))  # more than the room left: a new, larger buffer
    assert layer.keys.shape[2] == 18 + 200
    assert torch.equal(layer.keys[:, :, :17], keys) and torch.equal(layer.values[:, :, :17], values)


def test_a_crop_or_a_reorder_by_transformers_is_followed():
    layer, keys, values = filled(3, [8, 1])
    layer.crop(-2)
    k, v = kv(3, 1, 5)
    layer.update(k, v)
    assert torch.equal(layer.keys, torch.cat([keys[:, :, :7], k], dim=2))
    layer.reorder_cache(torch.tensor([2, 0]))  # replaces keys and values with new tensors
    k2, v2 = kv(2, 1, 6)
    layer.update(k2, v2)
    expected = torch.cat([torch.cat([keys[:, :, :7], k], dim=2)[[2, 0]], k2], dim=2)
    assert torch.equal(layer.keys, expected)
    assert torch.equal(layer.values[:, :, -1:], v2)


def cache_of(batch: int, lengths: list[int]):
    cache = decode_cache.new_cache()
    for index in range(2):
        for seed, length in enumerate(lengths):
            cache.update(*kv(batch, length, 10 * index + seed), index)
    return cache


def test_select_merge_and_trim_keep_each_rows_positions():
    cache = cache_of(4, [6, 1])
    keys = [layer.keys.clone() for layer in cache.layers]
    chosen = decode_cache.select(cache, torch.tensor([3, 1]))
    for layer, k in zip(chosen.layers, keys, strict=True):
        assert torch.equal(layer.keys, k[[3, 1]])

    other = cache_of(1, [3])
    mask_a = torch.ones(2, 7, dtype=torch.long)
    mask_b = torch.ones(1, 3, dtype=torch.long)
    both, mask = decode_cache.merged(chosen, mask_a, other, mask_b)
    assert mask.tolist() == [[1] * 7, [1] * 7, [0] * 4 + [1] * 3]
    for layer, k, o in zip(both.layers, keys, other.layers, strict=True):
        assert torch.equal(layer.keys[:2], k[[3, 1]])
        assert torch.equal(layer.keys[2, :, :4], torch.zeros(2, 4, 4))  # padding is zeros
        assert torch.equal(layer.keys[2, :, 4:], o.keys[0])

    last, mask = decode_cache.trimmed(decode_cache.select(both, torch.tensor([2])), mask[[2]])
    assert mask.tolist() == [[1, 1, 1]]
    for layer, o in zip(last.layers, other.layers, strict=True):
        assert torch.equal(layer.keys, o.keys) and torch.equal(layer.values, o.values)
    last.update(*kv(1, 1, 99), 0)  # still grows
    assert last.layers[0].keys.shape[2] == 4


def test_a_model_decodes_the_same_logits_through_it(tiny_llama_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    # transformers renamed the cache argument (past_key_values -> cache) in 5.2x.
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
    ids = torch.tensor([[5, 9, 2, 7, 1, 4], [0, 0, 3, 8, 6, 2]])
    mask = torch.tensor([[1] * 6, [0, 0, 1, 1, 1, 1]])
    runs = []
    with torch.no_grad():
        for cache in (DynamicCache(), decode_cache.new_cache()):
            out = model(input_ids=ids, attention_mask=mask, use_cache=True, **{name: cache})
            logits, step_mask = [out.logits[:, -1]], mask
            for _ in range(3):
                token = logits[-1].argmax(-1, keepdim=True)
                step_mask = torch.cat([step_mask, torch.ones(2, 1, dtype=torch.long)], dim=1)
                positions = step_mask.sum(-1, keepdim=True) - 1
                out = model(
                    input_ids=token,
                    attention_mask=step_mask,
                    position_ids=positions,
                    use_cache=True,
                    **{name: cache},
                )
                logits.append(out.logits[:, -1])
            runs.append(torch.stack(logits))
    assert torch.equal(runs[0], runs[1])
