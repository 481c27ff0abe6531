"""The H200 tooling on CPU: the staged wheel list, the repacking of a wheel (installed with pip
afterwards), the device runner's argument and precondition errors, and the GPU drivers' dry
runs (commands built for each end of the SGLang range, no server)."""

from __future__ import annotations

import base64
import csv
import hashlib
import importlib.util
import io
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.version import Version

from eaglepipe.drafter.variants import triton_mla_decode_fits

REPO_ROOT = Path(__file__).resolve().parent.parent
VENV_BIN = str(Path(sys.executable).parent)


def load_stage_tool():
    spec = importlib.util.spec_from_file_location(
        "stage_sglang", REPO_ROOT / "tools" / "stage_sglang.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["stage_sglang"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


stage = load_stage_tool()


def load_specforge_stage_tool():
    sys.path.insert(0, str(REPO_ROOT / "tools"))
    try:
        spec = importlib.util.spec_from_file_location(
            "stage_specforge", REPO_ROOT / "tools" / "stage_specforge.py"
        )
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(REPO_ROOT / "tools"))
    return module


stage_specforge = load_specforge_stage_tool()


def load_device_parts():
    spec = importlib.util.spec_from_file_location(
        "device_parts", REPO_ROOT / "tools" / "device_parts.py"
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_parts"] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


device_parts = load_device_parts()


# ------------------------------------------------------------------------------ the wheel list


def test_the_wheel_list_parses_and_pins_the_recommended_sglang():
    listed = stage.read_wheel_list()
    specs = {s.name: s for s in listed if s.site != "pipeline"}
    recommended = tomllib.loads((REPO_ROOT / "patch" / "sglang.toml").read_text())["recommended"]
    assert specs["sglang"].version == recommended
    # SGLang 0.5.14 does not import with the machine's transformers 5.17: its server alone
    # sees these.
    assert {n for n, s in specs.items() if s.site == "server"} == {"transformers", "tokenizers"}
    assert specs["transformers"].version == "5.8.1" and specs["tokenizers"].version == "0.22.2"
    assert specs["fastapi"].version == "0.140.0"
    # The pipeline's own transformers there: one that loads a tokenizer without torch (>= 5.18).
    pipeline = {s.name: s for s in listed if s.site == "pipeline"}
    assert set(pipeline) == {"transformers"}
    assert Version(pipeline["transformers"].version) >= Version("5.18")
    assert {s.name for s in listed if s.repack} == set(stage.REPACK_DROP)
    # The pipeline's own needs on the machine: snakemake and jsonschema (not in the image).
    assert "snakemake" in specs and "jsonschema" in specs
    assert "pulp" not in specs  # the runs use --scheduler greedy


def test_every_project_dependency_is_in_the_image_or_staged():
    """What eaglepipe imports on the H200: the machine's packages (KINDS.md) or a staged wheel."""
    from packaging.requirements import Requirement

    image = {
        "torch", "transformers", "tokenizers", "safetensors", "pandas", "pyarrow", "pyyaml",
        "aiohttp", "xxhash", "psutil", "filelock", "tqdm", "matplotlib", "jinja2", "packaging",
    }  # fmt: skip
    kinds = Path("/work/.library/device/KINDS.md")
    if kinds.exists():  # the list as last read on the machine, where this checkout has it
        listed = kinds.read_text().split("## Python packages already there", 1)[1]
        for name in image:
            assert f" {name}," in listed or f" {name}." in listed, name
    staged = {s.name for s in stage.read_wheel_list()}
    project = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())["project"]
    for line in project["dependencies"]:
        name = stage.canonical(Requirement(line).name)
        assert name in image or name in staged, f"{name}: neither on the machine nor staged"


@pytest.mark.parametrize(
    "line,match",
    [
        ("sglang 0.5.14 common", "expected 'NAME==VERSION SITE"),
        ("sglang==0.5.14 elsewhere", "expected 'NAME==VERSION SITE"),
        ("sglang==0.5.14 common slim", "unknown flag 'slim'"),
        ("numpy==2.0 common repack", "no repack rule for numpy"),
        ("dill==0.4.1 common\nDill==0.4.0 common", "dill is listed twice for site common"),
    ],
)
def test_a_malformed_wheel_list_names_the_line(tmp_path, line, match):
    path = tmp_path / "wheels.txt"
    path.write_text(f"# header\n\n{line}\n")
    with pytest.raises(ValueError, match=match) as error:
        stage.read_wheel_list(path)
    assert f"{path}:3:" in str(error.value) or f"{path}:4:" in str(error.value)


