"""Batched text generation for the reference server (the `/generate` path with max_new_tokens > 0).

Concurrent generation requests are decoded together: their prompts left-padded into one batch,
one forward per new token with a key/value cache, each request stopping at its own stop token or
length limit (finished requests leave the batch, so they cost nothing further).

Batching must not change what a request produces, or a regenerated dataset would depend on
which requests happened to share a batch. Padding and batch size move fp32 logits by ~1e-6, so
a greedy step is decided by the batch only when its top two logits are further apart than
`tie_margin` (far above that noise); a closer call is decided by one unbatched forward of the
request's whole sequence, the same computation whatever the batch. Greedy output is therefore
the same bytes whether a request ran alone or in any batch. Sampling draws from each request's
own generator seeded by `sampling_seed`, so it repeats for the same seed (up to the float noise
of batching, which can move a draw that lands on a boundary between two tokens).
"""

from __future__ import annotations

import inspect
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from . import decode_cache

# Top-two logit gaps below this are decided by an unbatched forward (see the module docstring).
TIE_MARGIN = {torch.float32: 1e-3, torch.float64: 1e-6}
LOW_PRECISION_TIE_MARGIN = 0.25  # bf16 / fp16: batching noise is ~1e-2 there


def tie_margin(dtype: torch.dtype) -> float:
    return TIE_MARGIN.get(dtype, LOW_PRECISION_TIE_MARGIN)


class BadSamplingParams(ValueError):
    """A sampling parameter the server cannot honour; the message names the field."""


@dataclass(frozen=True)
class SamplingParams:
    """The SGLang sampling parameters the reference server understands."""

    max_new_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    sampling_seed: int | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False

    @property
    def greedy(self) -> bool:
        # SGLang's rule: a temperature below 1e-6 means greedy (top_k = 1).
        return self.temperature < 1e-6

    @classmethod
    def from_request(cls, params: dict, vocab_size: int) -> SamplingParams:
        """Read `sampling_params` of a /generate body; raises BadSamplingParams naming the field."""
        known = {
            "max_new_tokens",
            "temperature",
            "top_p",
            "top_k",
            "sampling_seed",
            "stop_token_ids",
            "ignore_eos",
            "skip_special_tokens",
            "no_stop_trim",
        }
        unknown = sorted(set(params) - known)
        if unknown:
            raise BadSamplingParams(
                f"sampling_params.{unknown[0]} is not supported by the reference server "
                f"(supported: {', '.join(sorted(known))})"
            )
        new = params.get("max_new_tokens", 128)
        if not _is_int(new) or new < 1:
            raise BadSamplingParams("sampling_params.max_new_tokens must be a positive integer")
        temperature = params.get("temperature", 1.0)
        if not _is_number(temperature) or temperature < 0:
            raise BadSamplingParams("sampling_params.temperature must be a number >= 0")
        top_p = params.get("top_p", 1.0)
        if not _is_number(top_p) or not 0 < top_p <= 1:
            raise BadSamplingParams("sampling_params.top_p must be in (0, 1]")
        top_k = params.get("top_k", -1)
        if top_k not in (-1, None) and not (top_k == 1 and temperature < 1e-6):
            raise BadSamplingParams("sampling_params.top_k is not supported (only -1)")
        seed = params.get("sampling_seed")
        if seed is not None and (not _is_int(seed) or not 0 <= seed < 2**63):
            raise BadSamplingParams("sampling_params.sampling_seed must be an integer in [0, 2^63)")
        stops = params.get("stop_token_ids") or []
        if not isinstance(stops, list) or not all(_is_int(t) for t in stops):
            raise BadSamplingParams("sampling_params.stop_token_ids must be a list of token ids")
        bad = next((t for t in stops if not 0 <= t < vocab_size), None)
        if bad is not None:
            raise BadSamplingParams(
                f"sampling_params.stop_token_ids holds {bad}, outside the vocabulary "
                f"(0..{vocab_size - 1})"
            )
        ignore_eos = params.get("ignore_eos", False)
        if not isinstance(ignore_eos, bool):
            raise BadSamplingParams("sampling_params.ignore_eos must be true or false")
        return cls(
            max_new_tokens=int(new),
            temperature=float(temperature),
            top_p=float(top_p),
            sampling_seed=None if seed is None else int(seed),
            stop_token_ids=tuple(int(t) for t in stops),
            ignore_eos=ignore_eos,
        )


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


