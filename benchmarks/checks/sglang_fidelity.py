#!/usr/bin/env python3
"""SGLang's hidden-state dumps against an independent transformers forward, live, per layer.

For each model: build a small random checkpoint, compute transformers references of the same
weights (fp32 and bf16, every hidden state), start SGLang through the project's own launcher
(`eaglepipe.server.lifecycle.shared_server.start_server`, engine sglang: the recipe under
test), send the rows
through the project's ExtractionClient one at a time and then all in flight at once (SGLang
packs them into shared prefill batches; the server log says how many), and compare each layer:

- rel L2 of the dump against the fp32 forward at the layer it must be (aux id k = HF
  hidden_states[k + 1], final = the post-norm last state), and the per-token p99;
- the same for transformers' own bf16 forward against its fp32 one (the noise floor);
- rel L2 against the neighbouring layers (what an off-by-one would match instead).

A layer passes when its error is within twice the bf16 floor (plus a small absolute margin)
and less than half its distance to either neighbour; the packed dumps must match the single
ones within the same noise. Also checked: one dump per prefixed request, none for requests
with another prefix or for decode steps, and one (prompt-length) dump for a prefixed request
that goes on to decode.

Models: `llama` (random Llama, 8 layers), `deepseek` (DeepSeek-V3 shape: MLA, MoE after
`first_k_dense_replace` dense layers, 8 layers; config.json gets the keys SGLang 0.5.14 reads
and transformers does not save), `kimi` (KimiK25ForConditionalGeneration wrapping the same
DeepSeek weights as `language_model`, a tiny vision tower config without weights, and a
text-only multimodal processor for SGLang: the checkpoint has no image processor). The Kimi
model is compared with the DeepSeek references (same weights). A Kimi server that cannot start
is reported as unavailable, not as a mismatch.

    python3 -u -m benchmarks.checks.sglang_fidelity --out $OUT/fidelity.json       # on the H200
    python3 -u -m benchmarks.checks.sglang_fidelity --dry-run --small --sglang-version 0.5.14 \
        --out /tmp/fidelity.json                                             # CPU: no server

--dry-run builds the checkpoints and references, prints each model's launch command (for
--sglang-version) and runs the comparison on transformers' own bf16 states in place of dumps,
plus a deliberately shifted copy that must fail. Exit status: 0 all checks passed, 1 a mismatch
or a failed required model, 2 bad arguments.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import traceback
import urllib.request
from pathlib import Path

import numpy as np
import torch

from benchmarks.common import (
    REPO_ROOT,
    command_line,
    free_port,
    log,
    machine_info,
    markdown_table,
    working_directory,
    write_results,
)
from benchmarks.sglang_runs import (
    SGLANG_EXTRA_ARGS,
    add_engine_options,
    log_between,
    prefill_batches,
)
from benchmarks.toy_targets.deepseek import add_sglang_deepseek_keys
from eaglepipe.validate import (
    DEFAULT_NEIGHBOUR_FRACTION,
    DEFAULT_NOISE_MARGIN,
    rel_l2,
    spot_check_verdict,
    token_rel_l2,
)

MODELS = ("llama", "deepseek", "kimi")
ROW_LENGTHS = [5, 17, 64, 128, 300, 511, 1000, 33, 2, 257]
# Each layer is judged by the pipeline's spot-check rule (validate.spot_check_verdict). Packed
# dumps must equal the single ones within FLOOR_FACTOR x the layer's bf16 floor (+ ABS_MARGIN).
FLOOR_FACTOR = 2.0
ABS_MARGIN = 0.005
CORPUS_WORDS = (
    "the quick brown fox jumps over the lazy dog while eagle drafts speculate tokens hidden "
    "states flow through decoder layers residual streams and final norms latent attention "
    "routes tokens to experts shared expert dense layers"
).split()

LLAMA = {
    "full": dict(hidden_size=512, num_layers=8, num_heads=8, num_kv_heads=4,
                 intermediate_size=1408, vocab_size=1024, max_position_embeddings=4096, seed=0),
    "small": dict(hidden_size=128, num_layers=8, num_heads=4, num_kv_heads=2,
                  intermediate_size=256, vocab_size=512, max_position_embeddings=2048, seed=0),
}  # fmt: skip
# DeepSeek-V3's own per-head dims at full size (the triton MLA kernels see the real shapes).
DEEPSEEK = {
    "full": dict(vocab_size=1024, hidden_size=1024, intermediate_size=2048,
                 moe_intermediate_size=256, num_hidden_layers=8, first_k_dense_replace=2,
                 n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1, n_group=4,
                 topk_group=2, num_attention_heads=8, num_key_value_heads=8, q_lora_rank=384,
                 kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128),
    "small": dict(vocab_size=512, hidden_size=256, intermediate_size=512,
                  moe_intermediate_size=64, num_hidden_layers=8, first_k_dense_replace=2,
                  n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2,
                  topk_group=1, num_attention_heads=4, num_key_value_heads=4, q_lora_rank=96,
                  kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32),
}  # fmt: skip
DEEPSEEK_COMMON = dict(
    norm_topk_prob=True, routed_scaling_factor=2.5, max_position_embeddings=4096,
    rope_parameters={"rope_type": "default", "rope_theta": 10000.0}, rope_interleave=True,
    num_mtp_layers=0, tie_word_embeddings=False,
)  # fmt: skip
INIT_STD = {"llama": 0.08, "deepseek": 0.06}
GATE_STD = 0.01  # router weights: small logits, so bf16 noise rarely flips an expert choice
BIAS_STD = 0.5  # e_score_correction_bias (the choice only, as in DeepSeek-V3)
# A vision tower that constructs and is never run (text-only requests), with no weights.
KIMI_VISION = dict(
    patch_size=14, init_pos_emb_height=4, init_pos_emb_width=4, init_pos_emb_time=1,
    pos_emb_type="divided_fixed", num_attention_heads=2, num_hidden_layers=1, hidden_size=64,
    intermediate_size=128, merge_kernel_size=[2, 2], video_attn_type="spatial_temporal",
    merge_type="sd2_tpool", mm_projector_type="patchmerger", mm_hidden_size=64,
    projector_hidden_act="gelu", projector_ln_eps=1e-5, vt_hidden_size=64,
)  # fmt: skip
KIMI_PROCESSOR_PACKAGE = "eaglepipe_fidelity_kimi_processor"
KIMI_PROCESSOR_SOURCE = '''"""A text-only multimodal processor for a test Kimi-K2.5 checkpoint.

