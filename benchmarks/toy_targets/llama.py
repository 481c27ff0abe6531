"""Random-weight Llama targets of a given shape (the 8B shape and a tiny one), made directly on
the device in the dtype asked for: no download, no copy."""

from __future__ import annotations

SHAPES = {
    "8b": dict(
        hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336, vocab=128256, max_pos=8192
    ),
    "tiny": dict(
        hidden=64, layers=8, heads=4, kv_heads=2, intermediate=176, vocab=512, max_pos=2048
    ),
}


def random_model_on(config, device, dtype):
    """A random-weight causal LM made directly on `device` in `dtype` (no download, no copy)."""
    import torch
    from transformers import AutoModelForCausalLM

    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config)
    finally:
        torch.set_default_dtype(previous)
    return model.eval()


def random_llama(
    device,
    dtype,
    *,
    seed: int,
    vocab: int,
    hidden: int,
    intermediate: int,
    layers: int,
    heads: int,
    kv_heads: int,
    max_pos: int,
):
    """A random-weight Llama of the given shape, made on `device` (see `random_model_on`)."""
    import torch
    from transformers import LlamaConfig

    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=max_pos,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return random_model_on(config, device, dtype)