@dataclass
class Generation:
    """What one request produced: the new tokens (the stop token included, as SGLang's
    output_ids), why it ended (`stop` or `length`) and the stop token matched."""

    output_ids: list[int] = field(default_factory=list)
    finish: str = "length"
    matched: int | None = None

    def finish_reason(self) -> dict:
        """SGLang's `meta_info.finish_reason`."""
        if self.finish == "stop":
            return {"type": "stop", "matched": self.matched}
        return {"type": "length", "length": len(self.output_ids)}


@dataclass
class _Sequence:
    index: int  # position in the request list
    prompt: list[int]
    params: SamplingParams
    stops: frozenset[int]
    generator: torch.Generator | None
    result: Generation = field(default_factory=Generation)

    @property
    def tokens(self) -> list[int]:
        return self.prompt + self.result.output_ids

    @property
    def length(self) -> int:
        return len(self.prompt) + len(self.result.output_ids)


class BatchGenerator:
    """Decodes a batch of requests with one model (called from the server's forward thread)."""

    def __init__(self, model, device: torch.device, dtype: torch.dtype):
        self.model = model
        self.device = device
        self.margin = tie_margin(dtype)
        params = inspect.signature(model.forward).parameters
        # transformers renamed the cache argument (past_key_values -> cache) in 5.2x.
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self._logits_to_keep = "logits_to_keep" in params
        eos = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
        self.model_eos = frozenset([eos] if isinstance(eos, int) else (eos or []))
        self.unbatched_decisions = 0  # near ties decided by a forward of the request alone

    def _forward(self, input_ids, attention_mask=None, position_ids=None, cache=None):
        kwargs = {"input_ids": input_ids, "use_cache": cache is not False}
        if attention_mask is not None:
            kwargs["attention_mask"] = attention_mask
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if cache not in (None, False):
            kwargs[self._cache_arg] = cache
        if self._logits_to_keep:
            kwargs["logits_to_keep"] = 1
        out = self.model(**kwargs)
        return out.logits[:, -1].float(), out.get(self._cache_arg)

    def sequence(self, index: int, prompt: Sequence[int], params: SamplingParams) -> _Sequence:
        """A request to decode; `index` is the caller's handle for it."""
        stops = set(params.stop_token_ids) | (set() if params.ignore_eos else set(self.model_eos))
        generator = None
        if not params.greedy:
            generator = torch.Generator(device="cpu")
            generator.manual_seed(params.sampling_seed if params.sampling_seed is not None else 0)
        return _Sequence(index, list(prompt), params, frozenset(stops), generator)

    def generate(
        self, prompts: Sequence[Sequence[int]], params: Sequence[SamplingParams]
    ) -> list[Generation]:
        """Decode the requests together until each has ended."""
        session = DecodeSession(self)
        sequences = [
            self.sequence(i, prompt, p)
            for i, (prompt, p) in enumerate(zip(prompts, params, strict=True))
        ]
        session.admit(sequences)
        while session.active:
            session.step()
        return [s.result for s in sequences]

    def _prefill(self, sequences: list[_Sequence]):
        """One forward over the left-padded prompts: last-position logits, cache, mask."""
        width = max(len(s.prompt) for s in sequences)
        ids = torch.zeros((len(sequences), width), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, seq in enumerate(sequences):
            ids[row, width - len(seq.prompt) :] = torch.as_tensor(seq.prompt, dtype=torch.long)
            mask[row, width - len(seq.prompt) :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        ids, mask, positions = (t.to(self.device) for t in (ids, mask, positions))
        logits, cache = self._forward(ids, mask, positions, decode_cache.new_cache())
        return logits, cache, mask

    def choose(self, sequences: list[_Sequence], logits: torch.Tensor) -> list[int]:
        """Each request's next token from its row of `logits` [B, V]. The greedy rows' top two
        come from one topk over the batch (a topk per row was ~4 % of the toy's decoding)."""
        top = logits.topk(min(2, logits.shape[-1]), dim=-1)
        values, indices = top.values.tolist(), top.indices[:, 0].tolist()
        return [
            self._greedy(seq, values[row], indices[row])
            if seq.params.greedy
            else self._sample(seq, logits[row])
            for row, seq in enumerate(sequences)
        ]

    def _greedy(self, seq: _Sequence, top_two: list[float], index: int) -> int:
        if len(top_two) == 1 or top_two[0] - top_two[1] >= self.margin:
            return index
        self.unbatched_decisions += 1
        alone, _ = self._forward(torch.tensor([seq.tokens], device=self.device), cache=False)
        return int(alone[0].argmax())

    def _sample(self, seq: _Sequence, logits: torch.Tensor) -> int:
        probs = torch.softmax(logits.double() / seq.params.temperature, dim=-1).cpu()
        if seq.params.top_p < 1.0:
            ordered, order = probs.sort(descending=True)
            # Keep the smallest prefix whose mass reaches top_p (the top token always stays).
            outside = ordered.cumsum(0) - ordered >= seq.params.top_p
            probs = probs.clone()
            probs[order[outside]] = 0.0
        return int(torch.multinomial(probs, 1, generator=seq.generator))


class DecodeSession:
    """A running decode batch that requests join between steps (continuous batching).

    Joining requests are prefilled together, then their keys and values are merged into the
    running batch's (both left-padded to one width), so a request that arrives while others
    decode starts at the next step instead of waiting for the longest of them; a request that
    ends leaves the batch at once. What each request produces does not depend on its company
    (see the module docstring)."""

    def __init__(self, generator: BatchGenerator):
        self.generator = generator
        self.active: list[_Sequence] = []
        self._logits = self._cache = self._mask = None

    @property
    def width(self) -> int:
        """Positions (padding included) each active request's keys span."""
        return 0 if self._mask is None else int(self._mask.shape[1])

    @torch.inference_mode()
    def admit(self, sequences: list[_Sequence]) -> None:
        if not sequences:
            return
        logits, cache, mask = self.generator._prefill(sequences)
        if self.active:
            cache, mask = decode_cache.merged(self._cache, self._mask, cache, mask)
            logits = torch.cat([self._logits, logits])
        self.active = self.active + list(sequences)
        self._logits, self._cache, self._mask = logits, cache, mask

    @torch.inference_mode()
    def step(self) -> list[_Sequence]:
        """Each active request's next token; returns the requests that ended with it. The
        others get one forward pass for the token after."""
        g = self.generator
        chosen = g.choose(self.active, self._logits)
        keep, ended = [], []
        for row, (seq, token) in enumerate(zip(self.active, chosen, strict=True)):
            seq.result.output_ids.append(token)
            if token in seq.stops:
                seq.result.finish, seq.result.matched = "stop", token
                ended.append(seq)
            elif len(seq.result.output_ids) >= seq.params.max_new_tokens:
                seq.result.finish = "length"
                ended.append(seq)
            else:
                keep.append(row)
        if not keep:
            self.active = []
            self._logits = self._cache = self._mask = None
            return ended
        cache, mask = self._cache, self._mask
        if len(keep) < len(self.active):
            index = torch.tensor(keep, device=g.device)
            cache = decode_cache.select(cache, index)
            mask = mask.index_select(0, index)
            self.active = [self.active[row] for row in keep]
            cache, mask = decode_cache.trimmed(cache, mask)
        tokens = torch.tensor([[s.result.output_ids[-1]] for s in self.active], device=g.device)
        positions = torch.tensor([[s.length - 1] for s in self.active], device=g.device)
        mask = torch.cat([mask, mask.new_ones((len(self.active), 1))], dim=1)
        self._logits, self._cache = g._forward(tokens, mask, positions, cache)
        self._mask = mask
        return ended
