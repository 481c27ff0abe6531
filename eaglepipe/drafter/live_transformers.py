"""Live acceptance in transformers (server.engine reference): target and exported drafter.

The drafter is read from the *exported* directory through the name mapping of the engine it
was exported for (`engine_load.load_exported_drafter`: SGLang's or vLLM's, for either draft
layer), and the target's aux layers are the ones that engine would capture given the exported
ids and the target's family. Then, per prompt, greedy chain drafting:

    committed tokens S (n of them), pending token x (the target's greedy next token)
    draft: step 0 over S with inputs S[1:] + [x] and fc(aux of S); its last position gives d1;
           step j feeds d_j at that position (exactly the training-time-test layout)
    verify: one target forward over S + [x, d1..dk]; accept the longest prefix of d equal to
            the target's greedy tokens; the target's token after it becomes the next pending.

The prefill's token is the first output; each round then yields accepted + 1 tokens, and
decoding stops at the first stop token (end of turn) or the token budget, as SGLang decodes.
The output is compared with plain greedy decoding of the target, stopped the same way. The
whole target is loaded on one device: this harness is for targets that fit.
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch

from ..core.errors import PipelineError
from ..core.run import RunSpec
from .engine_load import load_exported_drafter
from .live_run import (
    ExportInfo,
    LiveTurn,
    PlainOutput,
    PromptRun,
    SpeculativeSetting,
    first_difference,
)
from .model import Eagle3Drafter


class Target:
    """A transformers target with a KV cache: greedy tokens and the captured aux hidden states of
    the tokens it is given, a few at a time, as an engine serves it."""

    def __init__(self, path, aux_layers: list[int], device: torch.device, trust_remote_code=False):
        from transformers import AutoModelForCausalLM

        # fp32 on CPU (the toy target); bf16 on a GPU, as the engines would serve it.
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        self.model = AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, trust_remote_code=trust_remote_code
        ).to(device)
        self.model.eval()
        self.aux_layers = aux_layers
        self.device = device
        self.cache = None
        # transformers renamed `past_key_values` to `cache` (5.24 warns on the old name).
        parameters = inspect.signature(self.model.forward).parameters
        self.cache_argument = "cache" if "cache" in parameters else "past_key_values"

    @torch.no_grad()
    def start(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Prefill `ids` into a fresh cache: (greedy next token per position, aux [n, 3H])."""
        from transformers import DynamicCache

        self.cache = DynamicCache()
        return self.extend(ids)

    @torch.no_grad()
    def extend(self, ids: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """The next tokens through the cache: (greedy next token per position, aux [n, 3H])."""
        out = self.model(
            torch.tensor([ids], device=self.device),
            use_cache=True,
            output_hidden_states=True,
            **{self.cache_argument: self.cache},
        )
        # Our aux id k is the output of decoder layer k = hidden_states[k + 1] (layers.py).
        aux = torch.cat([out.hidden_states[k + 1][0] for k in self.aux_layers], dim=-1)
        return out.logits[0].argmax(-1), aux.float()

    def keep(self, length: int) -> None:
        """Drop the cached positions from `length` on (rejected drafts)."""
        surplus = self.cache.get_seq_length() - length
        if surplus > 0:
            self.cache.crop(-surplus)  # a negative count removes that many: every release

    @torch.no_grad()
    def greedy(self, ids: list[int], new_tokens: int, stops=()) -> list[int]:
        """Plain greedy decoding: the new tokens, up to and including a stop token."""
        next_ids, _ = self.start(ids)
        out = [int(next_ids[-1])]
        while out[-1] not in stops and len(out) < new_tokens:
            next_ids, _ = self.extend([out[-1]])
            out.append(int(next_ids[-1]))
        return out

    @torch.no_grad()
    def margin(self, ids: list[int]) -> float:
        """Top-1 minus top-2 logit of the target's next token after `ids`."""
        out = self.model(torch.tensor([ids], device=self.device), use_cache=False)
        top = out.logits[0, -1].float().topk(2).values
        return float(top[0] - top[1])


class _ContinuedStepZero(list):
    """A draft chain's TTT kv_cache whose step-0 entry continues `earlier`, the step-0 keys and
    values of the positions drafted over in earlier rounds (`ttt_attend` appends one entry per
    step; the step-0 queries are then the entry's last positions)."""

    def __init__(self, earlier: tuple[torch.Tensor, torch.Tensor] | None):
        super().__init__()
        self.earlier = earlier

    def append(self, entry) -> None:
        if not self and self.earlier is not None:
            entry = tuple(torch.cat(pair, dim=2) for pair in zip(self.earlier, entry, strict=True))
        super().append(entry)


class DraftContext:
    """Step 0 of the positions one decode has drafted over so far. Position t's step-0 input
    (committed[t+1], or the pending token at the last position, which becomes committed[t+1])
    and aux never change, so a round runs step 0 only for the positions committed since."""

    def __init__(self):
        self.positions = 0
        self.step_zero: tuple[torch.Tensor, torch.Tensor] | None = None


@torch.no_grad()
def draft_chain(
    drafter: Eagle3Drafter,
    committed: list[int],
    pending: int,
    aux: torch.Tensor,
    k: int,
    context: DraftContext | None = None,
) -> list[int]:
    """k draft tokens continuing committed + [pending], from the aux states of `committed`.

    Step 0 runs over the whole context (its keys are what every later step attends to), or,
    with `context`, over the positions it has not seen; the later steps only for the last
    position, the one whose chain is drafted: the same keys and the same result as the
    training unroll's last position, without its other chains."""
    device = aux.device
    n = len(committed)
    start = context.positions if context is not None else 0
    inputs = torch.tensor([(committed[1:] + [pending])[start:]], device=device)
    positions = torch.arange(start, n, device=device)[None]
    hidden = drafter.project(aux[None, start:n])
    kv_cache = _ContinuedStepZero(context.step_zero if context is not None else None)
    drafted: list[int] = []
    for step in range(k):
        hidden, logits = drafter.step(inputs, hidden, positions + step, kv_cache)
        token = int(drafter.draft_to_target(logits[0, -1].argmax()))
        drafted.append(token)
        inputs = torch.tensor([[token]], device=device)
        hidden = hidden[:, -1:]
        positions = positions[:, -1:]
    if context is not None:
        context.positions, context.step_zero = n, kv_cache[0]
    return drafted


def speculative_decode(
    target: Target,
    drafter: Eagle3Drafter,
    prompt: list[int],
    new_tokens: int,
    k: int,
    stops=(),
) -> tuple[list[int], list[int]]:
    """(generated ids up to and including a stop token, accepted drafts per round)."""
    committed = list(prompt)
    greedy, aux = target.start(committed)
    pending = int(greedy[-1])
    produced = [pending]  # the prefill's token
    rounds: list[int] = []
    context = DraftContext()
    while produced[-1] not in stops and len(produced) < new_tokens:
        drafted = draft_chain(drafter, committed, pending, aux, k, context)
        # One verification forward over the pending token and the drafts: greedy[i] is the
        # target's token after ([pending] + drafted)[i].
        greedy, new_aux = target.extend([pending] + drafted)
        accepted = 0
        while accepted < k and int(greedy[accepted]) == drafted[accepted]:
            accepted += 1
        rounds.append(accepted)
        bonus = int(greedy[accepted])
        for token in [*drafted[:accepted], bonus]:
            produced.append(token)
            if token in stops:
                break  # what follows a stop token is not decoded
        committed = committed + [pending] + drafted[:accepted]
        target.keep(len(committed))
        aux = torch.cat([aux, new_aux[: accepted + 1]])
        pending = bonus
    return produced[:new_tokens], rounds


def harness_device() -> torch.device:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cpu":
        # A decode step is too little work to share between CPU threads: on a busy 2-core
        # machine two threads spinning on contended cores made this harness ~10x slower.
        torch.set_num_threads(1)
    return device


@contextmanager
def plain_decoder(run: RunSpec, stops, new_tokens: int) -> Iterator:
    """The target decoding plainly (greedy, no drafter) in transformers, one prompt at a time:
    yields `decode(prompt ids) -> PlainOutput`, the reference `run_transformers` takes as
    `plain`, for prompts that depend on earlier plain answers (a conversation's later turns)."""
    target = Target(
        run.model.directory, list(run.aux_layer_ids), harness_device(), run.model.trust_remote_code
    )

    def decode(prompt: list[int]) -> PlainOutput:
        started = time.perf_counter()
        output = target.greedy(prompt, new_tokens, stops)
        return PlainOutput(output, time.perf_counter() - started)

    yield decode


def run_transformers(
    run: RunSpec,
    export: ExportInfo,
    captured: list[int],
    turns: list[LiveTurn],
    stops,
    *,
    speculative: SpeculativeSetting,
    plain: dict[tuple[int, int], PlainOutput] | None = None,
) -> tuple[list[PromptRun], dict]:
    """Every turn decoded with the drafter and plainly (unless `plain` holds the plain outputs
    already), in transformers on one device. `extra["plain"]` holds the plain outputs used."""
    if speculative.topk != 1:
        raise PipelineError(
            f"speculative setting {speculative.label}: the transformers harness drafts a chain "
            "(top-k 1); a tree needs the SGLang harness (server.engine: sglang)"
        )
    new_tokens, k = run.evaluate.live_new_tokens, speculative.steps
    plain = dict(plain) if plain is not None else {}
    device = harness_device()
    target = Target(run.model.directory, captured, device, run.model.trust_remote_code)
    drafter = load_exported_drafter(export)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight.float())
    drafter = drafter.to(device).eval()
    runs = []
    for i, turn in enumerate(turns, 1):
        started = time.perf_counter()
        produced, rounds = speculative_decode(target, drafter, turn.prompt, new_tokens, k, stops)
        seconds = time.perf_counter() - started
        if (turn.row_id, turn.turn) not in plain:
            started = time.perf_counter()
            greedy = target.greedy(turn.prompt, new_tokens, stops)
            plain[(turn.row_id, turn.turn)] = PlainOutput(greedy, time.perf_counter() - started)
        greedy = plain[(turn.row_id, turn.turn)].output_ids
        greedy_seconds = plain[(turn.row_id, turn.turn)].seconds
        at = first_difference(produced, greedy)
        margin = None
        if at is not None and at < len(greedy):
            margin = target.margin(turn.prompt + greedy[:at])
        runs.append(
            PromptRun(
                turn.row_id,
                turn.turn,
                produced,
                greedy,
                completion_tokens=len(produced),
                rounds=len(rounds),
                accepted=sum(rounds),
                seconds=seconds,
                greedy_seconds=greedy_seconds,
                margin_at_difference=margin,
            )
        )
        length = len(produced) / len(rounds) if rounds else float(len(produced))
        print(
            f"live prompt {i}/{len(turns)} (row {turn.row_id}, turn {turn.turn}): "
            f"{len(produced)} tokens in {len(rounds)} rounds, acceptance length {length:.2f}",
            flush=True,
        )
    dtype = str(target.model.dtype).removeprefix("torch.")
    return runs, {"device": str(device), "dtype": dtype, "plain": plain}
