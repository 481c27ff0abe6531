"""Drafter building blocks: vocabulary, TTT mask and alignment, loss, data, target head, gate."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

from eaglepipe.core.errors import PipelineError
from eaglepipe.drafter.chunks import list_chunks, require_intact
from eaglepipe.drafter.data import (
    ChunkCache,
    index_rows,
    load_batch,
    plan_batches,
    split_row_ids,
)
from eaglepipe.drafter.loss import soft_cross_entropy, step_targets, target_distribution
from eaglepipe.drafter.model import DrafterConfig, Eagle3Drafter, ttt_attention_mask
from eaglepipe.drafter.target_head import load_target_head
from eaglepipe.drafter.train import check_validated, latest_checkpoint, lr_at, save_checkpoint
from eaglepipe.drafter.vocab import (
    build_draft_vocab,
    choose_draft_vocab,
    load_vocab,
    save_vocab,
)
from eaglepipe.extract.chunk_file import RowTensors, write_chunk
from eaglepipe.extract.shard_files import build_manifest, write_manifest


def tiny_config(**overrides) -> DrafterConfig:
    values = dict(
        hidden_size=16,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=4,
        intermediate_size=24,
        vocab_size=40,
        draft_vocab_size=20,
    )
    values.update(overrides)
    return DrafterConfig(**values)


# ---------------------------------------------------------------------------------------------
# Vocabulary


def test_vocab_round_trip_and_tie_breaking(tmp_path):
    counts = np.array([5, 0, 7, 7, 1, 3, 0, 7, 2, 0])
    vocab = choose_draft_vocab(counts, 5)
    # Counts 7,7,7 (ids 2,3,7), then 5 (id 0), then 3 (id 5); ids ascending in draft order.
    chosen = [0, 2, 3, 5, 7]
    assert (torch.arange(5) + vocab.d2t).tolist() == chosen
    assert vocab.t2d.nonzero().flatten().tolist() == chosen
    assert vocab.d2t.dtype == torch.int64 and vocab.t2d.dtype == torch.bool
    # A tie at the cut: ids 2, 3, 7 all have 7; taking two keeps the smaller ids.
    assert choose_draft_vocab(counts, 2).draft_ids.tolist() == [2, 3]
    # Capped at the target vocabulary.
    assert choose_draft_vocab(counts, 50).size == 10
    save_vocab(vocab, tmp_path / "vocab.safetensors", {"coverage": 0.9})
    loaded = load_vocab(tmp_path / "vocab.safetensors")
    assert torch.equal(loaded.d2t, vocab.d2t) and torch.equal(loaded.t2d, vocab.t2d)


def test_vocab_counts_only_masked_tokens_of_train_rows():
    table = pd.DataFrame(
        {
            "row_id": [0, 1, 2],
            "split": ["train", "train", "eval"],
            "input_ids": [[1, 2, 2, 3], [3, 3, 4, 1], [5, 5, 5, 5]],
            "loss_mask": [[0, 1, 1, 1], [1, 1, 0, 0], [1, 1, 1, 1]],
        }
    )
    vocab, stats = build_draft_vocab(table, target_vocab_size=8, draft_vocab_size=2)
    # Masked train tokens: 2,2,3,3,3 -> {3: 3, 2: 2}; id 5 (eval only) and 1, 4 (unmasked) lose.
    assert vocab.draft_ids.tolist() == [2, 3]
    assert stats["masked_tokens"] == 5 and stats["coverage"] == 1.0


def test_vocab_rejects_out_of_range_ids_and_inconsistent_files(tmp_path):
    table = pd.DataFrame(
        {"row_id": [7], "split": ["train"], "input_ids": [[1, 99]], "loss_mask": [[1, 1]]}
    )
    with pytest.raises(PipelineError, match="row 7: token id 99"):
        build_draft_vocab(table, target_vocab_size=10, draft_vocab_size=4)
    bad = tmp_path / "bad.safetensors"
    t2d = torch.zeros(10, dtype=torch.bool)
    t2d[[0, 1]] = True
    save_file({"d2t": torch.tensor([0, 5]), "t2d": t2d}, bad)  # draft id 1 -> 6, not in t2d
    with pytest.raises(PipelineError, match="disagree"):
        load_vocab(bad)


# ---------------------------------------------------------------------------------------------
# Training-time test: mask, alignment, loss


def test_ttt_attention_mask_three_steps_four_tokens():
    causal = [[1, 0, 0, 0], [1, 1, 0, 0], [1, 1, 1, 0], [1, 1, 1, 1]]
    own = [[1, 0, 0, 0], [0, 1, 0, 0], [0, 0, 1, 0], [0, 0, 0, 1]]
    expected = {
        0: causal,
        1: [c + o for c, o in zip(causal, own, strict=True)],
        2: [c + o + o for c, o in zip(causal, own, strict=True)],
    }
    for step, rows in expected.items():
        assert ttt_attention_mask(4, step).int().tolist() == rows


def test_unrolled_drafter_obeys_the_ttt_mask():
    """Step-2 output at t depends on step-1's input at t only, not at other positions."""
    torch.manual_seed(0)
    model = Eagle3Drafter(tiny_config()).eval()
    aux = torch.randn(1, 4, 48)
    ids = [torch.randint(0, 40, (1, 4)) for _ in range(3)]
    changed = [ids[0], ids[1].clone(), ids[2]]
    changed[1][0, 2] = (ids[1][0, 2] + 1) % 40
    with torch.no_grad():
        before = model(aux, ids)
        after = model(aux, changed)
    assert torch.allclose(before[0], after[0])  # step 0 does not see step-1 inputs
    same = [0, 1, 3]
    assert torch.allclose(before[2][0, same], after[2][0, same], atol=1e-6)
    assert not torch.allclose(before[2][0, 2], after[2][0, 2])
    # Step 0 is causal: a change of the last token leaves earlier positions alone.
    late = [ids[0].clone(), ids[1], ids[2]]
    late[0][0, 3] = (ids[0][0, 3] + 1) % 40
    with torch.no_grad():
        moved = model(aux, late)
    assert torch.allclose(before[0][0, :3], moved[0][0, :3], atol=1e-6)


