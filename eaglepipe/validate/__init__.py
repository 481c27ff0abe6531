"""The validation gate: prove a shard sound before any training may read it.

`validate_shard` runs six checks over one extracted shard and writes
`validated/rows_{start}-{end}.json` only when all of them pass:

- provenance: the manifest's model and tokenizer hashes, layer ids and conventions equal the
  current configuration's (its rows are checked by coverage);
- integrity: every listed chunk exists, has its listed size and re-hashes to its listed
  xxh3-128; no unlisted chunk file is present;
- schema: tensor names, dtypes and shapes agree with the offsets, the manifest's row ids,
  hidden size and layer count;
- coverage: the row ids are exactly the planned range minus the rows prepare skipped, without
  duplicates, in order; input ids and loss masks equal the prepared table's;
- values: everything finite, no sample whose hidden states are all zero or constant, per-layer
  mean norms within `validate.norm_drift_factor` of the first validated shard of the same model,
  layers, engine and dtype (`norm_comparable_on`);
- spot_check: a few seeded random rows recomputed, where the target fits in memory, by
  independent transformers forwards on CPU (fp32, and bf16 for the noise floor), and re-extracted
  one at a time through the server (held exclusively; each dump says how many requests its
  forward pass held, so a batched re-extraction is retried). Each stored layer, over all spot
  tokens at once, must lie within `validate.noise_margin` x the bf16 noise floor of its
  recomputation and within `validate.neighbour_fraction` x the distance to the nearest
  neighbouring layer (`spot_check_verdict`; docs/SPOT_CHECK.md). Stored tensors come from
  *batched* requests, so a batching or layer-offset bug shows up here.

The chunk-reading checks run chunk by chunk (hash, then schema, tokens and values while the
chunk is still in the page cache), so a shard larger than memory is read from disk once.
A failure raises `ValidationFailure` (a `PipelineError`) naming the shard, check, chunk and row.

`verify_shards` (`eaglepipe verify`) re-runs only integrity and schema over every shard, for data
copied between machines, and sets damaged shards aside.

One module per check: `integrity`, `schema`, `coverage`, `values` (norm drift included),
`provenance`, `spot_check` (with its rule in `spot_rule`), plus `checks` (the shared error and
tensor names), `gate` (`validate_shard`, the report) and `verify`. The names other parts of the
project use are imported here.
"""

from .checks import CHECKS, LAYER_NAMES, ValidationFailure
from .gate import ShardPaths, validate_shard
from .provenance import expected_provenance
from .spot_check import (
    StoredRow,
    independent_forward,
    judge_layers,
    read_stored_rows,
    reextract_rows,
)
from .spot_rule import (
    DEFAULT_NEIGHBOUR_FRACTION,
    DEFAULT_NOISE_MARGIN,
    hf_layer_references,
    rel_l2,
    spot_check_verdict,
    token_rel_l2,
)
from .verify import VerifyReport, invalidate_damaged, verify_all, verify_shards

__all__ = [
    "CHECKS",
    "DEFAULT_NEIGHBOUR_FRACTION",
    "DEFAULT_NOISE_MARGIN",
    "LAYER_NAMES",
    "ShardPaths",
    "StoredRow",
    "ValidationFailure",
    "VerifyReport",
    "expected_provenance",
    "hf_layer_references",
    "independent_forward",
    "invalidate_damaged",
    "judge_layers",
    "read_stored_rows",
    "reextract_rows",
    "rel_l2",
    "spot_check_verdict",
    "token_rel_l2",
    "validate_shard",
    "verify_all",
    "verify_shards",
]