SGLang builds one for every Kimi-K2.5 server; its own needs the real Kimi processor (media
config, image processor) that a test checkpoint does not have. Registered through
SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE; image input is refused.
"""

from sglang.srt.models.kimi_k25 import KimiK25ForConditionalGeneration
from sglang.srt.multimodal.processors.base_processor import BaseMultimodalProcessor


class TextOnlyKimiK25Processor(BaseMultimodalProcessor):
    models = [KimiK25ForConditionalGeneration]

    async def process_mm_data_async(self, image_data, input_text, request_obj, *args, **kwargs):
        raise ValueError("this test Kimi-K2.5 checkpoint has no image processor: text only")
'''


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated subset")
    parser.add_argument("--out", default=None, help="results JSON (markdown beside it)")
    parser.add_argument("--work-root", default=None, help="scratch parent dir (default /tmp)")
    parser.add_argument("--deadline-s", type=float, default=520.0, help="whole-run budget")
    parser.add_argument("--device", default="auto", help="for the transformers references")
    parser.add_argument("--small", action="store_true", help="smaller shapes (CPU checks)")
    parser.add_argument("--keep", action="store_true", help="keep the scratch dir")
    add_engine_options(
        parser,
        "reference: the built-in server on CPU, a check of this script itself (no decode "
        "request, no packing count)",
    )
    args = parser.parse_args(argv)
    models = [m.strip() for m in args.models.split(",") if m.strip()]
    unknown = sorted(set(models) - set(MODELS))
    if unknown or not models:
        parser.error(f"--models: choose from {', '.join(MODELS)} (got {args.models!r})")
    if "kimi" in models and "deepseek" not in models:
        models.insert(models.index("kimi"), "deepseek")  # Kimi reuses its weights and refs
    args.models = models
    if args.dry_run and not args.sglang_version:
        parser.error("--dry-run needs --sglang-version (the launch command depends on it)")
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    return args


# ----------------------------------------------------------------------------- checkpoints


def rows_for(vocab: int) -> list[list[int]]:
    """Seeded token rows clear of the special tokens (ids below 7)."""
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(7, vocab, (n,), generator=gen).tolist() for n in ROW_LENGTHS]


def tokenizer_for(vocab_size: int):
    from eaglepipe.data.toy_target import train_tokenizer

    texts = [
        " ".join(CORPUS_WORDS[(i * 7 + j) % len(CORPUS_WORDS)] for j in range(40))
        for i in range(400)
    ]
    return train_tokenizer(texts, vocab_size, model_max_length=4096)


def save_checkpoint(model, tokenizer, out: Path) -> None:
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
    settings_path = out / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"  # portable across versions
    settings_path.write_text(json.dumps(settings, indent=2))


def build_llama(out: Path, size: str) -> dict:
    from eaglepipe.data.toy_target import build_model

    shape = LLAMA[size]
    tokenizer = tokenizer_for(shape["vocab_size"])
    model = build_model(shape, tokenizer)
    torch.manual_seed(0)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() == 2:  # larger than the default init: neighbouring layers differ
                param.normal_(0.0, INIT_STD["llama"])
    save_checkpoint(model, tokenizer, out)
    return json.loads((out / "config.json").read_text())


def build_deepseek(out: Path, size: str) -> dict:
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    shape = {**DEEPSEEK[size], **DEEPSEEK_COMMON}
    tokenizer = tokenizer_for(shape["vocab_size"])
    config = DeepseekV3Config(
        **shape, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id
    )
    config.architectures = ["DeepseekV3ForCausalLM"]
    torch.manual_seed(0)
    model = DeepseekV3ForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() >= 2:
                std = GATE_STD if name.endswith("mlp.gate.weight") else INIT_STD["deepseek"]
                param.normal_(0.0, std)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, BIAS_STD)
    save_checkpoint(model, tokenizer, out)
    return add_sglang_deepseek_keys(out)


def build_kimi(out: Path, deepseek_dir: Path, packages: Path) -> dict:
    """KimiK25ForConditionalGeneration around the DeepSeek checkpoint's weights."""
    from safetensors.torch import load_file, save_file

    out.mkdir(parents=True, exist_ok=True)
    text = json.loads((deepseek_dir / "config.json").read_text())
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "model_type": "kimi_k25",
        "text_config": text,
        "vision_config": {**KIMI_VISION, "text_hidden_size": text["hidden_size"]},
        "media_placeholder_token_id": 3,
        "pad_token_id": 0,
        "bos_token_id": text.get("bos_token_id"),
        "eos_token_id": text.get("eos_token_id"),
        "tie_word_embeddings": False,
        "dtype": "bfloat16",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weight_files = sorted(deepseek_dir.glob("*.safetensors"))
    index = {"metadata": {}, "weight_map": {}}
    for path in weight_files:
        tensors = {f"language_model.{k}": v for k, v in load_file(str(path)).items()}
        save_file(tensors, str(out / path.name), metadata={"format": "pt"})
        index["weight_map"].update({k: path.name for k in tensors})
    if len(weight_files) > 1:
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    for path in deepseek_dir.iterdir():
        tokenizer_file = path.name.startswith(("tokenizer", "special_tokens", "chat_template"))
        if tokenizer_file:
            shutil.copyfile(path, out / path.name)
    package = packages / KIMI_PROCESSOR_PACKAGE
    package.mkdir(parents=True, exist_ok=True)
    (package / "__init__.py").write_text("")
    (package / "text_only.py").write_text(KIMI_PROCESSOR_SOURCE)
    return config