def test_a_later_step_of_the_last_positions_sees_the_whole_step0_context():
    # Decode-time drafting runs steps >= 1 for the last positions only: the mask keeps each
    # query's causal step-0 keys (offset to its place in the context) and its own later keys.
    assert ttt_attention_mask(2, 1, context_len=4).int().tolist() == [
        [1, 1, 1, 0, 1, 0],
        [1, 1, 1, 1, 0, 1],
    ]
    assert ttt_attention_mask(3, 2).equal(ttt_attention_mask(3, 2, context_len=3))


def _ttt_unroll(q_steps, k_steps, v_steps, fused: bool, monkeypatch):
    """Every step's ttt_attend output and the gradients of their sum, by one path."""
    from eaglepipe.drafter import causal_plus_own
    from eaglepipe.drafter.model import ttt_attend

    with monkeypatch.context() as patch:
        if not fused:
            patch.setattr(causal_plus_own, "available", lambda *a: False)
        leaves = [t.detach().clone().requires_grad_() for t in (*q_steps, *k_steps, *v_steps)]
        n = len(q_steps)
        qs, ks, vs = leaves[:n], leaves[n : 2 * n], leaves[2 * n :]
        cache: list = []
        # Queries as the model makes them: a transposed (non-contiguous) view.
        outs = [ttt_attend(q.transpose(1, 2).contiguous().transpose(1, 2), k, v, cache)
                for q, k, v in zip(qs, ks, vs, strict=True)]  # fmt: skip
        weights = [torch.randn_like(o, generator=torch.Generator().manual_seed(i))
                   for i, o in enumerate(outs)]  # fmt: skip
        sum((o * w).sum() for o, w in zip(outs, weights, strict=True)).backward()
    return outs, [t.grad for t in leaves]


