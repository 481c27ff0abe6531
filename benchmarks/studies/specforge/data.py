"""What SpecForge 0.2 trains from, made from an eaglepipe run (issue 27), and the checks that
both trained on the same tokens.

- `train_conversations`: the conversations the run's prepare stage tokenized (its regenerated
  rows with regeneration on, else the dataset's; the same reader prepare uses), keeping only
  the rows whose `split` in the prepared table is "train": held-out rows, and rows prepare
  skipped as bad, are left out.
- `write_specforge_jsonl`: SpecForge's input, one `{"id", "conversations": [{"role",
  "content"}, ...]}` per row (what its `safe_conversations_generator` reads).
- `chat_template_spec`: the target's chat template as SpecForge's `ChatTemplate` fields, the
  strings its loss mask is found by, probed from the template itself.
- `specforge_tokenize`: SpecForge 0.2.0's general parser rule (specforge/data/parse.py),
  written here from its source so the loss mask it gives can be held against chat_mask's
  without SpecForge installed: render with the tokenizer's chat template; tokenize the whole
  text (no special tokens added, truncated at max_length); every match of `assistant_header
  (.*?)(end_of_turn|$)` marks the tokens from len(encode(text before the match's group)) to
  len(encode(text through it)): the reply and its end-of-turn token, not the header.
- `compare_with_table`: SpecForge's feature files (`input_ids`, `loss_mask` per sample) against
  the prepared table's rows, matched by their tokens.
- `target_view` and `draft_config`: the target as SpecForge's loaders need it (an
  `*.index.json` beside single-file weights; a draft config with the run's aux layers and draft
  vocabulary, since SpecForge's derived default of 32,000 draft tokens exceeds a toy's vocab).
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Iterable
from pathlib import Path

from eaglepipe.core.atomic import atomic_write_bytes, atomic_write_json
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.run import RunSpec
from eaglepipe.data.chat_mask import end_of_turn_marker, render
from eaglepipe.data.dataset import Conversation, RowProblem
from eaglepipe.prepare.table import conversation_rows, load_prepared

_PROBE = "\u2063probe\u2063"
# SpecForge's draft config takes these from the target (training/model_loading.py, 0.2.0).
TARGET_FIELDS = (
    "vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads",
    "intermediate_size", "max_position_embeddings", "rms_norm_eps", "hidden_act",
    "initializer_range", "attention_bias", "attention_dropout", "head_dim", "rope_theta",
    "rope_scaling", "bos_token_id", "eos_token_id", "pad_token_id",
)  # fmt: skip


# ---------------------------------------------------------------- the training rows


def train_conversations(run: RunSpec, table_path) -> list[tuple[int, list[dict]]]:
    """(row id, messages) of every train row of the prepared table, in row-id order.

    Run from the run directory (the run's paths are relative to it). A train row the source
    does not hold is an error naming it: the table and the conversations must be one run's.
    """
    table = load_prepared(table_path, columns=["row_id", "split"])
    train = set(table.loc[table["split"] == "train", "row_id"].tolist())
    if not train:
        raise PipelineError(f"{table_path} has no train rows")
    rows = []
    for item in conversation_rows(run):
        row_id = int(item.row_id)
        if row_id in train and isinstance(item, Conversation):
            rows.append((row_id, item.messages))
    missing = sorted(train - {row_id for row_id, _ in rows})
    if missing:
        raise PipelineError(
            f"{table_path} has train rows the run's conversations do not hold (first: row "
            f"{missing[0]}, {len(missing)} in all): the table is not this run's"
        )
    return rows


def write_specforge_jsonl(rows: Iterable[tuple[int, list[dict]]], path) -> int:
    """SpecForge's JSONL input, written atomically; returns the number of rows."""
    lines = [
        json.dumps(
            {
                "id": str(row_id),
                "conversations": [{"role": m["role"], "content": m["content"]} for m in messages],
            },
            ensure_ascii=False,
        )
        for row_id, messages in rows
    ]
    atomic_write_bytes(path, ("\n".join(lines) + "\n").encode())
    return len(lines)


# ---------------------------------------------------------------- the chat template


def chat_template_spec(tokenizer, name: str) -> dict:
    """SpecForge's ChatTemplate fields for the tokenizer's chat template.

    assistant_header: what add_generation_prompt appends to a conversation; end_of_turn_token:
    what closes an assistant reply (chat_mask's probe); user_header: what precedes a user turn
    (used by SpecForge only for tokenizers without a template). No system prompt: SpecForge
    would add one the pipeline's rows do not have.
    """
    where = f"the chat template of {getattr(tokenizer, 'name_or_path', 'the target')}"
    probe = [{"role": "user", "content": _PROBE}]
    try:
        without = render(tokenizer, probe)
        with_header = render(tokenizer, probe, add_generation_prompt=True)
    except RowProblem as exc:
        raise PipelineError(f"{where} cannot render a user turn: {exc}") from None
    if not with_header.startswith(without) or len(with_header) == len(without):
        raise PipelineError(
            f"{where}: add_generation_prompt adds no assistant header at the end, so SpecForge "
            "cannot find the assistant spans by one"
        )
    end_of_turn = end_of_turn_marker(tokenizer)
    if not end_of_turn:
        raise PipelineError(f"{where} closes an assistant reply with nothing SpecForge can find")
    try:
        empty = render(tokenizer, [])
    except RowProblem:
        empty = ""
    before = without[: without.index(_PROBE)]
    bos = getattr(tokenizer, "bos_token", None) or ""
    if empty and before.startswith(empty):
        before = before[len(empty) :]
    elif bos and before.startswith(bos):  # a template that cannot render no messages
        before = before[len(bos) :]
    return {
        "name": name,
        "assistant_header": with_header[len(without) :],
        "user_header": before,
        "end_of_turn_token": end_of_turn,
        "system_prompt": None,
    }


def specforge_messages(messages: list[dict], system_prompt: str | None = None) -> list[dict]:
    """The messages SpecForge's general parser renders for a conversation: roles normalised
    (human/gpt), a leading system turn kept (else the template's system prompt added), turns
    before the first user turn dropped, and the conversation cut at the first assistant turn
    that does not follow a user or tool turn (or tool turn that does not follow an assistant
    or tool turn)."""
    turns = []
    for message in messages:
        role = message.get("role", message.get("from", ""))
        role = {"human": "user", "gpt": "assistant"}.get(role, role)
        content = message.get("content") or message.get("value") or ""
        turns.append({"role": role, "content": content})
    out = []
    if turns and turns[0]["role"] == "system":
        out.append(turns.pop(0))
    elif system_prompt:
        out.append({"role": "system", "content": system_prompt})
    while turns and turns[0]["role"] != "user":
        turns.pop(0)
    for j, turn in enumerate(turns):
        previous = turns[j - 1]["role"] if j else None
        if turn["role"] == "tool" and previous not in ("assistant", "tool"):
            break
        if turn["role"] == "assistant" and previous not in ("user", "tool"):
            break
        out.append(turn)
    return out


def specforge_tokenize(
    tokenizer, messages: list[dict], spec: dict, max_length: int
) -> tuple[list[int], list[int]]:
    """input_ids and loss mask by SpecForge 0.2.0's general parser rule (see the module doc)."""
    text = tokenizer.apply_chat_template(
        specforge_messages(messages, spec.get("system_prompt")),
        tokenize=False,
        add_generation_prompt=False,
    )

    def encode(part: str) -> list[int]:
        return tokenizer(part, add_special_tokens=False, truncation=True, max_length=max_length)[
            "input_ids"
        ]

    ids = encode(text)
    mask = [0] * len(ids)
    pattern = (
        re.escape(spec["assistant_header"])
        + r"([\s\S]*?(?:"
        + re.escape(spec["end_of_turn_token"])
        + "|$))"
    )
    for match in re.finditer(pattern, text):
        start = min(len(encode(text[: match.start(1)])), len(ids))
        end = min(len(encode(text[: match.end(1)])), len(ids))
        mask[start:end] = [1] * (end - start)
    return list(ids), mask


def template_agreement(
    tokenizer, rows: list[tuple[int, list[dict]]], spec: dict, table, max_length: int
) -> dict:
    """How many rows SpecForge's rule tokenizes and masks exactly as the prepared table holds
    them (input_ids and loss_mask), with the first rows that differ."""
    by_id = {int(r.row_id): r for r in table.itertuples()}
    equal, differing = 0, []
    for row_id, messages in rows:
        ids, mask = specforge_tokenize(tokenizer, messages, spec, max_length)
        row = by_id[row_id]
        if ids == [int(t) for t in row.input_ids] and mask == [int(m) for m in row.loss_mask]:
            equal += 1
        else:
            differing.append(row_id)
    return {"rows": len(rows), "equal": equal, "differing_rows": differing[:20]}


# ---------------------------------------------------------------- SpecForge's feature files


def compare_with_table(feature_dir, table) -> dict:
    """SpecForge's feature files (`rows_*/data_*.ckpt`) against the prepared table's train
    rows: each file's input_ids found among them, and its loss mask equal to that row's."""
    import torch

    by_tokens = {
        tuple(int(t) for t in r.input_ids): r for r in table[table["split"] == "train"].itertuples()
    }
    files = sorted(Path(feature_dir).glob("rows_*/data_*.ckpt*"))
    found, equal_mask, unmatched, seen = 0, 0, [], set()
    for path in files:
        record = torch.load(path, map_location="cpu", weights_only=True)
        tokens = tuple(int(t) for t in record["input_ids"].view(-1).tolist())
        row = by_tokens.get(tokens)
        if row is None:
            unmatched.append(path.name)
            continue
        found += 1
        seen.add(int(row.row_id))
        if [int(m) for m in record["loss_mask"].view(-1).tolist()] == list(map(int, row.loss_mask)):
            equal_mask += 1
    return {
        "files": len(files),
        "rows_found": found,
        "distinct_rows": len(seen),
        "loss_mask_equal": equal_mask,
        "train_rows": len(by_tokens),
        "unmatched_files": unmatched[:20],
        "bytes": sum(p.stat().st_size for p in Path(feature_dir).rglob("*") if p.is_file()),
    }


# ---------------------------------------------------------------- the target and draft config


def target_view(target_dir, view_dir, dtype: str | None = None) -> dict:
    """`view_dir` with a link to each of the target's files, plus the `*.index.json` SpecForge's
    target-head loader requires when the weights are one file (the target's own directory,
    which the pipeline fingerprints, is left alone). Returns the index and the lm_head key.

    `dtype` (e.g. "bfloat16") is written into the view's own config.json: SpecForge's
    in-process SGLang target loads in the config's dtype, and a toy saved in float32 would
    load in float32, which sgl_kernel's norms refuse (the pipeline's GPU server runs bf16)."""
    from safetensors import safe_open

    target_dir, view_dir = Path(target_dir).resolve(), Path(view_dir)
    view_dir.mkdir(parents=True, exist_ok=True)
    for path in target_dir.iterdir():
        link = view_dir / path.name
        if path.name == "config.json" and dtype is not None:
            config = json.loads(path.read_text())
            config["dtype"] = config["torch_dtype"] = dtype
            link.unlink(missing_ok=True)
            atomic_write_json(link, config)
        elif not link.is_symlink() and not link.exists():
            link.symlink_to(path)
    indexes = sorted(view_dir.glob("*.index.json"))
    if indexes:
        index = indexes[0]
        weight_map = json.loads(index.read_text())["weight_map"]
    else:
        weights = sorted(view_dir.glob("*.safetensors"))
        if not weights:
            raise PipelineError(f"{target_dir} has no *.safetensors weights for SpecForge")
        weight_map, total = {}, 0
        for path in weights:
            with safe_open(path, framework="pt") as f:
                for name in f.keys():
                    weight_map[name] = path.name
                    tensor = f.get_slice(name)
                    count = 1
                    for dim in tensor.get_shape():
                        count *= dim
                    total += count * {"F32": 4, "F64": 8}.get(tensor.get_dtype(), 2)
        index = view_dir / "model.safetensors.index.json"
        atomic_write_json(index, {"metadata": {"total_size": total}, "weight_map": weight_map})
    if "model.embed_tokens.weight" not in weight_map:
        raise PipelineError(f"{target_dir}: no model.embed_tokens.weight for SpecForge's drafter")
    # A target with tied embeddings has no lm_head of its own: SpecForge reads the embedding.
    lm_head = "lm_head.weight" if "lm_head.weight" in weight_map else "model.embed_tokens.weight"
    return {"index": str(index), "lm_head_key": lm_head, "tensors": len(weight_map)}


def draft_config(target_dir, aux_layer_ids: list[int], draft_vocab_size: int) -> dict:
    """SpecForge's EAGLE-3 draft config for a Llama-family target: its architecture fields, one
    LlamaForCausalLMEagle3 layer, and the run's aux layers and draft vocabulary written out
    (SGLang reads the layers from the export's eagle_config)."""
    from eaglepipe.core.config import text_config

    target = text_config(json.loads((Path(target_dir) / "config.json").read_text()))
    draft = {k: target[k] for k in TARGET_FIELDS if target.get(k) is not None}
    rope = target.get("rope_parameters") or target.get("rope_scaling") or {}
    if "rope_theta" not in draft and "rope_theta" in rope:
        draft["rope_theta"] = rope["rope_theta"]  # transformers 5 keeps it here
    draft.pop("rope_scaling", None)
    if rope.get("rope_type", rope.get("type", "default")) != "default":
        draft["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    draft.setdefault("head_dim", target["hidden_size"] // target["num_attention_heads"])
    layers = int(target["num_hidden_layers"])
    ids = [int(i) for i in aux_layer_ids]
    if len(set(ids)) != 3 or not all(0 <= i < layers for i in ids):
        raise PipelineError(
            f"aux layers {ids}: SpecForge needs three distinct ids in [0, {layers})"
        )
    if not 0 < draft_vocab_size <= int(target["vocab_size"]):
        raise PipelineError(
            f"draft vocabulary {draft_vocab_size} for a target vocabulary of {target['vocab_size']}"
        )
    draft.update(
        architectures=["LlamaForCausalLMEagle3"],
        model_type="llama",
        num_hidden_layers=1,
        tie_word_embeddings=False,
        use_cache=True,
        torch_dtype="bfloat16",
        draft_vocab_size=int(draft_vocab_size),
        eagle_config={"eagle_aux_hidden_state_layer_ids": ids},
    )
    if draft.get("pad_token_id") is None:
        draft["pad_token_id"] = 0
    return draft


def write_json(path, value) -> Path:
    os.makedirs(Path(path).parent, exist_ok=True)
    atomic_write_json(path, value)
    return Path(path)
