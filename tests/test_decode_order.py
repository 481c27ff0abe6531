"""Offline acceptance in decode order: hand-built acceptance patterns where the per-position mean
of overlapping chains and the decoder's walk differ, checked against both; and evaluate_model
reporting the walk as its headline."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from eaglepipe.drafter.data import index_rows
from eaglepipe.drafter.decode_order import (
    acceptance,
    assistant_turns,
    summarize,
    walk_row,
    walk_turn,
)
from eaglepipe.drafter.evaluate import evaluate_model
from eaglepipe.drafter.vocab import DraftVocab
from eaglepipe.extract.chunk_file import RowTensors, write_chunk


def test_assistant_turns_are_the_runs_of_masked_tokens():
    assert assistant_turns([0, 0, 1, 1, 0, 1, 0, 1, 1]) == [(2, 3), (5, 5), (7, 8)]
    assert assistant_turns([0, 0]) == []


def test_a_round_advances_by_the_accepted_chain_plus_the_bonus_token():
    # Turn 2..11 (10 tokens; token 2 comes from prefill). Chains at base t = emitted - 1.
    lead = [0] * 12
    lead[1] = 7  # after token 2: accepted min(7, 3 steps, 11-2) = 3 -> emitted 6
    lead[5] = 0  # after token 6: nothing accepted -> emitted 7
    lead[6] = 2  # after token 7: 2 accepted -> emitted 10
    lead[9] = 5  # after token 10: at most 11-10 = 1 more draft (nothing past the turn) -> 11
    assert walk_turn(lead, 2, 11, steps=3) == 4
    # 10 completion tokens in 4 rounds: SGLang's accept length 2.5
    (turn,) = walk_row(7, lead, [0, 0] + [1] * 10, steps=[3])
    assert (turn.row_id, turn.turn, turn.tokens, turn.rounds) == (7, 0, 10, {3: 4})
    assert acceptance([turn], 3)["acceptance_length"] == pytest.approx(2.5)


def test_easy_stretches_weigh_less_in_decode_order_than_per_position():
    """First half of the reply trivially predictable, second half never: the per-position mean
    counts every easy position's long chain, a decoder skips the easy half in a few rounds."""
    first, last, k = 1, 40, 7
    lead = [7 if t < 20 else 0 for t in range(41)]
    mask = [0] + [1] * 40
    positions = range(first - 1, last)  # chain bases whose first draft is inside the turn
    per_position = 1 + sum(min(lead[t], last - t - 1) for t in positions) / len(positions)
    (turn,) = walk_row(0, lead, mask, steps=[k])
    decode = turn.tokens / turn.rounds[k]
    # decode order: 3 rounds of 8 tokens from bases 0, 8, 16 reach token 25, then one token a
    # round up to token 40: 18 rounds for 40 tokens; per position: half the chains are 7 long
    assert turn.rounds[k] == 3 + 15
    assert decode == pytest.approx(40 / 18)
    assert per_position == pytest.approx(4.5)


def test_length_limited_turns_are_reported_apart():
    lead = [7] * 30
    mask = [0] + [1] * 9 + [0] * 5 + [1] * 15
    turns = walk_row(3, lead, mask, steps=[7], length_limited_turns=[1])
    assert [t.length_limited for t in turns] == [False, True]
    summary = summarize(turns, [7])["7"]
    assert summary["without_length_limited"]["turns"] == 1
    assert summary["length_limited_only"]["tokens"] == 15
    assert summary["all_turns"]["tokens"] == 24


class ScriptedDrafter(nn.Module):
    """A drafter whose step-i guess at base t is right exactly when i < lead[t]."""

    def __init__(self, targets: torch.Tensor, lead: list[int], vocab: int):
        super().__init__()
        self.targets, self.lead, self.vocab = targets, lead, vocab
        self.anchor = nn.Parameter(torch.zeros(1))

    def forward(self, aux, step_inputs):
        length = aux.shape[1]
        out = []
        for i in range(len(step_inputs)):
            logits = torch.zeros(1, length, self.vocab)
            for t in range(length):
                q = t + 1 + i
                target = int(self.targets[q]) if q < length else 0
                guess = target if i < self.lead[t] else (target + 1) % self.vocab
                logits[0, t, guess] = 1.0
            out.append(logits)
        return out


def test_evaluate_model_headline_is_the_decode_order_walk(tmp_path):
    vocab_size, length, ttt = 16, 24, 3
    mask = [0] * 4 + [1] * 20  # one turn, positions 4..23
    lead = [3 if 4 <= t < 12 else 0 for t in range(length)]
    targets = torch.randint(0, vocab_size, (length,), generator=torch.Generator().manual_seed(0))
    # final hidden = one-hot of the target's greedy token, lm_head = identity
    final = torch.nn.functional.one_hot(targets, vocab_size).to(torch.bfloat16) * 8
    row = RowTensors(
        row_id=5,
        input_ids=torch.arange(length, dtype=torch.int32),
        loss_mask=torch.tensor(mask, dtype=torch.uint8),
        aux_hidden_states=torch.zeros(length, 3 * vocab_size, dtype=torch.bfloat16),
        final_hidden_states=final,
    )
    record = write_chunk(tmp_path, 0, [row], hidden_size=vocab_size)
    chunk = type("Chunk", (), {"path": str(tmp_path / record.file)})()
    rows = index_rows([chunk])
    vocab = DraftVocab(d2t=torch.zeros(vocab_size, dtype=torch.int64), t2d=torch.ones(16).bool())
    result = evaluate_model(
        ScriptedDrafter(targets, lead, vocab_size),
        vocab,
        torch.eye(vocab_size),
        rows,
        ttt_length=ttt,
        batch_tokens=1024,
        max_len=64,
        device=torch.device("cpu"),
    )
    (expected,) = walk_row(5, lead, mask, steps=[ttt])
    assert result["acceptance_length"] == pytest.approx(20 / expected.rounds[ttt])
    # The old figure, kept as a diagnostic: chains counted at every masked base position
    # q = t+1 (the step-0 token is a reply token), each capped by where the mask ends.
    bases = [t for t in range(length - 1) if mask[t + 1]]
    capped = [min(lead[t], sum(mask[t + 1 : t + 1 + ttt])) for t in bases]
    assert result["per_position_mean_chain"] == pytest.approx(1 + sum(capped) / len(capped))
    assert result["per_position_mean_chain"] > result["acceptance_length"]
    assert result["turns"][0]["rounds"] == {str(ttt): expected.rounds[ttt]}