@pytest.mark.parametrize(("dtype", "tolerance"), [(torch.float32, 2e-5), (torch.bfloat16, 3e-2)])
def test_the_fused_cpu_ttt_attention_equals_the_mask_path(monkeypatch, dtype, tolerance):
    """Seven TTT steps with grouped-query heads: outputs and every gradient of the fused path
    (causal kernel plus own-position keys) equal the dense-mask path's."""
    generator = torch.Generator().manual_seed(3)
    batch, heads, kv_heads, length, dim = 2, 4, 2, 37, 8
    steps = 7
    q = [torch.randn(batch, heads, length, dim, generator=generator, dtype=dtype)
         for _ in range(steps)]  # fmt: skip
    k = [torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=dtype)
         for _ in range(steps)]  # fmt: skip
    v = [torch.randn(batch, kv_heads, length, dim, generator=generator, dtype=dtype)
         for _ in range(steps)]  # fmt: skip
    fused, fused_grads = _ttt_unroll(q, k, v, True, monkeypatch)
    masked, masked_grads = _ttt_unroll(q, k, v, False, monkeypatch)
    for step, (a, b) in enumerate(zip(fused, masked, strict=True)):
        assert torch.allclose(a.float(), b.float(), atol=tolerance), step
    for i, (a, b) in enumerate(zip(fused_grads, masked_grads, strict=True)):
        assert torch.allclose(a.float(), b.float(), atol=tolerance * 4), i


def test_the_fused_path_is_what_cpu_training_takes_and_changes_nothing(monkeypatch):
    """The drafter's TTT loss and gradients on the CPU are those of the mask path."""
    from eaglepipe.drafter import causal_plus_own

    calls = []
    original = causal_plus_own.attend
    monkeypatch.setattr(causal_plus_own, "attend", lambda *a: calls.append(1) or original(*a))

    def loss_and_grads(fused: bool):
        torch.manual_seed(0)
        model = Eagle3Drafter(tiny_config())
        generator = torch.Generator().manual_seed(1)
        aux = torch.randn(2, 11, 48, generator=generator)
        ids = [torch.randint(0, 40, (2, 11), generator=generator) for _ in range(3)]
        with monkeypatch.context() as patch:
            if not fused:
                patch.setattr(causal_plus_own, "available", lambda *a: False)
            loss = sum(step.square().mean() for step in model(aux, ids))
            loss.backward()
        return loss.item(), [p.grad.clone() for p in model.parameters() if p.grad is not None]

    fused_loss, fused_grads = loss_and_grads(True)
    assert len(calls) == 3  # one fused call per TTT step
    masked_loss, masked_grads = loss_and_grads(False)
    assert len(calls) == 3
    assert fused_loss == pytest.approx(masked_loss, rel=1e-6)
    for a, b in zip(fused_grads, masked_grads, strict=True):
        assert torch.allclose(a, b, atol=1e-6)


