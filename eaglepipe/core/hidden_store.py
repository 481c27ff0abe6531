"""The stored dtype of the hidden states (`extract.store`): bf16, or float8 e4m3 with scales.

The aux states and the final state each have a store dtype: `bf16` (the default) or `fp8_e4m3`
(torch.float8_e4m3fn, safetensors `F8_E4M3`: half the bytes). An FP8 tensor `<name>` [T, k*H]
travels with `<name>_scale`, float32 [T, k]: one scale per token and layer, the layer's absolute
maximum over 448 (e4m3's largest finite value), so every value maps into e4m3's range and the
largest lands on its top step. float32, not bf16: the scales cost 4 bytes per token and layer
(16 of 16,400 bytes a token at H = 4096), and a bf16 scale would add its own 2^-9 rounding to
every value of its layer for a saving of 8 bytes a token.

What this module states once, for the server that quantizes, the client and chunk writer that
move the bytes, the gate that checks them and the readers that dequantize them: the names and
dtypes, the bytes a token costs (`HiddenStore.token_bytes`), the chunk's tensor order, and the
quantize / dequantize pair (torch imported inside them only: the extraction jobs never need it).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

AUX_KEY = "aux_hidden_states"
FINAL_KEY = "final_hidden_states"
HIDDEN_KEYS = (AUX_KEY, FINAL_KEY)
BF16 = "bf16"
FP8 = "fp8_e4m3"
# Config name -> (safetensors dtype, the name torch and the manifests use, bytes per value).
STORE_DTYPES = {
    BF16: ("BF16", "bfloat16", 2),
    FP8: ("F8_E4M3", "float8_e4m3fn", 1),
}
SCALE_DTYPE = "F32"
SCALE_BYTES = 4
# e4m3fn's largest finite value (S.1111.110 = 1.75 x 2^8); 0x7F / 0xFF are its NaNs, it has no inf.
FP8_MAX = 448.0
# The relative L2 error one e4m3 rounding adds to a layer (docs/SPOT_CHECK.md, "FP8 stores"):
# round-to-nearest with 3 mantissa bits leaves an error uniform over half a step either way, a
# step being 2^-3 of the binade's bottom; over values whose mantissas m in [1, 2) spread
# log-uniformly, ||error|| / ||x|| = 2^-3 / sqrt(12 E[m^2]) with E[m^2] = 3 / (2 ln 2).
FP8_REL_L2 = 2**-3 / math.sqrt(12 * 3 / (2 * math.log(2)))


def scale_key(name: str) -> str:
    return f"{name}_scale"


@dataclass(frozen=True)
class HiddenStore:
    """The store dtypes of the aux states and of the final state (config names)."""

    aux: str = BF16
    final: str = BF16

    def __post_init__(self):
        for which in (self.aux, self.final):
            if which not in STORE_DTYPES:
                raise ValueError(f"store dtype {which!r}: one of {', '.join(STORE_DTYPES)}")

    @classmethod
    def from_dtypes(cls, aux_dtype: str, final_dtype: str) -> HiddenStore:
        """The store of tensors with these safetensors dtypes (BF16, F8_E4M3)."""
        by_dtype = {st: name for name, (st, _, _) in STORE_DTYPES.items()}
        for dtype in (aux_dtype, final_dtype):
            if dtype not in by_dtype:
                raise ValueError(
                    f"hidden states of dtype {dtype}: stored ones are {', '.join(by_dtype)}"
                )
        return cls(by_dtype[aux_dtype], by_dtype[final_dtype])

    @classmethod
    def from_manifest(cls, manifest: dict) -> HiddenStore:
        """The store a shard manifest records (`stored_dtypes`; none: an all-bf16 shard)."""
        recorded = manifest.get("stored_dtypes")
        if recorded is None:
            return cls()
        by_name = {name: key for key, (_, name, _) in STORE_DTYPES.items()}
        try:
            return cls(by_name[recorded[AUX_KEY]], by_name[recorded[FINAL_KEY]])
        except (KeyError, TypeError):
            raise ValueError(f"stored_dtypes {recorded!r} is not a store") from None

    def of(self, name: str) -> str:
        """The config name of tensor `name`'s store dtype."""
        return self.aux if name == AUX_KEY else self.final

    def dtype(self, name: str) -> str:
        """The safetensors dtype of hidden-state tensor `name`."""
        return STORE_DTYPES[self.of(name)][0]

    def quantized(self, name: str) -> bool:
        return self.of(name) == FP8

    @property
    def is_default(self) -> bool:
        return self == HiddenStore()

    @property
    def scaled_keys(self) -> tuple[str, ...]:
        return tuple(n for n in HIDDEN_KEYS if self.quantized(n))

    def manifest_dtypes(self) -> dict[str, str]:
        """What a manifest records: each hidden tensor's dtype as torch names it."""
        return {name: STORE_DTYPES[self.of(name)][1] for name in HIDDEN_KEYS}

    def as_dict(self) -> dict:
        return {"aux": self.aux, "final": self.final}

    def label(self) -> str:
        if self.aux == self.final:
            return self.aux
        return f"aux {self.aux}, final {self.final}"

    def token_bytes(self, hidden_size: int, num_aux_layers: int = 3) -> int:
        """Bytes of hidden states one token costs: the values, and the scales of FP8 layers."""
        total = 0
        for name, layers in ((AUX_KEY, num_aux_layers), (FINAL_KEY, 1)):
            width = STORE_DTYPES[self.of(name)][2]
            total += layers * int(hidden_size) * width
            if self.quantized(name):
                total += layers * SCALE_BYTES
        return total

    def tensor_order(self) -> tuple[str, ...]:
        """A chunk's tensors in file order, each starting aligned for its dtype: 8-byte
        tensors, float32 scales, bf16 states, int32 ids, then the 1-byte ones (the all-bf16
        order is the one chunks always had)."""
        wide = [n for n in HIDDEN_KEYS if not self.quantized(n)]
        narrow = [n for n in HIDDEN_KEYS if self.quantized(n)]
        scales = [scale_key(n) for n in narrow]
        return ("row_ids", "offsets", *scales, *wide, "input_ids", *narrow, "loss_mask")


