"""Tokenize a conversation with the target's chat template and mark the assistant tokens.

Real chat templates have no `{% generation %}` tags, so the assistant spans are found by
rendering the conversation turn by turn and diffing the texts. For the assistant message i:

- `header_end` = len(render(messages[:i], add_generation_prompt=True)): the conversation so
  far plus the assistant header (`<|assistant|>\\n`, `<|im_start|>assistant\\n`, ...);
- `turn_end` = len(render(messages[:i + 1])): the same plus the reply and its end of turn.

When both renders are prefixes of the full render, the span is `[header_end, turn_end)`.

What counts (loss mask = 1):

- the assistant's content, and the **end-of-turn token** that closes it (`<|end|>`,
  `<|im_end|>`, `<|eot_id|>`, ...): the drafter must learn to predict where a reply stops;
- not the **assistant header** (role tokens and the newline after them): the serving engine
  puts it in the prompt, the model never generates it;
- not the whitespace a template adds after the end-of-turn token as a separator between turns
  (the trailing whitespace of the span is dropped), nor any system or user token.

Character spans become token positions through the fast tokenizer's offsets of one
tokenization of the full text (a token counts if it overlaps a span), so `input_ids` are
exactly what `apply_chat_template(messages, tokenize=True)` gives. Tokenizers without
offsets (slow or custom-code ones) are tokenized segment by segment at the span edges.

Templates whose prefix renders are not prefixes of the full render (some rewrite earlier
turns) fall back to locating each assistant content, stripped, in the full text after the
previous span, extended by the template's end-of-turn marker (found by rendering a probe
conversation); a content the template does not render verbatim is a bad row
("chat template error") with a message saying so.

Truncation: the first `max_length` tokens are kept (the conversation's start, where the
context of every kept token lies). A row whose assistant tokens all fall beyond the limit is a
bad row ("assistant tokens truncated away"); a row with none at all is "no assistant tokens".

The fast path (the default) gives the same ids and mask with less work on long rows: the text
is tokenized only up to the first special-token boundary (an end-of-turn marker, a role header)
past which `max_length` tokens are reached (a fast tokenizer splits its special tokens out
before anything else, so what precedes one tokenizes alone exactly as in the whole text), and
assistant spans are found by prefix renders only up to where the kept tokens end. A row the
fast path finds nothing to train on is redone by the reference path, for its exact reason.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..core.errors import PipelineError
from .dataset import ASSISTANT_TRUNCATED, NO_ASSISTANT_TOKENS, TEMPLATE_ERROR, RowProblem

# Where `max_length` is checked, in the words both paths raise it with.
_TRUNCATED_DETAIL = "every assistant token lies beyond dataset.max_length={}"

_PROBE_USER = "\u2063probe-user\u2063"
_PROBE_ASSISTANT = "\u2063probe-assistant\u2063"


@dataclass(frozen=True)
class TokenizedConversation:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool

    @property
    def num_tokens(self) -> int:
        return len(self.input_ids)


def require_chat_template(tokenizer, where: str) -> None:
    if not getattr(tokenizer, "chat_template", None):
        raise PipelineError(f"the tokenizer of {where} has no chat template")


def render(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> str:
    """The chat template's text for `messages` (a template error is a RowProblem)."""
    from jinja2.exceptions import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt
        )
    except (TemplateError, ValueError, TypeError, KeyError, IndexError) as exc:
        message = str(exc).splitlines()[0] if str(exc) else repr(exc)
        raise RowProblem(TEMPLATE_ERROR, message) from None
    if not isinstance(text, str):
        raise PipelineError("apply_chat_template(tokenize=False) did not return a string")
    return text


class _EndOfTurn:
    """The template's end-of-turn marker after an assistant reply, probed once per tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._marker: str | None = None

    def marker(self) -> str:
        if self._marker is None:
            probe = [
                {"role": "user", "content": _PROBE_USER},
                {"role": "assistant", "content": _PROBE_ASSISTANT},
            ]
            try:
                text = render(self.tokenizer, probe)
            except RowProblem:
                text = ""
            at = text.rfind(_PROBE_ASSISTANT)
            self._marker = text[at + len(_PROBE_ASSISTANT) :].rstrip() if at >= 0 else ""
        return self._marker


def end_of_turn_marker(tokenizer) -> str:
    """The text the chat template puts after an assistant reply (e.g. `<|eot_id|>`), stripped."""
    return _EndOfTurn(tokenizer).marker()


def assistant_char_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The full rendered text and the character spans `[start, end)` the loss mask covers."""
    full = render(tokenizer, messages)
    return full, _spans(tokenizer, messages, full, _EndOfTurn(tokenizer))


