"""The EAGLE-3 drafter: one decoder layer on top of the target's fused hidden states.

Shapes (H = target hidden size, V = target vocab, Vd = draft vocab):

    aux hidden states [.., 3H] --fc--> h [.., H]
    x = concat(input_layernorm(embed(token)), hidden_norm(h))      [.., 2H]  (attention input)
    h' = h + o_proj(attention(x)); h'' = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(h''))                                     [.., Vd]

`h''` (pre-norm) is what the next draft step receives as its hidden state, which is what
SGLang's and vLLM's `llama_eagle3.py` carry between draft steps. Parameter names equal the
exported checkpoint's (`midlayer.*`, `fc`, `norm`, `lm_head`), except `embed_tokens`, which is
the target's own table, frozen and never exported (the engines share the target's).

Variants (`train.drafter`, variants.py), each a line or two below:

- the attention is Llama's (`DraftAttention`: q/k/v/o, grouped KV heads) or DeepSeek-V2's
  multi-latent attention (`MLAAttention`, layer `mla`: low-rank q, a shared compressed KV
  latent plus one RoPE key, interleaved RoPE, DeepSeek's YaRN softmax scale), computed in its
  plain form; the engines compute the same thing with absorbed weights;
- `fc_norm`: fc(concat(norm_i(aux_i))); `norm_before_fc`: fc(input_norm(aux));
- `norm_output`: the next step receives norm(h''), not h'';
- `norm_before_residual`: the residual is hidden_norm(h), not h.

RoPE takes the target's base and scaling (`target_rope`); the frequencies come from
transformers' own RoPE functions, which the engines' rotary embeddings for these types match,
and the export writes the same parameters, so training and serving rotate alike.

Training-time test (EAGLE-3): step 0 runs over the whole sequence; step i>0 re-runs the layer
on the previous step's outputs, its queries attending causally to step 0's keys plus only their
own position's keys of steps 1..i (`ttt_attention_mask`). Step i at base position t sits at
position t+i, where serving would run it.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..core.drafter_options import MLA_DIMS, NORM_FLAGS, default_options, drafter_options
from ..core.errors import PipelineError
from ..core.sealed import require_intact
from . import causal_plus_own
from .variants import check_draft_layer

# RoPE types the drafter carries from the target, with the scaling keys SGLang, vLLM and
# transformers all read alike (`attention_factor` is transformers-only, `attn_factor`
# SGLang-only: neither is carried). Types whose frequencies depend on the running sequence
# length (dynamic, longrope) are refused: the engines and transformers disagree on them.
ROPE_KEYS = {
    "default": (),
    "linear": ("factor",),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"),
    "yarn": (
        "factor",
        "original_max_position_embeddings",
        "beta_fast",
        "beta_slow",
        "mscale",
        "mscale_all_dim",
        "truncate",
    ),
}
REQUIRED_ROPE_KEYS = {"linear": ("factor",), "llama3": ROPE_KEYS["llama3"][:3], "yarn": ("factor",)}


def target_rope(text: dict) -> tuple[float, dict | None]:
    """(rope_theta, rope scaling or None) of a target's text config, in either config layout.

    transformers 4.x writes `rope_theta` plus `rope_scaling` (type under `type` or `rope_type`);
    5.x writes one `rope_parameters` dict holding `rope_theta` and `rope_type` beside the scaling
    keys. The scaling comes back as `{"rope_type": ..., <its keys>}`, the 4.x `rope_scaling` form.
    """
    params = text.get("rope_parameters") or {}
    if any(isinstance(v, dict) for v in params.values()):
        raise PipelineError(
            f"target config: rope_parameters differ per layer type ({', '.join(params)}); "
            "the one-layer drafter needs a single RoPE"
        )
    # transformers 5 reads a legacy `rope_scaling` in preference to `rope_parameters`.
    merged = {**params, **(text.get("rope_scaling") or {})}
    theta = float(merged.get("rope_theta") or text.get("rope_theta") or 10000.0)
    rope_type = merged.get("rope_type") or merged.get("type") or "default"
    if rope_type not in ROPE_KEYS:
        raise PipelineError(
            f"target config: RoPE type {rope_type!r} is not supported by the drafter "
            f"(supported: {', '.join(ROPE_KEYS)})"
        )
    if rope_type == "default":
        return theta, None
    if rope_type in ("llama3", "yarn") and "original_max_position_embeddings" not in merged:
        # Where transformers takes it from when the scaling dict lacks it.
        merged["original_max_position_embeddings"] = text.get(
            "original_max_position_embeddings", text.get("max_position_embeddings")
        )
    missing = [k for k in REQUIRED_ROPE_KEYS[rope_type] if merged.get(k) is None]
    if missing:
        raise PipelineError(f"target config: {rope_type} RoPE scaling lacks {', '.join(missing)}")
    scaling = {k: merged[k] for k in ROPE_KEYS[rope_type] if merged.get(k) is not None}
    return theta, {"rope_type": rope_type, **scaling}


@dataclass
class DrafterConfig:
    hidden_size: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # the target's vocabulary (embed_tokens rows, d2t/t2d domain)
    draft_vocab_size: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None  # {"rope_type": ..., its keys} or None (see target_rope)
    max_position_embeddings: int = 4096
    num_aux_hidden_states: int = 3
    # The variant (variants.py): the draft layer and the EAGLE-3.1 norm flags.
    layer: str = "llama"
    fc_norm: bool = False
    norm_before_fc: bool = False
    norm_output: bool = False
    norm_before_residual: bool = False
    # Layer `mla` only.
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_nope_head_dim: int | None = None
    qk_rope_head_dim: int | None = None
    v_head_dim: int | None = None

    @classmethod
    def from_target(
        cls, target_config: dict, draft_vocab_size: int, options: dict | None = None
    ) -> DrafterConfig:
        """Sizes shaped like the target (its text config for multimodal wrappers), in the
        variant `options` (`variants.drafter_options`; the plain Llama layer when None).

        A Llama layer for an MLA target (DeepSeek family: no plain head_dim or
        num_key_value_heads) uses hidden_size / num_attention_heads and full KV heads. An MLA
        layer takes the target's MLA dimensions unless `options["mla"]` sets them.
        """
        options = options or default_options()
        text = target_config.get("text_config") or target_config
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        is_mla = text.get("kv_lora_rank") is not None
        kv_heads = heads if is_mla else int(text.get("num_key_value_heads") or heads)
        head_dim = (hidden // heads) if is_mla else int(text.get("head_dim") or hidden // heads)
        rope_theta, rope_scaling = target_rope(text)
        config = cls(
            hidden_size=hidden,
            num_attention_heads=heads,
            num_key_value_heads=kv_heads,
            head_dim=head_dim,
            intermediate_size=int(text["intermediate_size"]),
            vocab_size=int(text["vocab_size"]),
            draft_vocab_size=int(draft_vocab_size),
            rms_norm_eps=float(text.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(text.get("max_position_embeddings", 4096)),
            layer=options["layer"],
            **{flag: bool(options[flag]) for flag in NORM_FLAGS},
        )
        check_draft_layer(config.layer, text)
        if config.layer == "mla":
            given = options.get("mla") or {}
            dims = {k: given[k] if given.get(k) is not None else text.get(k) for k in MLA_DIMS}
            missing = [k for k, v in dims.items() if v is None]
            if missing:
                raise PipelineError(
                    f"train.drafter.layer mla: the target's config has no {', '.join(missing)} "
                    "(the engines' EAGLE-3 MLA layer needs a low-rank query): set "
                    + ", ".join(f"train.drafter.mla.{k}" for k in missing)
                )
            if rope_scaling is not None and rope_scaling["rope_type"] != "yarn":
                raise PipelineError(
                    f"target config: {rope_scaling['rope_type']} RoPE scaling with "
                    "train.drafter.layer mla: the engines' MLA layer reads any scaling as "
                    "DeepSeek YaRN; only default and yarn RoPE are supported"
                )
            config.num_key_value_heads = heads
            config.head_dim = int(dims["qk_nope_head_dim"]) + int(dims["qk_rope_head_dim"])
            for key, value in dims.items():
                setattr(config, key, int(value))
        return config

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> DrafterConfig:
        return cls(**json.loads(text))


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def drafter_config(run, draft_vocab_size: int) -> DrafterConfig:
    """The drafter of a run (a run.RunSpec): `train.drafter` and the target's config, the one
    place both meet."""
    options = drafter_options(run.train.drafter.as_dict())
    return DrafterConfig.from_target(run.model.config, draft_vocab_size, options)


def rope_frequencies(config: DrafterConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [dim/2] and the cos/sin scale of a RoPE over `dim` channels."""
    if config.rope_scaling is None:
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        return 1.0 / config.rope_theta**exponents, 1.0
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    # A Llama config shaped like the drafter, as an engine builds it from the exported config.
    llama = LlamaConfig(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters={"rope_theta": config.rope_theta, **config.rope_scaling},
    )
    inv_freq, scale = ROPE_INIT_FUNCTIONS[config.rope_scaling["rope_type"]](llama, "cpu")
    return inv_freq.float(), float(scale)


