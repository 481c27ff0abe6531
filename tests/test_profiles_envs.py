"""Snakemake profiles and conda environment files: they parse, name real options and rules,
agree with pyproject.toml's pins, and a dry run with each profile builds the DAG."""

from __future__ import annotations

import functools
import importlib.util
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
import yaml
from conftest import REPO_ROOT
from packaging.requirements import Requirement
from packaging.version import Version

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


def copy_workflow(dest: Path) -> Path:
    """The repository's tracked and new files (what a user checks out), without outputs."""
    listed = subprocess.run(
        ["git", "ls-files", "-co", "--exclude-standard", "-z"],
        cwd=REPO_ROOT,
        capture_output=True,
        check=True,
    ).stdout.decode()
    for rel in filter(None, listed.split("\0")):
        source = REPO_ROOT / rel
        if source.is_file():
            (dest / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / rel)
    return dest


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
    requirements = [Requirement(line) for line in pip_lists[0]]
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
    (pin,) = project_requirements("sglang")["sglang"].specifier
    assert pin.operator == "=="
    assert (
        env_requirements("sglang")["sglang"].specifier
        == project_requirements("sglang")["sglang"].specifier
    )
    version_file = REPO_ROOT / "patch" / "SGLANG_VERSION"
    if version_file.exists():
        assert version_file.read_text().strip() == pin.version


@pytest.mark.network
def test_sglang_exact_pins_fit_the_pipeline_ranges():
    """The SGLang environment resolves: every package SGLang pins exactly that the pipeline
    also lists must fall inside the pipeline's range."""
    from sglang_source import sglang_source_root

    (metadata,) = sglang_source_root().parent.glob("sglang-*.dist-info/METADATA")
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
