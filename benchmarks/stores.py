"""The stored dtypes the benchmarks compare side by side (`--store-dtypes`), and their bytes per
token from the chunk file's own byte function."""

from __future__ import annotations

from collections.abc import Sequence

# The stores the benchmarks compare side by side (`--store-dtypes bf16,fp8,fp8aux`):
# extract.store values (eaglepipe/core/hidden_store.py).
STORE_VARIANTS = {
    "bf16": {"aux": "bf16", "final": "bf16"},
    "fp8": {"aux": "fp8_e4m3", "final": "fp8_e4m3"},
    "fp8aux": {"aux": "fp8_e4m3", "final": "bf16"},
}
# (hidden size, aux layers) of the shapes whose bytes per token the issue asks for.
BYTE_SHAPES = {"8b": (4096, 3), "kimi_k2.5": (7168, 3)}


def store_variants(parser, option: str, value: str) -> list[str]:
    """The names of a `--store-dtypes` comma list, checked."""
    names = [v.strip() for v in str(value).split(",") if v.strip()]
    unknown = [n for n in names if n not in STORE_VARIANTS]
    if not names or unknown:
        parser.error(f"{option}: a comma list of {', '.join(STORE_VARIANTS)}, got {value!r}")
    return names


def bytes_per_token(names: Sequence[str]) -> dict:
    """Chunk bytes per token of each store at the 8B shape and Kimi-K2.5's (the chunk file's
    own byte function), and each one's ratio to bf16."""
    from eaglepipe.core.hidden_store import HiddenStore
    from eaglepipe.extract.chunk_file import token_bytes

    table = {}
    for name in names:
        store = HiddenStore(**STORE_VARIANTS[name])
        table[name] = {}
        for shape, (hidden, aux) in BYTE_SHAPES.items():
            per_token = token_bytes(hidden, aux, store)
            table[name][shape] = {
                "bytes_per_token": per_token,
                "vs_bf16": round(per_token / token_bytes(hidden, aux), 4),
            }
    return table


def bytes_per_token_lines(table: dict) -> list[str]:
    return [
        f"bytes per token, {name}: "
        + ", ".join(
            f"{shape} {v['bytes_per_token']:,} ({v['vs_bf16']}x bf16)" for shape, v in row.items()
        )
        for name, row in table.items()
    ]
