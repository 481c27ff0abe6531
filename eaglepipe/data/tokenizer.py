"""The target's tokenizer, loaded once the way every stage needs it (chat template required)."""

from __future__ import annotations

import sys

from ..core.errors import PipelineError
from ..core.run import RunSpec
from .chat_mask import require_chat_template


def load_target_tokenizer(run: RunSpec):
    """The target's tokenizer (with remote code only when model.trust_remote_code is set)."""
    from transformers import AutoTokenizer

    model_dir = run.model.directory
    if not model_dir.is_dir():
        raise PipelineError(f"model.path: {model_dir} does not exist")
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            model_dir, trust_remote_code=run.model.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise PipelineError(f"cannot load the tokenizer of {model_dir}: {exc}") from None
    require_chat_template(tokenizer, str(model_dir))
    # prepare truncates to dataset.max_length itself; transformers would warn about every row
    # longer than the model's maximum, truncated on purpose or not.
    tokenizer.model_max_length = sys.maxsize
    return tokenizer
