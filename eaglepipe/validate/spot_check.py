"""spot_check: a few seeded rows recomputed, where the target fits, by independent transformers
forwards (fp32, and bf16 for the noise floor), and re-extracted one at a time through the
server (held exclusively; each dump says how many requests its forward pass held), each
stored layer judged by `spot_rule`."""

from __future__ import annotations

import json
import os
import random
import sys
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import psutil
import torch

from ..core.errors import PipelineError
from ..core.hidden_store import AUX_KEY, BF16_STORE, FINAL_KEY, HiddenStore
from ..core.run import RunSpec, TargetModel, ValidateSettings
from ..core.space import format_bytes
from ..extract.chunk_file import ChunkReader
from ..server.handoff.dumps import dump_path, read_dump, wait_for_dump
from ..server.handoff.request_ids import make_rid
from .checks import LAYER_NAMES, ValidationFailure
from .spot_rule import (
    LayerReference,
    fp8_floor,
    hf_layer_references,
    rel_l2,
    spot_check_verdict,
)
from .values import layer_label

# Re-extractions of one row when the server batched it with a foreign request (e.g. SGLang's own
# /health probe, which runs a one-token generate) before the batched guard fails the check.
REEXTRACT_ATTEMPTS = 3


@dataclass
class StoredRow:
    row_id: int
    chunk: str
    input_ids: list[int]
    aux: torch.Tensor  # [T, 3H] float32 (an FP8 store's dequantized)
    final: torch.Tensor  # [T, H] float32


def pick_spot_rows(row_ids: list[int], count: int, seed: int, shard: str) -> list[int]:
    """`count` rows chosen by a generator seeded with the config seed and the shard name."""
    rng = random.Random(f"{seed}:{shard}")
    return sorted(rng.sample(sorted(row_ids), min(count, len(row_ids))))


def read_stored_rows(shard_dir: Path, manifest: dict, rows: list[int]) -> list[StoredRow]:
    wanted = set(rows)
    found = []
    for entry in manifest["chunks"]:
        hits = [i for i, row in enumerate(entry["row_ids"]) if row in wanted]
        if not hits:
            continue
        with ChunkReader(shard_dir / entry["file"]) as reader:
            offsets = reader.offsets
            ids = reader.raw("input_ids").data
            for i in hits:
                a, b = offsets[i], offsets[i + 1]
                found.append(
                    StoredRow(
                        entry["row_ids"][i],
                        entry["file"],
                        ids[a:b].tolist(),
                        reader.hidden(AUX_KEY, a, b, torch.float32),
                        reader.hidden(FINAL_KEY, a, b, torch.float32),
                    )
                )
    return found


def split_layers(aux: torch.Tensor, final: torch.Tensor, hidden: int) -> list[torch.Tensor]:
    """[aux_0, aux_1, aux_2, final], each [T, H], from packed aux [T, 3H] and final [T, H]."""
    return [*aux.view(aux.shape[0], -1, hidden).unbind(1), final]


def _stored_slot(rows: list[StoredRow], index: int, hidden: int) -> torch.Tensor:
    return torch.cat([split_layers(r.aux, r.final, hidden)[index] for r in rows])


