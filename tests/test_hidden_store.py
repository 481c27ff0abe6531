"""The FP8 hidden-state store (eaglepipe/core/hidden_store.py): its bytes, its numbers, and the
chunk file that holds it, on real files (the chunk writer and the one chunk reader)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from eaglepipe.core.errors import PipelineError
from eaglepipe.core.hidden_store import (
    BF16_STORE,
    FP8_MAX,
    FP8_REL_L2,
    HiddenStore,
    dequantize,
    quantize,
)
from eaglepipe.core.tensor_bytes import read_safetensors
from eaglepipe.extract.chunk_file import ChunkReader, RowTensors, token_bytes, write_chunk
from eaglepipe.validate.spot_rule import rel_l2

FP8 = HiddenStore("fp8_e4m3", "fp8_e4m3")
AUX_ONLY = HiddenStore("fp8_e4m3", "bf16")
# (hidden size, aux layers): Llama-3.1-8B, and Kimi-K2.5 (DeepSeek-V3's 7168) projected.
SHAPES = {"8b": (4096, 3), "kimi_k2.5": (7168, 3)}


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_an_fp8_store_costs_at_most_0_52_of_bf16_per_token(shape):
    hidden, aux = SHAPES[shape]
    bf16 = token_bytes(hidden, aux, BF16_STORE)
    fp8 = token_bytes(hidden, aux, FP8)
    # The chunk's own byte function: states, scales, token id and loss mask.
    assert bf16 == 4 * hidden * 2 + 5
    assert fp8 == 4 * hidden + 4 * 4 + 5
    assert fp8 / bf16 <= 0.52
    # FP8 aux states only: 5/8 of the states' bytes.
    assert token_bytes(hidden, aux, AUX_ONLY) == 3 * hidden + 3 * 4 + 2 * hidden + 5


def hidden_like(tokens: int, hidden: int, layers: int, seed: int = 0) -> torch.Tensor:
    """Gaussian states with a few outlier channels 50x the rest (as residual streams have)."""
    gen = torch.Generator().manual_seed(seed)
    values = torch.randn(tokens, layers, hidden, generator=gen)
    values[:, :, :3] *= 50
    values *= torch.rand(tokens, layers, 1, generator=gen) * 10 + 0.1  # per-token scale
    return values.reshape(tokens, layers * hidden)


def test_quantized_states_come_back_within_the_derived_e4m3_error():
    values = hidden_like(64, 256, 3)
    q, scale = quantize(values, 3)
    assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32
    assert scale.shape == (64, 3)
    back = dequantize(q, scale, torch.float32)
    # Each token's layer maps onto e4m3's range: its largest value lands on 448.
    grouped = q.float().reshape(64, 3, -1).abs().amax(-1)
    assert torch.equal(grouped, torch.full((64, 3), FP8_MAX))
    # The derivation (docs/SPOT_CHECK.md): 2^-3 / sqrt(12 E[m^2]) ~ 0.0245. Gaussian states
    # land within 10 % of it; outlier channels, which carry the norm near the top of e4m3's
    # range, pull a layer's error below it.
    assert FP8_REL_L2 == pytest.approx(0.0245, abs=2e-4)
    assert rel_l2(back, values) < FP8_REL_L2
    gaussian = torch.randn(64, 3 * 256, generator=torch.Generator().manual_seed(1))
    error = rel_l2(dequantize(*quantize(gaussian, 3), torch.float32), gaussian)
    assert 0.9 * FP8_REL_L2 < error < 1.15 * FP8_REL_L2
    # The dequantized values are what the raw bytes and scales say, whoever multiplies.
    again = dequantize(q.view(torch.uint8), scale, torch.bfloat16)
    assert torch.equal(again, back.to(torch.bfloat16))


def test_a_zero_layer_keeps_scale_one_and_non_finite_values_stay_non_finite():
    values = hidden_like(4, 16, 2)
    values[1, :16] = 0
    values[2, 20] = float("nan")
    values[3, 3] = float("inf")
    q, scale = quantize(values, 2)
    assert scale[1, 0] == 1 and torch.count_nonzero(q[1, :16].float()) == 0
    back = dequantize(q, scale, torch.float32)
    assert torch.isnan(back[2, 20]) and torch.isfinite(back[2, :16]).all()
    assert torch.isnan(back[3, :16]).any() and torch.isfinite(back[:2]).all()


def test_a_store_names_what_it_holds():
    assert BF16_STORE.is_default and not FP8.is_default
    assert FP8.dtype("aux_hidden_states") == "F8_E4M3"
    assert AUX_ONLY.dtype("final_hidden_states") == "BF16"
    assert AUX_ONLY.manifest_dtypes() == {
        "aux_hidden_states": "float8_e4m3fn",
        "final_hidden_states": "bfloat16",
    }
    assert HiddenStore.from_manifest({"stored_dtypes": AUX_ONLY.manifest_dtypes()}) == AUX_ONLY
    assert HiddenStore.from_manifest({}) == BF16_STORE  # written before stores could differ
    assert HiddenStore.from_dtypes("F8_E4M3", "BF16") == AUX_ONLY
    with pytest.raises(ValueError, match="fp16"):
        HiddenStore("fp16", "bf16")
    with pytest.raises(ValueError, match="F32"):
        HiddenStore.from_dtypes("F32", "BF16")
    # The all-bf16 order is the one chunks always had.
    assert BF16_STORE.tensor_order() == (
        "row_ids",
        "offsets",
        "aux_hidden_states",
        "final_hidden_states",
        "input_ids",
        "loss_mask",
    )


def fp8_rows(store: HiddenStore, hidden: int, lengths: list[int]) -> tuple[list, list]:
    """Rows as the client hands them over (the server's stored tensors), and their values."""
    rows, values = [], []
    for row_id, tokens in enumerate(lengths):
        aux = hidden_like(tokens, hidden, 3, seed=row_id)
        final = hidden_like(tokens, hidden, 1, seed=100 + row_id)
        scales = {}
        stored = []
        for name, tensor, layers in (
            ("aux_hidden_states", aux, 3),
            ("final_hidden_states", final, 1),
        ):
            if store.quantized(name):
                q, scale = quantize(tensor, layers)
                stored.append(q)
                scales[f"{name}_scale"] = scale
            else:
                stored.append(tensor.to(torch.bfloat16))
        rows.append(
            RowTensors(
                row_id=row_id,
                input_ids=torch.arange(tokens, dtype=torch.int32),
                loss_mask=torch.ones(tokens, dtype=torch.uint8),
                aux_hidden_states=stored[0],
                final_hidden_states=stored[1],
                scales=scales,
            )
        )
        values.append((aux, final))
    return rows, values


@pytest.mark.parametrize("store", [FP8, AUX_ONLY], ids=["fp8", "fp8_aux_only"])
def test_an_fp8_chunk_is_one_safetensors_file_with_its_store_and_scales(tmp_path, store):
    hidden, lengths = 20, [3, 5, 2]  # hidden not a multiple of 8: alignment still holds
    rows, values = fp8_rows(store, hidden, lengths)
    record = write_chunk(tmp_path, 0, rows, hidden_size=hidden, store=store)
    path = tmp_path / record.file
    assert record.bytes == path.stat().st_size
    metadata, tensors = read_safetensors(path)
    described = json.loads(metadata["store"])
    assert described["aux_hidden_states"] == store.dtype("aux_hidden_states")
    assert set(described["scales"]) == set(store.scaled_keys)
    header_len = int.from_bytes(path.read_bytes()[:8], "little")
    header = json.loads(path.read_bytes()[8 : 8 + header_len])
    for name, tensor in tensors.items():
        begin = header[name]["data_offsets"][0]
        assert (8 + header_len + begin) % tensor.data.itemsize == 0, name  # aligned
    with ChunkReader(path) as reader:
        assert reader.store == store and reader.row_ids == [0, 1, 2]
        row = reader.row(1)
        aux, final = values[1]
        assert row["aux_hidden_states"].dtype == torch.bfloat16
        assert rel_l2(row["aux_hidden_states"].float(), aux) < 1.15 * FP8_REL_L2
        stored, scale = reader.stored("final_hidden_states", 3, 8)
        if store.quantized("final_hidden_states"):
            assert stored.dtype == torch.float8_e4m3fn and scale.shape == (5, 1)
        else:
            assert stored.dtype == torch.bfloat16 and scale is None
            assert torch.equal(stored, final.to(torch.bfloat16))


def test_the_chunk_writer_refuses_rows_of_another_store(tmp_path):
    rows, _ = fp8_rows(FP8, 8, [2])
    with pytest.raises(PipelineError, match="_scale beside a bf16 store"):
        write_chunk(tmp_path, 0, rows, hidden_size=8, store=BF16_STORE)
    scales = rows[0].scales
    rows[0].scales = {}
    with pytest.raises(PipelineError, match="aux_hidden_states is torch.float8_e4m3fn"):
        write_chunk(tmp_path, 0, rows, hidden_size=8, store=BF16_STORE)
    rows[0].scales = scales
    rows[0].scales.pop("final_hidden_states_scale")
    with pytest.raises(PipelineError, match="final_hidden_states_scale is missing"):
        write_chunk(tmp_path, 0, rows, hidden_size=8, store=FP8)
    assert not list(tmp_path.iterdir())


def test_the_one_reader_names_a_broken_chunk(tmp_path):
    with pytest.raises(PipelineError, match="does not exist"):
        ChunkReader(tmp_path / "chunk-00000.safetensors")
    torn = tmp_path / "chunk-00001.safetensors"
    torn.write_bytes(np.zeros(20, np.uint8).tobytes())
    with pytest.raises(PipelineError, match="is not a readable safetensors file"):
        ChunkReader(torn)


def test_the_store_is_part_of_a_shards_identity_and_a_bf16_one_is_as_before(
    tiny_llama_dir, tmp_path
):
    """Changing extract.store changes the shard's provenance stamp (it is extracted again), the
    key its journalled chunks are kept under and the server's fingerprint (the server
    quantizes); the default bf16 store adds nothing, so existing bf16 shards stay fresh."""
    from conftest import REPO_ROOT
    from tokenizers import Tokenizer, models

    from eaglepipe.core.config import validate_config
    from eaglepipe.core.config_files import load_config
    from eaglepipe.core.run import resolve
    from eaglepipe.plan.provenance import _shard_provenance_inputs, shard_provenance
    from eaglepipe.server.lifecycle.identity import chunk_reuse_key, server_identity
    from eaglepipe.server.lifecycle.launch import engine_command, server_fingerprint

    target = tmp_path / "target"  # with a tokenizer: the model's fingerprint reads it
    shutil.copytree(tiny_llama_dir, target)
    vocabulary = models.WordLevel({"[UNK]": 0}, unk_token="[UNK]")
    Tokenizer(vocabulary).save(str(target / "tokenizer.json"))

    def run_with(store: HiddenStore):
        config = load_config(REPO_ROOT / "config.yaml")
        config["model"]["path"] = str(target)
        config["dataset"]["path"] = str(REPO_ROOT / config["dataset"]["path"])
        config["extract"]["store"] = store.as_dict()
        return resolve(validate_config(config))

    bf16, fp8, aux_only = run_with(BF16_STORE), run_with(FP8), run_with(AUX_ONLY)
    assert bf16.extract.store == BF16_STORE and fp8.extract.store == FP8
    stamps = {shard_provenance(run, "rows_0-64") for run in (bf16, fp8, aux_only)}
    assert len(stamps) == 3
    assert "store" not in _shard_provenance_inputs(bf16)[0]
    assert _shard_provenance_inputs(fp8)[0]["store"] == FP8.as_dict()
    keys = [chunk_reuse_key(run, shard_inputs_hash="h", engine={}) for run in (bf16, fp8)]
    assert keys[0]["stored_dtype"] == "bfloat16" and keys[1]["stored_dtype"] == FP8.as_dict()
    assert "store" not in server_identity(bf16)
    assert server_fingerprint(bf16) != server_fingerprint(fp8)
    argv, _ = engine_command(fp8, host="127.0.0.1", port=1, dump_dir=Path("/d"), instance_id="i")
    assert argv[argv.index("--store-aux") + 1] == "fp8_e4m3"
    assert argv[argv.index("--store-final") + 1] == "fp8_e4m3"
