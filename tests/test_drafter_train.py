"""The drafter stages end to end through their scripts, on a tiny target trained for seconds.

vocab -> train -> evaluate -> export -> live acceptance, as the Snakemake rules run them, plus
the validation gate and kill-and-resume of training.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from conftest import PYTHON, REPO_ROOT, add_toy_tokenizer, build_tiny_llama, small_filesystem
from drafter_helpers import make_inputs, synthetic_rows, train_tiny_target

from eaglepipe.core.run import config_from_arg, resolve
from eaglepipe.drafter.evaluate import eval_rows, evaluate_model
from eaglepipe.drafter.target_head import load_target_head
from eaglepipe.drafter.train import build_drafter
from eaglepipe.drafter.vocab import load_vocab

TRAIN = {"batch_tokens": 256, "lr": 0.01, "epochs": 10, "warmup_steps": 10}


def run_script(name: str, *args: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """A drafter script run in the run directory `cwd` (it reads the shards planned there)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    result = subprocess.run(
        [PYTHON, "-u", str(REPO_ROOT / "scripts" / name), *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=cwd,
        timeout=600,
    )
    if check and result.returncode != 0:
        raise AssertionError(f"{name} failed:\n{result.stdout}\n{result.stderr}")
    return result


def train_args(inputs: dict, out: Path, **overrides) -> list[str]:
    args = {
        "--config": inputs["config"],
        "--vocab": str(inputs["vocab"]),
        "--table": inputs["table"],
        "--out": str(out / "model.safetensors"),
        "--log": str(out / "train_log.jsonl"),
        "--checkpoint-dir": str(out / "checkpoints"),
        **overrides,
    }
    return [x for pair in args.items() for x in pair]


def read_log(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line]


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    root = tmp_path_factory.mktemp("drafter")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the shared test machine is oversubscribed; one thread is faster
    try:
        # The toy's kind of tokenizer: live acceptance stops each reply at its end-of-turn ids.
        model_dir = add_toy_tokenizer(build_tiny_llama(root / "target"))
        train_tiny_target(model_dir, synthetic_rows(60, 300), steps=100)
        inputs = make_inputs(root, model_dir, **TRAIN)
    finally:
        torch.set_num_threads(threads)
    drafter = root / "drafter"
    inputs["vocab"] = drafter / "vocab.safetensors"
    run_script(
        "vocab.py", "--config", inputs["config"], "--table", inputs["table"],
        "--out", str(inputs["vocab"]), cwd=root,
    )  # fmt: skip
    trained = run_script("train.py", *train_args(inputs, drafter), cwd=root)
    inputs["train_stdout"] = trained.stdout
    common = ["--config", inputs["config"], "--vocab", str(inputs["vocab"])]
    run_script(
        "evaluate.py", *common, "--model", str(drafter / "model.safetensors"),
        "--table", inputs["table"],
        "--out", str(drafter / "eval.json"), "--plot", str(drafter / "eval.png"), cwd=root,
    )  # fmt: skip
    run_script(
        "export.py", *common, "--model", str(drafter / "model.safetensors"),
        "--out-dir", str(drafter / "export"), cwd=root,
    )  # fmt: skip
    run_script(
        "live_acceptance.py", "--config", inputs["config"],
        "--export-dir", str(drafter / "export" / "sglang"), "--table", inputs["table"],
        "--out", str(drafter / "live.json"), "--eval", str(drafter / "eval.json"), cwd=root,
    )  # fmt: skip
    inputs["drafter"] = drafter
    return inputs


def test_training_logs_every_step_and_the_loss_falls(pipeline):
    log = read_log(pipeline["drafter"] / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, len(log) + 1))
    assert len(log) > 50
    first = sum(r["loss"] for r in log[:10]) / 10
    last = sum(r["loss"] for r in log[-10:]) / 10
    assert last < 0.85 * first, (first, last)
    assert all(len(r["acc"]) == 7 for r in log)
    assert not list((pipeline["drafter"] / "checkpoints").glob(".*tmp"))