def judge_layers(
    shard: str,
    source: str,
    stored_rows: list[StoredRow],
    references: dict[str, LayerReference],
    hidden: int,
    aux_layer_ids: list[int],
    settings: ValidateSettings,
    store: HiddenStore = BF16_STORE,
    reference_quantized: bool = False,
) -> dict:
    """Every slot's verdict over the spot-check rows; the first failing slot fails the check,
    naming the row that disagrees most. A slot `store` keeps in e4m3 is judged against the
    floor raised by its roundings (`fp8_floor`: the stored one, and the reference's own when
    `reference_quantized`, a re-extraction through the same server)."""
    per_layer: dict[str, dict] = {}
    for index, name in enumerate(LAYER_NAMES):
        reference = references[name]
        stored = _stored_slot(stored_rows, index, hidden)
        quantized = store.quantized(AUX_KEY if index < len(LAYER_NAMES) - 1 else FINAL_KEY)
        roundings = (1 + int(reference_quantized)) if quantized else 0
        floor = reference.floor
        if roundings and floor is not None:
            floor = fp8_floor(floor, roundings)
        verdict = spot_check_verdict(
            stored,
            reference.values,
            reference.neighbours,
            floor,
            noise_margin=settings.noise_margin,
            neighbour_fraction=settings.neighbour_fraction,
        )
        per_layer[name] = {**verdict.as_dict(), "floor_source": reference.floor_source}
        if roundings:
            per_layer[name] |= {"fp8_roundings": roundings, "floor_before_fp8": reference.floor}
        if verdict.ok:
            continue
        bounds = np.cumsum([0] + [len(r.input_ids) for r in stored_rows])
        by_row = [
            rel_l2(stored[a:b], reference.values[a:b])
            for a, b in zip(bounds[:-1], bounds[1:], strict=True)
        ]
        worst = stored_rows[int(np.argmax(by_row))]
        raise ValidationFailure(
            shard,
            "spot_check",
            f"stored {layer_label(index, aux_layer_ids)} disagrees with {source}: relative L2 "
            f"{verdict.rel_l2:.4g} over {verdict.tokens} tokens, "
            f"{' and '.join(verdict.failures())}; worst row {worst.row_id} "
            f"(relative L2 {max(by_row):.4g}). A batching or layer-offset bug in extraction "
            "gives exactly this",
            chunk=worst.chunk,
            row=worst.row_id,
        )
    return per_layer


def new_nonce() -> str:
    return os.urandom(6).hex()


# Requests go straight to the local server, never through an http_proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _post_json(url: str, payload: dict, timeout: float) -> dict:
    request = urllib.request.Request(
        url, data=json.dumps(payload).encode(), headers={"Content-Type": "application/json"}
    )
    with _DIRECT.open(request, timeout=timeout) as response:
        return json.loads(response.read())


def _reextract_alone(handle, shard: str, row: StoredRow, prefix: str, nonce: str, timeout: float):
    """Row `row` through the server until a pass computed it alone: (aux, final, attempts).

    Whether it was alone is read from the dump itself (`batch_requests`, written by the dump
    writer of either engine), not from the HTTP answer, which SGLang does not annotate.
    """
    batched = []
    for attempt in range(REEXTRACT_ATTEMPTS):
        rid = make_rid(prefix, nonce, row.row_id, attempt)
        payload = {"input_ids": row.input_ids, "rid": rid, "sampling_params": {"max_new_tokens": 0}}
        dump = dump_path(handle.dump_dir, rid)
        try:
            _post_json(f"{handle.url}/generate", payload, timeout)
            wait_for_dump(dump)
            aux, final, meta = read_dump(dump)
        except (urllib.error.URLError, OSError, TimeoutError, ValueError) as exc:
            raise ValidationFailure(
                shard,
                "spot_check",
                f"re-extraction request {rid} to {handle.url} failed: {exc}",
                chunk=row.chunk,
                row=row.row_id,
            ) from None
        except PipelineError as exc:
            raise ValidationFailure(
                shard, "spot_check", f"re-extraction {rid}: {exc}", chunk=row.chunk, row=row.row_id
            ) from None
        finally:
            dump.unlink(missing_ok=True)
        if meta["batch_requests"] == 1:
            return aux.float(), final.float(), attempt + 1
        batched.append(f"{meta['batch_requests']} requests / {meta['batch_tokens']} tokens")
    # The comparison is only meaningful for a request computed alone.
    raise ValidationFailure(
        shard,
        "spot_check",
        f"each of {REEXTRACT_ATTEMPTS} re-extractions of row {row.row_id} shared its forward pass "
        f"with other requests ({'; '.join(batched)}) despite the exclusive lease: the server at "
        f"{handle.url} has traffic from outside the pipeline",
        chunk=row.chunk,
        row=row.row_id,
    )


