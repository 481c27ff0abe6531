"""Live acceptance: the transformers harness on either export, the SGLang harness against a
stand-in SGLang (tests/fake_sglang: the same flags and answers, the project's transformers
harness as its engine) run as a real server process, the skip, and the rule's inputs.

SGLang itself does not run here; tests/test_live_sglang_contract.py checks the flags and answer
fields used against the SGLang sources.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from pathlib import Path

import psutil
import pytest
import torch
from conftest import PYTHON, REPO_ROOT, add_toy_tokenizer, build_tiny_llama, free_port
from drafter_helpers import synthetic_rows, write_config, write_table
from pipeline_run import default_config, run_snakemake, small_config
from pipeline_run import write_config as write_run_config

from eaglepipe.core.config_files import load_config
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.run import resolve
from eaglepipe.drafter.export import export
from eaglepipe.drafter.live import held_out_turns, live_acceptance, live_export_engine
from eaglepipe.drafter.live_run import (
    ExportInfo,
    SpeculativeSetting,
    first_difference,
    greedy_reference_key,
    read_greedy_reference,
)
from eaglepipe.drafter.live_sglang import parse_generation, serve_command, served
from eaglepipe.drafter.live_transformers import load_exported_drafter
from eaglepipe.drafter.target_head import load_target_head
from eaglepipe.drafter.train import build_drafter, save_drafter
from eaglepipe.drafter.vocab import build_draft_vocab, save_vocab
from eaglepipe.server.lifecycle.ports import port_is_free
from eaglepipe.server.sglang.recipe import MAX_SERVER_PORT, check_port, free_server_port

FAKE_SGLANG = REPO_ROOT / "tests" / "fake_sglang"
EXTRA_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch"]


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """A tiny target, held-out prompts, and an (untrained) drafter exported for both engines."""
    import pandas as pd

    root = tmp_path_factory.mktemp("live")
    model_dir = add_toy_tokenizer(build_tiny_llama(root / "target"))
    rows = synthetic_rows(20, vocab_size=300)
    table = write_table(rows, root / "prepared" / "tokenized.parquet")
    config_path = write_config(root / "config.yaml", model_dir, root / "unused.jsonl", 20)
    config = load_config(config_path)
    vocab, _ = build_draft_vocab(pd.read_parquet(table), 300, config["train"]["draft_vocab_size"])
    save_vocab(vocab, root / "vocab.safetensors")
    drafter = build_drafter(resolve(config), vocab, load_target_head(model_dir), seed=0)
    save_drafter(drafter, root / "model.safetensors", {"aux_layer_ids": [1, 3, 4]})
    export(
        resolve(config),
        model_path=str(root / "model.safetensors"),
        vocab_path=str(root / "vocab.safetensors"),
        out_dir=str(root / "export"),
        engines=["sglang", "vllm"],
    )
    return {"root": root, "config_path": config_path, "table": str(table)}


def fresh_config(exported: dict, **evaluate) -> dict:
    config = load_config(exported["config_path"])
    config["evaluate"].update(evaluate)
    return config


def run_live(exported, config, engine_dir: str, out: Path) -> dict:
    return live_acceptance(
        resolve(config),
        export_dir=str(exported["root"] / "export" / engine_dir),
        table_path=exported["table"],
        out_path=str(out),
        eval_path=None,
    )


# --- the transformers harness -------------------------------------------------------------


def test_the_vllm_export_loads_into_the_same_drafter_as_the_sglang_export(exported):
    sglang = load_exported_drafter(ExportInfo.read(exported["root"] / "export" / "sglang"))
    vllm = load_exported_drafter(ExportInfo.read(exported["root"] / "export" / "vllm"))
    ours, theirs = sglang.state_dict(), vllm.state_dict()
    assert ours.keys() == theirs.keys()
    for name in ours:
        if not name.startswith("embed_tokens"):  # the engines share the target's
            assert torch.equal(ours[name], theirs[name]), name


def test_live_acceptance_runs_from_whichever_export_exists(exported, tmp_path):
    config = fresh_config(exported, live_prompts=2, live_new_tokens=8)
    from_sglang = run_live(exported, config, "sglang", tmp_path / "a.json")
    from_vllm = run_live(exported, config, "vllm", tmp_path / "b.json")
    assert from_vllm["export_engine"] == "vllm" and from_vllm["aux_layer_ids_written"] == [2, 4, 5]
    assert from_sglang["aux_layer_ids_written"] == [1, 3, 4]
    for result in (from_sglang, from_vllm):
        assert result["harness"] == "transformers" and result["skipped"] is None
        assert result["aux_layers_captured"] == [1, 3, 4]
        assert result["prompts"] == 2 and result["lossless"]["identical"] == 2
        assert result["lossless"]["dtype"] == "float32"
    strip = ("seconds", "greedy_seconds")
    assert [{k: v for k, v in r.items() if k not in strip} for r in from_vllm["per_prompt"]] == [
        {k: v for k, v in r.items() if k not in strip} for r in from_sglang["per_prompt"]
    ]
    assert json.loads((tmp_path / "b.json").read_text()) == from_vllm
    split = from_sglang["by_stored_reply"]
    flags = [r["reproduces_stored_reply"] for r in from_sglang["per_prompt"]]
    assert split["reproduced"]["turns"] == sum(flags) and split["departed"]["turns"] == 2 - sum(
        flags
    )


def test_live_prompts_zero_skips_and_says_so(exported, tmp_path):
    """Regression: the schema allowed `evaluate.live_prompts: 0` and the stage raised on it."""
    config = fresh_config(exported, live_prompts=0)
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    (tmp_path / "eval.json").write_text(json.dumps({"acceptance_length": 2.5}))
    out = tmp_path / "live.json"
    result = subprocess.run(
        [
            PYTHON,
            str(REPO_ROOT / "scripts" / "live_acceptance.py"),
            "--config",
            str(config_path),
            "--table",
            exported["table"],
            "--eval",
            str(tmp_path / "eval.json"),
            "--out",
            str(out),
        ],  # fmt: skip
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stderr
    live = json.loads(out.read_text())
    assert live["skipped"] == "evaluate.live_prompts is 0"
    assert live["acceptance_length"] is None and live["prompts"] == 0
    assert live["offline_acceptance_length"] == 2.5
    assert "live acceptance skipped" in result.stdout


def test_the_export_engine_follows_the_config():
    def config(engine, engines, prompts=3):
        config = default_config()
        config["server"]["engine"] = engine
        config["export"]["engines"] = engines
        config["evaluate"]["live_prompts"] = prompts
        return config

    assert live_export_engine(resolve(config("reference", ["sglang", "vllm"]))) == "sglang"
    assert live_export_engine(resolve(config("reference", ["vllm"]))) == "vllm"
    assert live_export_engine(resolve(config("sglang", ["vllm", "sglang"]))) == "sglang"
    assert live_export_engine(resolve(config("sglang", ["vllm"], prompts=0))) is None
    with pytest.raises(PipelineError, match=r"export.engines is \['vllm'\].*sglang"):
        live_export_engine(resolve(config("sglang", ["vllm"])))


def test_decoding_stops_at_the_end_of_the_turn(exported):
    """Rounds past the end of the reply are never decoded or counted: with the target's third
    greedy token as the stop token, both decodes end there."""
    from eaglepipe.drafter.live_transformers import Target, speculative_decode

    root = exported["root"]
    export_info = ExportInfo.read(root / "export" / "sglang")
    target = Target(root / "target", [1, 3, 4], torch.device("cpu"))
    drafter = load_exported_drafter(export_info).eval()
    prompt = synthetic_rows(1, vocab_size=300)[0]["input_ids"][:12]
    unbounded = target.greedy(prompt, 16)
    stop = unbounded[2]
    first_stop = unbounded.index(stop)
    greedy = target.greedy(prompt, 16, stops={stop})
    produced, rounds = speculative_decode(target, drafter, prompt, 16, 4, stops={stop})
    assert greedy == unbounded[: first_stop + 1]
    assert produced == greedy  # the same tokens, the stop token last
    assert len(rounds) <= first_stop  # no round after the stop token


def unverified_decode(target, drafter, prompt, new_tokens, k, stops=()):
    """A broken decoder: every draft is taken without checking it against the target."""
    from eaglepipe.drafter.live_transformers import draft_chain

    committed = list(prompt)
    greedy, aux = target.start(committed)
    pending = int(greedy[-1])
    produced, rounds = [pending], []
    while len(produced) < new_tokens and produced[-1] not in stops:
        drafted = draft_chain(drafter, committed, pending, aux, k)
        greedy, new_aux = target.extend([pending] + drafted)
        produced += [*drafted, int(greedy[k])]
        committed = committed + [pending] + drafted
        aux = torch.cat([aux, new_aux])
        pending = int(greedy[k])
        rounds.append(k)
    return produced[:new_tokens], rounds


def test_the_fp32_lossless_check_fails_when_drafts_are_used_unverified(
    exported, tmp_path, monkeypatch
):
    import eaglepipe.drafter.live_transformers as harness

    config = fresh_config(exported, live_prompts=2, live_new_tokens=12)
    run_live(exported, config, "sglang", tmp_path / "ok.json")  # verified: passes
    monkeypatch.setattr(harness, "speculative_decode", unverified_decode)
    with pytest.raises(PipelineError, match=r"changed the target's fp32 greedy output on 2 of 2"):
        run_live(exported, config, "sglang", tmp_path / "broken.json")
    assert not (tmp_path / "broken.json").exists()


def test_bf16_differences_are_counted_with_the_target_margin():
    from eaglepipe.drafter.live import check_lossless
    from eaglepipe.drafter.live_run import PromptRun

    same = PromptRun(1, 0, [5, 6], [5, 6], 2, 1, 1)
    near_tie = PromptRun(2, 1, [5, 7], [5, 6], 2, 1, 0, margin_at_difference=0.01)
    report = check_lossless([same, near_tie], "bfloat16")
    assert report["identical"] == 1 and report["prompts"] == 2
    assert report["first_differences"] == [
        {"row_id": 2, "turn": 1, "position": 1, "target_logit_margin": 0.01}
    ]
    with pytest.raises(PipelineError, match="row 2 turn 1 at token 1"):
        check_lossless([same, near_tie], "float32")


def test_live_turns_are_an_even_sample_of_the_offline_turns(tmp_path):
    """Two turns per row: the live set mixes first and second turns as the offline set does,
    and leaves out replies cut at max_new_tokens."""
    rows = [
        {
            "row_id": r,
            "split": "eval" if r != 1 else "train",
            "num_tokens": 8,
            "input_ids": list(range(10 * r, 10 * r + 8)),
            "loss_mask": [0, 0, 1, 1, 0, 0, 1, 1],
            "truncated": False,
            "length_limited_turns": [1] if r == 4 else [],
        }
        for r in range(5)
    ]
    table = write_table(rows, tmp_path / "tokenized.parquet")
    every = held_out_turns(table, 100, max_rows=64)
    assert [(t.row_id, t.turn) for t in every] == [
        (0, 0), (0, 1), (2, 0), (2, 1), (3, 0), (3, 1), (4, 0),
    ]  # fmt: skip
    assert every[1].prompt == [0, 1, 2, 3, 4, 5] and every[1].reply == [6, 7]
    sample = held_out_turns(table, 3, max_rows=64)
    assert [(t.row_id, t.turn) for t in sample] == [(0, 0), (2, 0), (3, 0)]
    sample = held_out_turns(table, 4, max_rows=64)
    assert {t.turn for t in sample} == {0, 1}
    assert [(t.row_id, t.turn) for t in held_out_turns(table, 100, max_rows=1)] == [(0, 0), (0, 1)]


def test_live_and_offline_are_compared_apart_where_the_live_output_left_the_stored_reply():
    """A near-tie broken another way than in the server that wrote the reply sends the live
    decode into text the offline walk never scored: that turn is reported on its own."""
    from eaglepipe.drafter.live import reproduces_reply, split_by_stored_reply
    from eaglepipe.drafter.live_run import PromptRun

    eot, newline = 9, 4
    pieces = {5: "a", 6: "b", 7: "c", 56: "ab", eot: "<eot>", newline: "\n"}

    def decode(ids):
        return "".join(pieces[i] for i in ids)

    # The table masks in a newline after the end-of-turn token; the server stops at it.
    assert reproduces_reply([5, 6, eot], [5, 6, eot, newline], {eot}, decode)
    assert reproduces_reply([5, 6], [5, 6, eot, newline], {eot}, decode)  # the token budget
    # prepare tokenised the regenerated text again and merged two tokens: the same reply
    assert reproduces_reply([5, 6, eot], [56, eot], {eot}, decode)
    assert not reproduces_reply([5, 7, eot], [5, 6, eot, newline], {eot}, decode)
    assert not reproduces_reply([5, 6, 6, eot], [5, 6, eot], {eot}, decode)

    same = PromptRun(1, 0, [5, 6, eot], [5, 6, eot], completion_tokens=12, rounds=3, accepted=9)
    left = PromptRun(2, 1, [5, 7, eot], [5, 7, eot], completion_tokens=30, rounds=20, accepted=10)
    walked = {
        (1, 0): {"tokens": 12, "rounds": {"7": 4}},
        (2, 1): {"tokens": 10, "rounds": {"7": 4}},
    }
    split = split_by_stored_reply([same, left], [True, False], walked, steps=7)
    assert split["reproduced"] == {
        "turns": 1,
        "completion_tokens": 12,
        "acceptance_length": 4.0,
        "offline_same_turns": 3.0,
        "live_over_offline": 4.0 / 3.0,
    }
    assert split["departed"]["acceptance_length"] == 1.5
    assert split["departed"]["offline_same_turns"] == 2.5
    assert split["departed"]["live_over_offline"] == 0.6
    # Pooled, the departed turn's rounds would hide the agreement: live 42 / 23 = 1.83 against
    # offline 22 / 8 = 2.75.
    nothing = split_by_stored_reply([same], [True], {}, steps=7)
    assert nothing["reproduced"]["offline_same_turns"] is None
    assert nothing["departed"] == {
        "turns": 0,
        "completion_tokens": 0,
        "acceptance_length": None,
        "offline_same_turns": None,
        "live_over_offline": None,
    }


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


# --- the SGLang harness ---------------------------------------------------------------------


def sglang_config(exported: dict) -> dict:
    config = fresh_config(exported, live_prompts=2, live_new_tokens=8)
    config["server"]["engine"] = "sglang"
    config["server"]["sglang"].update(tp_size=1, extra_args=list(EXTRA_ARGS))
    config["server"].update(health_timeout_s=120, idle_timeout_s=60, dtype="float32")
    return config


@pytest.fixture
def fake_sglang(monkeypatch, tmp_path):
    """`python -m sglang.launch_server` resolves to the stand-in; state and logs under tmp."""
    monkeypatch.chdir(tmp_path)
    path = os.pathsep.join(p for p in (str(FAKE_SGLANG), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    return tmp_path


def test_serve_command_drafts_with_the_export_and_never_loads_the_hook(exported):
    config = sglang_config(exported)
    draft = exported["root"] / "export" / "sglang"
    plain = serve_command(resolve(config), host="127.0.0.1", port=1234)
    drafting = serve_command(resolve(config), host="127.0.0.1", port=1234, draft_dir=draft)
    assert plain[1:3] == ["-m", "sglang.launch_server"]
    assert "--speculative-algorithm" not in plain and plain[-4:] == EXTRA_ARGS
    flags = dict(zip(drafting[3::2], drafting[4::2], strict=False))
    assert drafting[-4:] == EXTRA_ARGS and flags["--dtype"] == "float32"
    start = drafting.index("--speculative-algorithm")
    assert drafting[start : start + 10] == [
        "--speculative-algorithm", "EAGLE3",
        "--speculative-draft-model-path", str(draft.resolve()),
        "--speculative-num-steps", "7",
        "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "8",
    ]  # fmt: skip
    # Another setting (issue 27's 3/1/4) changes only the three counts.
    short = serve_command(
        resolve(config),
        host="127.0.0.1",
        port=1234,
        draft_dir=draft,
        speculative=SpeculativeSetting.parse("3/1/4"),
    )
    assert short[start + 4 : start + 10] == [
        "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
        "--speculative-num-draft-tokens", "4",
    ]  # fmt: skip
    assert short[:start] == drafting[:start] and short[start + 10 :] == drafting[start + 10 :]
    for argv in (plain, drafting):
        assert "--forward-hooks" not in argv and not any("patch" in a for a in argv)
        assert "--enable-return-aux-hidden-states" not in argv
    config["server"]["sglang"]["extra_args"] = ["--speculative-algorithm", "EAGLE"]
    with pytest.raises(PipelineError, match="server.sglang.extra_args: --speculative-algorithm"):
        serve_command(resolve(config), host="127.0.0.1", port=1234)


def test_sglang_harness_matches_the_transformers_harness(exported, fake_sglang, monkeypatch):
    config = sglang_config(exported)
    through_sglang = run_live(exported, config, "sglang", fake_sglang / "sglang.json")
    config["server"]["engine"] = "reference"
    in_transformers = run_live(exported, config, "sglang", fake_sglang / "reference.json")
    assert through_sglang["harness"] == "sglang"
    same = ("prompts", "completion_tokens", "rounds", "accepted", "acceptance_length")
    assert {k: through_sglang[k] for k in same} == {k: in_transformers[k] for k in same}
    assert through_sglang["lossless"]["identical"] == 2
    assert through_sglang["lossless"]["dtype"] == "float32"
    for mine, theirs in zip(
        through_sglang["per_prompt"], in_transformers["per_prompt"], strict=True
    ):
        assert mine["rounds"] == theirs["rounds"] and mine["accepted"] == theirs["accepted"]
        assert mine["spec_accept_length"] == pytest.approx(
            mine["completion_tokens"] / mine["rounds"]
        )
    assert through_sglang["acceptance_length"] == pytest.approx(
        through_sglang["completion_tokens"] / through_sglang["rounds"]
    )
    assert through_sglang["speedup"]["plain_s"] > 0 and through_sglang["speedup"]["ratio"] > 0
    sglang = through_sglang["sglang"]
    assert sglang["version"] == "0.5.14-fake"
    assert "--speculative-draft-model-path" in sglang["command"]
    logs = sorted((fake_sglang / "logs" / "live_acceptance").glob("*.log"))
    assert len(logs) == 2  # the plain target, then the target with the drafter
    assert "--speculative-algorithm" in logs[1].read_text() + logs[0].read_text()


def test_speculative_settings_that_sglang_would_not_run_as_written_are_refused():
    assert SpeculativeSetting.parse("7/1/8") == SpeculativeSetting.chain(7)
    assert SpeculativeSetting.parse("3/1/4").label == "3/1/4"
    assert SpeculativeSetting.parse("5/4/16").record() == {
        "steps": 5,
        "topk": 4,
        "draft_tokens": 16,
    }
    for text, match in [
        ("7-1-8", "expected STEPS/TOPK/DRAFT_TOKENS"),
        ("7/1", "expected STEPS/TOPK/DRAFT_TOKENS"),
        ("0/1/1", "steps and top-k must be >= 1"),
        ("7/1/9", "with top-k 1 a round verifies steps \\+ 1 = 8 tokens"),
        ("3/2/8", "draft tokens must lie in \\[2, steps x top-k \\+ 1\\]"),
    ]:
        with pytest.raises(PipelineError, match=match) as info:
            SpeculativeSetting.parse(text)
        assert repr(text) in str(info.value)


def test_the_transformers_harness_refuses_a_tree(exported, tmp_path):
    config = fresh_config(exported, live_prompts=1, live_new_tokens=4)
    with pytest.raises(PipelineError, match="transformers harness drafts a chain"):
        live_acceptance(
            resolve(config),
            export_dir=str(exported["root"] / "export" / "sglang"),
            table_path=exported["table"],
            out_path=str(tmp_path / "live.json"),
            speculative=SpeculativeSetting.parse("3/2/5"),
        )


def test_drafters_and_settings_on_one_target_share_one_greedy_reference(exported, fake_sglang):
    """Two settings of one drafter through the SGLang harness with one greedy-reference file:
    the plain target is served for the first only (its outputs, margins and wall time are
    reused); the file does not answer for another target, server setting, budget or turns."""
    from eaglepipe.data.tokenizer import load_target_tokenizer, stop_token_ids

    config = sglang_config(exported)
    reference = fake_sglang / "greedy.json"
    logs = fake_sglang / "logs" / "live_acceptance"

    def live(out: str, setting: str) -> dict:
        return live_acceptance(
            resolve(config),
            export_dir=str(exported["root"] / "export" / "sglang"),
            table_path=exported["table"],
            out_path=str(fake_sglang / out),
            speculative=SpeculativeSetting.parse(setting),
            greedy_reference=str(reference),
        )

    first = live("a.json", "7/1/8")
    assert first["greedy_reference"].startswith("computed: ") and reference.is_file()
    assert len(list(logs.glob("*.log"))) == 2  # the plain target, then the drafter
    second = live("b.json", "3/1/4")
    assert second["greedy_reference"] == f"read from {reference}"
    assert len(list(logs.glob("*.log"))) == 3  # only the drafter's server this time
    assert second["speculative"] == {"steps": 3, "topk": 1, "draft_tokens": 4}
    command = second["sglang"]["command"]
    assert command[command.index("--speculative-num-steps") + 1] == "3"
    assert second["lossless"]["identical"] == first["lossless"]["identical"] == 2
    assert second["speedup"]["plain_s"] == first["speedup"]["plain_s"] > 0
    # Shorter chains: at most 3 drafts accepted per round.
    assert all(p["accepted"] <= 3 * p["rounds"] for p in second["per_prompt"])
    # Another target, server, budget or turn set: the stored outputs do not answer for it.
    run = resolve(config)
    stops = stop_token_ids(load_target_tokenizer(run), run.model.directory)
    turns = held_out_turns(exported["table"], 2, run.evaluate.max_rows)
    key = greedy_reference_key(run, "sglang", turns, stops)
    assert read_greedy_reference(reference, key)[1] == "reused"
    for changed in (
        {**key, "max_new_tokens": 6},
        {**key, "sglang": {**key["sglang"], "mem_fraction_static": 0.3}},
        {**key, "weights_fingerprint": "other"},
        {**key, "stop_token_ids": []},
        greedy_reference_key(run, "sglang", turns[:1], stops),
    ):
        outputs, why = read_greedy_reference(reference, changed)
        assert outputs is None and "was made for another target, server or turns" in why


def test_a_server_that_dies_at_startup_fails_with_its_log_tail(exported, fake_sglang, monkeypatch):
    monkeypatch.setenv("FAKE_SGLANG_FAIL", "1")
    config = sglang_config(exported)
    port = free_port()
    with pytest.raises(PipelineError) as info:
        argv = serve_command(resolve(config), host="127.0.0.1", port=port)
        with served(argv, run=resolve(config), name="target", host="127.0.0.1", port=port):
            pass
    message = str(info.value)
    assert "SGLang server 'target' exited with code 3 before becoming healthy" in message
    assert "CUDA out of memory (FAKE_SGLANG_FAIL)" in message
    assert port_is_free("127.0.0.1", port)


def test_a_held_port_is_refused_naming_its_holder(exported, fake_sglang):
    config = sglang_config(exported)
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        with pytest.raises(
            PipelineError, match=rf"port {port} on 127.0.0.1 is held by PID {os.getpid()}"
        ):
            with served(["true"], run=resolve(config), name="target", host="127.0.0.1", port=port):
                pass


def test_the_whole_process_group_is_stopped(exported, fake_sglang, monkeypatch):
    pid_file = fake_sglang / "child.pid"
    monkeypatch.setenv("FAKE_SGLANG_CHILD_PID_FILE", str(pid_file))
    config = sglang_config(exported)
    port = free_port()
    argv = serve_command(resolve(config), host="127.0.0.1", port=port)
    with served(argv, run=resolve(config), name="target", host="127.0.0.1", port=port) as url:
        assert url == f"http://127.0.0.1:{port}"
        child = psutil.Process(int(pid_file.read_text()))
        assert child.is_running()
        group = os.getpgid(child.pid)
        assert group != os.getpgid(0)  # its own process group, not ours
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert port_is_free("127.0.0.1", port)
    leases = list((fake_sglang / ".eaglepipe" / "live-server").glob("*/leases/*.lease"))
    assert leases == []


SERVE_AND_WAIT = """
import json, sys, time
from eaglepipe.drafter.live_sglang import serve_command, served
from eaglepipe.core.run import resolve
config, port = json.loads(sys.argv[1]), int(sys.argv[2])
argv = serve_command(resolve(config), host="127.0.0.1", port=port)
with served(argv, run=resolve(config), name="target", host="127.0.0.1", port=port):
    print("serving", flush=True)
    time.sleep(600)