def test_the_live_draft_chain_equals_the_training_unrolls_last_position():
    from eaglepipe.drafter.live_transformers import draft_chain

    torch.manual_seed(2)
    model = Eagle3Drafter(tiny_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # sharper logits: argmax ties would make this vacuous
    committed = torch.randint(0, 20, (9,)).tolist()
    pending, aux, k = 7, torch.randn(9, 48), 5
    drafted = draft_chain(model, committed, pending, aux, k)
    # The unroll over every position, each step's last input the previous step's draft.
    step_ids = [torch.tensor([committed[1:] + [pending]])]
    expected = []
    with torch.no_grad():
        for _ in range(k):
            logits = model(aux[None], step_ids)[-1]
            expected.append(int(model.draft_to_target(logits[0, -1].argmax())))
            following = step_ids[-1].clone()
            following[0, -1] = expected[-1]
            step_ids.append(following)
    assert drafted == expected
    assert len(set(expected)) > 1


def test_the_draft_context_runs_step_zero_on_new_positions_only_with_the_same_drafts():
    from eaglepipe.drafter.live_transformers import DraftContext, draft_chain

    torch.manual_seed(3)
    model = Eagle3Drafter(tiny_config()).eval()
    with torch.no_grad():
        model.lm_head.weight.mul_(8)  # sharper logits: argmax ties would make this vacuous
    tokens, aux, k = torch.randint(0, 20, (20,)).tolist(), torch.randn(20, 48), 4
    context, seen = DraftContext(), []
    for n in (6, 7, 10, 15, 19):  # committed grows by accepted + 1 per round
        with_context = draft_chain(model, tokens[:n], tokens[n], aux[:n], k, context)
        assert context.positions == n and context.step_zero[0].shape[2] == n
        assert with_context == draft_chain(model, tokens[:n], tokens[n], aux[:n], k)
        seen += with_context
    assert len(set(seen)) > 1


def hand_built_batch():
    """Two rows over an 8-id vocab whose target argmax at position q is q (lm_head = 10 * I)."""
    final = torch.zeros(2, 6, 8)
    for q in range(6):
        final[:, q, q] = 1.0
    return {
        "input_ids": torch.tensor([[10, 11, 12, 13, 14, 15], [20, 21, 22, 23, 0, 0]]),
        "loss_mask": torch.tensor([[0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 0, 0]], dtype=torch.uint8),
        "lengths": torch.tensor([6, 4]),
        "final_hidden_states": final,
    }


def test_loss_mask_and_targets_shift_with_the_inputs():
    batch = hand_built_batch()
    lm_head = 10 * torch.eye(8)
    t2d = torch.ones(8, dtype=torch.bool)
    t2d[3] = False  # the target's argmax at q = 3 is outside the draft vocab
    draft_ids = t2d.nonzero().flatten()
    target = target_distribution(batch["final_hidden_states"], lm_head, draft_ids, t2d)
    assert target.argmax[0].tolist() == [0, 1, 2, 3, 4, 5]

    step0 = step_targets(batch["input_ids"], batch["loss_mask"], batch["lengths"], target, 0)
    # Base t consumes x[t+1] and is scored against the target at q = t+1 with loss_mask[t+1].
    assert step0.input_ids[0].tolist() == [11, 12, 13, 14, 15, 0]
    assert step0.argmax[0].tolist() == [1, 2, 3, 4, 5, -1]
    # loss_mask[t+1] = [0, 1, 1, 1, 0, -]; q = 3 is out of vocab -> t = 2 dropped.
    assert step0.mask[0].int().tolist() == [0, 1, 0, 1, 0, 0]
    # The unshifted mask (SpecForge #885) would have been loss_mask[t] = [0, 0, 1, 1, 1, 0].
    # Row 2 is 4 tokens long: positions whose q falls in the padding never count.
    assert step0.mask[1].int().tolist() == [1, 1, 0, 0, 0, 0]

    step1 = step_targets(batch["input_ids"], batch["loss_mask"], batch["lengths"], target, 1)
    assert step1.input_ids[0].tolist() == [12, 13, 14, 15, 0, 0]
    assert step1.argmax[0].tolist() == [2, 3, 4, 5, -1, -1]
    # loss_mask[t+2] = [1, 1, 1, 0, -, -]; q = 3 (t = 1) is out of vocab.
    assert step1.mask[0].int().tolist() == [1, 0, 1, 0, 0, 0]
    assert step1.mask[1].int().tolist() == [1, 0, 0, 0, 0, 0]

    scored = step_targets(
        batch["input_ids"], batch["loss_mask"], batch["lengths"], target, 0, require_in_vocab=False
    )
    assert scored.mask[0].int().tolist() == [0, 1, 1, 1, 0, 0]


def test_target_distribution_is_renormalised_over_the_draft_vocab():
    final = torch.randn(1, 3, 8)
    lm_head = torch.randn(8, 8)
    t2d = torch.zeros(8, dtype=torch.bool)
    t2d[[1, 4, 6]] = True
    draft_ids = t2d.nonzero().flatten()
    target = target_distribution(final, lm_head, draft_ids, t2d)
    full = torch.softmax(final @ lm_head.T, dim=-1)[..., draft_ids]
    assert torch.allclose(target.probs, full / full.sum(-1, keepdim=True), atol=1e-6)


def test_soft_cross_entropy_counts_only_masked_positions():
    logits = torch.randn(1, 3, 4)
    probs = torch.softmax(torch.randn(1, 3, 4), dim=-1)
    mask = torch.tensor([[True, False, True]])
    expected = -(probs * torch.log_softmax(logits, -1)).sum(-1)[0, [0, 2]].mean()
    assert torch.allclose(soft_cross_entropy(logits, probs, mask), expected)
    none = soft_cross_entropy(logits, probs, torch.zeros_like(mask))
    assert float(none) == 0.0


def test_learning_rate_warms_up_then_decays_to_zero():
    lrs = [lr_at(s, 100, 1.0, 10) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[9:], lrs[10:], strict=False))
    assert lrs[-1] < 0.01