def make_wheel(path: Path, files: dict[str, bytes]) -> Path:
    """A minimal valid wheel with a RECORD over `files`."""
    dist = "demo_pkg-1.0.dist-info"
    files = {
        **files,
        f"{dist}/METADATA": b"Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.0\n",
        f"{dist}/WHEEL": (
            b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    buffer = io.StringIO()
    writer = csv.writer(buffer, lineterminator="\n")
    for name, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        writer.writerow((name, f"sha256={digest}", len(data)))
    writer.writerow((f"{dist}/RECORD", "", ""))
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr(f"{dist}/RECORD", buffer.getvalue())
    return path


def test_repacking_drops_the_matched_members_and_stays_installable(tmp_path):
    source = make_wheel(
        tmp_path / "demo_pkg-1.0-py3-none-any.whl",
        {
            "demo_pkg/__init__.py": b"VALUE = 1\n",
            "demo_pkg/data/huge.bin": b"x" * 4096,
            "demo_pkg/data/more/huge2.bin": b"y" * 4096,
        },
    )
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    target = out_dir / source.name
    dropped = stage.repack(source, target, [r"^demo_pkg/data/"])
    assert dropped == 2
    names = zipfile.ZipFile(target).namelist()
    assert "demo_pkg/__init__.py" in names and not any("/data/" in n for n in names)
    record = zipfile.ZipFile(target).read("demo_pkg-1.0.dist-info/RECORD").decode()
    assert "huge" not in record and "demo_pkg/__init__.py,sha256=" in record
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps",
         "--disable-pip-version-check", "--target", str(site), str(target)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (site / "demo_pkg" / "__init__.py").read_text() == "VALUE = 1\n"
    assert not (site / "demo_pkg" / "data").exists()


def test_the_pipelines_transformers_keeps_what_the_runs_load():
    """The pipeline's transformers on the machine is repacked (12 -> 3 MiB): the models the
    pipeline, the benchmarks and the fidelity references load stay whole, every other model
    keeps its package and tokenizer (transformers imports them while loading any tokenizer),
    and a name that only starts like a kept one (llama4) loses its modeling code."""
    rule = [re.compile(p) for p in stage.REPACK_DROP["transformers"]]

    def dropped(name: str) -> bool:
        return any(p.search(name) for p in rule)

    for kept in (
        "transformers/__init__.py",
        "transformers/tokenization_utils_tokenizers.py",
        "transformers/models/__init__.py",
        "transformers/models/auto/tokenization_auto.py",
        "transformers/models/llama/modeling_llama.py",
        "transformers/models/deepseek_v3/configuration_deepseek_v3.py",
        "transformers/models/kimi_k25/modeling_kimi_k25.py",
        "transformers/models/encoder_decoder/configuration_encoder_decoder.py",
        "transformers/models/gemma/tokenization_gemma.py",
        "transformers/models/llama4/__init__.py",
    ):
        assert not dropped(kept), kept
    for gone in (
        "transformers/models/llama4/modeling_llama4.py",
        "transformers/models/qwen2/modeling_qwen2.py",
        "transformers/models/qwen2/configuration_qwen2.py",
        "transformers/models/gemma/modular_gemma.py",
    ):
        assert dropped(gone), gone


@pytest.mark.network
def test_the_project_wheel_builds_with_a_fresh_machines_python(tmp_path):
    """Regression (issue 25): the staging built its own wheel without build isolation, and a
    fresh Python 3.11 (setuptools 65, no `wheel` package) has no `bdist_wheel`. A new virtual
    environment has that Python's bundled setuptools; the staging's build function, run by it,
    must still give a wheel that registers the SGLang plugin and holds every module."""
    before = build_outputs_in_checkout()
    fresh = tmp_path / "fresh"
    subprocess.run([sys.executable, "-m", "venv", str(fresh)], check=True, timeout=300)
    python = fresh / "bin" / "python"
    out = tmp_path / "out"
    out.mkdir()
    build = (
        "import importlib.util, sys; from pathlib import Path\n"
        "spec = importlib.util.spec_from_file_location('stage_sglang', sys.argv[1])\n"
        "module = importlib.util.module_from_spec(spec); sys.modules['stage_sglang'] = module\n"
        "spec.loader.exec_module(module)\n"
        "print(module.build_project_wheel(Path(sys.argv[2])))\n"
    )
    done = subprocess.run(
        [str(python), "-c", build, str(REPO_ROOT / "tools" / "stage_sglang.py"), str(out)],
        capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONPATH": ""},
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    wheel = Path(done.stdout.strip().splitlines()[-1])
    assert wheel.parent == out and wheel.name.startswith("eaglepipe-")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
        entry_points = next(n for n in names if n.endswith(".dist-info/entry_points.txt"))
        assert "eaglepipe = eaglepipe.server.sglang.plugin:register" in (
            archive.read(entry_points).decode()
        )
    modules = {p.relative_to(REPO_ROOT).as_posix() for p in (REPO_ROOT / "eaglepipe").rglob("*.py")}
    assert modules and modules <= names
    # Built from a copy: nothing made or changed in the checkout (which may hold a build/ of
    # its own, from a `pip install .`).
    assert build_outputs_in_checkout() == before


def build_outputs_in_checkout() -> dict:
    """The checkout's top-level names, and every file (size, mtime) where a setuptools build
    writes into its source tree: build/, dist/, *.egg-info/."""
    state: dict = {"top": sorted(p.name for p in REPO_ROOT.iterdir())}
    for folder in [REPO_ROOT / "build", REPO_ROOT / "dist", *REPO_ROOT.glob("*.egg-info")]:
        for path in sorted(folder.rglob("*")) if folder.is_dir() else []:
            stat = path.lstat()
            state[str(path.relative_to(REPO_ROOT))] = (stat.st_size, stat.st_mtime_ns)
    return state


# ------------------------------------------------------------------------------ SpecForge's staging


def test_specforge_runs_on_wheels_the_sglang_staging_holds_at_the_same_versions():
    """SpecForge's set (the one that ran on the H200) beside the SGLang list: the seven wheels
    it shares are staged for SGLang with the same pins, on every process's path (common)."""
    specs = {s.name: s for s in stage.read_wheel_list()}
    assert stage_specforge.SPECFORGE.requirement == "specforge==0.2.0"
    assert len(stage_specforge.SHARED_WITH_SGLANG) == 7
    for name, version in stage_specforge.SHARED_WITH_SGLANG.items():
        assert name in specs, f"{name} is not in tools/h200_wheels.txt"
        assert (specs[name].version, specs[name].site) == (version, "common"), name
    assert "specforge" not in specs  # the pipeline's calls never carry it


def write_sglang_manifest(dest: Path, **versions: str) -> Path:
    """A staged .whl-sglang stand-in: a manifest and a wheel file for each shared name."""
    (dest / "common").mkdir(parents=True)
    entries = []
    for name, version in {**stage_specforge.SHARED_WITH_SGLANG, **versions}.items():
        file = f"common/{name.replace('-', '_')}-{version}-py3-none-any.whl"
        (dest / file).write_bytes(name.encode())
        entries.append({"name": name, "version": version, "site": "common", "file": file})
    (dest / "manifest.json").write_text(json.dumps(entries))
    return dest


def test_specforge_staging_takes_the_shared_wheels_from_the_sglang_staging(tmp_path, monkeypatch):
    monkeypatch.setattr(stage_specforge, "REPO_ROOT", tmp_path)
    dest = write_sglang_manifest(tmp_path / ".whl-sglang")
    entries = stage_specforge.shared_wheels(dest)
    assert [e["name"] for e in entries] == list(stage_specforge.SHARED_WITH_SGLANG)
    datasets = entries[0]
    assert datasets["file"] == ".whl-sglang/common/datasets-5.2.0-py3-none-any.whl"
    assert datasets["sha256"] == hashlib.sha256(b"datasets").hexdigest()


@pytest.mark.parametrize(
    "change,match",
    [
        ({"datasets": "5.1.0"}, r"SpecForge needs datasets==5.2.0 from .whl-sglang/common: 5.1.0"),
        ("no manifest", r"manifest.json does not exist: stage SGLang first"),
        ("file gone", r"dill-0.4.1-py3-none-any.whl is listed in .* but missing"),
    ],
)
def test_specforge_staging_names_what_the_sglang_staging_lacks(
    tmp_path, monkeypatch, change, match
):
    monkeypatch.setattr(stage_specforge, "REPO_ROOT", tmp_path)
    dest = tmp_path / ".whl-sglang"
    if change == "no manifest":
        dest.mkdir()
    else:
        write_sglang_manifest(dest, **(change if isinstance(change, dict) else {}))
        if change == "file gone":
            (dest / "common" / "dill-0.4.1-py3-none-any.whl").unlink()
    with pytest.raises(SystemExit, match=match):
        stage_specforge.shared_wheels(dest)


def test_specforge_must_pin_the_staged_sglang(tmp_path):
    def specforge_wheel(pin: str) -> Path:
        path = tmp_path / pin / "specforge-0.2.0-py3-none-any.whl"
        path.parent.mkdir()
        metadata = "Metadata-Version: 2.1\nName: specforge\nVersion: 0.2.0\n"
        metadata += f"Requires-Dist: torch==2.11.0\nRequires-Dist: {pin}\n"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr("specforge-0.2.0.dist-info/METADATA", metadata)
        return path

    wheel_list = REPO_ROOT / "tools" / "h200_wheels.txt"
    assert stage_specforge.check_sglang_pin(specforge_wheel("sglang==0.5.14"), wheel_list) == (
        "0.5.14"
    )
    with pytest.raises(SystemExit, match=r"requires \['sglang==0.5.13'\].*stages sglang==0.5.14"):
        stage_specforge.check_sglang_pin(specforge_wheel("sglang==0.5.13"), wheel_list)


def test_specforge_staging_copies_its_own_wheels_and_lists_every_one(tmp_path, monkeypatch):
    """SpecForge's wheel and cuda-tile (what its in-process capture imports beyond the server)
    land in DEST with their checksums; the shared ones are named in the SGLang staging."""
    monkeypatch.setattr(stage_specforge, "REPO_ROOT", tmp_path)
    sglang_dest = write_sglang_manifest(tmp_path / ".whl-sglang")
    cache = tmp_path / "cache"
    cache.mkdir()

    def fake_download(spec, into):
        path = into / f"{spec.name.replace('-', '_')}-{spec.version}-py3-none-any.whl"
        metadata = f"Metadata-Version: 2.1\nName: {spec.name}\nVersion: {spec.version}\n"
        if spec.name == "specforge":
            metadata += "Requires-Dist: sglang==0.5.14\n"
        with zipfile.ZipFile(path, "w") as archive:
            archive.writestr(f"{spec.name}-{spec.version}.dist-info/METADATA", metadata)
            archive.writestr(f"{spec.name}-{spec.version}.dist-info/licenses/LICENSE", "MIT")
        return path

    monkeypatch.setattr(stage_specforge, "download", fake_download)
    script = tmp_path / "prepare_hidden_states.py"
    script.write_text("print('stand-in')\n")
    monkeypatch.setattr(stage_specforge, "SCRIPT_SHA256", stage_specforge.sha256(script))
    dest = tmp_path / ".whl-specforge"
    wheel_list = REPO_ROOT / "tools" / "h200_wheels.txt"
    manifest = stage_specforge.stage(dest, cache, sglang_dest, wheel_list, script)
    names = [w["name"] for w in manifest["wheels"]]
    assert names == ["specforge", "cuda-tile", *stage_specforge.SHARED_WITH_SGLANG]
    for entry in manifest["wheels"][:2]:
        staged = tmp_path / entry["file"]
        assert staged.parent == dest and stage_specforge.sha256(staged) == entry["sha256"]
    assert json.loads((dest / "manifest.json").read_text()) == manifest
    # One version of each package per install: the extras are not staged for SGLang as well.
    sglang_names = {s.name for s in stage.read_wheel_list()}
    assert not {s.name for s in stage_specforge.OWN_EXTRAS} & sglang_names


def test_a_prepare_hidden_states_copy_of_another_commit_is_refused(tmp_path):
    copy = tmp_path / "prepare_hidden_states.py"
    copy.write_text("# not SpecForge's script at a6b6b023\n")
    with pytest.raises(SystemExit, match=r"sha256 [0-9a-f]{64}, not that of SpecForge's scripts"):
        stage_specforge.fetch_script(tmp_path / "staged.py", copy)
    with pytest.raises(SystemExit, match="--script-from .*: no prepare_hidden_states.py there"):
        stage_specforge.fetch_script(tmp_path / "staged.py", tmp_path / "elsewhere")


# ------------------------------------------------------------------------------ the device runner


def run_h200(
    args: list[str], repo: Path, root: Path, env: dict | None = None
) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "EAGLEPIPE_H200_ROOT": str(root),
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
        **(env or {}),
    }
    return subprocess.run(
        ["bash", str(repo / "tools" / "h200.sh"), *args],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip


@pytest.mark.parametrize("limit_from", ["setting", "room left by the carry"])
def test_the_jit_cache_returned_fits_what_the_next_call_can_carry(tmp_path, limit_from):
    """Over the limit, the JIT cache keeps only tvm-ffi's kernels, the most recently built ones
    that fit, so `.whl-sglang` and `.jit-sglang` together stay within a call's carry. Without
    a setting, the limit is what the wheels and the repository leave of the 64 MiB a call
    carries (less 512 KiB): here 62.5 MiB of wheels leave 1 MiB."""
    root, out, repo = tmp_path / "root", tmp_path / "out", tmp_path / "repo"
    out.mkdir()
    (repo / ".whl-sglang").mkdir(parents=True)
    with open(repo / ".whl-sglang" / "sglang.whl", "wb") as wheel:
        wheel.truncate(62 * 2**20 + 2**19)
    (repo / ".jit-sglang").mkdir()
    (repo / ".jit-sglang" / "jitcache.tgz").write_bytes(os.urandom(3 * 2**20))  # not counted
    (repo / "eaglepipe" / "__pycache__").mkdir(parents=True)
    (repo / "eaglepipe" / "__pycache__" / "x.pyc").write_bytes(os.urandom(2**20))  # not counted
    limit = {"EAGLEPIPE_JIT_CACHE_MAX_BYTES": "900000"} if limit_from == "setting" else {}
    kernels = root / "jit" / "tvm-ffi"
    for age, name in enumerate(["newest", "middle", "oldest"]):
        (kernels / name).mkdir(parents=True)
        (kernels / name / "kernel.so").write_bytes(os.urandom(400_000))  # incompressible
        os.utime(kernels / name, (1e9 - age * 3600,) * 2)
    (root / "jit" / "triton").mkdir()
    (root / "jit" / "triton" / "cache.bin").write_bytes(os.urandom(400_000))
    script = (REPO_ROOT / "tools" / "h200.sh").read_text()
    function = script[script.index("jit_cache_room() {") : script.index("save_server_logs() {")]
    done = subprocess.run(
        ["bash", "-c", f'say() {{ echo "$*"; }}\n{function}\nsave_jit_cache'],
        env={**os.environ, "ROOT": str(root), "OUT": str(out), "REPO": str(repo), **limit},
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "1 least recently built" in done.stdout
    archive = out / "jitcache.tgz"
    assert archive.stat().st_size <= (900_000 if limit else 2**20)
    with tarfile.open(archive) as tar:
        kept = {Path(n).parts[2] for n in tar.getnames() if n.endswith(".so")}
        assert not [n for n in tar.getnames() if "triton" in n]
    assert kept == {"newest", "middle"}


@pytest.mark.parametrize("args", [[], ["perf"], ["burn", "/tmp/x"]])
def test_the_runner_refuses_bad_arguments(tmp_path, args):
    done = run_h200(args, REPO_ROOT, tmp_path / "root")
    assert done.returncode == 2
    if args[:1] == ["burn"]:
        assert f"unknown part 'burn' ({', '.join(device_parts.BY_NAME)})" in done.stderr
    else:  # the usage, with every part of the table
        assert "usage" in done.stderr
        assert all(f"  {name}: " in done.stderr for name in device_parts.BY_NAME)
    assert not (tmp_path / "root").exists()


def test_the_runner_stops_without_staged_wheels(tmp_path):
    repo = tmp_path / "repo"
    (repo / "tools").mkdir(parents=True)
    for name in ("h200.sh", "device_parts.py"):
        shutil.copy(REPO_ROOT / "tools" / name, repo / "tools" / name)
    out = tmp_path / "out"
    done = run_h200(["check", str(out)], repo, tmp_path / "root")
    assert done.returncode == 1
    assert "no staged wheels in" in done.stdout and "tools/stage_sglang.py" in done.stdout
    assert "no staged wheels" in (out / "h200_check.log").read_text()


# ------------------------------------------------------------------------------ the parts' table

GOLDEN_PLANS = Path(__file__).parent / "device_parts"


def planned_lines(part, tmp_path: Path) -> str:
    """The part's commands for a call with its whole limit and `--dry-run`, paths under
    tmp_path written as <TMP> (the golden files' form)."""
    call = device_parts.Call(
        part.name, tmp_path / "out", ["--dry-run"], root=tmp_path / "root", repo=tmp_path / "repo",
        environ={"EAGLEPIPE_SCALE_ROOT": str(tmp_path / "scale")}, cores=2,
    )  # fmt: skip
    return "".join(f"{line}\n" for line in device_parts.plan_lines(part, call)).replace(
        str(tmp_path), "<TMP>"
    )


@pytest.mark.parametrize("part", device_parts.PARTS, ids=lambda part: part.name)
def test_each_part_plans_the_commands_its_golden_file_pins(tmp_path, part):
    """What each part of `bash tools/h200.sh PART OUT` runs, its arguments and deadline
    included: a change to the table shows here, one golden file per part."""
    golden = GOLDEN_PLANS / f"{part.name}.txt"
    assert planned_lines(part, tmp_path) == golden.read_text(), golden


def test_every_golden_plan_is_a_part_of_the_table():
    assert sorted(p.stem for p in GOLDEN_PLANS.glob("*.txt")) == sorted(device_parts.BY_NAME)


@pytest.mark.parametrize("part", device_parts.PARTS, ids=lambda part: part.name)
def test_each_part_runs_a_module_or_script_of_the_repository(part):
    if not part.command:
        return
    argv = shlex.split(part.command)
    if "-m" in argv:
        target = argv[argv.index("-m") + 1]
        path = Path(*target.split(".")).with_suffix(".py")
    else:
        target = path = next(w for w in argv if w.endswith((".py", ".sh")))
    assert (REPO_ROOT / path).is_file(), f"{part.name}: {target}"
    assert part.needs[0] == ".whl-sglang"  # what tools/h200.sh installs for every part


def test_a_part_given_too_little_time_is_not_started(tmp_path, capsys):
    call = device_parts.Call("perf", tmp_path / "out", [], root=tmp_path, budget_s=80)
    assert device_parts.run_part(device_parts.BY_NAME["perf"], call) == 1
    assert "only 50s left for perf: not started" in capsys.readouterr().out


def test_a_specforge_part_without_its_staged_wheels_names_them(tmp_path, capsys):
    (tmp_path / ".whl-sglang").mkdir()
    call = device_parts.Call("specforge", tmp_path / "out", [], root=tmp_path, repo=tmp_path)
    assert device_parts.run_part(device_parts.BY_NAME["specforge"], call) == 1
    assert "specforge needs .whl-specforge staged and carried: not started" in (
        capsys.readouterr().out
    )
    assert not (tmp_path / "out").exists() and not (tmp_path / "specforge").exists()


def test_a_part_keeps_the_tails_of_the_logs_its_run_left(tmp_path):
    root = tmp_path / "root"
    (root / "logs" / "server").mkdir(parents=True)
    (root / "logs" / "server" / "capture.log").write_text("".join(f"{i}\n" for i in range(500)))
    (root / "snakemake.log").write_text("one line\n")
    (root / "model.bin").write_bytes(b"not a log")
    archive = tmp_path / "tails.tgz"
    device_parts.keep_log_tails(root, archive)
    with tarfile.open(archive) as tar:
        names = sorted(n for n in tar.getnames() if n.endswith(".log"))
        server = tar.extractfile("./logs/server/capture.log").read().decode().splitlines()
    assert names == ["./logs/server/capture.log", "./snakemake.log"]
    assert server == [str(i) for i in range(300, 500)]


def test_the_variants_part_keeps_its_results_without_the_weights(tmp_path):
    variants = tmp_path / "root" / "variants"
    (variants / "fc_norm" / "checkpoints").mkdir(parents=True)
    (variants / "fc_norm" / "checkpoints" / "step.pt").write_bytes(b"x")
    (variants / "fc_norm" / "model.safetensors").write_bytes(b"x")
    (variants / "fc_norm" / "eval.json").write_text("{}")
    (variants / "summary.json").write_text('{"results": []}')
    (tmp_path / "out").mkdir()
    call = device_parts.Call("variants", tmp_path / "out", [], root=tmp_path / "root")
    device_parts.keep_variants(call, {})
    assert (tmp_path / "out" / "variants_summary.json").read_text() == '{"results": []}'
    with tarfile.open(tmp_path / "out" / "variants_results.tgz") as tar:
        assert sorted(tar.getnames()) == [
            "variants", "variants/fc_norm", "variants/fc_norm/eval.json", "variants/summary.json"
        ]  # fmt: skip


# ------------------------------------------------------------------------------ the drivers


def test_the_specforge_part_prints_its_commands_in_a_dry_run(tmp_path):
    """`bash tools/h200.sh specforge OUT --dry-run` on CPU: no wheels, no GPU; the driver prints
    (and records in specforge.json) every command the call would run, in order."""
    out = tmp_path / "out"
    done = run_h200(
        ["specforge", str(out), "--dry-run", "--seeds", "0,1", "--epochs", "3",
         "--settings", "3/1/4,7/1/8", "--deterministic-live"],
        REPO_ROOT, tmp_path / "root",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "dry run: no wheels installed" in done.stdout
    results = json.loads((out / "specforge.json").read_text())
    assert results["setup"]["dry_run"] and results["setup"]["seeds"] == [0, 1]
    assert results["setup"]["specforge_recipe"]["num_epochs"] == 3
    commands = results["commands"]
    steps = [c["step"] for c in commands]
    work = tmp_path / "root" / "specforge"
    run = work / "pipeline-run"

    def argv(step: str) -> list[str]:
        return next(c["argv"] for c in commands if c["step"] == step)

    # 1. the pipeline part's run, trained with the seed and epochs, up to its SGLang export
    pipeline = argv("pipeline@seed0-epochs3")
    assert pipeline[1].endswith("benchmarks/checks/sglang_pipeline_h200.sh")
    assert pipeline[pipeline.index("--overrides") + 1] == str(work / "overrides-seed0.yaml")
    assert pipeline[-2:] == ["drafter/eval.json", "drafter/export/sglang/config.json"]
    first = next(c for c in commands if c["step"] == "pipeline@seed0-epochs3")
    assert first["env"]["EAGLEPIPE_H200_ROOT"] == str(work)
    # 3. SpecForge's own generator first, then the transformers route, on the same inputs
    files = work / "specforge-files"
    sglang = argv("specforge-features:sglang")
    assert sglang[1:3] == ["-m", "torch.distributed.run"]
    assert sglang[sglang.index("--script") + 1] == str(
        files / "scripts" / "prepare_hidden_states.py"
    )
    script_args = sglang[sglang.index("--") + 1 :]
    for flag, value in [
        ("--strategy", "eagle3"), ("--chat-template", "eaglepipe-target"),
        ("--data-path", str(files / "train.jsonl")), ("--target-model-path", str(files / "target")),
        ("--draft-model-config", str(files / "draft_config.json")), ("--batch-size", "1"),
        ("--sglang-attention-backend", "triton"), ("--output-path", str(files / "features")),
    ]:  # fmt: skip
        assert script_args[script_args.index(flag) + 1] == value, flag
    hf = argv("specforge-features:hf")
    assert hf[1:3] == ["-m", "benchmarks.studies.specforge.hf_features"]
    assert hf[hf.index("--data") + 1] == str(files / "train.jsonl")
    # 4. specforge train and export, per seed
    for seed in (0, 1):
        train = argv(f"specforge-train@seed{seed}-epochs3:train")
        assert train[1:4] == ["-m", "specforge.cli", "train"]
        export = argv(f"specforge-train@seed{seed}-epochs3:export")
        assert export[3:6] == ["export", "--to", "sglang"]
        assert export[export.index("--output-dir") + 1] == str(
            work / "seeds" / f"seed{seed}-epochs3" / "specforge" / "export"
        )
    assert '"seed": 1' in done.stdout and '"num_epochs": 3' in done.stdout
    # 5. both drafters through the same live harness, same flags, one greedy reference
    lives = [c for c in commands if c["step"].startswith("live@")]
    assert [c["step"] for c in lives[:4]] == [
        "live@seed0-epochs3@eaglepipe@3-1-4", "live@seed0-epochs3@specforge@3-1-4",
        "live@seed1-epochs3@eaglepipe@3-1-4", "live@seed1-epochs3@specforge@3-1-4",
    ]  # fmt: skip
    assert len(lives) == 8 and {c["cwd"] for c in lives} == {str(run)}
    for live in lives:
        args = live["argv"]
        assert args[2].endswith("scripts/live_acceptance.py")
        assert args[args.index("--greedy-reference") + 1] == str(work / "greedy-reference.json")
        assert args[args.index("--config") + 1] == ".eaglepipe/config.json"
        drafter, setting = live["step"].split("@")[2:]
        assert args[args.index("--speculative") + 1] == setting.replace("-", "/")
        assert args[args.index("--export-dir") + 1].endswith(f"/{drafter}/export")
        assert args[args.index("--eval") + 1].endswith(
            "eaglepipe/eval.json" if drafter == "eaglepipe" else "specforge/none.json"
        )
    # With --deterministic-live one more for the first seed's drafter at the first setting, on
    # a config with SGLang's batch-invariant mode and its own greedy reference.
    deterministic = argv("live-deterministic@seed0-epochs3@eaglepipe@3-1-4")
    assert deterministic[deterministic.index("--config") + 1] == str(
        work / "config-deterministic.json"
    )
    assert deterministic[deterministic.index("--greedy-reference") + 1] == str(
        work / "greedy-reference-deterministic.json"
    )
    assert deterministic[deterministic.index("--out") + 1].endswith(
        "seed0-epochs3/eaglepipe/live-3-1-4-deterministic.json"
    )
    # The order of the whole call: the first seed's pipeline, SpecForge's inputs and features,
    # SpecForge's trainings (side by side with the later seeds' pipelines on the machine), their
    # exports, then the live runs.
    order = [
        "pipeline@seed0-epochs3", "specforge-features:sglang", "specforge-features:hf",
        "specforge-train@seed0-epochs3:train", "specforge-train@seed1-epochs3:train",
        "specforge-train@seed0-epochs3:export", "specforge-train@seed1-epochs3:export",
        "pipeline@seed1-epochs3", "live@seed0-epochs3@eaglepipe@3-1-4",
        "live-deterministic@seed0-epochs3@eaglepipe@3-1-4",
    ]  # fmt: skip
    assert [steps.index(name) for name in order] == sorted(steps.index(name) for name in order)
    assert not (tmp_path / "root" / "specforge").exists()  # a dry run makes nothing


def test_the_specforge_scale_part_prints_its_commands_in_a_dry_run(tmp_path):
    """`bash tools/h200.sh specforge-scale OUT --dry-run` on CPU: every command of the 8B-shape
    comparison, in order, recorded in specforge_scale.json; nothing made in its work
    root."""
    out, work = tmp_path / "out", tmp_path / "scale"
    env = {
        **os.environ,
        "EAGLEPIPE_H200_ROOT": str(tmp_path / "root"),
        "EAGLEPIPE_SCALE_ROOT": str(work),
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
    }
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "tools" / "h200.sh"), "specforge-scale", str(out), "--dry-run",
         "--rows", "64", "--shards", "4", "--specforge-steps", "40"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "specforge_scale.json").read_text())
    assert results["setup"]["dry_run"] and results["setup"]["rows"] == 64
    assert results["setup"]["aux_layer_ids"] == [1, 15, 28]
    commands = results["commands"]
    steps = [c["step"] for c in commands]
    shards = [f"rows_{i}-{i + 16}" for i in range(0, 64, 16)]
    assert steps == [
        "model", "inputs", "install-specforge", "specforge-kill", "specforge-resume",
        "pipeline:server", *[f"pipeline-kill:{s}" for s in shards],
        *[f"pipeline-resume:{s}" for s in shards], "pipeline", "fidelity",
        "train-specforge:train", "train-eaglepipe",
    ]  # fmt: skip

    def argv(step: str) -> list[str]:
        return next(c["argv"] for c in commands if c["step"] == step)

    # (a) SpecForge's own generator, SGLang in-process; the rerun is the same command
    files = work / "specforge-files"
    kill = argv("specforge-kill")
    assert kill[1:3] == ["-m", "torch.distributed.run"] and kill == argv("specforge-resume")
    script_args = kill[kill.index("--") + 1 :]
    template = kill[kill.index("--template-json") + 1]
    assert template == str(files / "chat_template.json")
    for flag, value in [
        ("--target-model-path", str(files / "target")), ("--output-path", str(files / "features")),
        ("--data-path", str(files / "train.jsonl")), ("--max-length", "2112"),
        ("--batch-size", "1"), ("--chat-template", "eaglepipe-target"),
    ]:  # fmt: skip
        assert script_args[script_args.index(flag) + 1] == value, flag
    assert "kill -9 once 50% of 64 rows are stored" in done.stdout
    # (a) the pipeline: its capture server on the same target, four jobs killed and rerun
    server = argv("pipeline:server")
    assert server[server.index("--model-path") + 1] == str(work / "model")
    assert server[server.index("--dtype") + 1] == "bfloat16"
    hook = json.loads(server[server.index("--forward-hooks") + 1])[0]
    assert hook["config"]["aux_layer_ids"] == [1, 15, 28]
    run = work / "pipeline-run"
    for shard in shards:
        job = argv(f"pipeline-kill:{shard}")
        assert job == argv(f"pipeline-resume:{shard}")
        assert job[2].endswith("scripts/extract.py") and job[-2:] == ["--shard", shard]
        assert job[job.index("--config") + 1] == str(run / ".eaglepipe" / "config.json")
    assert {c["cwd"] for c in commands if c["step"].startswith("pipeline") and "argv" in c} == {
        str(run)
    }
    # (b) both trainers, a fixed number of steps each
    train = argv("train-specforge:train")
    assert train[1:4] == ["-m", "specforge.cli", "train"]
    assert train[-2:] == ["training.max_steps=40", "training.log_interval=1"]
    assert '"ttt_length": 7' in done.stdout and '"batch_size": 1' in done.stdout
    ours = argv("train-eaglepipe")
    assert ours[2:4] == ["-m", "benchmarks.speed.train"]
    assert ours[ours.index("--run-dir") + 1] == str(run)
    assert ours[ours.index("--model-dir") + 1] == str(work / "model")
    assert ours[ours.index("--steps") + 1] == "16"
    assert "fidelity" in steps and (out / "specforge_scale.md").is_file()
    assert not work.exists()  # a dry run makes nothing


def test_the_specforge_drivers_pipeline_overrides_pass_the_config_schema():
    """The run's overrides (seed, epochs, the live runs' turns) over the pipeline part's, as
    config.yaml extended by both: what benchmarks/checks/sglang_pipeline_h200.sh --overrides
    hands snakemake."""
    import yaml

    from benchmarks.studies.specforge.compare import parse_args, pipeline_overrides
    from eaglepipe.core.config import validate_config

    plain = yaml.safe_load(pipeline_overrides(parse_args(["--epochs", "3"]), 2))
    assert plain == {"train": {"epochs": 3, "seed": 2}}
    args = parse_args(["--live-prompts", "8", "--live-new-tokens", "96"])
    overrides = yaml.safe_load(pipeline_overrides(args, 0))
    assert overrides["evaluate"] == {"live_prompts": 8, "live_new_tokens": 96}
    config = yaml.safe_load((REPO_ROOT / "config.yaml").read_text())
    for section, values in overrides.items():
        config[section].update(values)
    validate_config(config)


@pytest.mark.parametrize(
    ("option", "value", "minimum"),
    [
        ("--inflight-requests", "x", 1),
        ("--inflight-requests", "32,0", 1),
        ("--chunk-writeback-mb", "-1", 0),
        ("--chunk-writeback-mb", ",", 0),
    ],
)
def test_the_extraction_benchmarks_variant_lists_refuse_bad_values(capsys, option, value, minimum):
    """Each comma list of run variants is integers at or above its minimum, or one line naming
    the option (a non-integer was a ValueError traceback before)."""
    from benchmarks.speed.sglang_extraction import parse_args

    args = parse_args(["--inflight-requests", "32,64", "--chunk-writeback-mb", "64,0"])
    assert (args.inflight_variants, args.inflight_requests) == ([32, 64], 32)
    assert args.writeback_variants == [64, 0]
    with pytest.raises(SystemExit):
        parse_args([option, value])
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.endswith(f"error: {option}: one or more integers >= {minimum}, comma-separated")


def test_the_specforge_driver_continues_where_an_earlier_call_stopped(tmp_path):
    """A later call skips the steps WORK/state.json records as done, summarises the seeds it
    has, and leaves a step it has no time for to the next call (exit 3)."""
    from benchmarks.studies.specforge.compare import parse_args, plan_steps

    work = tmp_path / "work"
    work.mkdir()
    lengths = {("eaglepipe", 0): 2.5, ("eaglepipe", 1): 2.1, ("specforge", 0): 1.9,
               ("specforge", 1): 1.7}  # fmt: skip
    steps = {}
    for step in plan_steps(parse_args(["--seeds", "0,1", "--settings", "7/1/8"])):
        result = {}
        if step.kind == "live":
            result = {"acceptance_length": lengths[(step.drafter, step.seed)]}
        steps[step.name] = {"status": "done", "result": result, "seconds": 1.0}
    (work / "state.json").write_text(json.dumps({"steps": steps, "max_length": 1024}))

    out = tmp_path / "sf.json"
    common = ["--work-root", str(work), "--settings", "7/1/8", "--out", str(out)]
    done = run_script(
        "-m", "benchmarks.studies.specforge.compare", "--seeds", "0,1", *common, timeout=120
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert done.stdout.count("done in an earlier call") == len(steps)
    summary = json.loads(out.read_text())["summary"]["7/1/8"]
    assert summary["eaglepipe"]["by_seed"] == {"0": 2.5, "1": 2.1}
    assert summary["eaglepipe"]["mean"] == 2.3 and summary["specforge"]["mean"] == 1.8
    assert summary["eaglepipe"]["stdev"] == pytest.approx(0.283, abs=1e-3)
    assert "| 7/1/8 | specforge | 1.800 |" in out.with_suffix(".md").read_text()

    done = run_script(
        "-m", "benchmarks.studies.specforge.compare", "--seeds", "0,1,2", "--deadline-s", "30",
        *common,
        timeout=120,
    )  # fmt: skip
    assert done.returncode == 3, done.stdout[-3000:] + done.stderr[-3000:]
    # The new seed's two trainings go together; the done ones of their group are not redone.
    assert "[specforge-train@seed2-epochs8, pipeline@seed2-epochs8] not started" in done.stdout
    results = json.loads(out.read_text())
    assert results["remaining"][:2] == ["specforge-train@seed2-epochs8", "pipeline@seed2-epochs8"]
    assert len(results["remaining"]) == 4
    assert json.loads((work / "state.json").read_text())["steps"] == steps  # nothing new ran


def test_the_specforge_driver_runs_commands_side_by_side_and_stops_them_at_its_deadline(
    tmp_path,
):
    """What SpecForge's trainings run on: commands at once, each to its own log, exit codes in
    order; one still running at the deadline is stopped with its whole process group."""
    import argparse
    import time

    import psutil

    from benchmarks.studies.specforge.steps import Command, Context, Paths, run_commands

    ctx = Context(argparse.Namespace(dry_run=False), Paths(tmp_path), time.monotonic() + 25)
    child_pid = tmp_path / "child.pid"
    commands = [
        Command("quick", ["bash", "-c", "sleep 0.5; echo done"], tmp_path / "a.log"),
        Command("fails", ["bash", "-c", "echo no >&2; exit 3"], tmp_path / "b.log"),
        Command(
            "hangs",
            ["bash", "-c", f"sleep 600 & echo $! > {child_pid}; wait"],
            tmp_path / "c.log",
        ),
    ]
    assert run_commands(ctx, commands) == [0, 3, 124]
    assert (tmp_path / "a.log").read_text() == "done\n"
    assert (tmp_path / "b.log").read_text() == "no\n"
    try:  # the group got TERM: the child ends (or is already gone)
        gone, alive = psutil.wait_procs([psutil.Process(int(child_pid.read_text()))], timeout=10)
    except psutil.NoSuchProcess:
        alive = []
    assert alive == []


def test_the_specforge_driver_runs_the_later_pipelines_while_specforge_trains(
    tmp_path, monkeypatch
):
    """The trainings group: SpecForge's trainings and the later seeds' pipelines at the same
    time (a pipeline that waits for the trainings to have started would otherwise never see
    them), each with its own entry; a failed pipeline does not hide the trainings' results."""
    import threading
    import time

    from benchmarks.studies.specforge import compare as bench
    from benchmarks.studies.specforge.steps import Context, Paths

    trainings_running, pipelines_seen = threading.Event(), []

    def fake_trainings(ctx, steps):
        trainings_running.set()
        time.sleep(0.5)
        result = {"trained_at_once": len(steps)}
        return {s.name: {"status": "done", "result": dict(result)} for s in steps}

    def fake_pipeline(ctx, step):
        pipelines_seen.append((step.name, trainings_running.wait(timeout=30)))
        if step.seed == 2:
            raise bench.StepFailed("pipeline@seed2: exit 1")
        return {"seed": step.seed}

    monkeypatch.setattr(bench, "step_trainings", fake_trainings)
    monkeypatch.setitem(bench.RUNNERS, "pipeline", fake_pipeline)
    args = bench.parse_args(["--seeds", "0,1,2", "--settings", "7/1/8"])
    ctx = Context(args, Paths(tmp_path), time.monotonic() + 60)
    steps = bench.plan_steps(args)
    start = next(i for i, s in enumerate(steps) if s.kind == "train")
    group = bench.next_group(ctx, steps, start)
    assert [s.name for s in group] == [
        "specforge-train@seed0-epochs8", "specforge-train@seed1-epochs8",
        "specforge-train@seed2-epochs8", "pipeline@seed1-epochs8", "pipeline@seed2-epochs8",
    ]  # fmt: skip
    entries = bench.run_group(ctx, group)
    assert pipelines_seen == [("pipeline@seed1-epochs8", True), ("pipeline@seed2-epochs8", True)]
    assert entries["pipeline@seed1-epochs8"]["status"] == "done"
    assert entries["pipeline@seed1-epochs8"]["beside_trainings"] == 3
    assert entries["pipeline@seed2-epochs8"]["status"] == "failed"
    for seed in (0, 1, 2):
        entry = entries[f"specforge-train@seed{seed}-epochs8"]
        assert entry["status"] == "done" and entry["result"]["trained_at_once"] == 3
        assert entry["seconds"] >= 0.5
    # One at a time: every training alone.
    one = bench.parse_args(["--seeds", "0,1", "--train-one-at-a-time"])
    steps = bench.plan_steps(one)
    start = next(i for i, s in enumerate(steps) if s.kind == "train")
    assert len(bench.next_group(Context(one, Paths(tmp_path), 0.0), steps, start)) == 1


def test_the_specforge_driver_runs_live_runs_side_by_side_after_the_first(tmp_path, monkeypatch):
    """--live-at-once N: the plan's first live run alone (it makes the shared greedy
    reference), then up to N at once, each entry marked; a failed one is its own entry."""
    import threading
    import time

    from benchmarks.studies.specforge import compare as bench
    from benchmarks.studies.specforge.steps import Context, Paths

    args = bench.parse_args(
        ["--seeds", "0,1", "--settings", "7/1/8", "--live-at-once", "3", "--live-stagger-s", "0"]
    )
    ctx = Context(args, Paths(tmp_path), time.monotonic() + 60)
    steps = bench.plan_steps(args)
    first = next(i for i, s in enumerate(steps) if s.kind == "live")
    assert [s.name for s in bench.next_group(ctx, steps, first)] == [steps[first].name]
    group = bench.next_group(ctx, steps, first + 1)
    assert [s.name for s in group] == [
        "live@seed0-epochs8@specforge@7-1-8", "live@seed1-epochs8@eaglepipe@7-1-8",
        "live@seed1-epochs8@specforge@7-1-8",
    ]  # fmt: skip
    all_running = threading.Barrier(3, timeout=30)  # broken unless all three run at once

    def fake_live(ctx, step):
        all_running.wait()
        if step.seed == 1 and step.drafter == "specforge":
            raise bench.StepFailed("live: exit 1")
        return {"acceptance_length": 2.0}

    monkeypatch.setitem(bench.RUNNERS, "live", fake_live)
    entries = bench.run_group(ctx, group)
    assert [entries[s.name]["status"] for s in group] == ["done", "done", "failed"]
    assert {entries[s.name]["live_side_by_side"] for s in group} == {3}


def test_the_deterministic_live_config_adds_sglangs_flag_once(tmp_path):
    from benchmarks.studies.specforge.compare import DETERMINISTIC_FLAG, deterministic_config

    (tmp_path / ".eaglepipe").mkdir()
    config = {"server": {"sglang": {"extra_args": ["--attention-backend", "triton"]}}}
    (tmp_path / ".eaglepipe" / "config.json").write_text(json.dumps(config))
    out = deterministic_config(tmp_path, tmp_path / "det.json")
    written = json.loads(out.read_text())["server"]["sglang"]["extra_args"]
    assert written == ["--attention-backend", "triton", DETERMINISTIC_FLAG]
    assert json.loads((tmp_path / ".eaglepipe" / "config.json").read_text()) == config
    (tmp_path / ".eaglepipe" / "config.json").write_text(out.read_text())
    again = deterministic_config(tmp_path, tmp_path / "det2.json")
    assert json.loads(again.read_text())["server"]["sglang"]["extra_args"] == written


@pytest.mark.parametrize(
    "args,message",
    [
        (["--settings", "7/1/9"], "with top-k 1 a round verifies steps + 1 = 8 tokens"),
        (["--features", "vllm"], "--features: sglang and/or hf"),
        (["--seeds", "0,0"], "--seeds: distinct integers"),
    ],
)
def test_the_specforge_driver_refuses_bad_settings_in_one_line(args, message):
    done = run_script("-m", "benchmarks.studies.specforge.compare", "--dry-run", *args, timeout=120)
    assert done.returncode != 0
    assert message in done.stderr and "Traceback" not in done.stderr


def run_script(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-u", *args], cwd=REPO_ROOT, capture_output=True, text=True,
        timeout=timeout,
    )  # fmt: skip


@pytest.mark.parametrize("version,capture_flags", [("0.5.14", False), ("0.5.23", True)])
def test_the_extraction_benchmark_builds_the_bare_and_pipeline_commands(
    tmp_path, version, capture_flags
):
    out = tmp_path / "r.json"
    done = run_script(
        "-m", "benchmarks.speed.sglang_extraction", "--dry-run", "--sglang-version", version,
        "--work-root", str(tmp_path), "--out", str(out), "--bare-capture",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    bare, pipeline = results["bare"], results["pipeline"]
    # The capture without the hook: the pipeline's command less --forward-hooks, its env.
    capture = results["bare_capture"]
    hooks = pipeline["argv"].index("--forward-hooks")
    assert capture["argv"] == pipeline["argv"][:hooks] + pipeline["argv"][hooks + 2 :]
    capture_env = "EAGLEPIPE_SGLANG_CAPTURE_LAYER_IDS"
    assert capture["env"][capture_env] == pipeline["env"][capture_env]
    for flag in ("--forward-hooks", "--speculative-algorithm", "--enable-return-aux-hidden-states"):
        assert flag not in bare["argv"]
    assert bare["env"]["EAGLEPIPE_SGLANG_CAPTURE_LAYER_IDS"] == ""
    assert "--forward-hooks" in pipeline["argv"]
    assert ("--enable-return-aux-hidden-states" in pipeline["argv"]) is capture_flags
    captured = pipeline["env"]["EAGLEPIPE_SGLANG_CAPTURE_LAYER_IDS"]
    assert captured == ("" if capture_flags else "[1, 3, 4]")
    # Every other flag is the same in both runs.
    hook_at = pipeline["argv"].index("--forward-hooks")
    tail = pipeline["argv"][hook_at + 2 :]
    assert bare["argv"][-len(tail) :] == tail
    assert [a for a in bare["argv"] if a.startswith("--")][:6] == [
        "--model-path", "--tp-size", "--host", "--port", "--mem-fraction-static", "--dtype",
    ]  # fmt: skip
    assert pipeline["shards"] >= 2
    assert set(results["raw_write"]) >= {"disk"}
    assert list(tmp_path.glob("eaglepipe-bench-sglang-*")) == []  # the scratch dir is removed


def test_the_extraction_benchmark_compares_stores_and_prints_their_bytes(tmp_path):
    """`--store-dtypes`: each store's server is told its store in the hook's config (the hook
    quantizes on the GPU); the bytes per token of each, at the 8B shape and Kimi-K2.5's, come
    from the chunk file's own function, FP8's at most 0.52x bf16's."""
    out = tmp_path / "r.json"
    done = run_script(
        "-m", "benchmarks.speed.sglang_extraction", "--dry-run", "--sglang-version", "0.5.14",
        "--store-dtypes", "bf16,fp8,fp8aux", "--work-root", str(tmp_path), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    stores = results["pipeline"]["stores"]
    assert stores["bf16"]["hook_config_store"] == "absent: bf16"
    assert stores["fp8"]["hook_config_store"] == {"aux": "fp8_e4m3", "final": "fp8_e4m3"}
    assert stores["fp8aux"]["hook_config_store"] == {"aux": "fp8_e4m3", "final": "bf16"}
    sizes = results["bytes_per_token"]
    assert sizes["bf16"]["8b"]["bytes_per_token"] == 32773
    assert sizes["fp8"]["8b"]["vs_bf16"] <= 0.52 and sizes["fp8"]["kimi_k2.5"]["vs_bf16"] <= 0.52
    assert "bytes per token, fp8: 8b 16,405" in done.stderr + done.stdout
    assert results["setup"]["store_dtypes"] == ["bf16", "fp8", "fp8aux"]


@pytest.mark.parametrize("preset", ["scale-shm", "scale-disk"])
def test_the_realistic_size_runs_fit_the_lent_h200(tmp_path, preset):
    """The presets tools/h200.sh runs (issue 28, item 1): >= 5 M tokens on /dev/shm in shards of
    >= 1 M (3 M in 0.5 M shards on the 64 GiB disk), verified and deleted shard by shard, within
    the machine's storage and a call, by the plan the dry run makes for the 8B shape."""
    out = tmp_path / "r.json"
    done = run_script(
        "-m", "benchmarks.speed.sglang_extraction", "--dry-run", "--sglang-version", "0.5.14",
        "--preset", preset, "--work-root", str(tmp_path), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    plan = results["plan"]
    assert plan["fits"] and plan["fits_call"] and plan["verify_delete"]
    assert plan["total_gb"] > plan["room_gb"][preset.removeprefix("scale-")]  # hence the deletes
    if preset == "scale-shm":
        assert plan["tokens"] >= 5_000_000 and plan["shard_tokens"] >= 1_000_000
        assert plan["model_on"] == "disk"  # /dev/shm holds the chunks
    else:
        assert plan["model_on"] == "shm"
    assert results["setup"]["verify_delete"] is True
    assert list(tmp_path.glob("eaglepipe-bench-sglang-*")) == []


def test_the_regeneration_benchmark_builds_its_three_commands(tmp_path):
    out = tmp_path / "r.json"
    done = run_script(
        "-m", "benchmarks.speed.sglang_regeneration", "--dry-run", "--sglang-version", "0.5.14",
        "--work-root", str(tmp_path), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    pipeline, stock = results["pipeline"]["argv"], results["stock"]["argv"]
    capture = results["capture"]["argv"]
    capture_only = ["--disable-radix-cache", "--chunked-prefill-size=-1",
                    "--disable-prefill-cuda-graph", "--disable-decode-cuda-graph"]  # fmt: skip
    # Extraction's server has what the capture needs; regeneration's (issue 28) does not, and
    # keeps the inert hook; the stock server has neither.
    assert all(flag in capture for flag in [*capture_only, "--forward-hooks"])
    assert not any(flag in pipeline for flag in capture_only) and "--forward-hooks" in pipeline
    assert not any(flag in stock for flag in [*capture_only, "--forward-hooks"])
    # Apart from the hook, regeneration's server is the stock one: same model, memory, dtype
    # and the slim install's backends.
    hook_at = pipeline.index("--forward-hooks")
    assert stock == pipeline[:hook_at] + pipeline[hook_at + 2 :]
    (bench,) = results["bench_serving"]["argv"]
    assert bench[bench.index("--max-concurrency") + 1] == "8"  # 2 jobs x 4 in flight (tiny)
    assert bench[bench.index("--random-range-ratio") + 1] == "1.0"
    assert list(tmp_path.glob("eaglepipe-bench-regen-*")) == []


def test_the_regeneration_sweep_runs_bench_serving_at_each_concurrency(tmp_path):
    out = tmp_path / "r.json"
    done = run_script(
        "-m", "benchmarks.speed.sglang_regeneration", "--dry-run", "--sglang-version", "0.5.23",
        "--sweep", "64,128,256", "--work-root", str(tmp_path), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    benches = json.loads(out.read_text())["bench_serving"]["argv"]
    assert [b[b.index("--max-concurrency") + 1] for b in benches] == ["64", "128", "256"]
    refused = run_script(
        "-m", "benchmarks.speed.sglang_regeneration", "--dry-run", "--sglang-version", "0.5.14",
        "--jobs", "4", "--rows", "8", "--sweep", "2", "--work-root", str(tmp_path),
    )  # fmt: skip
    assert refused.returncode == 2 and "at least one row per job" in refused.stderr


def test_the_regeneration_benchmark_uses_only_flags_bench_serving_has():
    """bench_serving's options in the recommended release's source (never imported here)."""
    from sglang_source import sglang_source_root, supported

    version = supported()["recommended"]
    source = (sglang_source_root(version) / "bench_serving.py").read_text()
    from benchmarks.speed.sglang_regeneration import bench_serving_command, parse_args

    argv = bench_serving_command(
        "http://127.0.0.1:30000", Path("/m"), parse_args([]), 256, Path("/o")
    )
    flags = [a for a in argv if a.startswith("--")]
    assert flags and all(f'"{flag}"' in source for flag in flags), [
        f for f in flags if f'"{f}"' not in source
    ]
    assert '"random-ids"' in source


def test_the_fidelity_check_builds_deepseek_and_kimi_and_catches_a_shifted_layer(tmp_path):
    out = tmp_path / "fidelity.json"
    done = run_script(
        "-m", "benchmarks.checks.sglang_fidelity", "--dry-run", "--small", "--models", "kimi",
        "--sglang-version", "0.5.14", "--work-root", str(tmp_path), "--out", str(out),
        "--device", "cpu",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    assert list(results["models"]) == ["deepseek", "kimi"]  # kimi brings its DeepSeek weights
    deepseek, kimi = results["models"]["deepseek"], results["models"]["kimi"]
    # transformers does not save these; SGLang 0.5.14 reads them without a default.
    assert deepseek["config"]["moe_layer_freq"] == 1
    assert deepseek["config"]["topk_method"] == "noaux_tc"
    assert deepseek["config"]["first_k_dense_replace"] == 2
    assert kimi["config"]["architectures"] == ["KimiK25ForConditionalGeneration"]
    assert kimi["config"]["vision_config"]["text_hidden_size"] == 256
    for entry in (deepseek, kimi):
        assert entry["status"] == "ok", entry
        assert entry["checks"]["shifted_copy_fails"]
        assert all(not layer["ok"] for layer in entry["shifted_by_one_layer"][:-1])
        # DeepSeek's capture arithmetic: ours [1, 3, 4] pass as [2, 4, 5], through the plugin.
        assert entry["env"]["EAGLEPIPE_SGLANG_CAPTURE_LAYER_IDS"] == "[2, 4, 5]"
        assert "--speculative-algorithm" not in entry["argv"]
    assert kimi["argv"][kimi["argv"].index("--mm-attention-backend") + 1] == "sdpa"
    table = out.with_suffix(".md").read_text()
    assert "| kimi | packed | final | HF[8] |" in table


def test_the_fidelity_check_needs_a_version_for_its_dry_run():
    done = run_script("-m", "benchmarks.checks.sglang_fidelity", "--dry-run", timeout=120)
    assert done.returncode == 2 and "--sglang-version" in done.stderr


@pytest.mark.parametrize("options", [[], ["--quick"]])
def test_the_pipeline_driver_runs_snakemake_with_the_sglang_overrides(tmp_path, options):
    """A dry run of the driver's snakemake call: the overrides pass the config schema and the
    plan reaches live acceptance; the summary and the archive are written anyway."""
    env = {
        **os.environ,
        "EAGLEPIPE_H200_ROOT": str(tmp_path),
        "PATH": f"{VENV_BIN}:{os.environ['PATH']}",
    }
    out = tmp_path / "out"
    done = subprocess.run(
        ["bash", str(REPO_ROOT / "benchmarks" / "checks" / "sglang_pipeline_h200.sh"), str(out),
         *options, "-n"],
        capture_output=True, text=True, env=env, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "Config file config.yaml is extended" in done.stdout + done.stderr
    assert "live_acceptance" in done.stdout
    summary = json.loads((out / "pipeline_summary.json").read_text())
    assert summary["snakemake_exit"] == 0
    overrides = (tmp_path / "pipeline-run" / "h200-sglang.yaml").read_text()
    assert "engine: sglang" in overrides and "num_heads: 2" in overrides
    assert ("epochs: 2" in overrides) is bool(options)
    assert zipfile.is_zipfile(out / "pipeline_results.tgz") is False  # a gzip'd tar
    assert (out / "pipeline_results.tgz").stat().st_size > 0


def test_the_mla_part_plans_the_pipeline_on_a_deepseek_toy_sglang_can_load(tmp_path):
    """`pipeline-mla --dry-run` on CPU: a real DeepSeek-V3-shaped checkpoint (2 steps) with the
    config keys SGLang 0.5.14 needs, and a plan on it with no toy build and no regeneration
    that reaches training and live acceptance (then `variants --variants mla` serves it)."""
    root, out = tmp_path / "root", tmp_path / "out"
    done = run_h200(["pipeline-mla", str(out), "--dry-run"], REPO_ROOT, root)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    config = json.loads((root / "deepseek-toy" / "config.json").read_text())
    assert config["model_type"] == "deepseek_v3"
    # A shape SGLang's Triton MLA decode kernel serves (32 + 8 crashed the H200's server).
    assert triton_mla_decode_fits(config["kv_lora_rank"], config["qk_rope_head_dim"])
    assert config["moe_layer_freq"] == 1 and config["topk_method"] == "noaux_tc"
    tokenizer = json.loads((root / "deepseek-toy" / "tokenizer_config.json").read_text())
    assert tokenizer["tokenizer_class"] == "PreTrainedTokenizerFast"
    overrides = (root / "mla-overrides.yaml").read_text()
    assert f"path: {root / 'deepseek-toy'}" in overrides and "enabled: false" in overrides
    planned = set(re.findall(r"rule (\w+):", done.stdout))
    assert {"extract", "train", "live_acceptance"} <= planned
    assert not planned & {"build_toy_target", "regenerate"}
    assert "--device cuda" in done.stdout  # the real call pre-trains on the GPU
    # Other sizes (a shape mla-probe served) replace the toy.
    shape = {"EAGLEPIPE_MLA_TOY_SHAPE": "256,96,256,64,32,64"}
    done = run_h200(["pipeline-mla", str(out), "--dry-run"], REPO_ROOT, root, env=shape)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    config = json.loads((root / "deepseek-toy" / "config.json").read_text())
    assert (config["hidden_size"], config["kv_lora_rank"], config["qk_rope_head_dim"]) == (
        256, 256, 32
    )  # fmt: skip
    assert (root / "deepseek-toy" / "shape.txt").read_text().strip() == shape[
        "EAGLEPIPE_MLA_TOY_SHAPE"
    ]  # fmt: skip


def test_the_mla_probe_plans_each_shape_on_the_pipelines_own_servers(tmp_path):
    """`mla-probe --dry-run` on CPU: a DeepSeek-V3-shaped toy per shape, and for each the
    capture server's command (capturing hook, no radix cache) and the generation server's
    (radix cache on, the hook told not to capture)."""
    root, out = tmp_path / "root", tmp_path / "out"
    shapes = "64,64,48,32,16,32;256,96,256,64,32,64"
    done = run_h200(
        ["mla-probe", str(out), "--dry-run", "--sglang-version", "0.5.14", "--shapes", shapes],
        REPO_ROOT, root,
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    probed = json.loads((out / "mla_probe.json").read_text())["shapes"]
    assert [(s["shape"]["hidden_size"], s["shape"]["kv_lora_rank"]) for s in probed] == [
        (64, 48), (256, 256)
    ]  # fmt: skip
    for entry in probed:
        capture, generation = entry["commands"]["capture"], entry["commands"]["generation"]
        assert "--disable-radix-cache" in capture and "--disable-radix-cache" not in generation
        hooks = [json.loads(argv[argv.index("--forward-hooks") + 1])[0]["config"]
                 for argv in (capture, generation)]  # fmt: skip
        assert hooks[0].get("capture", True) and hooks[1]["capture"] is False
        for argv in (capture, generation):
            assert argv[argv.index("--attention-backend") + 1] == "triton"
            toy = Path(argv[argv.index("--model-path") + 1])
            built = json.loads((toy / "config.json").read_text())
            assert built["kv_lora_rank"] == entry["shape"]["kv_lora_rank"]


def test_the_mla_probe_keeps_the_traceback_that_names_the_failing_kernel(tmp_path):
    """A crash's first error line comes back with the traceback above it (CUDA_LAUNCH_BLOCKING
    makes that the failing kernel's launch); SGLang's harmless import notices are skipped."""
    from benchmarks.checks.sglang_mla_probe import first_error

    log = tmp_path / "vm-20261204-185749-07dc58.log"
    log.write_text(
        "Ignore import error when loading sglang.srt.models.glm4v: No module named 'x'\n"
        "[2026-12-04] Prefill batch. #new-seq: 32, #new-token: 14992\n"
        "Traceback (most recent call last):\n"
        '  File "sglang/srt/layers/attention/triton_ops/extend_attention.py", line 640\n'
        "    _fwd_kernel[grid](\n"
        "RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered\n"
        "Traceback (most recent call last):\n"
        "RuntimeError: a later consequence\n"
    )
    line, traceback = first_error(tmp_path)
    assert line == "RuntimeError: Triton Error [CUDA]: an illegal memory access was encountered"
    assert traceback[0].startswith("Traceback") and "extend_attention.py" in traceback[1]
    assert traceback[-1] == line and len(traceback) == 4
    assert first_error(tmp_path / "nothing-here") is None


@pytest.mark.slow
def test_the_fidelity_harness_end_to_end_on_the_reference_server(tmp_path):
    """The live path of benchmarks.checks.sglang_fidelity (lifecycle start, the project's client
    single and packed, the comparison, stray-dump check, stop) with the built-in server on CPU."""
    out = tmp_path / "fidelity.json"
    done = run_script(
        "-m", "benchmarks.checks.sglang_fidelity", "--engine", "reference", "--small", "--models",
        "llama", "--device", "cpu", "--work-root", str(tmp_path), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    llama = json.loads(out.read_text())["models"]["llama"]
    assert llama["status"] == "ok" and llama["aux_layer_ids"] == [1, 3, 4]
    assert llama["checks"]["one_dump_per_request"] and llama["other_requests"]["stray_dumps"] == []
    assert [e["layer"] for e in llama["single"]] == ["aux 1", "aux 3", "aux 4", "final"]
    assert not list(tmp_path.glob("eaglepipe-fidelity-*"))  # the scratch dir is gone


@pytest.mark.slow
def test_the_regeneration_benchmark_end_to_end_on_the_reference_server(tmp_path):
    """The pipeline half of benchmarks.speed.sglang_regeneration (its dataset and chat template,
    the lifecycle, concurrent regenerate jobs, the summary) with the built-in server on CPU."""
    out = tmp_path / "r.json"
    done = run_script(
        "-m", "benchmarks.speed.sglang_regeneration", "--engine", "reference", "--sweep", "4,8",
        "--work-root", str(tmp_path), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    # The sweep: every row regenerated afresh at each concurrency (split over the 2 jobs).
    assert [p["concurrency"] for p in results["pipeline"]["sweep"]] == [4, 8]
    assert all(p["rows"] == 8 and p["first_request_s"] for p in results["pipeline"]["sweep"])
    assert [p["concurrency"] for p in results["sweep"]] == [4, 8]
    regeneration = results["pipeline"]["regeneration"]
    assert regeneration["rows"] == 8 and regeneration["shards"] == 2
    # Replies of at most 8 new tokens (the tiny check), counted from the manifests.
    assert 0 < regeneration["output_tokens"] <= 8 * 8
    assert regeneration["output_tokens_per_row"] == round(regeneration["output_tokens"] / 8, 1)
    assert regeneration["output_tokens_per_s"] > 0
    assert (tmp_path / "r.md").read_text().count("pipeline regeneration") == 1


@pytest.mark.slow
def test_the_extraction_benchmark_end_to_end_on_the_reference_server(tmp_path):
    """The pipeline half of benchmarks/speed/sglang_extraction.py (lifecycle, concurrent shard jobs,
    chunks on tmpfs, the breakdown) with the built-in server on CPU."""
    out = tmp_path / "r.json"
    done = run_script(
        "-m", "benchmarks.speed.sglang_extraction", "--engine", "reference", "--tokens", "700",
        "--storages", "shm", "--parallel-shards", "2", "--verify-delete", "--inflight-gb",
        "2,auto", "--chunk-writeback-mb", "64,0", "--work-root", str(tmp_path), "--out", str(out),
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads(out.read_text())
    variants = results["pipeline"]["variants"]
    # Each dump bound and chunk writeback is its own run on the same server; the first is what
    # the ratios use.
    names = ["shm", "shm@64/wb0", "shm@64/auto", "shm@64/auto/wb0"]
    assert set(variants) == set(names)
    assert [variants[v]["inflight_gb"] for v in names] == ["2", "2", "auto", "auto"]
    assert [variants[v]["chunk_writeback_mb"] for v in names] == [64, 0, 64, 0]
    assert all(variants[v]["tokens"] == results["setup"]["tokens"] for v in names)
    report = (tmp_path / "r.md").read_text()
    assert "(dumps <= 2 GiB a job)" in report and "(dumps a quarter of the handoff)" in report
    assert report.count("(left to the kernel)") == 2
    assert report.count("(handed to the disk every 64 MiB)") == 2
    shm = variants["shm"]
    assert shm["tokens"] == results["setup"]["tokens"] >= 700
    assert shm["chunks"] >= 1 and shm["job_startup_s"] > 0
    # --verify-delete: every shard checked (all its chunks re-hashed), then deleted.
    shards = results["pipeline"]["shards"]
    assert shm["verified"]["shards"] == shards and shm["verified"]["chunks"] == shm["chunks"]
    assert shm["first_request"]["shards"] == shards and shm["first_request"]["max_s"] > 0
    assert set(shm["client_breakdown_s"]) == {
        "budget_wait_s", "bytes_wait_s", "dump_wait_s", "read_dump_s", "lookahead_wait_s",
        "chunk_write_s",
    }  # fmt: skip
    # The jobs' own span (no verification after it) and the run split by jobs alive.
    assert 0 < shm["jobs_span_s"] <= shm["seconds"]
    assert shm["jobs_span_tokens_per_s"] >= shm["tokens_per_s"]
    alive = shm["by_jobs_alive"]
    assert "2" in alive and sum(g["seconds"] for g in alive.values()) >= shm["jobs_span_s"]
    assert results["bare"] == {"skipped": "the reference engine has no bare server"}


def test_a_kit_carries_the_comparison_to_a_fresh_machine_after_the_trainings(tmp_path, monkeypatch):
    """The machine was lost after the pipelines and trainings (H200, 2026-12-03): the kit of
    the last call restores their state and drafters on a new work root, rebuilds the toy target
    byte for byte, and leaves out what the new machine has to redo."""
    from pipeline_run import SAMPLE, default_config

    from benchmarks.studies.specforge.compare import parse_args, plan_steps
    from benchmarks.studies.specforge.resume import restore_kit, write_kit
    from benchmarks.studies.specforge.steps import Paths
    from eaglepipe.core.config import validate_config
    from eaglepipe.core.errors import PipelineError

    monkeypatch.setenv("EAGLEPIPE_TOY_CACHE", "off")  # the rebuild must really build
    plan = plan_steps(parse_args(["--seeds", "0,1", "--settings", "7/1/8"]))
    old = Paths(tmp_path / "old")
    run = old.run
    config = default_config()
    config["dataset"]["path"] = str(SAMPLE)
    config["model"]["toy"].update(train_steps=2, train_seq_len=16, train_batch_size=2)
    (run / ".eaglepipe").mkdir(parents=True)
    (run / ".eaglepipe" / "config.json").write_text(json.dumps(validate_config(config)))
    (run / "prepared").mkdir()
    (run / "prepared" / "tokenized.parquet").write_bytes(b"the table")
    (run / "hidden_states").mkdir()  # large, never carried
    built = subprocess.run(
        [sys.executable, str(REPO_ROOT / "scripts" / "build_toy_target.py"), "--config",
         ".eaglepipe/config.json", "--out", "models/toy-target"],
        cwd=run, capture_output=True, text=True,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr
    for drafter in ("eaglepipe", "specforge"):
        (old.work / "seeds" / "seed0-epochs8" / drafter / "export").mkdir(parents=True)
        (
            old.work / "seeds" / "seed0-epochs8" / drafter / "export" / "model.safetensors"
        ).write_bytes(drafter.encode())
    (old.work / "greedy-reference.json").write_text('{"key": 1}')
    (old.work / "specforge-files").mkdir()  # features: redone if ever needed
    state = {"steps": {}, "max_length": 1024}
    kit = tmp_path / "out" / "specforge_resume.tgz"
    assert write_kit(old, state, plan, kit) is False  # nothing a later call could use yet
    for step in plan:
        if step.kind != "live" or step.seed == 0:
            state["steps"][step.name] = {"status": "done", "result": {"step": step.name}}
    state["steps"]["live@seed1-epochs8@specforge@7-1-8"] = {"status": "failed", "error": "x"}
    assert write_kit(old, state, plan, kit) is True
    assert not list(kit.parent.glob(".*tmp*"))

    new = Paths(tmp_path / "new")
    restored = restore_kit(new, kit, plan)
    kinds = {step.name: step.kind for step in plan}
    assert set(restored["steps"]) == {
        name for name, entry in state["steps"].items()
        if entry["status"] == "done" and kinds[name] != "inputs" and kinds[name] != "features"
    }  # fmt: skip
    assert restored["max_length"] == 1024
    carried = (
        "greedy-reference.json",
        "seeds/seed0-epochs8/specforge/export/model.safetensors",
        "pipeline-run/prepared/tokenized.parquet",
        "pipeline-run/.eaglepipe/config.json",
    )
    for name in carried:
        assert (new.work / name).read_bytes() == (old.work / name).read_bytes(), name
    for name in ("model.safetensors", "tokenizer.json", "config.json"):
        assert (new.run / "models/toy-target" / name).read_bytes() == (
            run / "models/toy-target" / name
        ).read_bytes()
    assert not (new.run / "hidden_states").exists() and not (new.work / "specforge-files").exists()
    assert not (new.work / "kit-state.json").exists()

    # A machine with the comparison's own state keeps it.
    new.state.write_text(json.dumps({"steps": {}}))
    assert restore_kit(new, kit, plan) is None
    # A pipeline left to run: the kit does not apply.
    partial = {"steps": {k: v for k, v in state["steps"].items() if k != "pipeline@seed1-epochs8"}}
    write_kit(old, partial, plan, kit)
    assert restore_kit(Paths(tmp_path / "other"), kit, plan) is None
    # A toy that rebuilds differently is refused by name: here the kit's config names another
    # toy seed than the toy the drafters were trained on.
    config["model"]["toy"]["seed"] = 1
    (run / ".eaglepipe" / "config.json").write_text(json.dumps(validate_config(config)))
    write_kit(old, state, plan, tmp_path / "kit-seed1.tgz")
    with pytest.raises(
        PipelineError,
        match=r"differs from the one the drafters were trained on "
        r"\(eaglepipe_toy.json, model.safetensors\)",
    ):
        restore_kit(Paths(tmp_path / "third"), tmp_path / "kit-seed1.tgz", plan)


def test_the_job_start_part_runs_without_gpu_or_server_dry_run_included(tmp_path):
    """`job-start` measures a shard job's imports and row read in the device's own environment;
    it needs no GPU, so even with --dry-run (which the script does not take) it runs."""
    out = tmp_path / "out"
    done = run_h200(
        ["job-start", str(out), "--dry-run", "--repeat", "1", "--rows", "400",
         "--rows-per-shard", "100"],
        REPO_ROOT, tmp_path / "root",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    results = json.loads((out / "job_start.json").read_text())
    assert results["imports"]["interpreter_s"] > 0
    assert results["imports"]["extract"]["imports_torch"] is False
    assert results["read"]["rows"] == 400 and results["read"]["rows_per_shard"] == 100
    assert "job-start: exit 0" in (out / "h200_job-start.log").read_text()


def test_the_extraction_benchmark_refuses_a_run_the_machine_cannot_hold(tmp_path):
    """The /dev/shm preset with the pipeline's own dump bound needs more than the machine's
    128 GiB of /dev/shm at once: refused by its dry run, naming the storage and the sizes,
    before anything is built."""
    done = run_script(
        "-m", "benchmarks.speed.sglang_extraction", "--dry-run", "--sglang-version", "0.5.14",
        "--preset", "scale-shm", "--inflight-gb", "auto", "--work-root", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 1
    (message,) = [line for line in done.stderr.splitlines() if line.strip()]
    assert message.startswith(
        "benchmarks.speed.sglang_extraction: the run does not fit the lent machine"
    )
    assert "shm " in message and "of its 137.4 GB at once" in message
    assert list(tmp_path.iterdir()) == []  # nothing was built


@pytest.mark.parametrize("value", ["0", "x", "inf", "2,-1"])
def test_the_extraction_benchmark_refuses_a_dump_bound_it_cannot_use(tmp_path, value):
    done = run_script(
        "-m", "benchmarks.speed.sglang_extraction", "--dry-run", "--sglang-version", "0.5.14",
        "--inflight-gb", value, "--work-root", str(tmp_path),
    )  # fmt: skip
    assert done.returncode == 2
    assert "--inflight-gb:" in done.stderr and "neither a positive number nor auto" in done.stderr
