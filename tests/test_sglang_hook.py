"""The SGLang dump hook's tensor logic, on plain CPU tensors shaped and packed as SGLang passes
them to LogitsProcessor.forward (names verified against both ends of the supported range by
tests/test_sglang_contract.py):
a list of per-layer [T, H] captures (Llama family) or one packed [T, 3H] tensor (DeepSeek family,
AuxHiddenStatePacker), several requests per prefill batch, split by `forward_batch.rids` and
`extend_seq_lens_cpu`."""

from __future__ import annotations

import enum
import sys
import types
from pathlib import Path

import pytest
import torch
from torch import nn

from eaglepipe.core.errors import PipelineError
from eaglepipe.core.hidden_store import BF16_STORE, FP8_REL_L2, HiddenStore, dequantize, quantize
from eaglepipe.server.handoff.dumps import read_dump, read_dump_raw
from eaglepipe.server.handoff.request_ids import make_rid
from eaglepipe.server.sglang import recipe
from eaglepipe.validate.spot_rule import rel_l2

PATCH_DIR = Path(__file__).resolve().parent.parent / "patch"
HIDDEN = 16
AUX_IDS = [1, 3, 4]
NONCE = "0123456789ab"


class ForwardMode(enum.IntEnum):
    """Stand-in with the members and method of sglang's ForwardMode that the hook uses."""

    EXTEND = enum.auto()
    DECODE = enum.auto()
    MIXED = enum.auto()
    IDLE = enum.auto()
    TARGET_VERIFY = enum.auto()
    DRAFT_EXTEND_V2 = enum.auto()

    def is_decode_or_idle(self):
        return self == ForwardMode.DECODE or self == ForwardMode.IDLE


class LogitsProcessorStandIn(nn.Module):
    def forward(self, input_ids, hidden_states, lm_head, logits_metadata, aux_hidden_states=None):
        return hidden_states.sum()


def import_hook_module(monkeypatch):
    """patch/eaglepipe_hook.py imported as one SGLang process imports it (a fresh module each
    call: another scheduler process), with a stand-in TP rank."""
    rank = types.SimpleNamespace(tp_rank=0)
    runtime_context = types.ModuleType("sglang.srt.runtime_context")
    runtime_context.get_parallel = lambda: rank
    for name in ("sglang", "sglang.srt"):
        monkeypatch.setitem(sys.modules, name, types.ModuleType(name))
    monkeypatch.setitem(sys.modules, "sglang.srt.runtime_context", runtime_context)
    monkeypatch.syspath_prepend(str(PATCH_DIR))
    monkeypatch.delitem(sys.modules, "eaglepipe_hook", raising=False)
    import eaglepipe_hook

    eaglepipe_hook.test_rank = rank
    return eaglepipe_hook


@pytest.fixture
def hook_module(monkeypatch):
    yield import_hook_module(monkeypatch)
    sys.modules.pop("eaglepipe_hook", None)


def make_hook(hook_module, dump_dir: Path, store: HiddenStore = BF16_STORE):
    spec = recipe.hook_spec(
        dump_dir=dump_dir,
        request_prefix="eaglepipe",
        aux_layer_ids=AUX_IDS,
        instance_id="t",
        store=store,
    )
    return hook_module.make_dump_hook(spec["config"])


def rid(row: int) -> str:
    return make_rid("eaglepipe", NONCE, row, 0)


