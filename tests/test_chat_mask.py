"""The loss mask equals the assistant spans: embedded template and two real-style templates.

The real-style templates (Llama-3 and ChatML/Qwen) are written here as Jinja text and used
with small byte-level BPE tokenizers built in the test: no download.
"""

from __future__ import annotations

import pytest

from eaglepipe.data import dataset
from eaglepipe.data.chat_mask import assistant_char_spans, tokenize_conversation
from eaglepipe.data.dataset import RowProblem, normalize_record
from eaglepipe.data.toy_target import CHAT_TEMPLATE, train_tokenizer

LLAMA3_TEMPLATE = (
    "{% set loop_messages = messages %}"
    "{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    " + message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}"
    "{{ content }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}"
    "{% endif %}"
)
CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{% if loop.first and message['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}"
    "{% endif %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Rewrites history: the latest assistant turn is tagged, earlier ones are not, so a prefix
# render is not a prefix of the full render (the fallback path).
REWRITING_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' and loop.last %}{{ '[latest] ' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
# Changes earlier assistant replies (upper-cases them): cannot be located, a clear bad row.
UPPERCASING_TEMPLATE = REWRITING_TEMPLATE.replace(
    "{{ message['content'] + '<|im_end|>\n' }}",
    "{% if message['role'] == 'assistant' and not loop.last %}"
    "{{ message['content'] | upper + '<|im_end|>\n' }}"
    "{% else %}{{ message['content'] + '<|im_end|>\n' }}{% endif %}",
)
# Ignores add_generation_prompt: the header must still be left out of the mask.
NO_GENERATION_PROMPT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>\n' }}"
    "{% endfor %}"
)

CORPUS = [
    "Hello there, how are you today?",
    "I am fine, thank you. The answer is 42.",
    "def add(a, b):\n    return a + b",
    "Bonjour, ça va ? 你好，世界！ 🚀✨",
    "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10.",
    "You are a helpful assistant. system user assistant",
] * 4


def _tokenizer(template: str, special_tokens: list[str], bos: str, eos: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    backend.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=330,
        special_tokens=special_tokens,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    backend.train_from_iterator(CORPUS, trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token=bos, eos_token=eos)
    tokenizer.chat_template = template
    return tokenizer


@pytest.fixture(scope="module")
def embedded():
    tokenizer = train_tokenizer(CORPUS, 330)
    assert tokenizer.chat_template == CHAT_TEMPLATE
    return tokenizer


@pytest.fixture(scope="module")
def llama3():
    specials = ["<|begin_of_text|>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"]
    return _tokenizer(LLAMA3_TEMPLATE, specials, "<|begin_of_text|>", "<|eot_id|>")


def _chatml(template):
    return _tokenizer(template, ["<|endoftext|>", "<|im_start|>", "<|im_end|>"], None, "<|im_end|>")


@pytest.fixture(scope="module")
def chatml():
    return _chatml(CHATML_TEMPLATE)


# (tokenizer fixture, end-of-turn text, whether the template trims content)
TEMPLATES = [("embedded", "<|end|>", False), ("llama3", "<|eot_id|>", True),
             ("chatml", "<|im_end|>", False)]  # fmt: skip

OPENAI = {
    "messages": [
        {"role": "system", "content": "Answer with care."},
        {"role": "user", "content": "Hello there, how are you?"},
        {"role": "assistant", "content": "I am fine, thank you. 你好 🚀"},
        {"role": "user", "content": "Write code."},
        {"role": "assistant", "content": "def add(a, b):\n    return a + b\n"},
    ]
}
SHAREGPT = {
    "conversations": [
        {"from": "human", "value": "Count to 5."},
        {"from": "gpt", "value": " 1, 2, 3, 4, 5."},
        {"from": "human", "value": "Bonjour, ça va ?"},
        {"from": "gpt", "value": "Oui, ça va ! ✨"},
        {"from": "human", "value": "Thanks"},
    ]
}


def _masked_segments(tokenizer, ids, mask):
    """The decoded runs of consecutive masked tokens."""
    segments, run = [], []
    for token, bit in zip(ids, mask, strict=True):
        if bit:
            run.append(token)
        elif run:
            segments.append(tokenizer.decode(run))
            run = []
    if run:
        segments.append(tokenizer.decode(run))
    return segments


def _expected_segments(messages, end_of_turn, trims):
    return [
        (m["content"].strip() if trims else m["content"]) + end_of_turn
        for m in messages
        if m["role"] == "assistant"
    ]


@pytest.mark.parametrize(("fixture", "end_of_turn", "trims"), TEMPLATES)
@pytest.mark.parametrize("record", [OPENAI, SHAREGPT], ids=["openai", "sharegpt"])
def test_mask_is_exactly_the_assistant_replies_and_end_of_turn(
    request, fixture, end_of_turn, trims, record
):
    tokenizer = request.getfixturevalue(fixture)
    messages = normalize_record(record)
    result = tokenize_conversation(tokenizer, messages, max_length=4096)
    # The ids are exactly what the template tokenizes to; nothing is truncated.
    expected_ids = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert result.input_ids == list(expected_ids)
    assert not result.truncated
    assert len(result.loss_mask) == len(result.input_ids)
    segments = _masked_segments(tokenizer, result.input_ids, result.loss_mask)
    assert segments == _expected_segments(messages, end_of_turn, trims)
    # The end-of-turn token closing each reply counts; no header token does.
    eot_id = tokenizer.convert_tokens_to_ids(end_of_turn)
    assistant_eots = [
        i for i, t in enumerate(result.input_ids) if t == eot_id and result.loss_mask[i]
    ]
    assert len(assistant_eots) == sum(m["role"] == "assistant" for m in messages)
    full_text = tokenizer.decode(result.input_ids)
    assert "assistant" in full_text
    assert all("assistant" not in s for s in segments)


@pytest.mark.parametrize(("fixture", "end_of_turn", "trims"), TEMPLATES)
def test_tokenizing_by_segments_matches_offsets(request, fixture, end_of_turn, trims):
    tokenizer = request.getfixturevalue(fixture)
    messages = normalize_record(OPENAI)
    with_offsets = tokenize_conversation(tokenizer, messages, 4096, use_offsets=True)
    by_segments = tokenize_conversation(tokenizer, messages, 4096, use_offsets=False)
    assert by_segments == with_offsets


def test_history_rewriting_template_falls_back_to_locating_replies():
    tokenizer = _chatml(REWRITING_TEMPLATE)
    messages = normalize_record(OPENAI)
    text, spans = assistant_char_spans(tokenizer, messages)
    assert "[latest]" not in text.split("Write code.")[0]
    result = tokenize_conversation(tokenizer, messages, 4096)
    segments = _masked_segments(tokenizer, result.input_ids, result.loss_mask)
    assert segments == [
        "I am fine, thank you. 你好 🚀<|im_end|>",
        "[latest] def add(a, b):\n    return a + b\n<|im_end|>",
    ]


def test_template_that_changes_replies_is_a_clear_bad_row():
    tokenizer = _chatml(UPPERCASING_TEMPLATE)
    with pytest.raises(RowProblem) as info:
        tokenize_conversation(tokenizer, normalize_record(OPENAI), 4096)
    assert info.value.reason == dataset.TEMPLATE_ERROR
    assert "message 2" in info.value.detail and "verbatim" in info.value.detail


def test_header_excluded_when_template_ignores_generation_prompt():
    tokenizer = _chatml(NO_GENERATION_PROMPT_TEMPLATE)
    messages = normalize_record(SHAREGPT)
    result = tokenize_conversation(tokenizer, messages, 4096)
    segments = _masked_segments(tokenizer, result.input_ids, result.loss_mask)
    assert segments == [" 1, 2, 3, 4, 5.<|im_end|>", "Oui, ça va ! ✨<|im_end|>"]


def test_truncation_keeps_the_first_max_length_tokens(embedded):
    messages = normalize_record(OPENAI)
    full = tokenize_conversation(embedded, messages, 4096)
    limit = full.num_tokens - 5
    cut = tokenize_conversation(embedded, messages, limit)
    assert cut.truncated and cut.num_tokens == limit
    assert cut.input_ids == full.input_ids[:limit]
    assert cut.loss_mask == full.loss_mask[:limit]
    exact = tokenize_conversation(embedded, messages, full.num_tokens)
    assert not exact.truncated and exact == full


def test_assistant_tokens_all_truncated_is_a_bad_row(embedded):
    messages = [
        {"role": "user", "content": "Count: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10. " * 5},
        {"role": "assistant", "content": "Done."},
    ]
    with pytest.raises(RowProblem) as info:
        tokenize_conversation(embedded, messages, 10)
    assert info.value.reason == dataset.ASSISTANT_TRUNCATED


@pytest.mark.parametrize("fixture", ["embedded", "llama3", "chatml"])
def test_no_assistant_turn_is_a_bad_row(request, fixture):
    tokenizer = request.getfixturevalue(fixture)
    with pytest.raises(RowProblem) as info:
        tokenize_conversation(tokenizer, [{"role": "user", "content": "Hello"}], 4096)
    assert info.value.reason == dataset.NO_ASSISTANT_TOKENS


def test_template_exception_is_a_bad_row(embedded):
    # The embedded template raises on a role it does not know.
    with pytest.raises(RowProblem) as info:
        tokenize_conversation(embedded, [{"role": "tool", "content": "x"}], 4096)
    assert info.value.reason == dataset.TEMPLATE_ERROR
    assert "unknown role tool" in info.value.detail


def test_template_that_cannot_render_an_empty_prefix_falls_back():
    template = "{% if not messages %}{{ raise_exception('no messages') }}{% endif %}" + (
        NO_GENERATION_PROMPT_TEMPLATE
    )
    tokenizer = _chatml(template)
    messages = [
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Count to 3."},
        {"role": "assistant", "content": "1, 2, 3."},
    ]
    result = tokenize_conversation(tokenizer, messages, 4096)
    segments = _masked_segments(tokenizer, result.input_ids, result.loss_mask)
    assert segments == ["Hello! How can I help?<|im_end|>", "1, 2, 3.<|im_end|>"]