def _spans(
    tokenizer, messages: list[dict], full: str, end_of_turn, until: int | None = None
) -> list[tuple[int, int]]:
    """The assistant spans of `full`, in order; with `until`, only those starting before it
    (the later ones cannot touch a token that ends by `until`)."""
    spans: list[tuple[int, int]] = []
    cursor = 0
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        span = _span_from_prefix_renders(tokenizer, messages, i, full, cursor)
        if span is None:
            span = _locate_reply(full, message["content"], cursor, end_of_turn, i)
        start, end = span
        if until is not None and start > until:
            break
        end = start + len(full[start:end].rstrip())
        if end > start:
            spans.append((start, end))
        cursor = max(cursor, end)
    return spans


def _span_from_prefix_renders(
    tokenizer, messages: list[dict], i: int, full: str, cursor: int
) -> tuple[int, int] | None:
    """`[header end, turn end)` of assistant message i, or None when renders are not prefixes."""
    try:
        with_header = render(tokenizer, messages[:i], add_generation_prompt=True)
        without_header = render(tokenizer, messages[:i])
        through = render(tokenizer, messages[: i + 1])
    except RowProblem:
        return None  # e.g. a template that cannot render an empty or partial conversation
    if not (
        full.startswith(through)
        and through.startswith(with_header)
        and with_header.startswith(without_header)
        and len(with_header) >= cursor
    ):
        return None
    start, end = len(with_header), len(through)
    if len(with_header) == len(without_header):
        # The template ignores add_generation_prompt: skip the header by finding the reply.
        content = messages[i]["content"]
        found = through.find(content, start) if content else -1
        if found < 0 and content.strip():
            found = through.find(content.strip(), start)
        start = found if found >= 0 else start
    return start, end


def _locate_reply(
    full: str, content: str, cursor: int, end_of_turn: _EndOfTurn, index: int
) -> tuple[int, int]:
    # The reply as given, or trimmed (many templates trim it).
    found, needle = -1, ""
    for needle in (content, content.strip()):
        found = full.find(needle, cursor) if needle else -1
        if found >= 0:
            break
    if found < 0:
        raise RowProblem(
            TEMPLATE_ERROR,
            f"message {index}: the chat template rewrites earlier turns and does not render "
            "this assistant reply verbatim, so its tokens cannot be located",
        )
    end = found + len(needle)
    marker = end_of_turn.marker()
    if marker and full.startswith(marker, end):
        end += len(marker)
    return found, end


def _mask_from_offsets(
    offsets: list[tuple[int, int]], spans: list[tuple[int, int]], text_length: int
) -> list[int]:
    in_span = bytearray(text_length + 1)
    for a, b in spans:
        in_span[a:b] = b"\x01" * (b - a)
    # A token counts if any character it covers lies in a span.
    return [1 if (in_span[s] if s == e else any(in_span[s:e])) else 0 for s, e in offsets]


def _mask_array(offsets: np.ndarray, spans: list[tuple[int, int]], text_length: int) -> np.ndarray:
    """`_mask_from_offsets` as uint8 numpy, by prefix sums (the same bits)."""
    in_span = np.zeros(text_length + 1, dtype=np.int32)
    for a, b in spans:
        in_span[a:b] = 1
    covered = np.concatenate(([0], np.cumsum(in_span)))
    if not len(offsets):
        return np.zeros(0, dtype=np.uint8)
    starts, ends = offsets[:, 0], offsets[:, 1]
    overlap = covered[ends] - covered[starts] > 0
    empty = starts == ends
    overlap[empty] = in_span[starts[empty]] > 0
    return overlap.astype(np.uint8)


def _tokenize_by_segments(tokenizer, text: str, spans: list[tuple[int, int]]):
    ids: list[int] = []
    mask: list[int] = []
    edges = [0]
    for a, b in spans:
        edges += [a, b]
    edges.append(len(text))
    for j in range(len(edges) - 1):
        segment = text[edges[j] : edges[j + 1]]
        if not segment:
            continue
        seg_ids = tokenizer(segment, add_special_tokens=False)["input_ids"]
        ids += seg_ids
        mask += [j % 2] * len(seg_ids)  # odd segments are assistant spans
    return ids, mask