class Batch:
    """Captured tensors for a batch of (rid, tokens) requests, packed in request order."""

    def __init__(self, requests: list[tuple[str, int]], *, seed: int = 0):
        gen = torch.Generator().manual_seed(seed)
        self.rids = [r for r, _ in requests]
        self.lens = [n for _, n in requests]
        total = sum(self.lens)
        self.captures = [
            torch.randn(total, HIDDEN, generator=gen).to(torch.bfloat16) for _ in AUX_IDS
        ]
        self.final = torch.randn(total, HIDDEN, generator=gen).to(torch.bfloat16)
        self.offsets = [sum(self.lens[:i]) for i in range(len(self.lens) + 1)]

    def aux(self, layout: str):
        if layout == "list":
            return list(self.captures)
        return torch.cat(self.captures, dim=-1)  # AuxHiddenStatePacker's [T, K*H]

    def forward_batch(self, mode=ForwardMode.EXTEND, prefix_lens=None, host_lists=True):
        prefix_lens = prefix_lens or [0] * len(self.rids)
        return types.SimpleNamespace(
            forward_mode=mode,
            rids=list(self.rids),
            extend_seq_lens=torch.tensor(self.lens, dtype=torch.int32),
            extend_prefix_lens=torch.tensor(prefix_lens, dtype=torch.int32),
            extend_seq_lens_cpu=list(self.lens) if host_lists else None,
            extend_prefix_lens_cpu=list(prefix_lens) if host_lists else None,
            contains_last_prefill_chunk=True,
        )

    def expected(self, index: int):
        lo, hi = self.offsets[index], self.offsets[index + 1]
        return torch.cat([c[lo:hi] for c in self.captures], dim=-1), self.final[lo:hi]


def attach(hook) -> nn.Module:
    """A logits-processor stand-in with the hook registered as SGLang's hook manager does."""
    processor = LogitsProcessorStandIn()
    processor.register_forward_hook(hook)
    return processor


def run_forward(processor: nn.Module, batch: Batch, forward_batch, aux):
    input_ids = torch.zeros(batch.final.shape[0], dtype=torch.int64)
    processor(input_ids, batch.final, "lm_head", forward_batch, aux)


@pytest.mark.parametrize("layout", ["list", "packed"])
def test_each_prefixed_request_gets_its_own_slice(hook_module, tmp_path, layout):
    dump_dir = tmp_path / "dumps"
    hook = make_hook(hook_module, dump_dir)
    processor = attach(hook)
    requests = [
        (rid(10), 5),
        ("HEALTH_CHECK_1f2e3d", 1),
        (rid(11), 7),
        ("9c0ffee0deadbeef9c0ffee0deadbeef", 3),  # a warm-up request's uuid4().hex rid
        (rid(12), 2),
        ("otherprefix-0123456789ab-1-0", 4),
    ]
    batch = Batch(requests)
    run_forward(processor, batch, batch.forward_batch(), batch.aux(layout))
    hook.close()
    assert sorted(p.name for p in dump_dir.iterdir()) == sorted(
        f"{rid(r)}.safetensors" for r in (10, 11, 12)
    )
    for index in (0, 2, 4):
        aux, final, meta = read_dump(dump_dir / f"{batch.rids[index]}.safetensors")
        want_aux, want_final = batch.expected(index)
        assert meta["rid"] == batch.rids[index]
        assert meta["num_tokens"] == batch.lens[index]
        assert meta["hidden_size"] == HIDDEN and meta["aux_layer_ids"] == AUX_IDS
        assert torch.equal(aux, want_aux)
        assert torch.equal(final, want_final)
        # Layer order inside the row: the first H columns are the lowest aux layer.
        assert torch.equal(aux[:, :HIDDEN], batch.captures[0][batch.offsets[index] :][: len(aux)])