BF16_STORE = HiddenStore()


# ----------------------------------------------------------------------------- the numbers


def quantize(values: torch.Tensor, num_layers: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`values` [T, k*H] (k = `num_layers`) as e4m3 and float32 scales [T, k], on its device.

    Each token's layer is divided by its absmax / 448 (a layer all zero keeps scale 1) and
    rounded to nearest; the clamp keeps a quotient that float rounding lifts past 448 from
    becoming NaN (e4m3fn has no inf). A NaN or inf comes back as NaN once dequantized (e4m3's
    NaN, or an infinite scale), so the gate's values check still sees it.
    """
    import torch

    tokens = values.shape[0]
    layered = values.reshape(tokens, num_layers, -1).float()
    absmax = layered.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(absmax > 0, absmax / FP8_MAX, torch.ones_like(absmax))
    q = (layered / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.reshape(values.shape), scale.reshape(tokens, num_layers)


def dequantize(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """e4m3 values [..., k*H] times their scales [..., k], as `dtype`, on q's device."""
    import torch

    layers = scale.shape[-1]
    if q.dtype != torch.float8_e4m3fn:
        q = q.view(torch.float8_e4m3fn)  # the raw bytes (uint8)
    grouped = q.reshape(*q.shape[:-1], layers, -1).float() * scale.float().unsqueeze(-1)
    return grouped.reshape(q.shape).to(dtype)


def store_tensors(store: HiddenStore, aux: torch.Tensor, final: torch.Tensor, num_aux: int):
    """{name: tensor} of the hidden states as `store` keeps them (bf16, or e4m3 and scales)."""
    import torch

    out = {}
    for name, values, layers in ((AUX_KEY, aux, num_aux), (FINAL_KEY, final, 1)):
        if store.quantized(name):
            out[name], out[scale_key(name)] = quantize(values, layers)
        else:
            out[name] = values.to(torch.bfloat16)
    return out
