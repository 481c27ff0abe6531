"""What every validation module shares: the check names, the chunk tensors, and the one
error type, `ValidationFailure`, naming the shard, the check and where known chunk and row."""

from __future__ import annotations

from ..core.errors import PipelineError

CHECKS = ("integrity", "schema", "coverage", "values", "provenance", "spot_check")
LAYER_NAMES = ("aux_0", "aux_1", "aux_2", "final")
CHUNK_GLOB = "chunk-*.safetensors"
# An all-bf16 chunk's tensors; an FP8 store's dtypes and scales are the manifest's (schema.py).
CHUNK_TENSORS = {
    "row_ids": "I64",
    "offsets": "I64",
    "input_ids": "I32",
    "loss_mask": "U8",
    "aux_hidden_states": "BF16",
    "final_hidden_states": "BF16",
}
# A manifest's `dtype`: what readers get (an FP8 store's values dequantized to bf16).
HIDDEN_DTYPES = {"bfloat16": "BF16"}
# The dataset file's hash is not among them: a shard depends on its own rows only (the coverage
# check compares them with the prepared table), as the rerun policy decides per shard; an
# appended row must not fail the untouched shards that no command would re-extract.
PROVENANCE_FIELDS = (
    "model_config_hash",
    "tokenizer_fingerprint",
    "aux_layer_ids",
    "layer_convention",
    "final_convention",
)


class ValidationFailure(PipelineError):
    """A failed check: the message names the shard, the check, and where known chunk and row."""

    def __init__(
        self,
        shard: str,
        check: str,
        detail: str,
        chunk: str | None = None,
        row: int | None = None,
    ):
        where = f"shard {shard}"
        if chunk is not None:
            where += f", chunk {chunk}"
        if row is not None:
            where += f", row {row}"
        super().__init__(f"validation check {check} failed ({where}): {detail}")
        self.shard = shard
        self.check = check
        self.chunk = chunk
        self.row = row
        self.detail = detail

    @classmethod
    def in_chunk(cls, shard: str, check: str, detail: str, entry: dict) -> ValidationFailure:
        """A failure located at a manifest chunk entry (its file and first row)."""
        row = entry["row_ids"][0] if entry["row_ids"] else None
        return cls(shard, check, detail, chunk=entry["file"], row=row)