"""


def start_serving_job(exported, stderr_path, attempts: int = 3):
    """A job serving through `served` on a free port. Between `free_port` and the stand-in's
    bind, another test's process can take the port: then the job fails with "address already
    in use" and it starts again on another port."""
    for _ in range(attempts):
        port = free_port()
        with stderr_path.open("w") as stderr:
            job = subprocess.Popen(
                [PYTHON, "-c", SERVE_AND_WAIT, json.dumps(sglang_config(exported)), str(port)],
                stdout=subprocess.PIPE,
                stderr=stderr,
                text=True,
            )
        if any(line.strip() == "serving" for line in job.stdout):
            return job, port
        job.wait()
        if "address already in use" not in stderr_path.read_text():
            break
    raise AssertionError(f"the job never served:\n{stderr_path.read_text()[-3000:]}")


def test_a_terminated_job_stops_its_server_group(exported, fake_sglang, monkeypatch):
    """Snakemake cancels a job with SIGTERM: the server's whole group goes with it."""
    pid_file = fake_sglang / "child.pid"
    monkeypatch.setenv("FAKE_SGLANG_CHILD_PID_FILE", str(pid_file))
    job, port = start_serving_job(exported, fake_sglang / "job.err")
    try:
        child = psutil.Process(int(pid_file.read_text()))
        assert not port_is_free("127.0.0.1", port)
        job.send_signal(signal.SIGTERM)
        assert job.wait(timeout=120) != 0
    finally:
        job.kill()
        job.wait()
    assert not child.is_running() or child.status() == psutil.STATUS_ZOMBIE
    assert port_is_free("127.0.0.1", port)


