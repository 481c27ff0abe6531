"""Drafter variants (train.drafter): options, shapes, what each flag does, the MLA layer against
transformers' DeepSeek-V3 attention, a training step, the export round trip per engine (export,
load with the engine's names, same logits), refusals, and the SGLang contract of the MLA
export against both ends of the supported range (source parsed with ast, never imported)."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

import pytest
import torch
from pipeline_run import default_config, run_snakemake, small_config, write_config
from safetensors.torch import save
from sglang_source import range_ends, sglang_source_root
from test_drafter_export import (
    assigned_literal,
    deepseek_config,
    export_run,
    find_function,
    llama_config,
    parse,
    self_attributes,
)

from eaglepipe.core.atomic import atomic_write_bytes
from eaglepipe.core.config import validate_config
from eaglepipe.core.config_files import load_config
from eaglepipe.core.drafter_options import NORM_FLAGS, default_options, drafter_options
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.run import resolve
from eaglepipe.drafter import engine_load as el
from eaglepipe.drafter import export as ex
from eaglepipe.drafter.loss import ttt_loss
from eaglepipe.drafter.model import DrafterConfig, Eagle3Drafter
from eaglepipe.drafter.variants import (
    ENGINE_OPTIONS,
    check_export_support,
    check_mla_serving,
    triton_mla_decode_fits,
)
from eaglepipe.drafter.vocab import choose_draft_vocab, save_vocab

# (name, options): every flag alone, the 3.1 pair, and the MLA layer plain and with the pair.
VARIANTS = {
    "plain": {},
    "fc_norm": {"fc_norm": True},
    "norm_before_fc": {"norm_before_fc": True},
    "norm_output": {"norm_output": True},
    "norm_before_residual": {"norm_before_residual": True},
    "fc_norm+norm_output": {"fc_norm": True, "norm_output": True},
    "mla": {"layer": "mla"},
    "mla+fc_norm+norm_output": {"layer": "mla", "fc_norm": True, "norm_output": True},
    "mla+norm_before_residual": {"layer": "mla", "norm_before_residual": True},
}
LLAMA_PARAMS = {
    "fc.weight": (32, 96),
    "norm.weight": (32,),
    "lm_head.weight": (24, 32),
    "midlayer.input_layernorm.weight": (32,),
    "midlayer.hidden_norm.weight": (32,),
    "midlayer.post_attention_layernorm.weight": (32,),
    "midlayer.mlp.gate_proj.weight": (48, 32),
    "midlayer.mlp.up_proj.weight": (48, 32),
    "midlayer.mlp.down_proj.weight": (32, 48),
}
ATTENTION_PARAMS = {
    # llama_config(): 4 heads of 8, 2 KV heads.
    "llama": {
        "midlayer.self_attn.q_proj.weight": (32, 64),
        "midlayer.self_attn.k_proj.weight": (16, 64),
        "midlayer.self_attn.v_proj.weight": (16, 64),
        "midlayer.self_attn.o_proj.weight": (32, 32),
    },
    # deepseek_config(): 4 heads, q_lora 16, kv_lora 24, nope 8, rope 8, v 8.
    "mla": {
        "midlayer.self_attn.q_a_proj.weight": (16, 64),
        "midlayer.self_attn.q_a_layernorm.weight": (16,),
        "midlayer.self_attn.q_b_proj.weight": (64, 16),
        "midlayer.self_attn.kv_a_proj_with_mqa.weight": (32, 64),
        "midlayer.self_attn.kv_a_layernorm.weight": (24,),
        "midlayer.self_attn.kv_b_proj.weight": (64, 24),
        "midlayer.self_attn.o_proj.weight": (32, 32),
    },
}


def options(**given) -> dict:
    return drafter_options(given)


def variant_config(name: str) -> DrafterConfig:
    given = options(**VARIANTS[name])
    target = deepseek_config() if given["layer"] == "mla" else llama_config()
    return DrafterConfig.from_target(target, 24, given)


def random_drafter(config: DrafterConfig, seed: int = 0) -> Eagle3Drafter:
    """A drafter with every weight random (norms too, so a norm's weight matters)."""
    torch.manual_seed(seed)
    model = Eagle3Drafter(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight") or ".fc_norm." in f".{name}":
                param.uniform_(0.5, 1.5)
            elif name == "embed_tokens.weight":
                param.normal_()
    return model


def unroll(model: Eagle3Drafter, seed: int = 1, steps: int = 3, length: int = 6):
    generator = torch.Generator().manual_seed(seed)
    c = model.config
    aux = torch.randn(2, length, 3 * c.hidden_size, generator=generator)
    ids = [torch.randint(0, c.vocab_size, (2, length), generator=generator) for _ in range(steps)]
    return model(aux, ids)


# ---------------------------------------------------------------------------------------------
# Options


def project_config(drafter: dict | None) -> dict:
    """The embedded default with `train.drafter` replaced (or removed, for None)."""
    config = default_config()
    config["train"].pop("drafter")
    if drafter is not None:
        config["train"]["drafter"] = drafter
    return config


def test_options_default_to_the_plain_llama_layer_and_are_schema_checked():
    run = resolve(validate_config(project_config(None)))
    assert drafter_options(run.train.drafter.as_dict()) == default_options()
    assert drafter_options(None) == default_options()
    run = resolve(validate_config(project_config({"layer": "mla", "mla": {"q_lora_rank": 64}})))
    assert run.train.drafter.layer == "mla" and run.train.drafter.mla.kv_lora_rank is None
    assert drafter_options(run.train.drafter.as_dict())["mla"] == {"q_lora_rank": 64}
    # Options that contradict each other stop the run description, in one line.
    with pytest.raises(PipelineError, match="fc_norm and norm_before_fc exclude each other"):
        resolve(validate_config(project_config({"fc_norm": True, "norm_before_fc": True})))
    for bad, key in (
        ({"layer": "gqa"}, "train.drafter.layer"),
        ({"fc_nrom": True}, "train.drafter.fc_nrom"),
        ({"mla": {"qk_rope_head_dim": 7}}, "train.drafter.mla.qk_rope_head_dim"),
        ({"norm_output": "yes"}, "train.drafter.norm_output"),
    ):
        with pytest.raises(PipelineError, match=f"config key {key}"):
            validate_config(project_config(bad))


def test_contradictory_options_are_refused_in_one_line():
    with pytest.raises(PipelineError, match="fc_norm and norm_before_fc exclude each other"):
        options(fc_norm=True, norm_before_fc=True)
    with pytest.raises(PipelineError, match="mla is set but train.drafter.layer is llama"):
        options(mla={"kv_lora_rank": 8})


@pytest.mark.parametrize(
    ("given", "engines", "message"),
    [
        (
            {"norm_before_residual": True},
            ["sglang", "vllm"],
            "export.engines has sglang, which cannot load a drafter with "
            "train.drafter.norm_before_residual (layer llama)",
        ),
        (
            {"norm_before_fc": True},
            ["vllm", "sglang"],
            "export.engines has sglang, which cannot load a drafter with "
            "train.drafter.norm_before_fc (layer llama): SGLang 0.5.14",
        ),
        (
            {"layer": "mla", "norm_before_fc": True},
            ["vllm"],
            "export.engines has vllm, which cannot load a drafter with "
            "train.drafter.norm_before_fc (layer mla)",
        ),
    ],
)
def test_an_export_an_engine_cannot_load_is_refused_naming_engine_and_option(
    given, engines, message
):
    with pytest.raises(PipelineError, match="^" + re.escape(message)):
        check_export_support(options(**given), engines)


def test_every_option_is_exported_to_an_engine_that_loads_it():
    check_export_support(options(fc_norm=True, norm_output=True), ["sglang", "vllm"])
    check_export_support(options(layer="mla", fc_norm=True, norm_output=True), ["sglang", "vllm"])
    check_export_support(options(norm_before_fc=True, norm_before_residual=True), ["vllm"])
    check_export_support(options(layer="mla", norm_before_residual=True), ["vllm"])


def test_the_workflow_refuses_such_a_variant_when_it_parses_the_config(tmp_path):
    config = small_config(tmp_path)
    config["train"]["drafter"] = {"norm_before_residual": True}
    write_config(tmp_path, config)
    result = run_snakemake(tmp_path, "-n", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    (line,) = [line for line in output.splitlines() if line.startswith("error:")]
    assert "export.engines has sglang" in line and "train.drafter.norm_before_residual" in line
    assert "Traceback" not in output
    # With vLLM alone the same variant is a valid run.
    config["export"]["engines"] = ["vllm"]
    write_config(tmp_path, config)
    assert run_snakemake(tmp_path, "-n", check=False).returncode == 0


def test_mla_dimensions_come_from_the_target_unless_set():
    target = deepseek_config()
    c = DrafterConfig.from_target(target, 24, options(layer="mla"))
    assert (c.q_lora_rank, c.kv_lora_rank, c.qk_nope_head_dim, c.qk_rope_head_dim) == (
        16,
        24,
        8,
        8,
    )
    assert c.v_head_dim == 8 and c.head_dim == 16 and c.num_key_value_heads == 4
    c = DrafterConfig.from_target(target, 24, options(layer="mla", mla={"kv_lora_rank": 32}))
    assert c.kv_lora_rank == 32 and c.q_lora_rank == 16
    # The plain layer for the same target keeps its Llama shape.
    assert DrafterConfig.from_target(target, 24).head_dim == 8


def test_an_mla_layer_needs_an_mla_target_and_a_low_rank_query():
    with pytest.raises(PipelineError, match="layer is mla, but the target has no multi-latent"):
        DrafterConfig.from_target(llama_config(), 24, options(layer="mla"))
    lite = {**deepseek_config(), "q_lora_rank": None}  # DeepSeek-V2-Lite has no q_lora_rank
    with pytest.raises(PipelineError, match="set train.drafter.mla.q_lora_rank$"):
        DrafterConfig.from_target(lite, 24, options(layer="mla"))
    c = DrafterConfig.from_target(lite, 24, options(layer="mla", mla={"q_lora_rank": 12}))
    assert c.q_lora_rank == 12
    scaled = deepseek_config()
    scaled["rope_parameters"] = {"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}
    with pytest.raises(PipelineError, match="linear RoPE scaling with train.drafter.layer mla"):
        DrafterConfig.from_target(scaled, 24, options(layer="mla"))


# ---------------------------------------------------------------------------------------------
# Shapes and what each flag does


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_has_the_parameters_its_engines_load(name):
    config = variant_config(name)
    model = Eagle3Drafter(config)
    expected = {**LLAMA_PARAMS, **ATTENTION_PARAMS[config.layer]}
    if config.fc_norm:
        expected.update({f"fc_norm.{i}.weight": (32,) for i in range(3)})
    if config.norm_before_fc:
        expected["input_norm.weight"] = (96,)
    shapes = {
        k: tuple(v.shape)
        for k, v in model.trainable_state_dict().items()
        if k not in ("d2t", "t2d")
    }
    assert shapes == expected
    logits = unroll(model)
    assert [tuple(x.shape) for x in logits] == [(2, 6, 24)] * 3
    assert all(torch.isfinite(x).all() for x in logits)


def test_a_config_written_before_the_variants_loads_as_the_plain_drafter():
    old = json.loads(variant_config("plain").to_json())
    for key in ("layer", *NORM_FLAGS, "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim"):
        old.pop(key)
    assert DrafterConfig.from_json(json.dumps(old)) == variant_config("plain")


def test_fc_norm_normalises_each_aux_layer_and_norm_before_fc_all_three():
    aux = torch.randn(2, 5, 96)
    one_scaled = aux.clone()
    one_scaled[..., 32:64] *= 7.0
    for name, invariant_to in (("fc_norm", one_scaled), ("norm_before_fc", aux * 7.0)):
        model = random_drafter(variant_config(name))
        torch.testing.assert_close(model.project(invariant_to), model.project(aux))
        plain = random_drafter(variant_config("plain"))
        assert not torch.allclose(plain.project(invariant_to), plain.project(aux))
    # norm_before_fc is one norm over all three: scaling one layer alone changes its output.
    model = random_drafter(variant_config("norm_before_fc"))
    assert not torch.allclose(model.project(one_scaled), model.project(aux))


def test_norm_output_hands_the_next_step_the_post_norm_hidden_state():
    for name in ("plain", "norm_output"):
        model = random_drafter(variant_config(name))
        ids = torch.randint(0, 64, (1, 5))
        hidden = torch.randn(1, 5, 32)
        positions = torch.arange(5)[None]
        pre = model.midlayer(model.embed_tokens(ids), hidden, positions, [])
        nxt, logits = model.step(ids, hidden, positions, [])
        torch.testing.assert_close(logits, model.lm_head(model.norm(pre)))
        torch.testing.assert_close(nxt, model.norm(pre) if name == "norm_output" else pre)


def test_norm_before_residual_takes_the_residual_after_hidden_norm():
    embeds, hidden = torch.randn(1, 5, 32), torch.randn(1, 5, 32)
    positions = torch.arange(5)[None]
    for name, invariant in (("norm_before_residual", True), ("plain", False)):
        layer = random_drafter(variant_config(name)).midlayer
        # With the residual normalised, the layer no longer sees the hidden state's scale.
        scaled = layer(embeds, 50.0 * hidden, positions, [])
        assert torch.allclose(scaled, layer(embeds, hidden, positions, []), atol=1e-5) is invariant


# ---------------------------------------------------------------------------------------------
# The MLA layer computes what transformers' DeepSeek-V3 attention computes


YARN = {
    "rope_type": "yarn",
    "factor": 40.0,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
    "original_max_position_embeddings": 64,
}


@pytest.mark.parametrize("rope_scaling", [None, YARN], ids=["default-rope", "deepseek-yarn"])
def test_mla_attention_matches_transformers_deepseek_v3_attention(rope_scaling):
    """Same weights, same input: our MLA layer (plain form, interleaved RoPE, YaRN mscale) and
    transformers' DeepseekV3Attention, widened to the draft's 2H input, agree at step 0."""
    from transformers import DeepseekV3Config
    from transformers.models.deepseek_v3 import modeling_deepseek_v3 as dsv3

    hidden = 16
    shape = dict(
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=8,
        kv_lora_rank=12,
        qk_nope_head_dim=8,
        qk_rope_head_dim=6,
        v_head_dim=10,
        max_position_embeddings=4096,
        rms_norm_eps=1e-6,
    )
    if rope_scaling:
        shape["rope_parameters"] = {"rope_theta": 10000.0, **rope_scaling}
    reference_config = DeepseekV3Config(hidden_size=2 * hidden, **shape)
    reference_config._attn_implementation = "eager"
    assert reference_config.rope_interleave  # the DeepSeek-V3 default, as the engines serve MLA
    target = {**reference_config.to_dict(), "hidden_size": hidden, "intermediate_size": 24}
    ours = Eagle3Drafter(DrafterConfig.from_target(target, 24, options(layer="mla")))
    attention = ours.midlayer.self_attn
    torch.manual_seed(0)
    with torch.no_grad():
        for param in attention.parameters():
            param.normal_(std=0.3)
    reference = dsv3.DeepseekV3Attention(reference_config, 0)
    reference.o_proj = torch.nn.Linear(4 * 10, hidden, bias=False)
    reference.load_state_dict(attention.state_dict(), strict=True)

    length = 7
    x = torch.randn(1, length, 2 * hidden)
    positions = torch.arange(100, 100 + length)[None]
    cos_sin = dsv3.DeepseekV3RotaryEmbedding(reference_config)(x, positions)
    causal = torch.full((length, length), float("-inf")).triu(1)[None, None]
    want = reference(x, cos_sin, causal)[0]
    torch.testing.assert_close(attention(x, positions, []), want, rtol=1e-5, atol=1e-5)
    assert attention.scale == pytest.approx(reference.scaling)


# ---------------------------------------------------------------------------------------------
# A training step


@pytest.mark.parametrize("name", VARIANTS)
def test_each_variant_trains(name):
    """Every trainable parameter (the variant's norms included) gets a gradient, and a few
    steps on one batch bring the TTT loss down."""
    config = variant_config(name)
    model = random_drafter(config)
    vocab = choose_draft_vocab(torch.arange(64).flip(0).numpy(), 24)
    model.d2t.copy_(vocab.d2t)
    model.t2d.copy_(vocab.t2d)
    generator = torch.Generator().manual_seed(0)
    length = 12
    batch = {
        "input_ids": torch.randint(0, 24, (2, length), generator=generator),
        "loss_mask": torch.ones(2, length, dtype=torch.uint8),
        "lengths": torch.tensor([length, length - 3]),
        "aux_hidden_states": torch.randn(2, length, 96, generator=generator),
        "final_hidden_states": torch.randn(2, length, 32, generator=generator),
    }
    lm_head = torch.randn(64, 32, generator=generator)
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=3e-3)
    losses = []
    for step in range(8):
        result = ttt_loss(model, batch, lm_head, vocab.draft_ids, vocab.t2d, 3, 0.8)
        optimizer.zero_grad()
        result.loss.backward()
        if step == 0:
            for param_name, param in model.named_parameters():
                if param.requires_grad:
                    assert param.grad is not None and param.grad.abs().sum() > 0, param_name
        optimizer.step()
        losses.append(float(result.loss.detach()))
    assert losses[-1] < 0.9 * losses[0], losses


# ---------------------------------------------------------------------------------------------
# Export, load with the engine's names, same logits


def export_variant(
    tmp_path: Path, name: str, engines: list[str], config: DrafterConfig | None = None
) -> tuple[Path, Eagle3Drafter]:
    config = config or variant_config(name)
    target = deepseek_config() if config.layer == "mla" else llama_config()
    model_dir = tmp_path / "target"
    model_dir.mkdir(parents=True, exist_ok=True)
    (model_dir / "config.json").write_text(json.dumps(target))
    model = random_drafter(config)
    vocab = choose_draft_vocab(torch.arange(64).flip(0).numpy(), 24)
    model.d2t.copy_(vocab.d2t)
    model.t2d.copy_(vocab.t2d)
    save_vocab(vocab, tmp_path / "vocab.safetensors")
    tensors = {k: v.contiguous() for k, v in model.trainable_state_dict().items()}
    meta = {"drafter_config": config.to_json(), "aux_layer_ids": json.dumps([1, 3, 4])}
    atomic_write_bytes(tmp_path / "model.safetensors", save(tensors, metadata=meta))
    ex.export(
        export_run(model_dir, engines),
        model_path=str(tmp_path / "model.safetensors"),
        vocab_path=str(tmp_path / "vocab.safetensors"),
        out_dir=str(tmp_path / "export"),
    )
    return tmp_path / "export", model


def engines_for(name: str) -> list[str]:
    given = options(**VARIANTS[name])
    flags = {f for f in NORM_FLAGS if given[f]}
    return [e for e in ex.ENGINES if flags <= ENGINE_OPTIONS[(e, given["layer"])]]


@pytest.mark.parametrize(
    ("name", "engine"), [(n, e) for n in VARIANTS for e in engines_for(n)], ids=str
)
def test_export_round_trip_gives_the_same_logits(tmp_path, name, engine):
    export_dir, model = export_variant(tmp_path, name, [engine])
    exported = json.loads((export_dir / engine / "config.json").read_text())
    assert exported["architectures"] == [
        "Eagle3DeepseekV2ForCausalLM" if "mla" in name else "LlamaForCausalLMEagle3"
    ]
    config, params = el.load_like_engine(export_dir / engine)
    assert set(params) - {"hot_token_id"} == set(el.engine_param_shapes(engine, config)) - {
        "model.embed_tokens.weight"
    }
    rebuilt = el.drafter_from_engine_params(config, params)
    assert rebuilt.config == model.config
    # The export is bf16: compare with the drafter whose weights went through bf16.
    rounded = Eagle3Drafter(model.config)
    rounded.load_state_dict(
        {
            k: v.to(torch.bfloat16).float() if v.is_floating_point() else v
            for k, v in model.state_dict().items()
        }  # fmt: skip
    )
    with torch.no_grad():
        rebuilt.embed_tokens.weight.copy_(rounded.embed_tokens.weight)
        for want, got in zip(unroll(rounded), unroll(rebuilt), strict=True):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        assert torch.equal(rebuilt.d2t, model.d2t) and torch.equal(rebuilt.t2d, model.t2d)


@pytest.mark.parametrize(
    ("name", "engine"), [("norm_before_residual", "sglang"), ("mla+norm_before_residual", "sglang")]
)
def test_export_refuses_an_engine_that_cannot_load_the_variant(tmp_path, name, engine):
    with pytest.raises(PipelineError, match=f"export.engines has {engine}, which cannot load"):
        export_variant(tmp_path, name, [engine])
    assert not (tmp_path / "export").exists()


@pytest.mark.parametrize(
    ("kv_lora_rank", "qk_rope_head_dim", "fits"),
    # Served or crashed on the H200 (SGLang 0.5.14, BENCHMARKS.md): 32 + 8 and 64 + 16 crashed,
    # 48 + 16 and 256 + 32 served; 512 + 64 is DeepSeek-V3's and Kimi-K2.5's own.
    [(32, 8, False), (64, 16, False), (48, 16, True), (256, 32, True), (512, 64, True),
     (16, 8, False), (24, 8, True), (128, 64, False)],
)  # fmt: skip
def test_the_triton_mla_decode_rule(kv_lora_rank, qk_rope_head_dim, fits):
    assert triton_mla_decode_fits(kv_lora_rank, qk_rope_head_dim) is fits


def test_an_mla_layer_sglang_cannot_decode_is_refused_before_anything_is_written(tmp_path):
    target = deepseek_config()  # kv_lora_rank 24 + rope 8: served
    check_mla_serving(["sglang"], DrafterConfig.from_target(target, 24, options(layer="mla")))
    narrow = DrafterConfig.from_target(target, 24, options(layer="mla", mla={"kv_lora_rank": 16}))
    expected = (
        "export.engines has sglang, which cannot serve this MLA draft layer: SGLang's Triton "
        "MLA decode kernel (0.5.14 to 0.5.23) needs next_power_of_2(kv_lora_rank + "
        "qk_rope_head_dim) to equal next_power_of_2(kv_lora_rank) (or the sum to be 288 or "
        "576), and the layer has kv_lora_rank 16 + qk_rope_head_dim 8 = 24; set "
        "train.drafter.mla.kv_lora_rank (e.g. 24) or drop sglang from export.engines"
    )
    with pytest.raises(PipelineError) as refused:
        export_variant(tmp_path / "sglang", "mla", ["sglang", "vllm"], narrow)
    assert str(refused.value) == expected
    assert not (tmp_path / "sglang" / "export").exists()
    # vLLM serves MLA with its own kernels; the plain layer has no latent cache.
    export_dir, _ = export_variant(tmp_path / "vllm", "mla", ["vllm"], narrow)
    assert (export_dir / "vllm" / "model.safetensors").is_file()
    check_mla_serving(["sglang"], DrafterConfig.from_target(target, 24, options(layer="llama")))


def test_training_refuses_an_mla_layer_sglang_cannot_decode_before_reading_any_data(tmp_path):
    from eaglepipe.drafter.train import train

    model_dir = tmp_path / "target"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(deepseek_config()))
    config = load_config(Path(__file__).resolve().parent.parent / "config.yaml")
    config["model"]["path"] = str(model_dir)
    config["export"]["engines"] = ["sglang"]
    config["train"]["drafter"] = {"layer": "mla", "mla": {"kv_lora_rank": 16}}
    save_vocab(choose_draft_vocab(torch.arange(64).flip(0).numpy(), 24), tmp_path / "vocab")
    missing = tmp_path / "not-read"  # no table or shards: refused before either is read
    with pytest.raises(PipelineError, match=r"kv_lora_rank 16 \+ qk_rope_head_dim 8 = 24"):
        train(
            resolve(config), vocab_path=str(tmp_path / "vocab"), table_path=str(missing),
            manifests=[], validated=[],
            out_path=str(tmp_path / "model.safetensors"), log_path=str(tmp_path / "log.jsonl"),
            checkpoint_dir=str(tmp_path / "checkpoints"),
        )  # fmt: skip
    assert not (tmp_path / "model.safetensors").exists()


def test_an_export_the_engine_would_read_differently_fails_the_round_trip(tmp_path):
    """The round trip is the check: a flag under a key the engine does not read, or a weight
    it would not load, is caught."""
    export_dir, _ = export_variant(tmp_path, "fc_norm", ["sglang"])
    config_path = export_dir / "sglang" / "config.json"
    config = json.loads(config_path.read_text())
    config["eagle_config"]["fc_norm"] = config.pop("fc_norm")  # not where SGLang reads it
    config_path.write_text(json.dumps(config))
    with pytest.raises(PipelineError, match="sglang loads fc_norm.0.weight into no parameter"):
        el.load_like_engine(export_dir / "sglang")


def test_the_mla_export_config_loads_as_transformers_deepseek_v3(tmp_path):
    """SGLang and vLLM read the draft config through transformers' AutoConfig."""
    from transformers import AutoConfig

    export_dir, model = export_variant(tmp_path, "mla+fc_norm+norm_output", ["sglang", "vllm"])
    for engine in ("sglang", "vllm"):
        loaded = AutoConfig.from_pretrained(export_dir / engine)
        assert type(loaded).__name__ == "DeepseekV3Config"
        c = model.config
        assert (loaded.q_lora_rank, loaded.kv_lora_rank, loaded.v_head_dim) == (16, 24, 8)
        assert (loaded.qk_nope_head_dim, loaded.qk_rope_head_dim) == (8, 8)
        assert loaded.num_hidden_layers == 1 and loaded.rope_interleave is True
        assert loaded.fc_norm is True and loaded.norm_output is True
        assert loaded.hidden_size == c.hidden_size and loaded.draft_vocab_size == 24
        assert loaded.intermediate_size == c.intermediate_size


# ---------------------------------------------------------------------------------------------
# SGLang's sources, both ends of the supported range


@pytest.fixture(scope="module", params=range_ends())
def sglang_root(request) -> Path:
    return sglang_source_root(request.param)


DRAFT_MODULES = {"llama": "llama_eagle3.py", "mla": "kimi_k25_eagle3.py"}


def constants(path: Path) -> set[str]:
    return {n.value for n in ast.walk(parse(path)) if isinstance(n, ast.Constant)}


def test_engine_options_table_matches_what_every_sglang_release_reads():
    """An option counts as loaded by SGLang only if both ends' draft class reads its key."""
    for layer, module in DRAFT_MODULES.items():
        read_by_all = set(NORM_FLAGS)
        for version in range_ends():
            path = sglang_source_root(version) / "srt" / "models" / module
            read_by_all &= constants(path)
        assert ENGINE_OPTIONS[("sglang", layer)] == read_by_all, layer


def test_sglang_serves_the_mla_architecture_as_mla(sglang_root):
    path = sglang_root / "srt" / "models" / "kimi_k25_eagle3.py"
    tree = parse(path)
    entry = [n for n in tree.body if isinstance(n, ast.Assign) and n.targets[0].id == "EntryClass"]
    assert ast.unparse(entry[0].value) == "[Eagle3DeepseekV2ForCausalLM]"
    model_config = (sglang_root / "srt" / "configs" / "model_config.py").read_text()
    assert '"Eagle3DeepseekV2ForCausalLM" in self.hf_config.architectures' in model_config
    # Interleaved RoPE unless the config says otherwise; the export says true explicitly.
    deepseek = (sglang_root / "srt" / "models" / "deepseek_v2.py").read_text()
    assert 'is_neox_style = not getattr(config, "rope_interleave", True)' in deepseek
    # The export holds no embedding: the draft worker hands it the target's.
    find_function(tree, "Eagle3DeepseekV2ForCausalLM", "set_embed")
    worker = (sglang_root / "srt" / "speculative" / "eagle_worker_v2.py").read_text()
    assert "self.draft_runner.model.set_embed(embed)" in worker


def test_the_triton_mla_decode_rule_is_the_one_each_sglang_release_has(sglang_root):
    """check_mla_serving's rule, read from `_decode_grouped_att_m_fwd` at both range ends."""
    places = ["srt/layers/attention/triton_ops/decode_attention.py",  # 0.5.14
              "kernels/ops/attention/decode_attention.py"]  # 0.5.23  # fmt: skip
    source = next(sglang_root / p for p in places if (sglang_root / p).exists()).read_text()
    grouped = source[source.index("def _decode_grouped_att_m_fwd(") :]
    grouped = grouped[: grouped.index("\ndef ", 1)]
    for line in ("if Lk == 576:", "BLOCK_DMODEL = 512", "elif Lk == 288:", "BLOCK_DMODEL = 256",
                 "BLOCK_DMODEL = triton.next_power_of_2(Lk)",
                 "BLOCK_DV = triton.next_power_of_2(Lv)"):  # fmt: skip
        assert line in grouped, line
    assert "v = tl.trans(k)" in source  # MLA's values are the latent block, Lk wide


def test_mla_name_tables_match_the_sglang_source(sglang_root):
    tree = parse(sglang_root / "srt" / "models" / "kimi_k25_eagle3.py")
    load = find_function(tree, "Eagle3DeepseekV2ForCausalLM", "load_weights")
    assert assigned_literal(load, "stacked_params_mapping") == el.SGLANG_MLA_STACKED_PARAMS
    renames = [
        [ast.literal_eval(a) for a in n.args[:2]]
        for n in ast.walk(load)
        if isinstance(n, ast.Call) and ast.unparse(n.func) == "re.sub"
    ]
    assert renames == [[r"^layers\.0\.", "midlayer."]]
    source = ast.unparse(load)
    fused = "torch.cat([cached_a_proj[q_name], cached_a_proj[kv_name]], dim=0)"
    for piece in ("q_a_proj", "kv_a_proj_with_mqa", el.SGLANG_MLA_FUSED, fused):
        assert piece in source, piece


@pytest.mark.parametrize("name", ["mla", "mla+fc_norm+norm_output"])
def test_mla_export_names_shapes_and_config_keys_fit_sglang(tmp_path, sglang_root, name):
    export_dir, _ = export_variant(tmp_path, name, ["sglang"])
    config = json.loads((export_dir / "sglang" / "config.json").read_text())
    models = sglang_root / "srt" / "models"
    attributes = self_attributes(parse(models / "kimi_k25_eagle3.py"))
    attributes |= self_attributes(parse(models / "deepseek_v2.py"))
    for param in el.engine_param_shapes("sglang", config):
        for segment in param.split(".")[:-1]:
            assert segment.isdigit() or segment in attributes, (param, segment)
    # Every config attribute the draft model reads directly (not through getattr) is written.
    tree = parse(models / "kimi_k25_eagle3.py")
    read = {
        n.attr
        for n in ast.walk(tree)
        if isinstance(n, ast.Attribute)
        and isinstance(n.value, ast.Name)
        and n.value.id == "config"
        and isinstance(n.ctx, ast.Load)
    }
    # rope_theta / rope_scaling are read only when rope_parameters is absent; it is written.
    assert read - {"rope_theta", "rope_scaling"} <= set(config), read - set(config)
    assert config["rope_parameters"]["rope_type"] == "default"
    # The fused a-projection SGLang builds: [q_lora + kv_lora + rope, 2H].
    layer = find_function(tree, "Eagle3MLADecoderLayer", "__init__")
    assert (
        "ReplicatedLinear(2 * config.hidden_size, attn.q_lora_rank + attn.kv_lora_rank + "
        "attn.qk_rope_head_dim" in ast.unparse(layer)
    )
    # And the round trip through SGLang's names gives our drafter back.
    el.load_exported_drafter(export_dir / "sglang")