def reextract_through(
    handle,
    shard: str,
    stored_rows: list[StoredRow],
    *,
    prefix: str,
    timeout: float,
) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict]:
    """Each row sent alone through the server behind `handle` (url, dump_dir, info); its
    complete dump read back. The caller holds the server exclusively."""
    fresh = {}
    attempts = []
    nonce = new_nonce()
    for row in stored_rows:
        aux, final, tries = _reextract_alone(handle, shard, row, prefix, nonce, timeout)
        if aux.shape != row.aux.shape or final.shape != row.final.shape:
            raise ValidationFailure(
                shard,
                "spot_check",
                f"re-extraction of row {row.row_id} returned aux {list(aux.shape)} / final "
                f"{list(final.shape)}, stored aux {list(row.aux.shape)} / final "
                f"{list(row.final.shape)}",
                chunk=row.chunk,
                row=row.row_id,
            )
        fresh[row.row_id] = (aux, final)
        attempts.append(tries)
    info = {
        "url": handle.url,
        "engine": handle.info.get("engine"),
        "engine_version": handle.info.get("engine_version"),
        "nonce": nonce,
        # Requests in the forward pass of each accepted re-extraction (from its dump): all 1.
        "batch_sizes": [1] * len(stored_rows),
        "attempts": attempts,
    }
    return fresh, info


def reextract_rows(
    run: RunSpec,
    shard: str,
    stored_rows: list[StoredRow],
    hidden: int,
    aux_layer_ids: list[int],
    store: HiddenStore = BF16_STORE,
) -> tuple[dict[int, tuple[torch.Tensor, torch.Tensor]], dict]:
    """The rows re-extracted one at a time under an exclusive lease of the pipeline's server,
    which must write the shard's store."""
    from ..server.lifecycle.shared_server import server_lease

    with server_lease(run, exclusive=True) as handle:
        served_store = HiddenStore(**(handle.info.get("store") or {}))
        if served_store != store:
            raise ValidationFailure(
                shard,
                "spot_check",
                f"the server at {handle.url} writes a {served_store.label()} store, the shard "
                f"holds a {store.label()} one",
            )
        served = (handle.info.get("aux_layer_ids"), handle.info.get("hidden_size"))
        if served != (aux_layer_ids, hidden):
            raise ValidationFailure(
                shard,
                "spot_check",
                f"the server at {handle.url} captures layers {served[0]} at hidden size "
                f"{served[1]}, the shard holds layers {aux_layer_ids} at {hidden}",
            )
        return reextract_through(
            handle,
            shard,
            stored_rows,
            prefix=run.extract.request_prefix,
            timeout=run.extract.request_timeout_s,
        )


def model_fp32_bytes(model: TargetModel) -> int:
    """Parameter bytes of the model loaded in fp32, estimated from its weight files."""
    model_dir = model.directory
    model_config = model.text_config
    stored_dtype = str(model_config.get("torch_dtype") or model_config.get("dtype") or "float32")
    width = {"float32": 4, "bfloat16": 2, "float16": 2, "float8_e4m3fn": 1}.get(stored_dtype, 2)
    weights = sum(
        p.stat().st_size
        for pattern in ("*.safetensors", "*.bin", "*.pt")
        for p in model_dir.glob(pattern)
    )
    return weights * 4 // width


def independent_forward_fits(model: TargetModel) -> tuple[bool, str]:
    """Whether an fp32 CPU forward leaves ample memory: weights at most a quarter of free RAM."""
    need = model_fp32_bytes(model)
    available = psutil.virtual_memory().available
    reason = f"model needs ~{format_bytes(need)} in fp32, {format_bytes(available)} available"
    return need * 4 <= available, reason


def _hidden_states_at(model, stored_rows: list[StoredRow], indices: set[int]) -> dict:
    """{hidden-state index: the rows' states there, concatenated over tokens}."""
    parts: dict[int, list[torch.Tensor]] = {i: [] for i in indices}
    with torch.inference_mode():
        for row in stored_rows:
            states = model(torch.tensor([row.input_ids]), output_hidden_states=True).hidden_states
            for i in indices:
                parts[i].append(states[i][0].float())
    return {i: torch.cat(tensors) for i, tensors in parts.items()}


def independent_forward(
    run: RunSpec, stored_rows: list[StoredRow], aux_layer_ids: list[int]
) -> dict[str, LayerReference]:
    """The rows through plain transformers forwards on CPU, fp32 then bf16 (the noise floor).

    Only the hidden states the four slots and their neighbours need are kept.
    """
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        run.model.directory,
        dtype=torch.float32,
        trust_remote_code=run.model.trust_remote_code,
    )
    model.eval()
    last = run.model.num_layers
    indices = {last - 1, last}
    for k in aux_layer_ids:
        indices |= {j for j in (k, k + 1, k + 2) if j <= last}
    fp32 = _hidden_states_at(model, stored_rows, indices)
    model.to(torch.bfloat16)
    bf16 = _hidden_states_at(model, stored_rows, indices)
    return hf_layer_references(fp32, bf16, aux_layer_ids, num_layers=last)