# ----------------------------------------------------------------------------- references


def references(model_dir: Path, rows: list[list[int]], device: str) -> dict[str, list]:
    """Per row, every hidden state of transformers' forward, [L + 2, T, H] fp32 on the CPU:
    index 0 the embeddings, k + 1 decoder layer k's output, L the post-norm final state, L + 1
    the last layer's pre-norm output (a forward hook)."""
    from transformers import AutoModelForCausalLM

    out = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype).to(device).eval()
        grabbed = {}

        def grab(module, args, output, grabbed=grabbed):
            grabbed["pre_norm"] = output[0] if isinstance(output, tuple) else output

        handle = model.model.layers[-1].register_forward_hook(grab)
        states = []
        with torch.inference_mode():
            for ids in rows:
                result = model(torch.tensor([ids], device=device), output_hidden_states=True)
                stack = [h[0].float().cpu() for h in result.hidden_states]
                states.append(torch.stack([*stack, grabbed["pre_norm"][0].float().cpu()]))
        handle.remove()
        if dtype == torch.float32:
            # The last state transformers reports must be the post-norm one SGLang dumps.
            last = states[0]
            with torch.inference_mode():
                normed = model.model.norm(last[-1].to(device)).float().cpu()
            if rel_l2(last[-2], normed) > 1e-4:
                raise RuntimeError(
                    f"{model_dir}: transformers' last hidden state is not the final norm of the "
                    "last layer's output; the final-state comparison would be wrong"
                )
        out[str(dtype).removeprefix("torch.")] = states
        del model
        if device.startswith("cuda"):
            torch.cuda.empty_cache()
    return out


