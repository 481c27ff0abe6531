"""The target's tokenizer, loaded once the way every stage needs it (chat template required),
and where a reply ends (its stop tokens)."""

from __future__ import annotations

import sys
from pathlib import Path

from ..core.errors import PipelineError
from ..core.run import RunSpec
from .chat_mask import end_of_turn_marker, require_chat_template

# Tokenizer classes that are a tokenizer.json and nothing else (Llama 3's, the toy's): loaded by
# their own class, transformers' AutoTokenizer gives the same tokenizer but first imports torch
# through its config machinery, which is most of a shard job's start.
PLAIN_TOKENIZER_CLASSES = ("PreTrainedTokenizerFast", "TokenizersBackend")


def tokenizer_settings(model_dir: Path) -> dict:
    """`model_dir`'s tokenizer_config.json ({} when there is none); an unreadable one is a
    PipelineError naming the file."""
    import json

    settings_file = model_dir / "tokenizer_config.json"
    try:
        settings = json.loads(settings_file.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise PipelineError(f"model.path: {settings_file} cannot be read: {exc}") from None
    return settings if isinstance(settings, dict) else {}


def tokenizer_loader(model_dir: Path):
    """The class whose from_pretrained loads `model_dir`'s tokenizer: the plain class when the
    tokenizer_config.json names one and brings no code of its own, else AutoTokenizer (which
    also reports an unreadable tokenizer_config.json its own way)."""
    try:
        settings = tokenizer_settings(model_dir)
    except PipelineError:
        settings = {}
    plain = (
        settings.get("tokenizer_class") in PLAIN_TOKENIZER_CLASSES
        and "auto_map" not in settings
        and (model_dir / "tokenizer.json").is_file()
    )
    if plain:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast
    from transformers import AutoTokenizer

    return AutoTokenizer


# The files a tokenizer's vocabulary comes from (what from_pretrained needs beside the config).
VOCABULARY_FILES = ("tokenizer.json", "*.model", "vocab.json", "vocab.txt", "*.tiktoken")


def check_chat_template_files(run: RunSpec) -> None:
    """A target whose tokenizer files carry no vocabulary or no chat template, refused before
    any job runs (prepare and regeneration render every conversation with it; it was found by
    their first job). Looks where transformers does: tokenizer_config.json's `chat_template`,
    chat_template.jinja, additional_chat_templates/*.jinja. With model.trust_remote_code the
    tokenizer's own code may bring one: left to the jobs. The embedded toy target is built
    with its template (data/toy_target.py)."""
    model = run.model
    if model.is_toy or not model.exists or model.trust_remote_code:
        return
    directory = model.directory
    if not any(any(directory.glob(pattern)) for pattern in VOCABULARY_FILES):
        raise PipelineError(
            f"model.path: {directory} holds no tokenizer vocabulary (tokenizer.json, a "
            "SentencePiece *.model, vocab.json with merges.txt, vocab.txt or *.tiktoken): copy "
            "the model's tokenizer files beside its weights"
        )
    if (directory / "chat_template.jinja").is_file() or any(
        (directory / "additional_chat_templates").glob("*.jinja")
    ):
        return
    if tokenizer_settings(directory).get("chat_template"):
        return
    raise PipelineError(
        f"model.path: the tokenizer of {directory} has no chat template (none in "
        "tokenizer_config.json, no chat_template.jinja): prepare and regeneration render every "
        "conversation with it; use the model's chat (instruct) release or add its template as "
        "chat_template.jinja"
    )


def load_target_tokenizer(run: RunSpec):
    """The target's tokenizer (with remote code only when model.trust_remote_code is set)."""
    model_dir = run.model.directory
    if not model_dir.is_dir():
        raise PipelineError(f"model.path: {model_dir} does not exist")
    try:
        tokenizer = tokenizer_loader(model_dir).from_pretrained(
            model_dir, trust_remote_code=run.model.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise PipelineError(f"cannot load the tokenizer of {model_dir}: {exc}") from None
    require_chat_template(tokenizer, str(model_dir))
    # prepare truncates to dataset.max_length itself; transformers would warn about every row
    # longer than the model's maximum, truncated on purpose or not.
    tokenizer.model_max_length = sys.maxsize
    return tokenizer


def stop_token_ids(tokenizer, model_dir: Path) -> tuple[int, ...]:
    """Where a reply ends: the tokenizer's eos, the model's generation_config eos ids, and the
    chat template's end-of-turn marker when it is a single token (`<|eot_id|>`, `<|im_end|>`)."""
    import json

    ids: set[int] = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    try:
        eos = json.loads((model_dir / "generation_config.json").read_text()).get("eos_token_id")
    except (FileNotFoundError, ValueError):
        eos = None
    ids.update([eos] if isinstance(eos, int) else [int(t) for t in eos or []])
    marker = end_of_turn_marker(tokenizer)
    if marker:
        marker_ids = tokenizer(marker, add_special_tokens=False)["input_ids"]
        if len(marker_ids) == 1:
            ids.add(int(marker_ids[0]))
    if not ids:
        raise PipelineError(
            f"the tokenizer of {model_dir} has no eos token and its chat template no single-token "
            "end of turn: replies could not stop"
        )
    return tuple(sorted(ids))