def test_answers_without_speculative_counters_are_refused():
    meta = {"id": "x", "prompt_tokens": 3, "completion_tokens": 2, "cached_tokens": 0}
    plain = {"text": "", "output_ids": [5, 6], "meta_info": meta}
    assert parse_generation(plain, speculative=False, where="w").output_ids == [5, 6]
    with pytest.raises(PipelineError, match="no speculative counters .* SGLang did not draft"):
        parse_generation(plain, speculative=True, where="w")
    drafted = {
        **plain,
        "meta_info": {
            **meta,
            "spec_verify_ct": 1,
            "spec_num_correct_drafts": 1,
            "spec_accept_length": 2.0,
        },  # fmt: skip
    }
    got = parse_generation(drafted, speculative=True, where="w")
    assert (got.spec_verify_ct, got.spec_num_correct_drafts, got.spec_accept_length) == (1, 1, 2.0)
    top = [[[-0.1, 5, None], [-2.6, 9, None]], [[-0.5, 6, None], [-0.7, 3, None]]]
    with_top = {**plain, "meta_info": {**meta, "output_top_logprobs": top}}
    margins = parse_generation(with_top, speculative=False, where="w", with_margins=True).margins
    assert margins == pytest.approx([2.5, 0.2])
    with pytest.raises(PipelineError, match="no output_top_logprobs"):
        parse_generation(plain, speculative=False, where="w", with_margins=True)
    with pytest.raises(PipelineError, match="completion_tokens 2 but 1 output_ids"):
        parse_generation({**plain, "output_ids": [5]}, speculative=False, where="w")
    with pytest.raises(PipelineError, match="not SGLang's JSON"):
        parse_generation({"error": "boom"}, speculative=False, where="w")