# ----------------------------------------------------------------------------- comparison


def token_p99(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(np.quantile(token_rel_l2(a.float(), b.float()), 0.99))


def slots(aux_ids: list[int], num_layers: int) -> list[tuple[str, int, list[int]]]:
    """(name, HF index it must equal, neighbouring HF indices) per dumped layer."""
    out = []
    for k in aux_ids:
        out.append((f"aux {k}", k + 1, [i for i in (k, k + 2) if 0 <= i <= num_layers]))
    out.append(("final", num_layers, [num_layers + 1, num_layers - 1]))
    return out


def split_dump(aux: torch.Tensor, final: torch.Tensor, count: int) -> list[torch.Tensor]:
    hidden = final.shape[-1]
    return [*aux.reshape(aux.shape[0], count, hidden).unbind(1), final]


def compare(got: dict, refs: dict, aux_ids: list[int], num_layers: int) -> list[dict]:
    """One entry per dumped layer: errors against the fp32 forward, the floor, neighbours."""
    ids = sorted(got)
    entries = []
    for index, (name, want, neighbours) in enumerate(slots(aux_ids, num_layers)):
        dumped = torch.cat([split_dump(*got[i], len(aux_ids))[index].float() for i in ids])
        fp32 = torch.cat([refs["float32"][i][want] for i in ids])
        bf16 = torch.cat([refs["bfloat16"][i][want] for i in ids])
        near = {
            n: rel_l2(dumped, torch.cat([refs["float32"][i][n] for i in ids])) for n in neighbours
        }
        entry = {
            "layer": name,
            "hf_index": want,
            "tokens": int(dumped.shape[0]),
            "rel_l2": round(rel_l2(dumped, fp32), 5),
            "token_p99": round(token_p99(dumped, fp32), 5),
            "floor_rel_l2": round(rel_l2(bf16, fp32), 5),
            "floor_token_p99": round(token_p99(bf16, fp32), 5),
            "neighbours": {str(n): round(v, 4) for n, v in near.items()},
        }
        # The pipeline's own spot-check rule (validate.spot_check_verdict, its defaults).
        verdict = spot_check_verdict(
            dumped,
            fp32,
            [torch.cat([refs["float32"][i][n] for i in ids]) for n in neighbours],
            floor=rel_l2(bf16, fp32),
        )
        entry["ok"] = verdict.ok
        entry["why"] = "; ".join(verdict.failures())
        entries.append(entry)
    return entries


def compare_shifted(got: dict, refs: dict, aux_ids: list[int], num_layers: int) -> list[dict]:
    """Each aux slot's dump judged as if it were the next layer's (a one-layer shift, the bug
    the spot check exists for): the pipeline's rule must fail every one."""
    ids = sorted(got)
    entries = []
    for index, k in enumerate(aux_ids):
        claimed = k + 2  # HF index of layer k + 1's output
        if claimed + 1 >= num_layers:
            continue  # the shifted claim needs both its neighbours among the pre-norm layers
        dumped = torch.cat([split_dump(*got[i], len(aux_ids))[index].float() for i in ids])
        fp32 = torch.cat([refs["float32"][i][claimed] for i in ids])
        bf16 = torch.cat([refs["bfloat16"][i][claimed] for i in ids])
        neighbours = [
            torch.cat([refs["float32"][i][n] for i in ids]) for n in (claimed - 1, claimed + 1)
        ]
        verdict = spot_check_verdict(dumped, fp32, neighbours, floor=rel_l2(bf16, fp32))
        entries.append(
            {
                "layer": f"aux {k} claimed as {k + 1}",
                "rel_l2": round(verdict.rel_l2, 5),
                "noise_bound": round(verdict.noise_bound, 5),
                "neighbour_bound": round(verdict.neighbour_bound, 5),
                "fails": not verdict.ok,
            }
        )
    return entries


def compare_runs(single: dict, packed: dict, count: int, floors: list[float]) -> list[dict]:
    """Packed dumps against the single ones, per layer, within the same bf16 noise."""
    ids = sorted(set(single) & set(packed))
    out = []
    for index, floor in enumerate(floors):
        a = torch.cat([split_dump(*packed[i], count)[index].float() for i in ids])
        b = torch.cat([split_dump(*single[i], count)[index].float() for i in ids])
        error = rel_l2(a, b)
        out.append(
            {
                "slot": index,
                "rel_l2": round(error, 5),
                "ok": error <= FLOOR_FACTOR * floor + ABS_MARGIN,
            }
        )
    return out


# ----------------------------------------------------------------------------- the server


def server_config(
    model_dir: Path, dump_root: Path, extra_args: list[str], health_s: float, engine="sglang"
):
    from eaglepipe.core.config import validate_config
    from eaglepipe.core.config_files import load_config
    from eaglepipe.core.run import resolve

    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(model_dir)
    config["server"].update(
        engine=engine,
        dtype="bfloat16" if engine == "sglang" else "float32",
        device="auto" if engine == "sglang" else "cpu",
        port=free_port(),
        dump_root=str(dump_root),
        health_timeout_s=max(60, int(health_s)),
        idle_timeout_s=900,
        sglang={"tp_size": 1, "mem_fraction_static": 0.5, "extra_args": list(extra_args)},
    )
    return resolve(validate_config(config))


def post_generate(url: str, ids: list[int], rid: str, max_new_tokens: int) -> dict:
    # ignore_eos: a random model may sample its end-of-sequence token first.
    params = {"max_new_tokens": max_new_tokens, "ignore_eos": True}
    body = {"input_ids": ids, "rid": rid, "sampling_params": params}
    request = urllib.request.Request(
        f"{url}/generate", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.loads(response.read())


def extract(handle, rows: list[list[int]], hidden: int, inflight: int, prefix: str) -> dict:
    """The rows through the project's ExtractionClient: row id -> (aux, final) clones."""
    from eaglepipe.extract.client import ClientSettings, ExtractionClient, RowRequest
    from eaglepipe.server.lifecycle.watch import liveness_check

    settings = ClientSettings(
        request_prefix=prefix,
        max_inflight_requests=inflight,
        max_inflight_bytes=1 << 30,
        retries=0,
        request_timeout_s=120,
        hidden_size=hidden,
    )
    got = {}

    async def on_row(row):
        got[row.row_id] = (
            row.aux_hidden_states.to_torch().clone(),
            row.final_hidden_states.to_torch().clone(),
        )

    client = ExtractionClient(
        handle.url, Path(handle.dump_dir), settings, liveness_check(handle), log=log
    )
    asyncio.run(client.run([RowRequest(i, ids) for i, ids in enumerate(rows)], on_row))
    return got


def check_other_requests(handle, rows: list[list[int]], prefix: str, decode: bool) -> dict:
    """Requests that must leave no dump, and (`decode`) a prefixed one that decodes: one dump,
    of its prompt."""
    from eaglepipe.server.handoff.dumps import read_dump
    from eaglepipe.server.handoff.request_ids import make_rid

    dump_dir = Path(handle.dump_dir)
    ids = rows[2]
    others = [(f"other{prefix}-0123456789ab-1-0", 0), ("0123456789abcdef0123456789abcdef", 0)]
    if decode:
        others.append((f"{prefix}X-decode-1", 4))
    for rid, new_tokens in others:
        post_generate(handle.url, ids, rid, new_tokens)
    time.sleep(1.0)
    stray = sorted(p.name for p in dump_dir.iterdir())
    if not decode:
        return {"stray_dumps": stray, "ok": not stray}
    rid = make_rid(prefix, "fedcba987654", 999, 0)
    answer = post_generate(handle.url, ids, rid, 4)
    deadline = time.monotonic() + 30
    path = dump_dir / f"{rid}.safetensors"
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.5)  # a second dump (a decode step dumped) would land by now
    decoded = sorted(p.name for p in dump_dir.iterdir())
    tokens = None
    if path.exists():
        aux, final, meta = read_dump(path)
        tokens = int(meta["num_tokens"])
        del aux, final
        path.unlink()
    completion = (answer.get("meta_info") or {}).get("completion_tokens")
    result = {
        "stray_dumps": stray,
        "decode_request_dumps": decoded,
        "decode_request_dump_tokens": tokens,
        "decode_request_completion_tokens": completion,
    }
    result["ok"] = not stray and decoded == [path.name] and tokens == len(ids) and completion == 4
    return result


def log_lines(text: str, needles: tuple[str, ...], limit: int = 12) -> list[str]:
    return [ln[:300] for ln in text.splitlines() if any(n in ln for n in needles)][:limit]


def serve_and_compare(name, model_dir, rows, refs, info, work, args, started) -> dict:
    """Start SGLang through the lifecycle, extract single and packed, compare; stop it."""
    from eaglepipe.server.lifecycle.shared_server import start_server, stop_server

    result: dict = {}
    left = args.deadline_s - (time.monotonic() - started)
    if left < 90:
        return {"status": "skipped", "why": f"{left:.0f}s of the run's budget left"}
    extra = list(SGLANG_EXTRA_ARGS)
    if name == "kimi":
        extra += ["--mm-attention-backend", "sdpa"]
    run_dir = work / f"run-{name}"
    run_dir.mkdir()
    dump_root = Path(tempfile.mkdtemp(prefix=f"eaglepipe-fidelity-{name}-", dir=shm_or(work)))
    config = server_config(model_dir, dump_root, extra, min(400, left - 60), args.engine)
    sglang = args.engine == "sglang"
    num_layers, hidden = info["num_layers"], info["hidden_size"]
    aux_ids = config.aux_layer_ids
    result["aux_layer_ids"] = aux_ids
    prefix = config.extract.request_prefix
    handle = None
    with working_directory(run_dir):
        try:
            t0 = time.monotonic()
            handle = start_server(config)
            result["startup_s"] = round(time.monotonic() - t0, 1)
            result["server_info"] = {
                k: handle.info.get(k)
                for k in ("engine_version", "sglang_capture_layer_ids", "aux_layer_ids")
            }
            served = result["server_info"]
            log(
                f"{name}: {args.engine} {served['engine_version']} healthy after "
                f"{result['startup_s']}s; capture ids {served['sglang_capture_layer_ids']}"
            )
            offset = handle.log_path.stat().st_size
            single = extract(handle, rows, hidden, 1, prefix)
            time.sleep(0.5)  # SGLang logs a prefill batch after running it
            between = handle.log_path.stat().st_size
            packed = extract(handle, rows, hidden, len(rows), prefix)
            time.sleep(0.5)
            result["prefill_batches_single"] = prefill_batches(
                log_between(handle.log_path, offset, between)
            )
            result["prefill_batches_packed"] = prefill_batches(
                log_between(handle.log_path, between)
            )
            result["other_requests"] = check_other_requests(handle, rows, prefix, sglang)
        except Exception as exc:  # the other models still run; the error is the result
            result["status"] = "unavailable" if handle is None else "error"
            result["error"] = f"{type(exc).__name__}: {exc}"[:3000]
            traceback.print_exc()
            return result
        finally:
            stop_server()
            logs = sorted((run_dir / "logs" / "server").glob("*.log"))
            if logs:
                text = logs[-1].read_text(errors="replace")
                result["server_log"] = str(logs[-1])
                result["server_log_tail"] = text.splitlines()[-30:]
                result["plugin_and_hook_lines"] = log_lines(
                    text, ("[eaglepipe sglang plugin]", "eaglepipe dump hook", "forward hook")
                )
            shutil.rmtree(dump_root, ignore_errors=True)
    result.update(verdicts(single, packed, refs, aux_ids, num_layers, len(rows)))
    result["packed_batch_max_seqs"] = max(
        (b["seqs"] for b in result["prefill_batches_packed"]), default=0
    )
    if sglang:  # the reference server logs no prefill batches
        result["checks"]["packing_observed"] = result["packed_batch_max_seqs"] >= 2
    result["checks"]["other_requests"] = result["other_requests"]["ok"]
    result["status"] = "ok" if all(result["checks"].values()) else "mismatch"
    return result


def verdicts(single, packed, refs, aux_ids, num_layers, row_count) -> dict:
    single_layers = compare(single, refs, aux_ids, num_layers)
    packed_layers = compare(packed, refs, aux_ids, num_layers)
    floors = [entry["floor_rel_l2"] for entry in single_layers]
    packed_vs_single = compare_runs(single, packed, len(aux_ids), floors)
    shifted = compare_shifted(packed, refs, aux_ids, num_layers)
    return {
        "single": single_layers,
        "packed": packed_layers,
        "packed_vs_single": packed_vs_single,
        "shifted_layer": shifted,
        "checks": {
            "one_dump_per_request": len(single) == row_count and len(packed) == row_count,
            "single_layers": all(e["ok"] for e in single_layers),
            "packed_layers": all(e["ok"] for e in packed_layers),
            "packed_equals_single": all(e["ok"] for e in packed_vs_single),
            "shifted_layer_fails": bool(shifted) and all(e["fails"] for e in shifted),
        },
    }


def shm_or(work: Path) -> str:
    shm = Path("/dev/shm")
    return str(shm) if shm.is_dir() and os.access(shm, os.W_OK) else str(work)


# ----------------------------------------------------------------------------- dry run


def dry_run(name, model_dir, rows, refs, info, work, args) -> dict:
    """The launch command for --sglang-version, and the comparison on transformers' bf16
    states standing in for dumps (must pass) and on a copy shifted by one layer (must fail)."""
    from eaglepipe.server.sglang.recipe import launch_command

    extra = list(SGLANG_EXTRA_ARGS) + (["--mm-attention-backend", "sdpa"] if name == "kimi" else [])
    config = server_config(model_dir, work / "dumps", extra, 300)
    argv, env = launch_command(
        config, host="127.0.0.1", port=config.server.port, dump_dir=work / "dumps" / "x",
        instance_id="dry-run", sglang_version=args.sglang_version,
    )  # fmt: skip
    aux_ids = config.aux_layer_ids
    num_layers = info["num_layers"]

    def stand_in(offset: int) -> dict:
        got = {}
        for i, states in enumerate(refs["bfloat16"]):
            aux = torch.cat([states[k + 1 + offset] for k in aux_ids], dim=-1).to(torch.bfloat16)
            got[i] = (aux, states[num_layers].to(torch.bfloat16))
        return got

    result = verdicts(stand_in(0), stand_in(0), refs, aux_ids, num_layers, len(rows))
    shifted = compare(stand_in(1), refs, aux_ids, num_layers)
    result["shifted_by_one_layer"] = shifted
    result["checks"]["shifted_copy_fails"] = not any(e["ok"] for e in shifted[:-1])
    result["argv"] = argv
    result["env"] = {k: v for k, v in env.items() if k != "PYTHONPATH"}
    result["aux_layer_ids"] = aux_ids
    result["status"] = "ok" if all(result["checks"].values()) else "mismatch"
    return result


# ----------------------------------------------------------------------------- report


def report(results: dict) -> str:
    rows = []
    for name, entry in results["models"].items():
        for phase in ("single", "packed"):
            for layer in entry.get(phase, []):
                near = " / ".join(f"{v:.3f}" for v in layer["neighbours"].values())
                rows.append([
                    name, phase, layer["layer"], f"HF[{layer['hf_index']}]", layer["rel_l2"],
                    layer["token_p99"], layer["floor_rel_l2"], layer["floor_token_p99"], near,
                    "ok" if layer["ok"] else f"MISMATCH ({layer['why']})",
                ])  # fmt: skip
    header = ["model", "requests", "layer", "vs", "rel L2", "token p99", "bf16 floor",
              "floor p99", "neighbours", "verdict"]  # fmt: skip
    shifted_rows = [
        [name, layer["layer"], layer["rel_l2"], layer["noise_bound"], layer["neighbour_bound"],
         "fails (right)" if layer["fails"] else "PASSES (wrong)"]
        for name, entry in results["models"].items()
        for layer in entry.get("shifted_layer", [])
    ]  # fmt: skip
    status_rows = []
    for name, entry in results["models"].items():
        checks = entry.get("checks", {})
        failed = [k for k, v in checks.items() if not v]
        status_rows.append([
            name, entry.get("status"), entry.get("startup_s"),
            (entry.get("server_info") or {}).get("engine_version"),
            (entry.get("server_info") or {}).get("sglang_capture_layer_ids"),
            entry.get("packed_batch_max_seqs"),
            ", ".join(failed) or entry.get("error", entry.get("why", ""))[:160],
        ])  # fmt: skip
    return (
        "### SGLang dumps vs an independent transformers forward\n\n"
        + markdown_table(header, rows)
        + "\nThe same packed dumps judged as the next layer's (a one-layer shift) by the "
        "pipeline's spot-check rule:\n\n"
        + markdown_table(
            ["model", "dump", "rel L2", "noise bound", "neighbour bound", "verdict"],
            shifted_rows,
        )
        + "\n"
        + markdown_table(
            [
                "model",
                "status",
                "start s",
                "SGLang",
                "capture ids",
                "max seqs/prefill",
                "failed checks",
            ],  # fmt: skip
            status_rows,
        )
        + f"\nCommand: `{results['command']}`\n"
    )


def main(argv=None) -> int:
    args = parse_args(argv)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    started = time.monotonic()
    size = "small" if args.small else "full"
    work = Path(tempfile.mkdtemp(prefix="eaglepipe-fidelity-", dir=args.work_root))
    results: dict = {
        "benchmark": "sglang_fidelity",
        "command": command_line(),
        "machine": machine_info(args.device),
        "dry_run": args.dry_run,
        "size": size,
        "criteria": {
            "layers": "eaglepipe.validate.spot_check_verdict with its defaults",
            "noise_margin": DEFAULT_NOISE_MARGIN,
            "neighbour_fraction": DEFAULT_NEIGHBOUR_FRACTION,
            "packed_vs_single_floor_factor": FLOOR_FACTOR,
            "packed_vs_single_abs_margin": ABS_MARGIN,
        },
        "models": {},
    }
    shared: dict = {}
    try:
        for name in args.models:
            log(f"--- {name}")
            entry = results["models"][name] = {}
            try:
                t0 = time.monotonic()
                model_dir = work / name
                if name == "llama":
                    config = build_llama(model_dir, size)
                elif name == "deepseek":
                    config = build_deepseek(model_dir, size)
                else:
                    config = build_kimi(model_dir, shared["deepseek_dir"], work / "packages")
                    packages = str(work / "packages")
                    os.environ["PYTHONPATH"] = os.pathsep.join(
                        p for p in (packages, os.environ.get("PYTHONPATH", "")) if p
                    )
                    os.environ["SGLANG_EXTERNAL_MM_PROCESSOR_PACKAGE"] = KIMI_PROCESSOR_PACKAGE
                text = config.get("text_config") or config
                info = {"num_layers": text["num_hidden_layers"], "hidden_size": text["hidden_size"]}
                entry["config"] = {k: v for k, v in config.items() if k != "text_config"}
                entry["build_s"] = round(time.monotonic() - t0, 1)
                rows = rows_for(text["vocab_size"])
                if name == "kimi":  # the same language-model weights as the DeepSeek model
                    refs = shared["deepseek_refs"]
                else:
                    t0 = time.monotonic()
                    refs = references(model_dir, rows, args.device)
                    entry["references_s"] = round(time.monotonic() - t0, 1)
                if name == "deepseek":
                    shared.update(deepseek_dir=model_dir, deepseek_refs=refs)
                runner = dry_run if args.dry_run else serve_and_compare
                extra = () if args.dry_run else (started,)
                entry.update(runner(name, model_dir, rows, refs, info, work, args, *extra))
            except Exception as exc:  # report and go on with the next model
                traceback.print_exc()
                entry.update(status="error", error=f"{type(exc).__name__}: {exc}"[:3000])
            log(f"{name}: {entry.get('status')} {json.dumps(entry.get('checks', {}))}")
            write_results(args.out, results)
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    markdown = report(results)
    print("\n" + markdown, flush=True)
    write_results(args.out, results, markdown)
    return 0 if all(passed(name, e) for name, e in results["models"].items()) else 1


def passed(name: str, entry: dict) -> bool:
    """Every model must pass; a Kimi server that could not start is reported, not failed."""
    if name == "kimi" and entry.get("status") in ("unavailable", "skipped"):
        return True
    return entry.get("status") == "ok"


if __name__ == "__main__":
    sys.exit(main())