def tokenize_conversation(
    tokenizer,
    messages: list[dict],
    max_length: int,
    use_offsets: bool | None = None,
    fast: bool = True,
) -> TokenizedConversation:
    """input_ids and assistant loss mask of one conversation, truncated to `max_length`.

    Raises RowProblem ("no assistant tokens", "assistant tokens truncated away", "chat
    template error") for a row that cannot be trained on. `fast=False` is the reference path
    (whole text tokenized, every span rendered) the fast one must equal.
    """
    if max_length < 1:
        raise PipelineError(f"dataset.max_length must be positive, not {max_length}")
    if use_offsets is None:
        use_offsets = bool(getattr(tokenizer, "is_fast", False))
    if fast and use_offsets:
        found = _tokenize_fast(tokenizer, messages, max_length)
        if found is not None:
            return found
    text, spans = assistant_char_spans(tokenizer, messages)
    if use_offsets:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = list(encoded["input_ids"])
        mask = _mask_from_offsets([tuple(o) for o in encoded["offset_mapping"]], spans, len(text))
    else:
        ids, mask = _tokenize_by_segments(tokenizer, text, spans)
    if not any(mask):
        raise RowProblem(NO_ASSISTANT_TOKENS, f"{len(ids)} tokens, none from an assistant turn")
    truncated = len(ids) > max_length
    if truncated:
        ids, mask = ids[:max_length], mask[:max_length]
        if not any(mask):
            raise RowProblem(ASSISTANT_TRUNCATED, _TRUNCATED_DETAIL.format(max_length))
    return TokenizedConversation(ids, mask, truncated)


class _SpecialTokens:
    """The special tokens a fast tokenizer splits its input at, probed once per tokenizer: the
    fast path cuts the text only at them. None when one of them also takes the whitespace
    beside it (lstrip / rstrip), which would move the boundary."""

    _cache: dict[int, tuple[object, tuple[str, ...] | None]] = {}

    @classmethod
    def of(cls, tokenizer) -> tuple[str, ...] | None:
        key = id(tokenizer)
        entry = cls._cache.get(key)
        if entry is None or entry[0] is not tokenizer:
            entry = (tokenizer, cls._probe(tokenizer))
            cls._cache[key] = entry
        return entry[1]

    @staticmethod
    def _probe(tokenizer) -> tuple[str, ...] | None:
        decoder = getattr(tokenizer, "added_tokens_decoder", None)
        if not decoder or getattr(tokenizer, "split_special_tokens", False):
            return None
        tokens = []
        for added in decoder.values():
            if not getattr(added, "special", False):
                continue
            if getattr(added, "lstrip", False) or getattr(added, "rstrip", False):
                return None
            tokens.append(str(added))
        return tuple(sorted(set(tokens), key=len, reverse=True)) or None


def _special_boundaries(text: str, specials: tuple[str, ...]) -> list[int]:
    """Sorted start positions of special-token strings in `text`."""
    found = set()
    for token in specials:
        at = text.find(token)
        while at >= 0:
            found.add(at)
            at = text.find(token, at + len(token))
    return sorted(found)


def _tokenize_fast(tokenizer, messages: list[dict], max_length: int):
    """The fast path's TokenizedConversation, or None where only the reference path can tell
    (no special tokens to cut at; nothing to train on in the kept tokens)."""
    specials = _SpecialTokens.of(tokenizer)
    if specials is None:
        return None
    full = render(tokenizer, messages)
    boundaries = [b for b in _special_boundaries(full, specials) if b > 0] + [len(full)]
    # A first guess of the characters max_length tokens take, then scaled by what was found.
    wanted = 2 * max_length
    index = 0
    while True:
        while index < len(boundaries) - 1 and boundaries[index] < wanted:
            index += 1
        cut = boundaries[index]
        ids, offsets = encode_text(tokenizer, full[:cut])
        if len(ids) > max_length or cut == len(full):
            break
        wanted = max(cut + 1, int(cut * 1.2 * (max_length + 1) / max(len(ids), 1)))
    truncated = len(ids) > max_length
    kept = min(len(ids), max_length)
    offsets = np.asarray(offsets[:kept], dtype=np.int64).reshape(-1, 2)
    until = int(offsets[:, 1].max()) if kept else 0
    end_of_turn = _EndOfTurn(tokenizer)
    spans = _spans(tokenizer, messages, full, end_of_turn, until if truncated else None)
    mask = _mask_array(offsets, spans, len(full))
    if not mask.any():
        # Every character lies in some token, so a span past the kept tokens has tokens there.
        if truncated and _spans(tokenizer, messages, full, end_of_turn):
            raise RowProblem(ASSISTANT_TRUNCATED, _TRUNCATED_DETAIL.format(max_length))
        return None
    return TokenizedConversation(list(ids[:kept]), mask.tolist(), truncated)


def encode_text(tokenizer, text: str) -> tuple[list[int], list[tuple[int, int]]]:
    """ids and offsets of `text`, as `tokenizer(text, add_special_tokens=False,
    return_offsets_mapping=True)` gives them; straight from the Rust tokenizer when it is set
    to neither truncate nor pad (transformers' wrapping of the result costs as much again)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if (
        backend is not None
        and backend.truncation is None
        and backend.padding is None
        and not getattr(backend, "encode_special_tokens", False)
    ):
        encoding = backend.encode(text, add_special_tokens=False)
        return encoding.ids, encoding.offsets
    encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return list(encoded["input_ids"]), [tuple(o) for o in encoded["offset_mapping"]]