def _server_references(
    stored_rows: list[StoredRow],
    fresh: dict[int, tuple[torch.Tensor, torch.Tensor]],
    hidden: int,
    independent: dict[str, LayerReference] | None,
    assumed_floor: float,
) -> dict[str, LayerReference]:
    """The re-extracted rows as references. The yardsticks come from the independent forward
    of the same tokens when it ran; otherwise the floor is `validate.server_noise_floor` and
    there is no neighbour test (the server captures only the configured layers)."""
    references = {}
    for index, name in enumerate(LAYER_NAMES):
        values = torch.cat([split_layers(*fresh[r.row_id], hidden)[index] for r in stored_rows])
        if independent is not None:
            measured = independent[name]
            references[name] = LayerReference(
                values, measured.neighbours, measured.floor, measured.floor_source
            )
        else:
            references[name] = LayerReference(
                values, [], assumed_floor, "assumed: validate.server_noise_floor"
            )
    return references


def _run_independent_forward(run, stored_rows, aux_ids, log) -> tuple[dict | None, dict]:
    """The independent references and what the report says about them (ran, or why not)."""
    if not run.validate.independent_forward:
        return None, {"ran": False, "reason": "validate.independent_forward is false"}
    fits, reason = independent_forward_fits(run.model)
    if not fits:
        return None, {"ran": False, "reason": reason}
    log(f"spot check: independent transformers forwards (fp32, bf16) on CPU ({reason})")
    try:
        return independent_forward(run, stored_rows, aux_ids), {"ran": True}
    except (OSError, ValueError, ImportError, KeyError, RuntimeError) as exc:
        # The server runs the model; transformers may not (e.g. an engine-only architecture).
        # That weakens the check, so it is said out loud and recorded, never silently skipped.
        reason = f"transformers could not run the model: {type(exc).__name__}: {exc}"
        print(f"warning: independent forward skipped: {reason}", file=sys.stderr)
        return None, {"ran": False, "reason": reason}


def check_spot(run: RunSpec, shard: str, shard_dir: Path, manifest: dict, log) -> dict:
    """Seeded random rows recomputed independently where the target fits, and re-extracted
    alone through the server; each stored layer judged against both (see the rule above)."""
    settings = run.validate
    all_rows = [row for entry in manifest["chunks"] for row in entry["row_ids"]]
    rows = pick_spot_rows(all_rows, settings.spot_check_rows, settings.seed, shard)
    if not rows:
        return {"ok": True, "rows": [], "note": "validate.spot_check_rows is 0: nothing checked"}
    hidden, aux_ids = manifest["hidden_size"], manifest["aux_layer_ids"]
    store = HiddenStore.from_manifest(manifest)
    stored_rows = read_stored_rows(shard_dir, manifest, rows)
    # Before the exclusive lease: the CPU forwards need no server and must not hold it up.
    independent, independent_report = _run_independent_forward(run, stored_rows, aux_ids, log)
    if independent is not None:
        independent_report["layers"] = judge_layers(
            shard,
            "independent transformers fp32 forwards on CPU",
            stored_rows,
            independent,
            hidden,
            aux_ids,
            settings,
            store,
        )
    log(f"spot check: re-extracting rows {rows} one at a time through the server")
    fresh, server = reextract_rows(run, shard, stored_rows, hidden, aux_ids, store)
    references = _server_references(
        stored_rows, fresh, hidden, independent, settings.server_noise_floor
    )
    return {
        "ok": True,
        "rows": rows,
        "tokens": sum(len(r.input_ids) for r in stored_rows),
        "server": server,
        "reextract": judge_layers(
            shard,
            "re-extraction of the row alone through the server",
            stored_rows,
            references,
            hidden,
            aux_ids,
            settings,
            store,
            reference_quantized=True,
        ),
        "independent_forward": independent_report,
    }
