"""Text generation on the reference server (a real process) and the generation client.

Greedy replies equal an independent unbatched transformers greedy decode, alone or in any batch
(the property that makes regenerated datasets reproducible); stop tokens and length limits end
a reply as SGLang reports them; seeded sampling repeats per seed; generation requests are never
dumped, even beside extraction requests; bad sampling parameters get a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import os
import signal

import aiohttp
import pytest
import torch
from conftest import plain_greedy
from test_reference_server import body, generate, launch, rid, token_ids

from eaglepipe.core.errors import PipelineError
from eaglepipe.regenerate.client import (
    GenerationClient,
    GenerationSettings,
    RowRefused,
    parse_reply,
)
from eaglepipe.server.handoff.request_ids import make_generation_rid, parse_generation_rid
from eaglepipe.server.reference.faults import parse_faults

NONCE = "0123456789ab"
# Prompt lengths of one concurrent wave: padding, and requests finishing at different steps.
PROMPT_LENGTHS = [5, 31, 2, 17, 60, 9]
NEW_TOKENS = 12


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama_dir):
    proc = launch("generation", tiny_llama_dir, tmp_path_factory.mktemp("generation"))
    try:
        yield proc.wait_healthy()
    finally:
        proc.signal_group(signal.SIGTERM)
        proc.stop()


def gen_body(row: int, prompt: list[int], **params) -> dict:
    sampling = {"max_new_tokens": NEW_TOKENS, "temperature": 0.0, **params}
    return {
        "input_ids": prompt,
        "rid": make_generation_rid("eaglepipe", NONCE, row, 1, 0),
        "sampling_params": sampling,
    }


def test_greedy_replies_are_the_unbatched_greedy_decode_alone_or_batched(server, tiny_llama_dir):
    prompts = [token_ids(n, seed=n) for n in PROMPT_LENGTHS]
    expected = [plain_greedy(tiny_llama_dir, p, NEW_TOKENS) for p in prompts]
    alone = [generate(server, [gen_body(i, p)])[0] for i, p in enumerate(prompts)]
    batched = generate(server, [gen_body(i, p) for i, p in enumerate(prompts)])
    for (status_a, answer_a), (status_b, answer_b), want in zip(
        alone, batched, expected, strict=True
    ):
        assert status_a == status_b == 200
        assert answer_a["output_ids"] == answer_b["output_ids"] == want
        assert answer_b["meta_info"]["finish_reason"] == {"type": "length", "length": NEW_TOKENS}
        assert answer_b["meta_info"]["completion_tokens"] == NEW_TOKENS


def test_a_stop_token_ends_the_reply_and_is_reported_as_sglang_does(server, tiny_llama_dir):
    prompt = token_ids(20, seed=3)
    full = plain_greedy(tiny_llama_dir, prompt, NEW_TOKENS)
    stop = full[3]
    [(status, answer)] = generate(server, [gen_body(1, prompt, stop_token_ids=[stop])])
    assert status == 200
    assert answer["output_ids"] == full[: full.index(stop) + 1]
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # The client drops the matched stop token, as it reads SGLang's answer too.
    reply = parse_reply(answer, [stop], "row 1")
    assert reply.output_ids == full[: full.index(stop)] and reply.finish == "stop"


def test_seeded_sampling_repeats_for_a_seed_and_differs_across_seeds(server):
    prompt = token_ids(12, seed=11)

    def sample(seed: int, row: int) -> list[int]:
        [(status, answer)] = generate(
            server, [gen_body(row, prompt, temperature=1.0, sampling_seed=seed, max_new_tokens=24)]
        )
        assert status == 200
        return answer["output_ids"]

    first = sample(7, 1)
    # In a batch with other requests, the same seed draws the same tokens.
    together = generate(
        server,
        [
            gen_body(2, prompt, temperature=1.0, sampling_seed=7, max_new_tokens=24),
            gen_body(3, token_ids(40, seed=1), temperature=1.0, sampling_seed=9),
        ],
    )
    assert together[0][1]["output_ids"] == first
    assert sample(8, 4) != first


def test_generation_is_never_dumped_even_beside_extraction_requests(server):
    before = set(os.listdir(server.dump_dir))
    answers = generate(
        server,
        [body(rid(900), token_ids(7, seed=1)), gen_body(901, token_ids(7, seed=1))]
        + [body(rid(902), token_ids(30, seed=2)), gen_body(903, token_ids(30, seed=2))],
    )
    assert [status for status, _ in answers] == [200] * 4
    assert answers[0][1]["output_ids"] == [] and len(answers[1][1]["output_ids"]) == NEW_TOKENS
    new = set(os.listdir(server.dump_dir)) - before
    assert new == {f"{rid(900)}.safetensors", f"{rid(902)}.safetensors"}
    for name in new:
        (server.dump_dir / name).unlink()


@pytest.mark.parametrize(
    ("sampling", "message"),
    [
        ({"temperature": -1}, "sampling_params.temperature"),
        ({"top_p": 0}, "sampling_params.top_p"),
        ({"stop_token_ids": [300]}, "sampling_params.stop_token_ids holds 300"),
        ({"sampling_seed": "x"}, "sampling_params.sampling_seed"),
        ({"frequency_penalty": 0.5}, "sampling_params.frequency_penalty is not supported"),
        ({"max_new_tokens": 1020}, "more than max_position_embeddings 1024"),
    ],
)
def test_bad_sampling_parameters_get_400_naming_the_field(server, sampling, message):
    [(status, answer)] = generate(server, [gen_body(1, token_ids(5, seed=1), **sampling)])
    assert status == 400
    assert message in answer["error"]["message"]


def test_an_extraction_request_id_may_not_generate(server):
    [(status, answer)] = generate(server, [body(rid(5), [1, 2], max_new_tokens=4)])
    assert status == 400
    assert "extraction requests are prefill only" in answer["error"]["message"]


def test_the_client_returns_replies_and_names_a_refused_row(server, tiny_llama_dir):
    settings = GenerationSettings(
        temperature=0.0,
        top_p=1.0,
        stop_token_ids=(),
        request_prefix="eaglepipe",
        retries=1,
        request_timeout_s=60,
    )
    client = GenerationClient(server.url, settings, nonce=NONCE)
    prompt = token_ids(9, seed=4)

    async def run(ids, new):
        async with aiohttp.ClientSession() as session:
            return await client.generate(session, 42, 3, ids, new, seed=0)

    reply = asyncio.run(run(prompt, 6))
    assert reply.output_ids == plain_greedy(tiny_llama_dir, prompt, 6)
    assert reply.finish == "length"
    with pytest.raises(RowRefused, match=r"^row 42 turn 3: server refused request .* with 400"):
        asyncio.run(run([1] * 1020, 6))


def test_generation_request_ids_never_carry_the_extraction_prefix():
    made = make_generation_rid("eaglepipe", NONCE, 17, 4, 2)
    assert not made.startswith("eaglepipe-")
    assert parse_generation_rid(made) == ("eaglepipe", NONCE, 17, 4, 2)
    assert parse_generation_rid(rid(17)) is None
    with pytest.raises(PipelineError):
        make_generation_rid("eaglepipe", "not-hex", 1, 1, 0)


def test_the_empty_reply_fault_names_rows():
    faults = parse_faults("empty_reply:3,empty_reply:12")
    assert faults.active and faults.describe() == "empty_reply:3,empty_reply:12"
    assert faults.empty_reply_for(make_generation_rid("eaglepipe", NONCE, 12, 1, 0))
    assert not faults.empty_reply_for(make_generation_rid("eaglepipe", NONCE, 4, 1, 0))
    assert not faults.empty_reply_for(rid(3))
    with pytest.raises(PipelineError, match="empty_reply needs a non-negative count"):
        parse_faults("empty_reply:x")


def test_near_ties_are_decided_by_an_unbatched_forward(tiny_llama_dir):
    """In-process: with a margin that counts every step as a near tie, each token comes from the
    request's unbatched forward (and the replies stay the greedy decode); with none, none does."""
    from transformers import AutoModelForCausalLM

    from eaglepipe.server.reference.generate import BatchGenerator, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    prompts = [token_ids(n, seed=n) for n in (4, 19, 33)]
    params = [SamplingParams(max_new_tokens=5, temperature=0.0)] * len(prompts)
    expected = [plain_greedy(tiny_llama_dir, p, 5) for p in prompts]
    for margin, unbatched in ((float("inf"), 15), (0.0, 0)):
        generator = BatchGenerator(model, torch.device("cpu"), torch.float32)
        generator.margin = margin
        results = generator.generate(prompts, params)
        assert [r.output_ids for r in results] == expected
        assert generator.unbatched_decisions == unbatched


