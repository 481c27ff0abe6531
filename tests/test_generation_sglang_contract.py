"""Contract test: what regeneration through SGLang (eaglepipe/regenerate/client.py) relies on,
checked
against the source of both ends of the supported range (parsed, never imported):

- /generate takes `input_ids`, `rid` and `sampling_params`;
- every sampling parameter the client sends is one SGLang knows, and temperature 0 is greedy;
- a finished non-streamed answer carries `output_ids` and `meta_info` (`finish_reason`,
  `completion_tokens`);
- `finish_reason` is `{"type": "stop", "matched": id}` at a stop token and
  `{"type": "length", "length": n}` at max_new_tokens, which `parse_reply` reads.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from sglang_source import range_ends, sglang_source_root

from eaglepipe.regenerate.client import GenerationSettings, parse_reply, sampling_params

pytestmark = pytest.mark.network


@pytest.fixture(scope="module", params=range_ends())
def src(request) -> Path:
    return sglang_source_root(request.param)


def class_def(tree: ast.Module, name: str) -> ast.ClassDef:
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == name)


def field_names(tree: ast.Module, name: str) -> set[str]:
    """Annotated fields of a class and of its bases defined in the same module, plus the
    parameters of its __init__."""
    cls = class_def(tree, name)
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            names |= {a.arg for a in node.args.args + node.args.kwonlyargs}
    for base in cls.bases:
        if isinstance(base, ast.Name) and any(
            isinstance(n, ast.ClassDef) and n.name == base.id for n in tree.body
        ):
            names |= field_names(tree, base.id)
    return names


def to_json_dict(tree: ast.Module, name: str) -> dict:
    """The literal keys and string values of a finish reason's `to_json` return value."""
    cls = class_def(tree, name)
    method = next(n for n in cls.body if isinstance(n, ast.FunctionDef) and n.name == "to_json")
    returned = next(n.value for n in ast.walk(method) if isinstance(n, ast.Return))
    assert isinstance(returned, ast.Dict)
    return {
        key.value: (value.value if isinstance(value, ast.Constant) else ast.unparse(value))
        for key, value in zip(returned.keys, returned.values, strict=True)
    }


SETTINGS = GenerationSettings(
    temperature=0.7,
    top_p=0.9,
    stop_token_ids=(2, 7),
    request_prefix="eaglepipe",
    retries=0,
    request_timeout_s=1,
)


def test_generate_takes_input_ids_rid_and_sampling_params(src):
    tree = ast.parse((src / "srt/managers/io_struct.py").read_text())
    assert {"input_ids", "rid", "sampling_params"} <= field_names(tree, "GenerateReqInput")


@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_every_sampling_parameter_sent_is_one_sglang_knows(src, temperature):
    tree = ast.parse((src / "srt/sampling/sampling_params.py").read_text())
    known = field_names(tree, "SamplingParams")
    settings = GenerationSettings(**{**SETTINGS.__dict__, "temperature": temperature})
    sent = sampling_params(settings, max_new_tokens=64, seed=5)
    assert set(sent) <= known, set(sent) - known
    # Greedy requests carry no seed (SGLang checks it; it would decide nothing).
    assert ("sampling_seed" in sent) == (temperature > 0)


def test_a_finished_answer_carries_output_ids_and_meta_info(src):
    source = (src / "srt/managers/tokenizer_manager.py").read_text()
    tree = ast.parse(source)
    answers = [
        {k.value for k in node.keys if isinstance(k, ast.Constant)}
        for node in ast.walk(tree)
        if isinstance(node, ast.Dict)
    ]
    assert {"text", "output_ids", "meta_info"} in answers
    assert '"finish_reason": recv_obj.finished_reasons[i]' in source
    assert '"completion_tokens": recv_obj.completion_tokens[i]' in source


def test_finish_reasons_are_the_ones_parse_reply_reads(src):
    tree = ast.parse((src / "srt/managers/schedule_batch.py").read_text())
    stop = to_json_dict(tree, "FINISH_MATCHED_TOKEN")
    length = to_json_dict(tree, "FINISH_LENGTH")
    assert stop == {"type": "stop", "matched": "self.matched"}
    assert length == {"type": "length", "length": "self.length"}
    # An answer shaped that way, with the stop token kept in output_ids as SGLang keeps it:
    meta = {"finish_reason": {"type": "stop", "matched": 2}, "completion_tokens": 3}
    answer = {"output_ids": [5, 9, 2], "meta_info": meta}
    reply = parse_reply(answer, SETTINGS.stop_token_ids, "row 1")
    assert reply.output_ids == [5, 9] and reply.finish == "stop" and reply.completion_tokens == 3
    answer = {"output_ids": [5, 9], "meta_info": {"finish_reason": {"type": "length", "length": 2}}}
    assert parse_reply(answer, SETTINGS.stop_token_ids, "row 1").finish == "length"
