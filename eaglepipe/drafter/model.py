"""The EAGLE-3 drafter: one Llama decoder layer on top of the target's fused hidden states.

Shapes (H = target hidden size, V = target vocab, Vd = draft vocab):

    aux hidden states [.., 3H] --fc--> h [.., H]
    x = concat(input_layernorm(embed(token)), hidden_norm(h))      [.., 2H]  (q/k/v input)
    h' = h + o_proj(attention(x)); h'' = h' + mlp(post_attention_layernorm(h'))
    logits = lm_head(norm(h''))                                     [.., Vd]

`h''` (pre-norm) is what the next draft step receives as its hidden state, which is what
SGLang's and vLLM's `llama_eagle3.py` carry between draft steps. Parameter names equal the
exported checkpoint's (`midlayer.*`, `fc`, `norm`, `lm_head`), except `embed_tokens`, which is
the target's own table, frozen and never exported (the engines share the target's).

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
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import PipelineError

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

    @classmethod
    def from_target(cls, target_config: dict, draft_vocab_size: int) -> DrafterConfig:
        """Llama-layer sizes shaped like the target (its text config for multimodal wrappers).

        MLA targets (DeepSeek family) have no plain head_dim/num_key_value_heads: the drafter
        is a Llama layer, so it uses hidden_size / num_attention_heads and full KV heads.
        """
        text = target_config.get("text_config") or target_config
        hidden = int(text["hidden_size"])
        heads = int(text["num_attention_heads"])
        is_mla = "kv_lora_rank" in text
        kv_heads = heads if is_mla else int(text.get("num_key_value_heads") or heads)
        head_dim = (hidden // heads) if is_mla else int(text.get("head_dim") or hidden // heads)
        rope_theta, rope_scaling = target_rope(text)
        return cls(
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
        )

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


def rope_frequencies(config: DrafterConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [head_dim/2] and the cos/sin scale of the drafter's RoPE."""
    dim = config.head_dim
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
    """Llama (non-interleaved) rotary embedding with the target's base and scaling."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        # A plain attribute, not a buffer: never saved, never cast to bf16 with the module.
        self.inv_freq, self.scale = rope_frequencies(config)

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin [B, L, head_dim] for positions [B, L]."""
        angles = positions.float()[..., None] * self.inv_freq.to(positions.device)
        angles = torch.cat((angles, angles), dim=-1)
        return angles.cos() * self.scale, angles.sin() * self.scale

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """x [B, heads, L, D] rotated by positions [B, L]."""
        cos, sin = (t[:, None] for t in self.cos_sin(positions))
        return (x.float() * cos + rotate_half(x.float()) * sin).to(x.dtype)


def ttt_attention_mask(seq_len: int, step: int, device=None) -> torch.Tensor:
    """Boolean [L, (step+1)*L] mask of the keys a step-`step` query may attend to.

    Keys are laid out as [step-0 keys | step-1 keys | ... | step-`step` keys]. The query at
    base position t sees step-0 keys 0..t (causal) and, of every later step 1..step, only
    the key at its own position t: the drafter's own earlier guesses for this chain.
    """
    causal = torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).tril()
    own = torch.eye(seq_len, dtype=torch.bool, device=device)
    return torch.cat([causal] + [own] * step, dim=1)


class DraftAttention(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = config
        self.num_heads = c.num_attention_heads
        self.num_kv_heads = c.num_key_value_heads
        self.head_dim = c.head_dim
        self.rotary = RotaryEmbedding(c)
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
        kv_cache.append((k, v))
        step = len(kv_cache) - 1
        keys = torch.cat([kk for kk, _ in kv_cache], dim=2)
        values = torch.cat([vv for _, vv in kv_cache], dim=2)
        repeat = self.num_heads // self.num_kv_heads
        if repeat > 1:
            keys = keys.repeat_interleave(repeat, dim=1)
            values = values.repeat_interleave(repeat, dim=1)
        mask = ttt_attention_mask(length, step, device=x.device)
        out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, length, -1))


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
        self.self_attn = DraftAttention(config)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DraftMLP(config)

    def forward(self, embeds, hidden, positions, kv_cache):
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        hidden = hidden + self.self_attn(x, positions, kv_cache)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Drafter(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        c = config
        self.config = c
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size)
        self.embed_tokens.weight.requires_grad_(False)
        self.fc = nn.Linear(c.num_aux_hidden_states * c.hidden_size, c.hidden_size, bias=False)
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
        return self.fc(aux_hidden_states)

    def step(
        self,
        input_ids: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_cache: list,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One draft step over [B, L] tokens: (next hidden [B, L, H], logits [B, L, Vd])."""
        embeds = self.embed_tokens(input_ids).to(hidden.dtype)
        hidden = self.midlayer(embeds, hidden, positions, kv_cache)
        return hidden, self.lm_head(self.norm(hidden))

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

    try:
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
    except FileNotFoundError:
        raise PipelineError(f"drafter checkpoint {path} does not exist") from None
    if "drafter_config" not in metadata:
        raise PipelineError(f"{path} has no drafter_config metadata: not an eaglepipe drafter")
    model = Eagle3Drafter(DrafterConfig.from_json(metadata["drafter_config"]))
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    missing = [m for m in missing if not m.startswith("embed_tokens")]
    if missing or unexpected:
        raise PipelineError(f"{path}: missing keys {missing}, unexpected keys {unexpected}")
    return model.to(device)
