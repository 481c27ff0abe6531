"""Snakemake profiles and conda environment files: they parse, name real options and rules,
agree with pyproject.toml's pins, and a dry run with each profile builds the DAG."""

from __future__ import annotations

import functools
import importlib.util
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT
from packaging.requirements import Requirement
from packaging.version import Version
from pipeline_run import copy_workflow

from eaglepipe.plan.shard_plan import plan_for_source

SNAKEMAKE = str(Path(sys.executable).parent / "snakemake")
PROFILES = {name: REPO_ROOT / "profiles" / name / "config.yaml" for name in ("default", "slurm")}
ENVS = {name: REPO_ROOT / "envs" / f"{name}.yaml" for name in ("pipeline", "sglang")}
HAS_SLURM_PLUGIN = importlib.util.find_spec("snakemake_executor_plugin_slurm") is not None


@functools.cache
def snakemake_help() -> str:
    done = subprocess.run([SNAKEMAKE, "--help"], capture_output=True, text=True, check=True)
    return done.stdout


def long_options() -> set[str]:
    return set(re.findall(r"(?<![\w-])--([a-z][a-z0-9-]*)", snakemake_help()))


def option_choices(option: str) -> set[str]:
    match = re.search(rf"--{option} \{{([a-z,-]+)\}}", snakemake_help())
    assert match, f"--{option} lists no choices in snakemake --help"
    return set(match.group(1).split(","))


def load_profile(name: str) -> dict:
    profile = yaml.safe_load(PROFILES[name].read_text())
    assert isinstance(profile, dict) and profile, f"{PROFILES[name]} is not a YAML mapping"
    return profile


def workflow_rules() -> set[str]:
    sources = [REPO_ROOT / "Snakefile", *sorted((REPO_ROOT / "rules").glob("*.smk"))]
    return {
        name
        for source in sources
        if source.exists()
        for name in re.findall(r"^rule (\w+):", source.read_text(), re.MULTILINE)
    }


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_keys_are_snakemake_options(name):
    profile = load_profile(name)
    unknown = sorted(set(profile) - long_options())
    assert not unknown, f"profiles/{name}: not snakemake options: {unknown}"
    triggers = set(profile["rerun-triggers"])
    assert triggers <= option_choices("rerun-triggers")
    # Reformatting a rule must not re-extract terabytes.
    assert "code" not in triggers
    assert profile["rerun-incomplete"] is True
    assert profile["keep-going"] is True
    assert profile["show-failed-logs"] is True


def test_default_profile_uses_every_core():
    assert load_profile("default")["cores"] == "all"


@pytest.mark.parametrize("name", sorted(PROFILES))
def test_profile_names_only_real_rules(name):
    profile = load_profile(name)
    rules = workflow_rules()
    if not rules:
        pytest.skip("the workflow defines no rules yet")
    named = set(profile.get("set-resources", {})) | set(profile.get("set-threads", {}))
    named |= set(profile.get("groups", {}))
    assert named <= rules, f"profiles/{name} names unknown rules: {sorted(named - rules)}"


def test_slurm_groups_share_one_server_per_node():
    profile = load_profile("slurm")
    assert profile["executor"] == "slurm"
    groups = profile["groups"]
    assert groups["extract"] == groups["validate"]
    assert profile["group-components"][groups["extract"]] > 1
    resources = profile["set-resources"]
    grouped = [rule for rule in groups if groups[rule] == groups["extract"]]
    for rule in grouped:
        # Numeric resources are summed over a group: a `gpu` count would multiply the GPUs.
        assert "gpu" not in resources[rule]
        assert resources[rule]["gres"].startswith("gpu:")
    # Snakemake refuses a group whose jobs ask for different values of a string resource.
    for key in ("gres", "slurm_partition", "slurm_extra"):
        assert len({resources[rule].get(key) for rule in grouped}) == 1, key
    for rule, values in resources.items():
        for key in ("mem_mb", "runtime", "cpus_per_task"):
            if key in values:
                assert isinstance(values[key], int) and values[key] > 0, (rule, key)


def dry_run(workdir: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [SNAKEMAKE, "--dry-run", *args], cwd=workdir, capture_output=True, text=True, timeout=300
    )


needs_workflow = pytest.mark.skipif(
    not (REPO_ROOT / "Snakefile").exists(), reason="the Snakefile does not exist yet"
)


@needs_workflow
def test_dry_run_loads_the_default_profile(tmp_path):
    workdir = copy_workflow(tmp_path)
    done = dry_run(workdir)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    output = done.stdout + done.stderr
    assert "Using workflow specific profile profiles/default" in output
    assert re.search(r"^extract\s+\d+$", output, re.MULTILINE)