@pytest.mark.parametrize("layout", ["list", "packed"])
@pytest.mark.parametrize("store", ["fp8_e4m3", "fp8_aux_only"])
def test_an_fp8_store_is_quantized_in_the_hook(hook_module, tmp_path, layout, store):
    """The hook hands the writer SGLang's bf16 captures; what lands in the handoff is e4m3 with
    per-token, per-layer float32 scales (the quantization runs where the batch is: the GPU in
    SGLang, torch on the CPU here), equal to quantizing each request's slice by itself."""
    wanted = HiddenStore("fp8_e4m3", "bf16" if store == "fp8_aux_only" else "fp8_e4m3")
    spec = recipe.hook_spec(
        dump_dir=tmp_path, request_prefix="eaglepipe", aux_layer_ids=AUX_IDS, instance_id="t",
        store=wanted,
    )  # fmt: skip
    assert spec["config"]["store"] == wanted.as_dict()
    hook = make_hook(hook_module, tmp_path, wanted)
    processor = attach(hook)
    batch = Batch([(rid(10), 5), ("HEALTH_CHECK_1f2e3d", 1), (rid(11), 7)])
    run_forward(processor, batch, batch.forward_batch(), batch.aux(layout))
    hook.close()
    for index in (0, 2):
        path = tmp_path / f"{batch.rids[index]}.safetensors"
        tensors, meta = read_dump_raw(path, wanted)
        assert meta["store"] == wanted
        assert tensors["aux_hidden_states"].dtype == "F8_E4M3"
        assert tensors["aux_hidden_states_scale"].shape == (batch.lens[index], 3)
        want_aux, want_final = batch.expected(index)
        q, scale = quantize(want_aux, 3)
        stored = tensors["aux_hidden_states"].to_torch()
        assert torch.equal(stored.view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(tensors["aux_hidden_states_scale"].to_torch(), scale)
        aux, final, _ = read_dump(path)  # dequantized
        assert rel_l2(aux, want_aux.float()) < 1.2 * FP8_REL_L2
        if wanted.quantized("final_hidden_states"):
            assert torch.equal(final, dequantize(*quantize(want_final, 1), torch.float32))
        else:
            assert "final_hidden_states_scale" not in tensors
            assert torch.equal(final, want_final)
        # The client, configured for bf16, refuses it in one line.
        with pytest.raises(PipelineError, match="the config's extract.store is bf16"):
            read_dump_raw(path, BF16_STORE)


def test_device_extend_lengths_are_used_when_host_lists_are_absent(hook_module, tmp_path):
    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    batch = Batch([(rid(1), 3), (rid(2), 6)], seed=1)
    run_forward(processor, batch, batch.forward_batch(host_lists=False), batch.aux("packed"))
    hook.close()
    aux, final, _ = read_dump(tmp_path / f"{rid(2)}.safetensors")
    assert torch.equal(aux, batch.expected(1)[0]) and torch.equal(final, batch.expected(1)[1])


def test_several_batches_accumulate_dumps(hook_module, tmp_path):
    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    for seed, rows in enumerate(([1, 2], [3], [4, 5, 6])):
        batch = Batch([(rid(r), 2 + r) for r in rows], seed=seed)
        run_forward(processor, batch, batch.forward_batch(), batch.aux("list"))
    hook.close()
    assert len(list(tmp_path.glob("*.safetensors"))) == 6


def test_prefix_cache_hit_fails_loudly_and_writes_nothing(hook_module, tmp_path):
    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    batch = Batch([(rid(1), 4), (rid(2), 4)])
    with pytest.raises(RuntimeError, match=f"request {rid(2)} starts at token 3"):
        run_forward(processor, batch, batch.forward_batch(prefix_lens=[0, 3]), batch.aux("packed"))
    hook.close()
    assert list(tmp_path.glob("*.safetensors")) == []


def test_prefix_on_a_request_that_is_not_ours_is_ignored(hook_module, tmp_path):
    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    batch = Batch([("HEALTH_CHECK_ab", 2), (rid(7), 3)])
    run_forward(processor, batch, batch.forward_batch(prefix_lens=[5, 0]), batch.aux("list"))
    hook.close()
    assert [p.name for p in tmp_path.glob("*.safetensors")] == [f"{rid(7)}.safetensors"]


def test_unfinished_prefill_chunk_fails_loudly(hook_module, tmp_path):
    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    batch = Batch([(rid(1), 4)])
    forward_batch = batch.forward_batch()
    forward_batch.contains_last_prefill_chunk = False
    with pytest.raises(RuntimeError, match="unfinished prefill chunks"):
        run_forward(processor, batch, forward_batch, batch.aux("list"))
    hook.close()


def test_decode_and_idle_batches_do_nothing(hook_module, tmp_path):
    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    batch = Batch([(rid(1), 1), (rid(2), 1)])
    for mode in (ForwardMode.DECODE, ForwardMode.IDLE):
        # Decode batches carry one token per request and earlier tokens as prefix.
        fb = batch.forward_batch(mode=mode, prefix_lens=[9, 12])
        run_forward(processor, batch, fb, batch.aux("packed"))
    hook.close()
    assert list(tmp_path.iterdir()) == []


def test_speculative_decoding_steps_are_not_dumped(hook_module, tmp_path):
    """With a draft model (live acceptance), the target verifies draft tokens and the draft
    extends: decode steps of requests whose prefill was dumped, never dumped themselves."""
    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    batch = Batch([(rid(1), 4), (rid(2), 4)])
    for mode in (ForwardMode.TARGET_VERIFY, ForwardMode.DRAFT_EXTEND_V2):
        fb = batch.forward_batch(mode=mode, prefix_lens=[9, 12])
        run_forward(processor, batch, fb, batch.aux("list"))
    hook.close()
    assert list(tmp_path.iterdir()) == []


def test_mixed_batch_with_our_requests_is_refused(hook_module, tmp_path):
    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    batch = Batch([(rid(1), 3)])
    with pytest.raises(RuntimeError, match="MIXED batch"):
        mixed = batch.forward_batch(mode=ForwardMode.MIXED)
        run_forward(processor, batch, mixed, batch.aux("list"))
    hook.close()


def test_batches_without_our_requests_pass_through_untouched(hook_module, tmp_path):
    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    batch = Batch([("HEALTH_CHECK_1", 1), ("abcdef0123", 2)])
    # Even with no aux at all (as a model without capture would call it).
    run_forward(processor, batch, batch.forward_batch(mode=ForwardMode.MIXED), None)
    hook.close()
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize(
    "aux,match",
    [
        (None, "no aux hidden states"),
        ("two-layers", "2 aux hidden states captured, 3 expected"),
        ("wrong-width", r"aux hidden states are \(6, 32\)"),
    ],
)
def test_missing_or_misshapen_aux_fails_loudly(hook_module, tmp_path, aux, match):
    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    batch = Batch([(rid(1), 6)])
    value = {
        None: None,
        "two-layers": batch.captures[:2],
        "wrong-width": torch.cat(batch.captures[:2], dim=-1),
    }[aux]
    with pytest.raises(RuntimeError, match=match):
        run_forward(processor, batch, batch.forward_batch(), value)
    hook.close()


def test_extend_lengths_longer_than_the_hidden_states_fail(hook_module, tmp_path):
    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    batch = Batch([(rid(1), 6)])
    forward_batch = batch.forward_batch()
    forward_batch.extend_seq_lens_cpu = [9]
    with pytest.raises(RuntimeError, match="hold 6 tokens, the batch's extend lengths sum to 9"):
        run_forward(processor, batch, forward_batch, batch.aux("list"))
    hook.close()


def test_only_tensor_parallel_rank_zero_writes(hook_module, tmp_path, monkeypatch):
    hook_module.test_rank.tp_rank = 3
    assert make_hook(hook_module, tmp_path / "rank3") is None
    assert not (tmp_path / "rank3").exists()
    rank0 = import_hook_module(monkeypatch)  # rank 0 is another scheduler process
    hook = make_hook(rank0, tmp_path / "rank0")
    assert (tmp_path / "rank0").stat().st_mode & 0o777 == 0o700
    hook.close()


def test_a_speculative_draft_runner_in_the_same_process_is_not_hooked(hook_module, tmp_path):
    """Live acceptance loads an EAGLE-3 draft beside the target; SGLang registers the forward
    hooks on both runners (the draft's after the target's, in the same process). The draft's
    logits processor sees the same rids with its own hidden states: only the target dumps."""
    target_hook = make_hook(hook_module, tmp_path)
    assert make_hook(hook_module, tmp_path) is None
    target = attach(target_hook)
    batch = Batch([(rid(1), 4), (rid(2), 3)])
    run_forward(target, batch, batch.forward_batch(), batch.aux("list"))
    # The draft's extend of the same requests: no aux captured there, and nothing hooked.
    draft = LogitsProcessorStandIn()
    run_forward(draft, batch, batch.forward_batch(), None)
    target_hook.close()
    aux, final, _ = read_dump(tmp_path / f"{rid(2)}.safetensors")
    assert torch.equal(aux, batch.expected(1)[0]) and torch.equal(final, batch.expected(1)[1])
    assert len(list(tmp_path.glob("*.safetensors"))) == 2


def test_hook_attached_to_two_modules_fails(hook_module, tmp_path):
    hook = make_hook(hook_module, tmp_path)
    batch = Batch([(rid(1), 2)])
    first, second = LogitsProcessorStandIn(), LogitsProcessorStandIn()
    first.register_forward_hook(hook)
    second.register_forward_hook(hook)
    first(None, batch.final, None, batch.forward_batch(), batch.aux("list"))
    with pytest.raises(RuntimeError, match="attached to two modules"):
        second(None, batch.final, None, batch.forward_batch(), batch.aux("list"))
    hook.close()


def test_factory_rejects_a_config_without_its_keys(hook_module):
    with pytest.raises(ValueError, match="config lacks dump_dir, aux_layer_ids"):
        hook_module.make_dump_hook({"request_prefix": "eaglepipe"})


def test_each_dump_records_the_forward_pass_it_came_from(hook_module, tmp_path):
    """What validation's batched guard reads: every request of SGLang's forward batch counts,
    health checks and other prefixes included, and the batch's real tokens."""
    dump_dir = tmp_path / "dumps"
    hook = make_hook(hook_module, dump_dir)
    processor = attach(hook)
    batch = Batch([("HEALTH_CHECK_1f2e3d", 1), (rid(20), 6), ("other-0123456789ab-1-0", 3)])
    run_forward(processor, batch, batch.forward_batch(), batch.aux("list"))
    alone = Batch([(rid(21), 4)], seed=1)
    run_forward(processor, alone, alone.forward_batch(), alone.aux("packed"))
    hook.close()
    _, _, batched = read_dump(dump_dir / f"{rid(20)}.safetensors")
    _, _, single = read_dump(dump_dir / f"{rid(21)}.safetensors")
    assert (batched["batch_requests"], batched["batch_tokens"]) == (3, 10)
    assert (single["batch_requests"], single["batch_tokens"]) == (1, 4)


def test_the_hook_logs_what_it_costs_the_forward_thread(hook_module, tmp_path, monkeypatch, caplog):
    """Every EAGLEPIPE_HOOK_STATS_EVERY dumped batches, and at close, one line with the counts
    and the host time spent inside the hook (the benchmarks read it from SGLang's log)."""
    monkeypatch.setenv(hook_module.STATS_EVERY_ENV, "2")
    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    caplog.set_level("INFO", logger="eaglepipe_hook")
    for seed, rows in enumerate(([1, 2], [3], [4, 5])):
        batch = Batch([(rid(r), 2 + r) for r in rows] + [("HEALTH_CHECK_x", 4)], seed=seed)
        run_forward(processor, batch, batch.forward_batch(), batch.aux("list"))
    undumped = Batch([("abcdef0123", 3)])
    run_forward(processor, undumped, undumped.forward_batch(), undumped.aux("list"))
    hook.close()
    lines = [r.getMessage() for r in caplog.records if "prefill batches dumped" in r.getMessage()]
    assert len(lines) == 2  # after the second batch, and the third at close
    assert lines[0].startswith(
        "eaglepipe dump hook: 2 prefill batches dumped (3 requests, 12 tokens)"
    )
    assert lines[1].startswith(
        "eaglepipe dump hook: 3 prefill batches dumped (5 requests, 25 tokens)"
    )
    assert "in the hook per batch: mean " in lines[1] and "writer: 5 files" in lines[1]


def test_generation_requests_beside_extraction_requests_are_never_dumped(hook_module, tmp_path):
    """Regeneration's requests (`eaglepipe.server.handoff.request_ids` generation ids) share prefill
    batches with extraction
    requests on one server: only the extraction requests are dumped, each its own slice, and
    the generation requests' decode steps pass through."""
    from eaglepipe.server.handoff.request_ids import make_generation_rid

    hook = make_hook(hook_module, tmp_path)
    processor = attach(hook)
    generation = [make_generation_rid("eaglepipe", NONCE, row, 2, 0) for row in (10, 11)]
    batch = Batch([(generation[0], 6), (rid(10), 5), (generation[1], 9), (rid(11), 3)])
    run_forward(processor, batch, batch.forward_batch(), batch.aux("list"))
    decode = Batch([(name, 1) for name in generation], seed=1)
    fb = decode.forward_batch(mode=ForwardMode.DECODE, prefix_lens=[6, 9])
    run_forward(processor, decode, fb, decode.aux("list"))
    hook.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        f"{rid(r)}.safetensors" for r in (10, 11)
    )
    for index in (1, 3):
        aux, final, _ = read_dump(tmp_path / f"{batch.rids[index]}.safetensors")
        want_aux, want_final = batch.expected(index)
        assert torch.equal(aux, want_aux) and torch.equal(final, want_final)