class RotaryEmbedding(nn.Module):
    """Llama (non-interleaved) rotary embedding over `dim` channels, the target's base and
    scaling."""

    def __init__(self, config: DrafterConfig, dim: int):
        super().__init__()
        # A plain attribute, not a buffer: never saved, never cast to bf16 with the module.
        self.inv_freq, self.scale = rope_frequencies(config, dim)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, L, head_dim] for positions [B, L]."""
        angles = positions.float()[..., None] * self.inv_freq.to(positions.device)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos() * self.scale, angles.sin() * self.scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, L, D] rotated by positions [B, L]."""
        cos, sin = (t[:, None] for t in self.cos_sin(positions))
        return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


def ttt_attention_mask(
    seq_len: int, step: int, device=None, context_len: int | None = None
) -> torch.Tensor:
    """Boolean [L, context_len + step*L] mask of the keys a step-`step` query may attend to.

    Keys are laid out as [step-0 keys | step-1 keys | ... | step-`step` keys]. The query at
    base position t sees step-0 keys 0..t (causal) and, of every later step 1..step, only
    the key at its own position t: the drafter's own earlier guesses for this chain.
    In training the queries are every position (`context_len` = L); drafting at decode time
    runs the later steps for the last L positions of a longer step-0 context.
    """
    context_len = seq_len if context_len is None else context_len
    causal = torch.ones(seq_len, context_len, dtype=torch.bool, device=device)
    causal = causal.tril(context_len - seq_len)
    own = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [own] * step, dim=1)


