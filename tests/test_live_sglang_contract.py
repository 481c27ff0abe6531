"""Contract test: what live acceptance through SGLang (eaglepipe/drafter/live_sglang.py) relies
on, checked against the source of each SGLang release in VERSIONS (parsed, never imported):
0.5.14 runs on the H200 machine; 0.5.23 is the pin of patch/SGLANG_VERSION.

- every flag the live launcher passes is a server argument of the expected type;
- EAGLE3 is a speculative algorithm;
- temperature 0 is greedy (top-k 1), and max_new_tokens / ignore_eos are sampling parameters;
- /generate, /health and /server_info ("version") exist;
- SGLang's own `_calculate_spec_decoding_metrics`, run on a stand-in batch output, reports the
  fields the harness reads: spec_verify_ct, spec_num_correct_drafts and spec_accept_length =
  completion_tokens / spec_verify_ct.
"""

from __future__ import annotations

import ast
import shutil
import tempfile
import types
import zipfile
from pathlib import Path

import pytest
from filelock import FileLock
from sglang_source import _download_wheel, cache_dir

from eaglepipe.core.config_files import load_config
from eaglepipe.core.run import resolve
from eaglepipe.drafter.live_run import SpeculativeSetting
from eaglepipe.drafter.live_sglang import serve_command
from eaglepipe.server.sglang.recipe import check_extra_args

pytestmark = pytest.mark.network

VERSIONS = ["0.5.14", "0.5.23"]
REPO_ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module", params=VERSIONS)
def src(request) -> Path:
    """The `sglang` package directory of one release's wheel (Python files only), cached beside
    tests/sglang_source.py's extraction of the pinned release."""
    version = request.param
    base = cache_dir()
    extracted = base / f"sglang-{version}-src"
    with FileLock(str(base / f"sglang-{version}.lock")):
        if not (extracted / "sglang" / "srt").is_dir():
            wheel = _download_wheel(version, base)
            staging = Path(tempfile.mkdtemp(dir=base, prefix=".extract-"))
            try:
                with zipfile.ZipFile(wheel) as archive:
                    members = [n for n in archive.namelist() if n.endswith((".py", "METADATA"))]
                    archive.extractall(staging, members=members)
                shutil.rmtree(extracted, ignore_errors=True)
                staging.replace(extracted)
            finally:
                shutil.rmtree(staging, ignore_errors=True)
    return extracted / "sglang"


def server_argument_fields(src: Path) -> dict[str, tuple[str, str]]:
    """{--flag: (field, type)} of the `A[type, help]` dataclass fields SGLang derives its
    command line from (ServerArgs in 0.5.14; the arg_groups/fields classes later)."""
    files = [src / "srt" / "server_args.py", *sorted((src / "srt/arg_groups/fields").glob("*.py"))]
    flags = {}
    for path in files:
        if not path.exists():
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            annotation = getattr(node, "annotation", None)
            if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
                continue
            if not (
                isinstance(annotation, ast.Subscript) and getattr(annotation.value, "id", "") == "A"
            ):
                continue
            raw_type, meta = annotation.slice.elts[:2]
            options = {}
            if isinstance(meta, ast.Call):
                options = {k.arg: k.value for k in meta.keywords}
            if "no_cli" in options and ast.literal_eval(options["no_cli"]):
                continue
            name = node.target.id
            type_name = ast.unparse(raw_type).removeprefix("Optional[").removesuffix("]")
            primary = "--" + name.replace("_", "-")
            if "cli_name" in options:
                primary = ast.literal_eval(options["cli_name"])
            for flag in [primary, *ast.literal_eval(options.get("aliases", ast.List([])))]:
                flags[flag] = (name, type_name)
    return flags


