"""The reference server's engine: a Hugging Face causal LM on the chosen device and dtype, run on
a batch of requests (packed or padded), its aux and final hidden states captured."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from ...core.errors import PipelineError
from ...core.layers import validate_aux_layer_ids
from .capture import HiddenStateCapture, text_config
from .generate import BatchGenerator, Generation, SamplingParams
from .settings import flex_attention_available, resolve_dtype_name, resolve_layout

_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    return _DTYPES[resolve_dtype_name(name, device.type)]


def resolve_attention(layout: str, device: torch.device) -> tuple[str, str | None]:
    """(batch layout, transformers attention implementation or None for the model's default)."""
    layout = resolve_layout(layout, device.type)
    if layout == "padded":
        return layout, None
    if device.type == "cuda" and flex_attention_available():
        return layout, "flex_attention"
    # sdpa packs too: transformers then builds a dense [T, T] block-diagonal mask.
    return layout, "sdpa"


class ReferenceEngine:
    """The model, its capture hooks and one batched forward pass (called from one thread)."""

    def __init__(
        self,
        model_dir: str | os.PathLike,
        aux_layer_ids: list[int],
        *,
        device: torch.device,
        dtype: torch.dtype,
        trust_remote_code: bool = False,
        hook_shifted_layers: bool = False,
        attention: str = "padded",
    ):
        from transformers import AutoModelForCausalLM

        self.model_dir = Path(model_dir)
        if not (self.model_dir / "config.json").is_file():
            raise PipelineError(f"--model {model_dir}: no config.json (a local HF model dir)")
        self.device, self.dtype = device, dtype
        self.layout, self.attn_implementation = resolve_attention(attention, device)
        load_kwargs = {"dtype": dtype, "trust_remote_code": trust_remote_code}
        if self.attn_implementation is not None:
            load_kwargs["attn_implementation"] = self.attn_implementation
        if device.type == "cuda":
            load_kwargs["device_map"] = str(device)
        try:
            model = AutoModelForCausalLM.from_pretrained(str(self.model_dir), **load_kwargs)
        except (OSError, ValueError) as exc:
            raise PipelineError(f"cannot load model {model_dir}: {exc}") from None
        self.model = model.to(device).eval()
        config = text_config(self.model)
        self.num_layers = int(config.num_hidden_layers)
        self.hidden_size = int(config.hidden_size)
        self.vocab_size = int(config.vocab_size)
        self.max_positions = getattr(config, "max_position_embeddings", None)
        validate_aux_layer_ids(aux_layer_ids, self.num_layers)
        self.aux_layer_ids = list(aux_layer_ids)
        # The shift_layer_batched fault reads id + 1; those layers are hooked only for it.
        self.shifted_layer_ids = [min(i + 1, self.num_layers - 1) for i in self.aux_layer_ids]
        hooked = self.aux_layer_ids + (self.shifted_layer_ids if hook_shifted_layers else [])
        self.capture = HiddenStateCapture(self.model, hooked)
        self.generator = BatchGenerator(self.model, device, dtype)

    @contextmanager
    def generating(self) -> Iterator[BatchGenerator]:
        """The text generator (`generate.BatchGenerator`), for the block."""
        if self.device.type != "cpu":
            yield self.generator
            return
        # One decode step of a small batch is too little work to share between CPU threads:
        # on a busy machine, threads spinning on contended cores made it ~30x slower.
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            yield self.generator
        finally:
            torch.set_num_threads(threads)

    def generate(self, prompts: list[list[int]], params: list[SamplingParams]) -> list[Generation]:
        """Text generation for a batch of requests, decoded together until each has ended."""
        with self.generating() as generator:
            return generator.generate(prompts, params)

    def forward(
        self,
        sequences: list[list[int]],
        *,
        capacity: int | None = None,
        shift_layers: bool = False,
        drop_last: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
        """Packed aux [T, 3H], final [T, H] (real tokens, on the model's device), counts.

        `capacity` is the packed row's width (the batch token budget)."""
        ids = self.shifted_layer_ids if shift_layers else self.aux_layer_ids
        if self.layout == "packed":
            return self.capture.run_packed(sequences, ids, capacity=capacity, drop_last=drop_last)
        return self.capture.run(sequences, ids, drop_last=drop_last)

    def warm_up(self, capacity: int) -> float:
        """One full-width forward, so kernels are compiled before the first request; seconds."""
        started = time.monotonic()
        self.forward([[0]], capacity=capacity)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return time.monotonic() - started