def test_trained_drafter_beats_an_untrained_one_on_held_out_rows(pipeline):
    config = config_from_arg(pipeline["config"])
    evaluation = json.loads((pipeline["drafter"] / "eval.json").read_text())
    assert (pipeline["drafter"] / "eval.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    vocab = load_vocab(pipeline["vocab"])
    head = load_target_head(Path(config["model"]["path"]))
    untrained = build_drafter(resolve(config), vocab, head, seed=config["train"]["seed"])
    rows, _ = eval_rows(pipeline["table"], pipeline["manifests"], config["evaluate"]["max_rows"])
    baseline = evaluate_model(
        untrained,
        vocab,
        head.lm_head,
        rows,
        ttt_length=config["train"]["ttt_length"],
        batch_tokens=config["train"]["batch_tokens"],
        max_len=config["train"]["max_len"],
        device=torch.device("cpu"),
    )
    assert (
        evaluation["rows"] == baseline["rows"] and evaluation["positions"] == baseline["positions"]
    )
    trained_acc, untrained_acc = evaluation["accuracy"][0], baseline["accuracy"][0]
    assert trained_acc > untrained_acc + 0.2, (trained_acc, untrained_acc)
    assert evaluation["acceptance_length"] > baseline["acceptance_length"] + 0.3
    cond = evaluation["conditional_accuracy"]
    assert cond[0] == pytest.approx(trained_acc)


def test_live_acceptance_is_well_above_one_and_near_the_offline_estimate(pipeline):
    live = json.loads((pipeline["drafter"] / "live.json").read_text())
    offline = live["offline_acceptance_length"]
    assert live["aux_layers_captured"] == [1, 3, 4]
    assert live["lossless"]["identical"] == live["prompts"] == 3
    assert live["acceptance_length"] > 1.3, live
    # Same order of gain as the teacher-forced estimate: a layer-id or export bug collapses to ~1.
    gain, offline_gain = live["acceptance_length"] - 1, offline - 1
    assert 0.35 * offline_gain < gain < 3.0 * offline_gain, (live["acceptance_length"], offline)


def test_export_writes_both_engines(pipeline):
    for engine, ids in (("sglang", [1, 3, 4]), ("vllm", [2, 4, 5])):
        config = json.loads((pipeline["drafter"] / "export" / engine / "config.json").read_text())
        assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == ids
        assert (pipeline["drafter"] / "export" / engine / "model.safetensors").exists()


def test_training_refuses_shards_without_a_validation_report(pipeline, tmp_path):
    run = tmp_path / "run"
    for part in ("hidden_states", "validated"):
        shutil.copytree(pipeline["root"] / part, run / part)
    (run / "validated" / "rows_30-60.json").unlink()
    result = run_script("train.py", *train_args(pipeline, tmp_path), cwd=run, check=False)
    assert result.returncode == 1
    assert result.stderr.strip() == (
        "error: validation report validated/rows_30-60.json does not exist: "
        "validate its shard first (training needs every report)"
    )
    assert not (tmp_path / "model.safetensors").exists()


def test_killed_training_resumes_to_the_same_step_count(pipeline, tmp_path):
    full_steps = len(read_log(pipeline["drafter"] / "train_log.jsonl"))
    config = json.loads(json.dumps(config_from_arg(pipeline["config"])))
    config["train"]["checkpoint_every"] = 5
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    inputs = {**pipeline, "config": str(config_path)}
    args = train_args(inputs, tmp_path)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    process = subprocess.Popen(
        [PYTHON, "-u", str(REPO_ROOT / "scripts" / "train.py"), *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        env=env,
        cwd=pipeline["root"],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while not list((tmp_path / "checkpoints").glob("step-*.pt")):
            assert process.poll() is None, process.stdout.read().decode()
            assert time.monotonic() < deadline, "no checkpoint appeared"
            time.sleep(0.05)
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    assert process.returncode == -signal.SIGKILL
    assert not (tmp_path / "model.safetensors").exists()
    killed_at = len(read_log(tmp_path / "train_log.jsonl"))
    assert killed_at < full_steps
    # Snakemake deletes a job's outputs before it reruns the job, the training log among them:
    # the steps before the checkpoint must come back from the history kept with the checkpoints.
    (tmp_path / "train_log.jsonl").unlink()

    resumed = run_script("train.py", *args, cwd=pipeline["root"])
    checkpoint_step = int(resumed.stdout.split("(step ")[1].split(")")[0])
    assert 5 <= checkpoint_step <= killed_at
    log = read_log(tmp_path / "train_log.jsonl")
    assert [r["step"] for r in log] == list(range(1, full_steps + 1))
    history = tmp_path / "checkpoints" / "train_log.jsonl"
    assert history.read_bytes() == (tmp_path / "train_log.jsonl").read_bytes()
    assert f"from step {checkpoint_step}" in resumed.stdout
    assert (tmp_path / "model.safetensors").exists()


def test_a_full_disk_at_a_checkpoint_stops_training_in_one_line_and_the_rerun_resumes(
    pipeline, tmp_path
):
    full_steps = len(read_log(pipeline["drafter"] / "train_log.jsonl"))
    config = json.loads(json.dumps(config_from_arg(pipeline["config"])))
    config["train"]["checkpoint_every"] = 5
    config_path = tmp_path / "config.json"
    config_path.write_text(json.dumps(config))
    args = train_args({**pipeline, "config": str(config_path)}, tmp_path)
    # A checkpoint holds the trainable weights and two Adam moments, about 3x the model file:
    # room for one and a half, so the first is written and the second runs out of space.
    model_bytes = (pipeline["drafter"] / "model.safetensors").stat().st_size
    room = -(-int(4.5 * model_bytes) // 4096) * 4096
    checkpoints = tmp_path / "checkpoints"
    with small_filesystem(checkpoints, room) as resize:
        full = run_script("train.py", *args, cwd=pipeline["root"], check=False)
        output = full.stdout + full.stderr
        assert full.returncode == 1, output[-3000:]
        (error,) = [line for line in output.splitlines() if line.startswith("error: ")]
        assert error.startswith(
            f"error: no space left on the filesystem of {checkpoints} while writing step-0000001"
        ), error
        assert "Traceback" not in output
        # Only whole checkpoints are left (with their checksum, beside the steps log), no model.
        assert sorted(p.name for p in checkpoints.iterdir()) == [
            "step-00000005.pt",
            "step-00000005.pt.xxh3",
            "train_log.jsonl",
        ]
        assert not (tmp_path / "model.safetensors").exists()

        resize(64 << 20)
        resumed = run_script("train.py", *args, cwd=pipeline["root"])
        assert "(step 5)" in resumed.stdout and "from step 5" in resumed.stdout
        assert [r["step"] for r in read_log(tmp_path / "train_log.jsonl")] == list(
            range(1, full_steps + 1)
        )
        assert (tmp_path / "model.safetensors").exists()


def test_a_changed_drafter_variant_never_resumes_another_variants_checkpoint(
    pipeline, tmp_path, capsys
):
    """Checkpoints belong to one variant: the run key holds the whole `train` section."""
    from eaglepipe.drafter.train import train
    from eaglepipe.plan.freshness import planned_manifests, planned_validations

    config = json.loads(json.dumps(config_from_arg(pipeline["config"])))
    config["train"]["checkpoint_every"] = 2
    paths = dict(
        vocab_path=str(pipeline["vocab"]),
        table_path=pipeline["table"],
        out_path=str(tmp_path / "model.safetensors"),
        log_path=str(tmp_path / "train_log.jsonl"),
        checkpoint_dir=str(tmp_path / "checkpoints"),
    )
    cwd = os.getcwd()
    os.chdir(pipeline["root"])  # the planned shards are relative to the run directory
    try:
        run = resolve(config)
        inputs = dict(manifests=planned_manifests(run), validated=planned_validations(run))
        train(run, **paths, **inputs, stop_after_steps=2)
        plain = list((tmp_path / "checkpoints").glob("step-*.pt"))
        assert [p.name for p in plain] == ["step-00000002.pt"]
        capsys.readouterr()

        config["train"]["drafter"]["norm_output"] = True
        summary = train(resolve(config), **paths, **inputs, stop_after_steps=2)
        out = capsys.readouterr().out
        assert summary["resumed_from"] == 0
        assert "was made from other inputs or settings; removing it" in out
        assert "resuming" not in out
        # Its own checkpoint (step 2 of the norm_output run) is resumed by the same variant.
        summary = train(resolve(config), **paths, **inputs, stop_after_steps=3)
        assert summary["resumed_from"] == 2
    finally:
        os.chdir(cwd)


def test_a_damaged_checkpoint_is_passed_over_for_the_one_before(tmp_path):
    """torch.load reads a flipped bit in a tensor without complaint: training resumed from it
    and wrote a broken drafter, sealed as if it were whole."""
    from eaglepipe.drafter.train import latest_checkpoint, save_checkpoint

    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.arange(4096, dtype=torch.float32))

        def trainable_state_dict(self):
            return {"w": self.w.detach().clone()}

    model = Model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(tmp_path, 1, model, optimizer, "key")
    with torch.no_grad():
        model.w += 1
    newest = save_checkpoint(tmp_path, 2, model, optimizer, "key")
    data = bytearray(newest.read_bytes())
    data[len(data) // 2] ^= 0x40
    newest.write_bytes(bytes(data))
    lines = []
    state = latest_checkpoint(tmp_path, "key", lines.append)
    assert state["step"] == 1 and torch.equal(state["model"]["w"], torch.arange(4096.0))
    assert lines[0].startswith(f"checkpoint {newest} is damaged (re-hashes to xxh3-128 ")
    assert lines[0].endswith("); ignoring it")
    # The newest two are kept, each with its checksum.
    save_checkpoint(tmp_path, 3, model, optimizer, "key")
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "step-00000002.pt",
        "step-00000002.pt.xxh3",
        "step-00000003.pt",
        "step-00000003.pt.xxh3",
    ]
