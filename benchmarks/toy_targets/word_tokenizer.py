"""Word-level tokenizers covering a random target's whole vocabulary (`t<id>` per token), with a
chat template of three word tokens when the benchmark sends conversations."""

from __future__ import annotations

import json
from pathlib import Path


def save_word_tokenizer(model_dir: Path, vocab: int, chat_template: str | None = None) -> None:
    """A tokenizer covering the whole vocabulary (SGLang's server loads one at start; the rows
    are sent as token ids), as the 0.5.14 throughput run on the H200 used; with `chat_template`
    (a Jinja template) for tools that render conversations (SpecForge's generator)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"t{i}": i for i in range(3, vocab)}
    backend = Tokenizer(models.WordLevel(words, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
        pad_token="<unk>", model_max_length=8192,
    )  # fmt: skip
    if chat_template is not None:
        tokenizer.chat_template = chat_template
    tokenizer.save_pretrained(model_dir)
    settings_path = model_dir / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings["tokenizer_class"] = "PreTrainedTokenizerFast"
    settings_path.write_text(json.dumps(settings, indent=2))


# Chat markers: word tokens, so the template renders to exactly 3 tokens around the content.
USER_MARK, END_MARK, ASSISTANT_MARK = "t100", "t101", "t102"


CHAT_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'user' %}" + USER_MARK + " {% else %}"
    + ASSISTANT_MARK + " {% endif %}{{ m['content'] }} " + END_MARK + " {% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT_MARK + " {% endif %}"
)  # fmt: skip


TEMPLATE_TOKENS = 3  # user mark, end mark, assistant mark


def save_chat_tokenizer(model_dir: Path, vocab: int) -> None:
    save_word_tokenizer(model_dir, vocab)
    settings_path = model_dir / "tokenizer_config.json"
    settings = json.loads(settings_path.read_text())
    settings["chat_template"] = CHAT_TEMPLATE
    settings_path.write_text(json.dumps(settings, indent=2))