TP_RANK_SCRIPT = """
import sys, types
from pathlib import Path
import torch
import torch.distributed as dist

rank, world, init_file = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
dump_dir = Path(sys.argv[4])
dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
sys.path.insert(0, sys.argv[5])  # the tests directory
import test_sglang_hook as t

# One SGLang scheduler process per TP rank: its own import of the hook, its own rank.
parallel = types.SimpleNamespace(tp_rank=dist.get_rank())
runtime_context = types.ModuleType("sglang.srt.runtime_context")
runtime_context.get_parallel = lambda: parallel
for name in ("sglang", "sglang.srt"):
    sys.modules[name] = types.ModuleType(name)
sys.modules["sglang.srt.runtime_context"] = runtime_context
sys.path.insert(0, str(t.PATCH_DIR))
import eaglepipe_hook

hook = t.make_hook(eaglepipe_hook, dump_dir)
processor = t.attach(hook) if hook is not None else t.LogitsProcessorStandIn()
for step in range(3):
    batch = t.Batch([(t.rid(10 * step + i), 3 + i) for i in range(4)], seed=step)
    # Every TP rank holds the same full-width hidden states after the all-reduce: rank 0's.
    for tensor in [*batch.captures, batch.final]:
        dist.broadcast(tensor, src=0)
    t.run_forward(processor, batch, batch.forward_batch(), batch.aux("packed"))
if hook is not None:
    hook.close()
dist.barrier()
dist.destroy_process_group()
print(f"rank {rank}: hook {'registered' if hook is not None else 'not registered'}")
"""