def test_requests_join_a_running_decode_and_leave_it_when_they_end(tiny_llama_dir):
    """Continuous batching, in-process: requests admitted while others decode, with other
    prompt lengths and budgets, each still produce the unbatched greedy decode, with no near-tie
    fallback (margin 0: the merged keys and values alone decide every token); each request
    leaves the batch at the step it ends, and the padding only ended requests needed goes."""
    from transformers import AutoModelForCausalLM

    from eaglepipe.server.reference.generate import BatchGenerator, DecodeSession, SamplingParams

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    generator = BatchGenerator(model, torch.device("cpu"), torch.float32)
    generator.margin = 0.0
    session = DecodeSession(generator)
    waves = {0: [(40, 6), (3, 2)], 2: [(11, 9), (25, 4)], 5: [(7, 3)]}  # step: (length, budget)
    ended_at, sequences, widths = {}, [], []
    for step in range(40):
        for length, budget in waves.get(step, []):
            seq = generator.sequence(
                len(sequences), token_ids(length, seed=length),
                SamplingParams(max_new_tokens=budget, temperature=0.0, ignore_eos=True),
            )  # fmt: skip
            sequences.append(seq)
            session.admit([seq])
        if not session.active:
            break
        for seq in session.step():
            ended_at[seq.index] = step
        widths.append(session.width)
    assert len(ended_at) == len(sequences) == 5
    for seq in sequences:
        prompt, budget = seq.prompt, seq.params.max_new_tokens
        assert seq.result.output_ids == plain_greedy(tiny_llama_dir, prompt, budget)
        assert seq.result.finish == "length"
    # Each left at the step its budget ran out.
    assert ended_at == {0: 5, 1: 1, 2: 10, 3: 5, 4: 7}
    assert generator.unbatched_decisions == 0
    # The 40-token prompt left at step 5: the 25-token one is the widest after it.
    assert widths[5] < widths[4]