# ---------------------------------------------------------------------------------------------
# Data streaming


def write_test_shard(root, name, row_ids, lengths, hidden=4, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shard_dir = root / "hidden_states" / name
    shard_dir.mkdir(parents=True)
    rows = [
        RowTensors(
            row_id=r,
            input_ids=torch.randint(0, 50, (n,), generator=gen, dtype=torch.int32),
            loss_mask=torch.ones(n, dtype=torch.uint8),
            aux_hidden_states=torch.randn(n, 3 * hidden, generator=gen).to(torch.bfloat16),
            final_hidden_states=torch.randn(n, hidden, generator=gen).to(torch.bfloat16),
        )
        for r, n in zip(row_ids, lengths, strict=True)
    ]
    half = len(rows) // 2
    records = [
        write_chunk(shard_dir, 0, rows[:half], hidden_size=hidden),
        write_chunk(shard_dir, 1, rows[half:], hidden_size=hidden),
    ]
    manifest = build_manifest(
        shard=name,
        row_start=row_ids[0],
        row_end=row_ids[-1] + 1,
        hidden_size=hidden,
        aux_layer_ids=[1, 3, 4],
        records=records,
        provenance={},
        timing={},
    )
    return write_manifest(shard_dir, manifest), rows


def test_batches_stream_the_right_rows_within_the_token_budget(tmp_path):
    lengths = [5, 9, 13, 7, 11, 3, 8, 12]
    manifest, rows = write_test_shard(tmp_path, "rows_0-8", list(range(8)), lengths)
    table = pd.DataFrame({"row_id": range(8), "split": ["train"] * 6 + ["eval"] * 2})
    table.to_parquet(tmp_path / "t.parquet")
    train_ids = split_row_ids(tmp_path / "t.parquet", "train")
    chunks, facts = list_chunks([manifest], train_ids)
    require_intact(chunks, log=print)
    refs = index_rows(chunks, train_ids)
    assert sorted(r.row_id for r in refs) == [0, 1, 2, 3, 4, 5]
    assert facts == {
        "hidden_size": 4,
        "aux_layer_ids": [1, 3, 4],
        "stored_dtypes": {"aux_hidden_states": "bfloat16", "final_hidden_states": "bfloat16"},
    }

    plan = plan_batches(refs, batch_tokens=24, max_len=10, seed=3, epoch=0)
    assert sorted(r.row_id for b in plan for r in b) == [0, 1, 2, 3, 4, 5]
    for batch in plan:
        assert len(batch) * max(min(r.length, 10) for r in batch) <= 24 or len(batch) == 1
    assert plan == plan_batches(refs, 24, 10, seed=3, epoch=0)
    orders = {
        tuple(r.row_id for b in plan_batches(refs, 24, 10, 3, e) for r in b) for e in range(6)
    }
    assert len(orders) > 1  # reshuffled per epoch

    cache = ChunkCache(capacity=1)
    for batch_refs in plan:
        batch = load_batch(batch_refs, 10, cache)
        for i, ref in enumerate(batch_refs):
            row = rows[ref.row_id]
            n = min(row.num_tokens, 10)
            assert batch["lengths"][i] == n
            assert torch.equal(batch["input_ids"][i, :n], row.input_ids[:n].long())
            assert torch.equal(batch["aux_hidden_states"][i, :n], row.aux_hidden_states[:n])
            assert int(batch["loss_mask"][i, n:].sum()) == 0


def test_a_missing_chunk_is_named_with_its_shard_and_the_repair(tmp_path):
    manifest, _ = write_test_shard(tmp_path, "rows_0-4", [0, 1, 2, 3], [4, 4, 4, 4])
    (manifest.parent / "chunk-00001.safetensors").unlink()
    chunks, _ = list_chunks([manifest])
    with pytest.raises(PipelineError) as failure:
        require_intact(chunks, log=print)
    assert str(failure.value).startswith(
        f"chunk {manifest.parent / 'chunk-00001.safetensors'} of shard rows_0-4 is missing: "
    )
    assert "repair: `eaglepipe verify` sets the damaged shards aside" in str(failure.value)


def test_chunks_are_listed_only_where_the_wanted_rows_are(tmp_path):
    manifest, _ = write_test_shard(tmp_path, "rows_0-4", [0, 1, 2, 3], [4, 4, 4, 4])
    assert [c.row_ids for c in list_chunks([manifest])[0]] == [(0, 1), (2, 3)]
    assert [c.row_ids for c in list_chunks([manifest], {3})[0]] == [(2, 3)]


# ---------------------------------------------------------------------------------------------
# Target head and the validation gate


def test_target_head_reads_sharded_checkpoints_and_ignores_mtp_copies(tmp_path):
    embed, head = torch.randn(12, 4), torch.randn(12, 4)
    save_file({"model.embed_tokens.weight": embed}, tmp_path / "model-00001-of-00002.safetensors")
    save_file(
        {"lm_head.weight": head, "model.layers.61.embed_tokens.weight": torch.zeros(12, 4)},
        tmp_path / "model-00002-of-00002.safetensors",
    )
    weight_map = {
        "model.embed_tokens.weight": "model-00001-of-00002.safetensors",
        "lm_head.weight": "model-00002-of-00002.safetensors",
        "model.layers.61.embed_tokens.weight": "model-00002-of-00002.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 12, "hidden_size": 4}))
    loaded = load_target_head(tmp_path)
    assert torch.equal(loaded.embed_tokens, embed) and torch.equal(loaded.lm_head, head)


def test_target_head_ties_embeddings_only_when_configured(tmp_path):
    embed = torch.randn(12, 4)
    save_file({"model.embed_tokens.weight": embed}, tmp_path / "model.safetensors")
    config = {"vocab_size": 12, "hidden_size": 4, "tie_word_embeddings": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert torch.equal(load_target_head(tmp_path).lm_head, embed)
    config["tie_word_embeddings"] = False
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(PipelineError, match="no lm_head.weight"):
        load_target_head(tmp_path)


def test_gate_needs_a_matching_validation_report(tmp_path):
    manifest, _ = write_test_shard(tmp_path, "rows_0-4", [0, 1, 2, 3], [4, 4, 4, 4])
    with pytest.raises(PipelineError, match="shard rows_0-4 .* has no validation report"):
        check_validated([str(manifest)], [])
    from eaglepipe.core.fingerprint import hash_file

    report = tmp_path / "rows_0-4.json"
    passed = {"shard": "rows_0-4", "manifest_xxh3_128": hash_file(manifest)}
    passed["checks"] = {"integrity": {"ok": True}, "values": {"ok": True}}
    report.write_text(json.dumps(passed))
    check_validated([str(manifest)], [str(report)])
    # A report that records a failed check (the validate job never writes one: edited by hand),
    # or none, was accepted: training read the shard.
    failed = {**passed, "checks": {"integrity": {"ok": False}, "values": {"ok": True}}}
    report.write_text(json.dumps(failed))
    with pytest.raises(PipelineError) as raised:
        check_validated([str(manifest)], [str(report)])
    assert str(raised.value) == (
        f"validation report {report} records check(s) integrity as not passed: its shard was "
        f"not validated; `rm {report}`, then `snakemake --cores N` validates it again"
    )
    report.write_text(json.dumps({k: v for k, v in passed.items() if k != "checks"}))
    with pytest.raises(PipelineError, match="records no checks: its shard was not validated"):
        check_validated([str(manifest)], [str(report)])
    report.write_text(json.dumps(passed))
    manifest.write_text(manifest.read_text().replace('"num_rows"', '"num_rows" ', 1))
    with pytest.raises(PipelineError, match="changed after it was validated"):
        check_validated([str(manifest)], [str(report)])


# ---------------------------------------------------------------------------------------------
# Checkpoints


class RunsCodeWhenUnpickled:
    """What a hostile `step-*.pt` holds: unpickling it calls os.mkdir(marker)."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        import os

        return (os.mkdir, (self.marker,))


def test_checkpoint_round_trip_loads_as_plain_tensors(tmp_path):
    model = Eagle3Drafter(tiny_config())
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=0.1)
    model.fc.weight.sum().backward()
    optimizer.step()
    save_checkpoint(tmp_path, 7, model, optimizer, "run-key")
    state = latest_checkpoint(tmp_path, "run-key", log=print)
    assert state["step"] == 7
    fresh = Eagle3Drafter(tiny_config())
    fresh.load_state_dict(state["model"], strict=False)
    assert torch.equal(fresh.fc.weight, model.fc.weight)
    again = torch.optim.AdamW([p for p in fresh.parameters() if p.requires_grad], lr=0.1)
    again.load_state_dict(state["optimizer"])
    assert again.state_dict()["state"][0]["step"] == 1


def test_a_checkpoint_that_runs_code_is_refused_not_executed(tmp_path):
    marker = tmp_path / "code-ran"
    checkpoints = tmp_path / "checkpoints"
    checkpoints.mkdir()
    payload = {"step": 9, "run_key": "run-key", "model": RunsCodeWhenUnpickled(marker)}
    torch.save(payload, checkpoints / "step-00000009.pt")
    lines = []
    assert latest_checkpoint(checkpoints, "run-key", log=lines.append) is None
    assert not marker.exists()
    assert len(lines) == 1 and "step-00000009.pt is not a plain-tensor checkpoint" in lines[0]


def test_gate_names_a_missing_manifest_or_report_in_one_line(tmp_path):
    manifest, _ = write_test_shard(tmp_path, "rows_0-4", [0, 1, 2, 3], [4, 4, 4, 4])
    from eaglepipe.core.fingerprint import hash_file

    report = tmp_path / "rows_0-4.json"
    passed = {"shard": "rows_0-4", "manifest_xxh3_128": hash_file(manifest)}
    report.write_text(json.dumps({**passed, "checks": {"integrity": {"ok": True}}}))
    with pytest.raises(PipelineError, match="validation report .*missing.json does not exist"):
        check_validated([str(manifest)], [str(report), str(tmp_path / "missing.json")])
    manifest.unlink()
    with pytest.raises(PipelineError) as failure:
        check_validated([str(manifest)], [str(report)])
    message = str(failure.value)
    assert message.startswith(f"shard rows_0-4: {manifest} does not exist")
    assert "\n" not in message