def test_tensor_parallel_ranks_in_a_process_group_dump_once_per_request(tmp_path):
    """Two real processes in a gloo process group, as two TP ranks of one SGLang server: both run
    the same batches through the hook, only rank 0 writes, and each request's dump holds the
    full hidden width (a CPU stand-in for issue 20's TP=2 run on two GPUs)."""
    import subprocess

    dump_dir = tmp_path / "dumps"
    script = tmp_path / "rank.py"
    script.write_text(TP_RANK_SCRIPT)
    tests_dir = str(Path(__file__).resolve().parent)
    ranks = [
        subprocess.Popen(
            [
                sys.executable,
                str(script),
                str(r),
                "2",
                str(tmp_path / "init"),
                str(dump_dir),
                tests_dir,
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )  # fmt: skip
        for r in range(2)
    ]
    outputs = [p.communicate(timeout=180)[0] for p in ranks]
    assert [p.returncode for p in ranks] == [0, 0], outputs
    assert "rank 0: hook registered" in outputs[0]
    assert "rank 1: hook not registered" in outputs[1]
    dumps = sorted(p.name for p in dump_dir.glob("*.safetensors"))
    assert dumps == sorted(f"{rid(10 * s + i)}.safetensors" for s in range(3) for i in range(4))
    for step in range(3):
        batch = Batch([(rid(10 * step + i), 3 + i) for i in range(4)], seed=step)
        for i in range(4):
            aux, final, meta = read_dump(dump_dir / f"{rid(10 * step + i)}.safetensors")
            want_aux, want_final = batch.expected(i)
            assert aux.shape == (3 + i, len(AUX_IDS) * HIDDEN) and final.shape == (3 + i, HIDDEN)
            assert torch.equal(aux, want_aux) and torch.equal(final, want_final)
            assert meta["batch_requests"] == 4
