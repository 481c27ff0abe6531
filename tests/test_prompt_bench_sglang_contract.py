"""Contract test: what the benchmark stage assumes of SGLang when it serves a draft directory
another tool wrote (eaglepipe/prompt_bench/drafters.py), checked against the source of each
release in test_live_sglang_contract.VERSIONS (parsed, never imported). The flags, the answer
fields and the counters are the live harness's and are checked there.

- the draft's aux layer ids are read from its config's `eagle_config` dict, key
  `eagle_aux_hidden_state_layer_ids`, and are None (the target's default) when absent;
- with None, a Llama target captures `[2, L//2, L-3]` (the input of those layers): the outputs
  of our default `[1, L//2-1, L-4]`, which is what the stage records for such a directory;
- with ids, it captures `id + 1` for each: the outputs of the layers the ids name.
"""

from __future__ import annotations

import ast

import pytest
from test_live_sglang_contract import src  # noqa: F401 (the per-release source fixture)

from eaglepipe.core.layers import default_aux_layer_ids
from eaglepipe.drafter.export import engine_captured_layers

pytestmark = pytest.mark.network


def _function(path, name: str) -> ast.FunctionDef:
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{path}: no function {name}")


def test_the_draft_configs_eagle_config_names_the_aux_layers_or_none(src):  # noqa: F811
    # 0.5.14 reads it in model_runner.py, 0.5.23 in model_runner_components/.
    candidates = [
        src / "srt" / "model_executor" / "model_runner.py",
        src / "srt" / "model_executor" / "model_runner_components" / "spec_aux_hidden_state.py",
    ]
    readers = []
    for path in candidates:
        if not path.is_file():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Try):
                continue
            text = ast.unparse(node)
            if "eagle_config['eagle_aux_hidden_state_layer_ids']" in text:
                readers.append(text)
    assert readers, "no reader of eagle_config['eagle_aux_hidden_state_layer_ids']"
    for text in readers:
        assert "getattr(draft_model_config.hf_config, 'eagle_config', None)" in text
        # absent (a KeyError, or no eagle_config at all): None, the target's default capture
        assert "eagle_aux_hidden_state_layer_ids = None" in text


def test_a_llama_target_captures_our_default_layers_when_the_draft_names_none(src):  # noqa: F811
    function = _function(src / "srt" / "models" / "llama.py", "set_eagle3_layers_to_capture")
    branch = next(
        node
        for node in ast.walk(function)
        if isinstance(node, ast.If) and ast.unparse(node.test) == "layer_ids is None"
    )
    default = next(
        node.value
        for node in ast.walk(ast.Module(body=branch.body, type_ignores=[]))
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]).endswith("capture")
    )
    given = next(
        node.value
        for node in ast.walk(ast.Module(body=branch.orelse, type_ignores=[]))
        if isinstance(node, ast.Assign) and ast.unparse(node.targets[0]).endswith("capture")
    )
    for layers in (8, 32, 61):
        captured = eval(
            compile(ast.Expression(default), "llama.py", "eval"), {"num_layers": layers}
        )
        # SGLang's capture index k is the output of our layer k - 1.
        assert [c - 1 for c in captured] == default_aux_layer_ids(layers)
        ids = default_aux_layer_ids(layers)
        taken = eval(compile(ast.Expression(given), "llama.py", "eval"), {"layer_ids": ids})
        assert [c - 1 for c in taken] == engine_captured_layers("sglang", "llama", ids)
