"""SGLang forward hook that dumps each prefixed request's aux and final hidden states.

Loaded by SGLang's `--forward-hooks` as `eaglepipe_hook:make_dump_hook` (the launcher in
eaglepipe/server/sglang/recipe.py puts this directory on PYTHONPATH). SGLang calls the factory
once per TP rank with the spec's `config` and registers the returned callable with
`module.register_forward_hook` on the logits processor, so the hook sees LogitsProcessor.forward's
positional inputs: (input_ids, hidden_states, lm_head, forward_batch, aux_hidden_states).
`hidden_states` there is post-final-norm; `aux_hidden_states` is the residual stream entering the
captured layers, either one packed [T, K*H] tensor (DeepSeek family) or a list of K [T, H]
tensors (Llama family). Every name used here is checked against the source of both ends of the
supported SGLang range (patch/sglang.toml) by tests/test_sglang_contract.py.

With an FP8 store (the config's `store`, from extract.store) the writer quantizes the batch to
e4m3 with per-token, per-layer scales on the GPU, in the forward thread, before the copy to the
host: the copy, the pinned buffers and the dumps hold half the bytes.
"""

from __future__ import annotations

import atexit
import logging
import os
import time
from pathlib import Path

import torch

from eaglepipe.core.hidden_store import HiddenStore
from eaglepipe.server.handoff.dump_writer import DumpWriter
from eaglepipe.server.handoff.dumps import concat_aux, prepare_dump_dir

logger = logging.getLogger("eaglepipe_hook")

# sglang.srt.constants.HEALTH_CHECK_RID_PREFIX across the supported range (contract-tested). Our
# prefix filter (`<prefix>-`, prefix alphanumeric) already excludes these; checked anyway.
HEALTH_CHECK_RID_PREFIX = "HEALTH_CHECK"
_FORWARD_BATCH_ARG = 3
_AUX_ARG = 4
# Speculative decoding's steps (the target verifying draft tokens, the draft extending): decoding,
# not a request's prefill, so never dumped (live acceptance serves the target with a draft).
SPECULATIVE_DECODE_MODES = ("TARGET_VERIFY", "DRAFT_EXTEND_V2")
# Every this many dumped prefill batches the hook logs what it cost the forward thread so far.
STATS_EVERY_ENV = "EAGLEPIPE_HOOK_STATS_EVERY"
DEFAULT_STATS_EVERY = 256


def _tensor_parallel_rank() -> int:
    # Present across the supported range; sglang.srt.distributed's get_tensor_model_parallel_rank
    # is deprecated in 0.5.23 and left out of that package's star re-export.
    from sglang.srt.runtime_context import get_parallel

    return int(get_parallel().tp_rank)


# Whether this process's factory already ran: SGLang calls it once per model runner, and a
# speculative draft model's runner (live acceptance) comes after its target's in the same process.
_FACTORY_CALLED = False


def make_dump_hook(config: dict):
    """SGLang's hook factory: a dump hook for the target model on TP rank 0, None (nothing
    registered) on other ranks and for a speculative draft model's runner."""
    global _FACTORY_CALLED
    missing = [k for k in ("dump_dir", "request_prefix", "aux_layer_ids") if k not in config]
    if missing:
        raise ValueError(f"eaglepipe forward hook: config lacks {', '.join(missing)}")
    if _FACTORY_CALLED:
        # SGLang builds the draft's model runner after the target's, in the target's scheduler
        # process; the draft's logits processor sees the same rids with its own hidden states.
        logger.info("eaglepipe dump hook: a second model runner (a speculative draft): not hooked")
        return None
    _FACTORY_CALLED = True
    rank = _tensor_parallel_rank()
    if rank != 0:
        logger.info("eaglepipe dump hook: TP rank %d does not write (rank 0 does)", rank)
        return None
    hook = LogitsDumpHook(
        dump_dir=Path(config["dump_dir"]),
        request_prefix=str(config["request_prefix"]),
        aux_layer_ids=[int(i) for i in config["aux_layer_ids"]],
        # An FP8 store is quantized here, on the GPU, before the copy to the host.
        store=HiddenStore(**(config.get("store") or {})),
        stats_every=int(os.environ.get(STATS_EVERY_ENV) or DEFAULT_STATS_EVERY),
    )
    atexit.register(hook.close)
    logger.info(
        "eaglepipe dump hook: instance %s writes %s-* dumps of aux layers %s to %s (store %s)",
        config.get("instance_id", "?"),
        hook.request_prefix,
        hook.aux_layer_ids,
        hook.dump_dir,
        hook.writer.store.label(),
    )
    return hook