def ttt_attend(q, k, v, kv_cache: list, scale: float | None = None) -> torch.Tensor:
    """Attention of this step's queries [B, heads, L, D] over every step's keys so far.

    Appends this step's (k, v) to `kv_cache` (one entry per TTT step); KV heads fewer than the
    query heads are repeated (grouped-query attention). Returns [B, L, heads * Dv]. The
    step-0 entry may be longer than L (the queries are then its last L positions).
    """
    kv_cache.append((k, v))
    step = len(kv_cache) - 1
    repeat = q.shape[1] // k.shape[1]
    heads = [
        (kk.repeat_interleave(repeat, dim=1), vv.repeat_interleave(repeat, dim=1))
        if repeat > 1
        else (kk, vv)
        for kk, vv in kv_cache
    ]
    b, _, length, _ = q.shape
    if causal_plus_own.available(q, *heads[0]):
        # Training on the CPU: the same attention without the dense mask (about 10x less work
        # at the 7th step).
        scale = q.shape[-1] ** -0.5 if scale is None else scale
        out = causal_plus_own.attend(q, heads, scale)
    else:
        keys = torch.cat([kk for kk, _ in heads], dim=2)
        values = torch.cat([vv for _, vv in heads], dim=2)
        context_len = heads[0][0].shape[2]
        mask = ttt_attention_mask(length, step, device=q.device, context_len=context_len)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).reshape(b, length, -1)