@pytest.fixture(scope="module")
def live_argv(tmp_path_factory) -> list[str]:
    model = tmp_path_factory.mktemp("target")
    (model / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    config = load_config(REPO_ROOT / "config.yaml")
    config["model"].update(path=str(model), trust_remote_code=True)
    config["server"]["dtype"] = "bfloat16"
    return serve_command(
        resolve(config),
        host="127.0.0.1",
        port=30000,
        draft_dir=model,
        speculative=SpeculativeSetting.parse("7/1/8"),
    )


EXPECTED_TYPES = {
    "--model-path": "str",
    "--tp-size": "int",
    "--host": "str",
    "--port": "int",
    "--mem-fraction-static": "float",
    "--dtype": "str",
    "--trust-remote-code": "bool",
    "--speculative-algorithm": "str",
    "--speculative-draft-model-path": "str",
    "--speculative-num-steps": "int",
    "--speculative-eagle-topk": "int",
    "--speculative-num-draft-tokens": "int",
}


def test_every_flag_the_live_launcher_passes_exists_with_its_type(src, live_argv):
    fields = server_argument_fields(src)
    passed = [a for a in live_argv[3:] if a.startswith("--")]
    assert set(passed) == set(EXPECTED_TYPES)
    for flag in passed:
        assert flag in fields, f"{flag} is not a server argument of {src}"
        assert fields[flag][1] == EXPECTED_TYPES[flag], (flag, fields[flag])


# What benchmarks/checks/sglang_pipeline_h200.sh adds through server.sglang.extra_args: the flags
# that ran on the H200, and --enable-deterministic-inference for its --deterministic-live run
# (the triton attention backend it sets is one SGLang's deterministic mode accepts).
H200_EXTRA_ARGS = {
    "--attention-backend": "str",
    "--sampling-backend": "str",
    "--grammar-backend": "str",
    "--enable-deterministic-inference": "bool",
}


@pytest.mark.parametrize("src", ["0.5.14"], indirect=True)  # the release the H200 stages
def test_the_h200_drivers_extra_flags_exist_and_the_launcher_accepts_them(src):
    fields = server_argument_fields(src)
    for flag, type_name in H200_EXTRA_ARGS.items():
        assert flag in fields, f"{flag} is not a server argument of {src}"
        assert fields[flag][1] == type_name, (flag, fields[flag])
    check_extra_args(
        ["--attention-backend", "triton", "--sampling-backend", "pytorch", "--grammar-backend",
         "none", "--enable-deterministic-inference"]
    )  # fmt: skip
    source = (src / "srt" / "server_args.py").read_text()
    choices = next(
        line for line in source.splitlines() if line.startswith("DETERMINISTIC_ATTENTION_BACKEND")
    )
    assert '"triton"' in choices, choices


def test_eagle3_is_a_speculative_algorithm(src):
    tree = ast.parse((src / "srt/speculative/spec_info.py").read_text())
    members = {
        target.id
        for node in ast.walk(tree)
        if isinstance(node, ast.ClassDef) and node.name == "SpeculativeAlgorithm"
        for item in node.body
        if isinstance(item, ast.Assign)
        for target in item.targets
        if isinstance(target, ast.Name)
    }
    assert "EAGLE3" in members


def test_temperature_zero_is_greedy_and_the_sampling_parameters_exist(src):
    tree = ast.parse((src / "srt/sampling/sampling_params.py").read_text())
    cls = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "SamplingParams")
    names = {n.target.id for n in cls.body if isinstance(n, ast.AnnAssign)}
    for node in cls.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            names |= {a.arg for a in node.args.args + node.args.kwonlyargs}
    assert {"temperature", "max_new_tokens", "ignore_eos"} <= names
    greedy = [
        node
        for node in ast.walk(cls)
        if isinstance(node, ast.If)
        and ast.unparse(node.test) == "0 <= self.temperature < _SAMPLING_EPS"
    ]
    assert greedy, "no temperature-0 branch in SamplingParams"
    assert "self.top_k = 1" in [ast.unparse(s) for s in greedy[0].body]


def test_the_endpoints_the_harness_calls_exist(src):
    text = (src / "srt/entrypoints/http_server.py").read_text()
    assert '@app.get("/health")' in text and '@app.get("/server_info")' in text
    assert '"/generate",' in text  # registered for GET and POST through api_route
    assert '"version": __version__' in text


class StandInOutput(types.SimpleNamespace):
    """A BatchStrOutput stand-in: fields not given read as None."""

    def __getattr__(self, name):
        return None


def test_sglangs_spec_metrics_report_the_fields_the_harness_reads(src):
    tree = ast.parse((src / "srt/managers/tokenizer_manager.py").read_text())
    function = next(
        n
        for n in ast.walk(tree)
        if isinstance(n, ast.FunctionDef) and n.name == "_calculate_spec_decoding_metrics"
    )
    for arg in function.args.args:
        arg.annotation = None
    function.returns = None
    module = ast.Module(body=[function], type_ignores=[])
    namespace = {
        # 0.5.23 reads the draft width through get_spec(), 0.5.14 through self.server_args.
        "get_spec": lambda: types.SimpleNamespace(speculative_num_draft_tokens=8),
        # 0.5.23's switch for an experimental ragged-verify report, off by default.
        "_ragged_verify_cap_accept": lambda: False,
    }
    exec(compile(ast.fix_missing_locations(module), str(src), "exec"), namespace)
    manager = types.SimpleNamespace(
        server_args=types.SimpleNamespace(speculative_num_draft_tokens=8)
    )
    meta: dict = {}
    output = StandInOutput(
        spec_verify_ct=[5, 3], spec_num_correct_drafts=[11, 9], completion_tokens=[17, 13]
    )
    namespace["_calculate_spec_decoding_metrics"](manager, meta, output, 1)
    assert meta["spec_verify_ct"] == 3 and meta["spec_num_correct_drafts"] == 9
    assert meta["spec_accept_length"] == pytest.approx(13 / 3)
    # ... only for requests that were verified at least once
    unverified: dict = {}
    output.spec_verify_ct = [0, 0]
    namespace["_calculate_spec_decoding_metrics"](manager, unverified, output, 0)
    assert "spec_verify_ct" not in unverified
    # and the answer of a finished request carries them next to completion_tokens / output_ids
    text = (src / "srt/managers/tokenizer_manager.py").read_text()
    assert "self._calculate_spec_decoding_metrics(meta_info, recv_obj, i)" in text
    assert '"completion_tokens": recv_obj.completion_tokens[i]' in text
    assert '"output_ids": state.output_ids.copy()' in text