class HookStats:
    """What dumping cost the forward thread: host time inside the hook per dumped batch."""

    def __init__(self, every: int):
        self.every = max(1, every)
        self.batches = self.requests = self.tokens = 0
        self.seconds = self.max_seconds = 0.0

    def add(self, seconds: float, requests: int, tokens: int) -> bool:
        """Count one dumped batch; True when a summary line is due."""
        self.batches += 1
        self.requests += requests
        self.tokens += tokens
        self.seconds += seconds
        self.max_seconds = max(self.max_seconds, seconds)
        return self.batches % self.every == 0

    def line(self, writer) -> str:
        mean_ms = 1e3 * self.seconds / max(1, self.batches)
        return (
            f"eaglepipe dump hook: {self.batches} prefill batches dumped ({self.requests} "
            f"requests, {self.tokens} tokens); in the hook per batch: mean {mean_ms:.3f} ms, "
            f"max {1e3 * self.max_seconds:.3f} ms; writer: {writer.files_written} files, "
            f"{writer.bytes_written / 1e9:.3f} GB"
        )


class LogitsDumpHook:
    """Forward hook on the logits processor; hands prefill batches to the dump writer."""

    def __init__(
        self,
        *,
        dump_dir: Path,
        request_prefix: str,
        aux_layer_ids: list[int],
        store: HiddenStore | None = None,
        stats_every: int = DEFAULT_STATS_EVERY,
    ):
        self.dump_dir = prepare_dump_dir(dump_dir)
        self.request_prefix = request_prefix
        self.aux_layer_ids = aux_layer_ids
        self.writer = DumpWriter(
            self.dump_dir, request_prefix, aux_layer_ids=aux_layer_ids, store=store or HiddenStore()
        )
        self.stats = HookStats(stats_every)
        self._module_id: int | None = None

    def is_dumped(self, rid) -> bool:
        return (
            isinstance(rid, str)
            and rid.startswith(f"{self.request_prefix}-")
            and not rid.startswith(HEALTH_CHECK_RID_PREFIX)
        )

    def __call__(self, module, args, output) -> None:
        # Two matched modules would dump every request twice.
        if self._module_id is None:
            self._module_id = id(module)
        elif self._module_id != id(module):
            raise RuntimeError(
                "eaglepipe dump hook is attached to two modules; --forward-hooks "
                "target_modules must match exactly one logits processor"
            )
        if len(args) <= _FORWARD_BATCH_ARG:
            return None
        forward_batch = args[_FORWARD_BATCH_ARG]
        rids = list(getattr(forward_batch, "rids", None) or [])
        dumped = [i for i, rid in enumerate(rids) if self.is_dumped(rid)]
        mode = forward_batch.forward_mode
        if not dumped or mode.is_decode_or_idle() or mode.name in SPECULATIVE_DECODE_MODES:
            return None
        if mode.name != "EXTEND":
            raise RuntimeError(
                f"eaglepipe dump hook: requests {[rids[i] for i in dumped]} arrived in a "
                f"{mode.name} batch; only plain prefill (EXTEND) is "
                "supported (chunked prefill, mixed chunks and speculative modes are off)"
            )
        started = time.perf_counter()
        tokens = self._dump_prefill(args, forward_batch, rids, dumped)
        if self.stats.add(time.perf_counter() - started, len(dumped), tokens):
            logger.info(self.stats.line(self.writer))
        return None

    def _dump_prefill(self, args, forward_batch, rids: list[str], dumped: list[int]) -> int:
        """Hand the batch to the writer; returns how many of its tokens are dumped."""
        seq_lens = _host_list(forward_batch, "extend_seq_lens")[: len(rids)]
        prefix_lens = _host_list(forward_batch, "extend_prefix_lens")[: len(rids)]
        if len(seq_lens) != len(rids) or len(prefix_lens) != len(rids):
            raise RuntimeError(
                f"eaglepipe dump hook: batch has {len(rids)} rids but {len(seq_lens)} extend "
                f"lengths and {len(prefix_lens)} prefix lengths"
            )
        for i in dumped:
            if prefix_lens[i] > 0:
                raise RuntimeError(
                    f"eaglepipe dump hook: request {rids[i]} starts at token {prefix_lens[i]} "
                    "(a prefix-cache hit or a later prefill chunk); its earlier tokens were "
                    "never seen, so its dump cannot be placed. Run SGLang with "
                    "--disable-radix-cache and --chunked-prefill-size=-1"
                )
        if not getattr(forward_batch, "contains_last_prefill_chunk", True):
            raise RuntimeError(
                f"eaglepipe dump hook: batch of {rids} holds only unfinished prefill chunks; "
                "run SGLang with --chunked-prefill-size=-1"
            )
        hidden_states = args[1]
        aux = args[_AUX_ARG] if len(args) > _AUX_ARG else None
        total = sum(seq_lens)
        if hidden_states.shape[0] < total:
            raise RuntimeError(
                f"eaglepipe dump hook: hidden states hold {hidden_states.shape[0]} tokens, "
                f"the batch's extend lengths sum to {total}"
            )
        aux_packed = self._pack_aux(aux, hidden_states, [rids[i] for i in dumped])
        self.writer.submit(rids, seq_lens, aux_packed[:total], hidden_states[:total])
        return sum(seq_lens[i] for i in dumped)

    def _pack_aux(self, aux, hidden_states: torch.Tensor, dumped_rids: list[str]):
        count = len(self.aux_layer_ids)
        hidden_size = hidden_states.shape[-1]
        if aux is None:
            raise RuntimeError(
                f"eaglepipe dump hook: no aux hidden states for {dumped_rids}; the capture is "
                "off: start SGLang through eaglepipe's launcher (capture-only flags, or the "
                "eaglepipe SGLang plugin on releases without them; its log lines start with "
                "'[eaglepipe sglang plugin]')"
            )
        if isinstance(aux, torch.Tensor):
            packed = aux
        else:
            if len(aux) != count:
                raise RuntimeError(
                    f"eaglepipe dump hook: {len(aux)} aux hidden states captured, "
                    f"{count} expected (layers {self.aux_layer_ids})"
                )
            packed = concat_aux(aux)
        if packed.shape[-1] != count * hidden_size or packed.shape[0] != hidden_states.shape[0]:
            raise RuntimeError(
                f"eaglepipe dump hook: aux hidden states are {tuple(packed.shape)}, expected "
                f"[{hidden_states.shape[0]}, {count} x {hidden_size}] for layers "
                f"{self.aux_layer_ids}"
            )
        return packed

    def close(self) -> None:
        self.writer.close()
        if self.stats.batches % self.stats.every:  # what the last periodic line left out
            logger.info(self.stats.line(self.writer))


def _host_list(forward_batch, name: str) -> list[int]:
    """A per-request length list, from the host mirror when SGLang filled it (no device sync)."""
    host = getattr(forward_batch, f"{name}_cpu", None)
    if host is not None:
        return [int(v) for v in host]
    device = getattr(forward_batch, name, None)
    if device is None:
        raise RuntimeError(f"eaglepipe dump hook: forward batch has no {name}")
    return [int(v) for v in device.tolist()]