class DraftAttention(nn.Module):
    """Llama attention over the 2H draft input."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.rotary = RotaryEmbedding(c, c.head_dim)
        self.q_proj = nn.Linear(2 * c.hidden_size, c.num_attention_heads * c.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * c.hidden_size, c.num_key_value_heads * c.head_dim, bias=False)
        self.o_proj = nn.Linear(c.num_attention_heads * c.head_dim, c.hidden_size, bias=False)

    def forward(
        self,
        x: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: list[tuple[torch.Tensor, torch.Tensor]],
    ) -> torch.Tensor:
        """x [B, L, 2H]; appends this step's (k, v) to `kv_cache` (one entry per TTT step)."""
        b, length, _ = x.shape
        q = self.q_proj(x).view(b, length, self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        q = self.rotary(q, positions)
        k = self.rotary(k, positions)
        return self.o_proj(ttt_attend(q, k, v, kv_cache))


def deinterleave(x: torch.Tensor) -> torch.Tensor:
    """Channels (x0, x1, x2, x3, ..) as (x0, x2, .., x1, x3, ..): rotating these in halves is
    rotating the pairs (x0, x1), (x2, x3), .. (interleaved RoPE), for any query-key product."""
    return x.unflatten(-1, (-1, 2)).transpose(-1, -2).flatten(-2)


def mla_softmax_scale(config: DrafterConfig) -> float:
    """1/sqrt(q/k head dim), times DeepSeek's YaRN mscale(factor, mscale_all_dim) squared."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    scaling = config.rope_scaling or {}
    mscale_all_dim = float(scaling.get("mscale_all_dim") or 0.0)
    factor = float(scaling.get("factor") or 1.0)
    if mscale_all_dim and factor > 1.0:
        scale *= (0.1 * mscale_all_dim * math.log(factor) + 1.0) ** 2
    return scale


class MLAAttention(nn.Module):
    """DeepSeek-V2 multi-latent attention over the 2H draft input (layer `mla`).

    q = q_b(norm(q_a(x))) per head as [nope | rope]; one compressed latent c and one RoPE key
    k_pe per position from kv_a(x); per head [k_nope | v] = kv_b(norm(c)); k = [k_nope | k_pe].
    RoPE is interleaved, as both engines apply it to MLA layers.
    """

    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.dims = (c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim, c.kv_lora_rank)
        nope, rope, v_dim, kv_rank = self.dims
        self.rotary = RotaryEmbedding(c, rope)
        self.scale = mla_softmax_scale(c)
        self.q_a_proj = nn.Linear(2 * c.hidden_size, c.q_lora_rank, bias=False)
        self.q_a_layernorm = RMSNorm(c.q_lora_rank, c.rms_norm_eps)
        self.q_b_proj = nn.Linear(c.q_lora_rank, self.num_heads * (nope + rope), bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(2 * c.hidden_size, kv_rank + rope, bias=False)
        self.kv_a_layernorm = RMSNorm(kv_rank, c.rms_norm_eps)
        self.kv_b_proj = nn.Linear(kv_rank, self.num_heads * (nope + v_dim), bias=False)
        self.o_proj = nn.Linear(self.num_heads * v_dim, c.hidden_size, bias=False)

    def forward(self, x, positions, kv_cache):
        """x [B, L, 2H]; appends this step's (k, v) to `kv_cache` (one entry per TTT step)."""
        b, length, _ = x.shape
        nope, rope, v_dim, kv_rank = self.dims
        heads = (b, length, self.num_heads, -1)
        q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x))).view(heads).transpose(1, 2)
        q_nope, q_pe = q.split([nope, rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([kv_rank, rope], dim=-1)
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(heads).transpose(1, 2)
        k_nope, v = kv.split([nope, v_dim], dim=-1)
        q_pe = self.rotary(deinterleave(q_pe), positions)
        k_pe = self.rotary(deinterleave(k_pe[:, None]), positions)
        q = torch.cat([q_nope, q_pe], dim=-1)
        k = torch.cat([k_nope, k_pe.expand(-1, self.num_heads, -1, -1)], dim=-1)
        return self.o_proj(ttt_attend(q, k, v, kv_cache, self.scale))


class DraftMLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DraftDecoderLayer(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = MLAAttention(config) if config.layer == "mla" else DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)
        self.norm_before_residual = config.norm_before_residual

    def forward(self, embeds, hidden, positions, kv_cache):
        normed = self.hidden_norm(hidden)
        residual = normed if self.norm_before_residual else hidden
        x = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        hidden = residual + self.self_attn(x, positions, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        aux_size = c.num_aux_hidden_states * c.hidden_size
        self.fc = nn.Linear(aux_size, c.hidden_size, bias=False)
        if c.fc_norm:  # one norm per aux layer, as engines name them: fc_norm.{0,1,2}
            self.fc_norm = nn.ModuleList(
                RMSNorm(c.hidden_size, c.rms_norm_eps) for _ in range(c.num_aux_hidden_states)
            )
        if c.norm_before_fc:
            self.input_norm = RMSNorm(aux_size, c.rms_norm_eps)
        self.midlayer = DraftDecoderLayer(c)
        self.norm = RMSNorm(c.hidden_size, c.rms_norm_eps)
        self.lm_head = nn.Linear(c.hidden_size, c.draft_vocab_size, bias=False)
        # draft id -> target id offsets and the target-vocab membership mask (vocab.py).
        self.register_buffer("d2t", torch.zeros(c.draft_vocab_size, dtype=torch.int64))
        self.register_buffer("t2d", torch.zeros(c.vocab_size, dtype=torch.bool))
        self._init_weights()

    def _init_weights(self) -> None:
        std = 1.0 / math.sqrt(self.config.hidden_size)
        for name, param in self.named_parameters():
            if name.endswith("weight") and param.dim() == 2 and "embed_tokens" not in name:
                nn.init.normal_(param, std=std)

    def trainable_state_dict(self) -> dict[str, torch.Tensor]:
        """Everything but the frozen target embedding: what checkpoints and exports hold."""
        return {k: v for k, v in self.state_dict().items() if not k.startswith("embed_tokens")}

    def draft_to_target(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    def project(self, aux_hidden_states: torch.Tensor) -> torch.Tensor:
        """fc over the concatenated aux states [.., 3H], normalised first if the variant says so."""
        aux = aux_hidden_states
        if self.config.norm_before_fc:
            aux = self.input_norm(aux)
        if self.config.fc_norm:
            parts = aux.chunk(self.config.num_aux_hidden_states, dim=-1)
            aux = torch.cat([norm(p) for norm, p in zip(self.fc_norm, parts, strict=True)], -1)
        return self.fc(aux)

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: list,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over [B, L] tokens: (next hidden [B, L, H], logits [B, L, Vd]).

        The next hidden is the layer's pre-norm output, or its normed one with `norm_output`.
        """
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        hidden = self.midlayer(embeds, hidden, positions, kv_cache)
        normed = self.norm(hidden)
        return (normed if self.config.norm_output else hidden), self.lm_head(normed)

    def forward(
        self,
        aux_hidden_states: torch.Tensor,
        step_input_ids: list[torch.Tensor],
    ) -> list[torch.Tensor]:
        """The training-time-test unroll: logits [B, L, Vd] of every step.

        `step_input_ids[i]` holds, at base position t, the token step i consumes
        (x[t+1+i] in training, see loss.py); step i runs at position t+i.
        """
        b, length = step_input_ids[0].shape
        base = torch.arange(length, device=aux_hidden_states.device).expand(b, length)
        hidden = self.project(aux_hidden_states)
        kv_cache: list = []
        all_logits = []
        for i, ids in enumerate(step_input_ids):
            hidden, logits = self.step(ids, hidden, base + i, kv_cache)
            all_logits.append(logits)
        return all_logits


def load_drafter(path, device="cpu") -> Eagle3Drafter:
    """Load our own model.safetensors (config in its metadata); embed_tokens stays zero."""
    from safetensors import safe_open

    if not os.path.exists(path):
        raise PipelineError(f"drafter checkpoint {path} does not exist")
    require_intact(path)
    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = f.metadata() or {}
        tensors = {k: f.get_tensor(k) for k in f.keys()}
    if "drafter_config" not in metadata:
        raise PipelineError(f"{path} has no drafter_config metadata: not an eaglepipe drafter")
    model = Eagle3Drafter(DrafterConfig.from_json(metadata["drafter_config"]))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens")]
    if missing or unexpected:
        raise PipelineError(f"{path}: missing keys {missing}, unexpected keys {unexpected}")
    return model.to(device)