@needs_workflow
@pytest.mark.skipif(not HAS_SLURM_PLUGIN, reason="snakemake-executor-plugin-slurm not installed")
def test_dry_run_with_the_slurm_profile_groups_shards(tmp_path):
    workdir = copy_workflow(tmp_path)
    done = dry_run(workdir, "--workflow-profile", "profiles/slurm")
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-6000:]
    assert "Using workflow specific profile profiles/slurm" in output
    group = load_profile("slurm")["groups"]["extract"]
    assert f"Group job {group}" in output
    assert "gres=gpu:8" in output and "slurm_extra=--exclusive" in output
    # Every default resource is a number: Snakemake's own disk default, an expression over the
    # job's input sizes, would be evaluated for every job (and is <TBD> before the inputs exist).
    assert all(
        isinstance(value, int) for value in load_profile("slurm")["default-resources"].values()
    )
    assert "disk_mb=1000" in output and "<TBD>" not in output


@needs_workflow
def test_every_rule_quotes_its_script_path_for_a_checkout_with_a_space(tmp_path):
    """A checkout under `My Projects/` runs: each job's command names its script as one word."""
    workdir = copy_workflow(tmp_path / "my checkout")
    done = dry_run(workdir, "--forceall", "--printshellcmds")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    prefix = "Shell command: "
    commands = [
        line.strip().removeprefix(prefix)
        for line in done.stdout.splitlines()
        if line.strip().startswith(prefix + "python -u ")
    ]
    assert len({shlex.split(command)[2] for command in commands}) >= 8, done.stdout[-3000:]
    for command in commands:
        script = Path(shlex.split(command)[2])
        assert script.is_file() and " " in str(script), command


FAKE_SLURM_COMMAND = """#!/bin/sh
echo "$(basename "$0") $*" >> "{log}"
if [ "$(basename "$0")" = sbatch ]; then echo "$((1000 + $(grep -c '^sbatch' "{log}")))"; fi
"""


def fake_slurm(bindir: Path, log: Path) -> dict:
    """Stand-ins for SLURM's commands that record their arguments; sbatch answers a job id."""
    bindir.mkdir()
    for command in ("sbatch", "sacct", "squeue", "sinfo", "scontrol", "sacctmgr", "scancel"):
        path = bindir / command
        path.write_text(FAKE_SLURM_COMMAND.format(log=log))
        path.chmod(0o755)
    return {**os.environ, "PATH": f"{bindir}{os.pathsep}{os.environ['PATH']}"}


def write_prepared_outputs(workdir: Path) -> None:
    """What extraction needs in place, so the first jobs submitted are the extract groups."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    model = workdir / "models" / "toy-target" / "config.json"
    model.parent.mkdir(parents=True)
    model.write_text(json.dumps({"hidden_size": 64, "num_hidden_layers": 8}))
    prepared = workdir / "prepared"
    prepared.mkdir()
    table = {"row_id": pa.array(range(300), pa.int64()), "num_tokens": pa.array([50] * 300)}
    pq.write_table(pa.table(table), prepared / "tokenized.parquet")
    for name in ("summary.json", "skipped.json"):
        (prepared / name).write_text("{}")


@needs_workflow
@pytest.mark.skipif(not HAS_SLURM_PLUGIN, reason="snakemake-executor-plugin-slurm not installed")
def test_slurm_profile_submits_several_shards_as_one_gpu_node_job(tmp_path):
    """The real plugin submits through a fake sbatch: four shards (extract + validate each)
    in one job asking once for the node's GPUs, with memory and CPUs summed."""
    workdir = copy_workflow(tmp_path / "run")
    write_prepared_outputs(workdir)
    calls = tmp_path / "slurm_calls.log"
    calls.touch()
    env = fake_slurm(tmp_path / "bin", calls)
    profile = load_profile("slurm")
    extract = profile["set-resources"]["extract"]
    per_group = profile["group-components"][profile["groups"]["extract"]]
    config = yaml.safe_load((workdir / "config.yaml").read_text())
    shards = plan_for_source(
        workdir / config["dataset"]["path"],
        config["shards"]["rows_per_shard"],
        cache_dir=tmp_path / "cache",
    )
    assert len(shards) > per_group, "the sample dataset must fill more than one group"
    targets = [f"validated/{shard.name}.json" for shard in shards]
    with open(tmp_path / "snakemake.log", "w") as out:
        proc = subprocess.Popen(
            [SNAKEMAKE, "--workflow-profile", "profiles/slurm", *targets]
            + ["--allowed-rules", "extract", "validate"],
            cwd=workdir,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        try:
            for _ in range(600):
                submitted = [c for c in calls.read_text().splitlines() if c.startswith("sbatch")]
                if len(submitted) >= 2 or proc.poll() is not None:
                    break
                time.sleep(0.5)
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    full = [c for c in submitted if c.count("'extract:") == per_group]
    log = (tmp_path / "snakemake.log").read_text()[-3000:]
    assert full, f"no sbatch call with {per_group} extract jobs among {submitted}; log:\n{log}"
    call = full[0]
    assert call.count("'validate:") == per_group
    assert f"--gres={extract['gres']}" in call
    assert f"--mem {extract['mem_mb'] * per_group}" in call
    assert f"--cpus-per-task={extract['cpus_per_task'] * per_group}" in call
    assert "--exclusive" in call and f"-p {extract['slurm_partition']}" in call


# --- conda environments ----------------------------------------------------------------------


def pyproject() -> dict:
    return tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())