# --- the rule ---------------------------------------------------------------------------------


def dry_run_live(tmp_path: Path, **changes) -> subprocess.CompletedProcess:
    config = small_config(tmp_path)
    for key, value in changes.items():
        section, name = key.split("__")
        config[section][name] = value
    write_run_config(tmp_path, config)
    return run_snakemake(tmp_path, "-n", "-p", "drafter/live.json", check=False)


def live_command(output: str) -> str:
    lines = [line for line in output.splitlines() if "live_acceptance.py" in line]
    assert len(lines) == 1, output
    return lines[0]


def test_the_rule_reads_the_export_that_exists(tmp_path):
    """Regression: the rule read drafter/export/sglang even when only vLLM was exported."""
    result = dry_run_live(tmp_path, export__engines=["vllm"])
    assert result.returncode == 0, result.stderr
    assert "--export-dir drafter/export/vllm" in live_command(result.stdout)
    assert "drafter/export/sglang" not in result.stdout


def test_the_rule_skips_without_an_export_when_live_prompts_is_zero(tmp_path):
    result = dry_run_live(tmp_path, evaluate__live_prompts=0)
    assert result.returncode == 0, result.stderr
    assert "--export-dir" not in live_command(result.stdout)
    assert "rule export:" not in result.stdout


def test_the_sglang_engine_without_an_sglang_export_is_one_clear_error(tmp_path):
    result = dry_run_live(tmp_path, export__engines=["vllm"], server__engine="sglang")
    assert result.returncode != 0
    assert "export.engines is ['vllm']: live acceptance with server.engine sglang" in (
        result.stdout + result.stderr
    )


def test_sglang_servers_get_ports_whose_grpc_port_exists(monkeypatch):
    # SGLang 0.5.14 refuses to start when --port + 10000 is past 65535 (seen live on the H200,
    # where an ephemeral port of 56441 was picked for the live server).
    monkeypatch.delenv("SGLANG_GRPC_PORT", raising=False)
    assert all(free_server_port("127.0.0.1") <= MAX_SERVER_PORT for _ in range(50))
    check_port(MAX_SERVER_PORT)
    with pytest.raises(PipelineError, match=r"server.port 56441: SGLang also uses port 56441"):
        check_port(56441)
    monkeypatch.setenv("SGLANG_GRPC_PORT", "45123")
    check_port(56441)
