"""The identity keys of a run, built in one place.

- `engine_identity`: what decides the numbers the engine computes besides the model: engine,
  its version, device kind, dtype and batch layout (resolved, not `auto`).
- `server_identity`: everything that decides what a running hidden-state server computes and
  where it listens. Its hash is the server's fingerprint: a job whose identity differs from the
  running server's never uses that server (`shared_server.py`). With SGLang a server is started
  for a purpose: `capture` (extraction, validation: the hook, the capture and the flags it
  needs) or `generation` (regeneration: no capture, so SGLang's radix cache, chunked prefill and
  CUDA graphs stay on); the reference server does both, so it has no purpose in its identity.
- `chunk_reuse_key`: what a journalled chunk must have been computed under for a resumed
  extraction to keep it: the shard's inputs, the model and its weights, the layers, and the
  engine identity and the store, so a shard never mixes chunks of two engines or dtypes.

Why the weights and not only config.json: a fine-tune saved in place has the same config; the
weights fingerprint (`fingerprint.weights_fingerprint`, sampled bytes of every weight file) is
the one the shard provenance uses too.
"""

from __future__ import annotations

from ...core.run import RunSpec

# What an SGLang server is started for (`server_purpose`).
CAPTURE = "capture"
GENERATION = "generation"
PURPOSES = (CAPTURE, GENERATION)


def server_purpose(run: RunSpec, wanted: str = CAPTURE) -> str:
    """The purpose a job's server is started for: `generation` only where it makes another
    server (SGLang); the reference server serves both from one process."""
    if wanted not in PURPOSES:
        raise ValueError(f"server purpose {wanted!r}: one of {', '.join(PURPOSES)}")
    return wanted if run.server.engine == "sglang" else CAPTURE


def engine_identity(run: RunSpec) -> dict:
    """Engine, version, device kind, dtype and layout, as the server on this node resolves them."""
    server = run.server
    if server.engine == "sglang":
        from ..sglang.recipe import installed_sglang_version

        return {
            "engine": "sglang",
            # The SGLang the server process imports (its own path may differ from ours).
            "engine_version": installed_sglang_version(),
            # SGLang resolves `auto` from the model's own torch_dtype: the same on every node.
            "dtype": server.dtype,
            "tp_size": server.sglang.tp_size,
        }
    from ..reference.settings import (
        engine_version,
        resolve_device_type,
        resolve_dtype_name,
        resolve_layout,
    )

    device = resolve_device_type(server.device)
    return {
        "engine": "reference",
        "engine_version": engine_version(),
        "device": device,
        "dtype": resolve_dtype_name(server.dtype, device),
        "attention": resolve_layout(server.attention, device),
    }


def server_identity(run: RunSpec, purpose: str = CAPTURE) -> dict:
    """Everything that decides what the server computes and where it listens."""
    server, model = run.server, run.model
    identity = {
        **engine_identity(run),
        "model_dir": str(model.directory.resolve()),
        "model_config_hash": model.config_hash,
        "weights": model.weights_fingerprint,
        "aux_layer_ids": run.aux_layer_ids,
        "max_batch_tokens": server.max_batch_tokens,
        "trust_remote_code": model.trust_remote_code,
        "request_prefix": run.extract.request_prefix,
        "host": server.host,
        "port": server.port,
    }
    if not run.extract.store.is_default:
        # The server quantizes the dumps; only here, so a bf16 server's fingerprint is the one
        # it had before stores existed.
        identity["store"] = run.extract.store.as_dict()
    if server.engine == "sglang":
        identity["sglang"] = server.sglang.as_dict()
        if server_purpose(run, purpose) == GENERATION:
            # Only here: a capture server's fingerprint is what it was before purposes existed.
            identity["purpose"] = GENERATION
    return identity


def chunk_reuse_key(run: RunSpec, *, shard_inputs_hash: str, engine: dict) -> dict:
    """What a journalled chunk must match to be kept by a resumed extraction."""
    model, store = run.model, run.extract.store
    return {
        "shard_inputs_hash": shard_inputs_hash,
        "model_config_hash": model.config_hash,
        "weights": model.weights_fingerprint,
        "aux_layer_ids": run.aux_layer_ids,
        "hidden_size": model.hidden_size,
        # The store; an all-bf16 one as before stores could differ, so its chunks are kept.
        "stored_dtype": "bfloat16" if store.is_default else store.as_dict(),
        "engine": engine,
    }