def env_requirements(name: str) -> dict[str, Requirement]:
    env = yaml.safe_load(ENVS[name].read_text())
    assert isinstance(env, dict) and env.get("dependencies"), f"{ENVS[name]} lists nothing"
    conda = [d for d in env["dependencies"] if isinstance(d, str)]
    assert "python=3.11" in conda and "pip" in conda, f"{ENVS[name]}: conda part {conda}"
    pip_lists = [d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d]
    assert len(pip_lists) == 1, f"{ENVS[name]}: expected one pip list"
    # The project itself is installed from the checkout, so rules can import eaglepipe.
    assert "--editable .." in pip_lists[0], f"{ENVS[name]}: the project is not installed"
    requirements = [Requirement(line) for line in pip_lists[0] if not line.startswith("-")]
    by_name = {r.name.lower(): r for r in requirements}
    assert len(by_name) == len(requirements), f"{ENVS[name]} lists a package twice"
    return by_name


def project_requirements(extra: str | None = None) -> dict[str, Requirement]:
    project = pyproject()["project"]
    lines = project["optional-dependencies"][extra] if extra else project["dependencies"]
    return {r.name.lower(): r for r in map(Requirement, lines)}


@pytest.mark.parametrize("env", sorted(ENVS))
def test_env_pins_equal_pyproject(env):
    expected = project_requirements()
    if env == "sglang":
        expected |= project_requirements("sglang")
    listed = env_requirements(env)
    assert sorted(listed) == sorted(expected), f"{ENVS[env]} lists other packages than pyproject"
    for name, requirement in expected.items():
        assert listed[name].specifier == requirement.specifier, (
            f"{ENVS[env]}: {listed[name]} but pyproject.toml says {requirement}"
        )


def test_sglang_pin_agrees_everywhere():
    """The extra and the SGLang environment pin the range's recommended release."""
    (pin,) = project_requirements("sglang")["sglang"].specifier
    assert pin.operator == "=="
    assert (
        env_requirements("sglang")["sglang"].specifier
        == project_requirements("sglang")["sglang"].specifier
    )
    supported = tomllib.loads((REPO_ROOT / "patch" / "sglang.toml").read_text())
    assert supported["recommended"] == pin.version
    assert Version(supported["oldest"]) <= Version(pin.version) <= Version(supported["newest"])


@pytest.mark.network
@pytest.mark.parametrize("end", ["oldest", "newest"])
def test_sglang_exact_pins_fit_the_pipeline_ranges(end):
    """The SGLang environment resolves at both ends of the supported range: every package
    SGLang pins exactly that the pipeline also lists must fall inside the pipeline's range."""
    from sglang_source import sglang_source_root, supported

    root = sglang_source_root(supported()[end]).parent
    (metadata,) = root.glob("sglang-*.dist-info/METADATA")
    ours = project_requirements()
    checked = []
    for line in metadata.read_text().splitlines():
        if not line.startswith("Requires-Dist:"):
            continue
        theirs = Requirement(line.split(":", 1)[1].strip())
        if theirs.marker is not None or theirs.name.lower() not in ours:
            continue
        for spec in theirs.specifier:
            if spec.operator == "==":
                assert ours[theirs.name.lower()].specifier.contains(Version(spec.version)), (
                    f"sglang pins {theirs}, outside pyproject's {ours[theirs.name.lower()]}"
                )
                checked.append(theirs.name)
    assert "torch" in checked
