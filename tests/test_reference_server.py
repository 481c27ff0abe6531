"""The reference server as a real process: its dumps equal a plain transformers forward, single
and batched, on the tiny Llama and DeepSeek-V3 targets; prefix filter, request validation,
writer errors and every fault mode of EAGLEPIPE_FAULT.

All server processes start together (module fixture) so their model loads overlap.
"""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import pytest
import torch
from conftest import free_port

from eaglepipe.core.errors import PipelineError
from eaglepipe.server.handoff.dumps import prepare_dump_dir, read_dump
from eaglepipe.server.handoff.request_ids import make_rid
from eaglepipe.server.reference.engine import ReferenceEngine
from eaglepipe.server.reference.faults import DIE_EXIT_CODE, ENV_VAR, parse_faults

PYTHON = sys.executable
REPO_ROOT = Path(__file__).resolve().parent.parent
AUX_IDS = [1, 3, 4]
NONCE = "00112233aabb"
START_TIMEOUT_S = 180
# Lengths of one concurrent wave: several sizes, so padding and sorting are exercised.
WAVE_LENGTHS = [3, 17, 40, 64, 5, 100, 1, 23]
TIGHT = {"rtol": 1e-5, "atol": 1e-5}
SKEW_FAULTS = "shift_layer_batched,wrong_token_count"


def rid(row: int, attempt: int = 0) -> str:
    return make_rid("eaglepipe", NONCE, row, attempt)


@dataclass
class ServerProc:
    name: str
    proc: subprocess.Popen
    url: str
    port: int
    dump_dir: Path
    log_path: Path
    model_dir: Path
    healthy: bool = False
    rows: list[int] = field(default_factory=list)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_exit(self, timeout: float = START_TIMEOUT_S) -> int:
        return self.proc.wait(timeout=timeout)

    def wait_healthy(self) -> ServerProc:
        if self.healthy:
            return self
        import urllib.request

        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                pytest.fail(
                    f"server {self.name} exited {self.proc.returncode}:\n{self.log()[-3000:]}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/health", timeout=2) as response:
                    if response.status == 200:
                        self.healthy = True
                        return self
            except OSError:
                time.sleep(0.2)
        pytest.fail(f"server {self.name} not healthy in {START_TIMEOUT_S}s:\n{self.log()[-3000:]}")

    def signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:
            pass

    def stop(self) -> None:
        """After `signal_group(SIGTERM)`: wait briefly, then kill the whole group."""
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.signal_group(signal.SIGKILL)
            self.proc.wait()


def launch(
    name, model_dir, root: Path, *, fault=None, aux_ids=AUX_IDS, port=None, attention="auto"
) -> ServerProc:
    port = port or free_port()
    dump_dir = root / "dumps" / name
    log_path = root / f"{name}.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop(ENV_VAR, None)
    if fault:
        env[ENV_VAR] = fault
    cmd = [
        PYTHON, "-u", "-m", "eaglepipe.server.reference.server",
        "--model", str(model_dir),
        "--aux-layer-ids", ",".join(map(str, aux_ids)),
        "--host", "127.0.0.1", "--port", str(port),
        "--dump-dir", str(dump_dir),
        "--request-prefix", "eaglepipe",
        "--device", "cpu", "--dtype", "auto",
        "--max-batch-tokens", "4096",
        "--attention", attention,
        "--instance-id", name,
        "--batch-window-ms", "30",
    ]  # fmt: skip
    with open(log_path, "wb") as log_file:
        proc = subprocess.Popen(
            cmd,
            cwd=REPO_ROOT,
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    return ServerProc(name, proc, f"http://127.0.0.1:{port}", port, dump_dir, log_path, model_dir)


@pytest.fixture(scope="module")
def fleet(tmp_path_factory, tiny_llama_dir, tiny_deepseek_dir):
    root = tmp_path_factory.mktemp("reference-servers")
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    held.listen()
    servers = {
        "llama": launch("llama", tiny_llama_dir, root),
        "packed": launch("packed", tiny_llama_dir, root, attention="packed"),
        "deepseek": launch("deepseek", tiny_deepseek_dir, root),
        "skewed": launch("skewed", tiny_llama_dir, root, fault=SKEW_FAULTS),
        # Serves 1 request, stalls on the 2nd, dies when the 4th arrives.
        "stalls": launch("stalls", tiny_llama_dir, root, fault="hang_after:1,die_after:3"),
        "bad_ids": launch("bad_ids", tiny_llama_dir, root, aux_ids=[1, 3, 9]),
        "port_taken": launch("port_taken", tiny_llama_dir, root, port=held.getsockname()[1]),
    }  # fmt: skip
    try:
        yield servers
    finally:
        for server in servers.values():
            server.signal_group(signal.SIGTERM)
        for server in servers.values():
            server.stop()
        held.close()


# ----------------------------------------------------------------------------- helpers


async def _post(session, url, body, timeout=120):
    async with session.post(f"{url}/generate", json=body, timeout=timeout) as response:
        return response.status, await response.json()


def generate(server: ServerProc, requests: list[dict], timeout: float = 120) -> list:
    """Send all requests concurrently; returns (status, json) per request, in order."""

    async def run():
        async with aiohttp.ClientSession() as session:
            coros = [_post(session, server.url, body, timeout) for body in requests]
            return await asyncio.gather(*coros)

    return asyncio.run(run())


def body(row_rid: str | None, input_ids: list[int], max_new_tokens=0) -> dict:
    payload = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": max_new_tokens}}
    if row_rid is not None:
        payload["rid"] = row_rid
    return payload


def token_ids(length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, 300, (length,), generator=gen).tolist()


_REFERENCE_MODELS: dict[Path, torch.nn.Module] = {}


def reference_states(model_dir: Path, ids: list[int]) -> dict[int, torch.Tensor]:
    """HF hidden_states of one unbatched fp32 forward: index i -> [T, H]."""
    from transformers import AutoModelForCausalLM

    if model_dir not in _REFERENCE_MODELS:
        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
        _REFERENCE_MODELS[model_dir] = model.eval()
    with torch.no_grad():
        out = _REFERENCE_MODELS[model_dir](
            input_ids=torch.tensor([ids]), output_hidden_states=True, use_cache=False
        )
    return {i: h[0] for i, h in enumerate(out.hidden_states)}


def expected_aux(states: dict[int, torch.Tensor], aux_ids: list[int]) -> torch.Tensor:
    return torch.cat([states[k + 1] for k in aux_ids], dim=-1)  # aux id k = hidden_states[k + 1]


def assert_bf16_of(dumped: torch.Tensor, reference: torch.Tensor) -> None:
    """`dumped` (bf16) is `reference` (fp32) up to bf16 rounding: within half a bf16 ulp plus
    fp32 noise everywhere, and bit-equal to the rounded reference almost everywhere."""
    assert dumped.dtype == torch.bfloat16 and dumped.shape == reference.shape
    torch.testing.assert_close(dumped.float(), reference, rtol=2**-8, atol=1e-5)
    exact = (dumped == reference.to(torch.bfloat16)).float().mean().item()
    assert exact > 0.97, f"only {exact:.3f} of the values equal the bf16-rounded reference"


def read_row(server: ServerProc, row_rid: str):
    return read_dump(server.dump_dir / f"{row_rid}.safetensors")


# ----------------------------------------------------------------------------- tests


def test_in_process_batched_forward_matches_transformers_fp32(tiny_llama_dir, tiny_deepseek_dir):
    """The capture hooks on a padded batch equal unbatched output_hidden_states in fp32."""
    for model_dir in (tiny_llama_dir, tiny_deepseek_dir):
        engine = ReferenceEngine(
            model_dir, AUX_IDS, device=torch.device("cpu"), dtype=torch.float32
        )
        sequences = [token_ids(n, seed=n) for n in (9, 1, 30, 4)]
        aux, final, counts = engine.forward(sequences)
        assert counts == [9, 1, 30, 4]
        assert aux.dtype == torch.float32 and aux.shape == (sum(counts), 3 * 32)
        start = 0
        for seq in sequences:
            states = reference_states(model_dir, seq)
            end = start + len(seq)
            torch.testing.assert_close(aux[start:end], expected_aux(states, AUX_IDS), **TIGHT)
            torch.testing.assert_close(final[start:end], states[len(states) - 1], **TIGHT)
            start = end
        engine.capture.remove()


@pytest.mark.parametrize("drop_last", [False, True])
def test_packed_forward_matches_transformers_fp32(tiny_llama_dir, tiny_deepseek_dir, drop_last):
    """Requests packed end to end in one row (positions restart per request, padding segment
    at the end) give each request exactly its unbatched hidden states: no attention crosses
    from one request into another."""
    for model_dir in (tiny_llama_dir, tiny_deepseek_dir):
        engine = ReferenceEngine(
            model_dir, AUX_IDS, device=torch.device("cpu"), dtype=torch.float32, attention="packed"
        )
        assert (engine.layout, engine.attn_implementation) == ("packed", "sdpa")
        sequences = [token_ids(n, seed=n) for n in (9, 1, 30, 4)]
        aux, final, counts = engine.forward(sequences, capacity=64, drop_last=drop_last)
        lengths = [len(s) for s in sequences]
        assert counts == ([max(n - 1, 1) for n in lengths] if drop_last else lengths)
        assert aux.shape == (sum(counts), 3 * 32) and final.shape == (sum(counts), 32)
        start = 0
        for seq, kept in zip(sequences, counts, strict=True):
            states = reference_states(model_dir, seq)
            end = start + kept
            torch.testing.assert_close(
                aux[start:end], expected_aux(states, AUX_IDS)[:kept], **TIGHT
            )
            torch.testing.assert_close(final[start:end], states[len(states) - 1][:kept], **TIGHT)
            start = end
        # One request that fills the row exactly: no padding segment, plain causal attention.
        [seq] = [token_ids(16, seed=3)]
        aux, final, counts = engine.forward([seq], capacity=16)
        states = reference_states(model_dir, seq)
        torch.testing.assert_close(final, states[len(states) - 1], **TIGHT)
        engine.capture.remove()


def test_packed_server_batches_requests_into_one_row(fleet):
    """The packed server dumps what transformers computes per request, batches a concurrent
    wave into rows of at most --max-batch-tokens real tokens, and reports its layout and
    where its forward thread's time went."""
    server = fleet["packed"].wait_healthy()
    sequences = {300 + i: token_ids(n, seed=50 + i) for i, n in enumerate(WAVE_LENGTHS)}
    answers = generate(server, [body(rid(row), ids) for row, ids in sequences.items()])
    assert all(status == 200 for status, _ in answers), answers
    sizes = [answer["meta_info"]["batch_size"] for _, answer in answers]
    assert max(sizes) > 1, f"concurrent requests were never batched: {sizes}"
    for row, ids in sequences.items():
        aux, final, meta = read_row(server, rid(row))
        assert meta["num_tokens"] == len(ids)
        states = reference_states(server.model_dir, ids)
        assert_bf16_of(aux, expected_aux(states, AUX_IDS))
        assert_bf16_of(final, states[len(states) - 1])
    info = asyncio.run(_get_json(server.url + "/server_info"))
    assert (info["batch_layout"], info["attn_implementation"]) == ("packed", "sdpa")
    stats = asyncio.run(_get_json(server.url + "/stats"))
    assert stats["requests"] >= len(sequences) and stats["batches"] >= 1
    assert stats["busy_s"] > 0 and stats["idle_s"] > 0
    # Packed rows are computed at full width: the padding segment counts, nothing else.
    assert stats["computed_tokens"] == 4096 * stats["batches"]


def test_server_info_model_info_and_dump_dir(fleet, tiny_llama_dir):
    server = fleet["llama"].wait_healthy()

    async def fetch():
        async with aiohttp.ClientSession() as session:
            out = {}
            for path in ("/server_info", "/model_info"):
                async with session.get(server.url + path) as response:
                    out[path] = await response.json()
            async with session.get(server.url + "/health_generate") as response:
                out["health_generate"] = response.status
            return out

    got = asyncio.run(fetch())
    info = got["/server_info"]
    assert info["engine"] == "reference"
    assert info["engine_version"].startswith("0.1.0+transformers-")
    assert info["model_path"] == str(tiny_llama_dir)
    assert info["aux_layer_ids"] == AUX_IDS
    assert info["layer_convention"] == "decoder-layer-output-0based"
    assert (info["hidden_size"], info["num_layers"], info["dtype"]) == (32, 8, "float32")
    assert info["dump_dir"] == str(server.dump_dir)
    assert (info["request_prefix"], info["instance_id"]) == ("eaglepipe", "llama")
    assert len(info["fingerprint"]) == 32
    # Same model and layers on another instance: same fingerprint.
    skewed = fleet["skewed"].wait_healthy()
    with_skew = asyncio.run(_get_json(skewed.url + "/server_info"))
    assert with_skew["fingerprint"] == info["fingerprint"]
    assert got["/model_info"]["is_generation"] is True
    assert got["/model_info"]["model_path"] == str(tiny_llama_dir)
    assert got["health_generate"] == 200
    assert stat.S_IMODE(server.dump_dir.stat().st_mode) == 0o700
    assert not list(server.dump_dir.iterdir()), "health_generate must not dump"


async def _get_json(url):
    async with aiohttp.ClientSession() as session:
        async with session.get(url) as response:
            return await response.json()


@pytest.mark.parametrize("name", ["llama", "deepseek"])
def test_dumps_equal_transformers_single_and_batched(fleet, name):
    server = fleet[name].wait_healthy()
    single_ids = token_ids(12, seed=1000)
    [(status, single)] = generate(server, [body(rid(0), single_ids)])
    assert status == 200, single
    assert single["meta_info"]["prompt_tokens"] == 12
    assert single["meta_info"]["batch_size"] == 1
    sequences = {100 + i: token_ids(n, seed=i) for i, n in enumerate(WAVE_LENGTHS)}
    sequences[0] = single_ids
    answers = generate(server, [body(rid(row), sequences[row]) for row in sequences if row])
    assert all(status == 200 for status, _ in answers), answers
    sizes = [answer["meta_info"]["batch_size"] for _, answer in answers]
    assert max(sizes) > 1, f"concurrent requests were never batched: {sizes}"
    for row, ids in sequences.items():
        aux, final, meta = read_row(server, rid(row))
        assert meta["num_tokens"] == len(ids) and meta["aux_layer_ids"] == AUX_IDS
        states = reference_states(server.model_dir, ids)
        assert_bf16_of(aux, expected_aux(states, AUX_IDS))
        assert_bf16_of(final, states[len(states) - 1])  # final = hidden_states[-1]


def test_prefix_filter_only_dumps_pipeline_rids(fleet):
    server = fleet["llama"].wait_healthy()
    before = set(os.listdir(server.dump_dir))
    other_rids = [
        "warmup-1",
        f"eaglepipeX-{NONCE}-1-0",
        f"other-{NONCE}-1-0",
        None,
    ]
    answers = generate(server, [body(r, token_ids(6, seed=7)) for r in other_rids])
    assert [status for status, _ in answers] == [200] * len(other_rids)
    answers = generate(server, [body(rid(500), token_ids(6, seed=7))])
    assert answers[0][0] == 200
    assert set(os.listdir(server.dump_dir)) - before == {f"{rid(500)}.safetensors"}


@pytest.mark.parametrize(
    ("payload", "names"),
    [
        ({"sampling_params": {"max_new_tokens": 0}}, "input_ids is required"),
        ({"text": "hi", "sampling_params": {"max_new_tokens": 0}}, "does not tokenize"),
        (body(rid(1), [1, 2], max_new_tokens=5), "extraction requests are prefill only"),
        ({"input_ids": [1, 2], "rid": rid(1)}, "sampling_params.max_new_tokens"),
        (body(rid(1), [1] * 1025), "more than max_position_embeddings 1024"),
        (body(rid(1), [1, 300]), "token id 300 outside the vocabulary"),
        (body(rid(1), [[1, 2], [3]]), "flat list"),
        (body(rid(1), []), "non-empty"),
        (body("eaglepipe-not-a-row", [1, 2]), "rid: request id 'eaglepipe-not-a-row'"),
    ],
)
def test_bad_requests_get_400_naming_the_field(fleet, payload, names):
    server = fleet["llama"].wait_healthy()
    [(status, answer)] = generate(server, [payload])
    assert status == 400
    assert names in answer["error"]["message"]


def test_non_json_body_is_400(fleet):
    server = fleet["llama"].wait_healthy()

    async def send():
        async with aiohttp.ClientSession() as session:
            async with session.post(server.url + "/generate", data=b"{not json") as response:
                return response.status, await response.json()

    status, answer = asyncio.run(send())
    assert status == 400 and "not valid JSON" in answer["error"]["message"]


def test_writer_error_is_an_http_error_naming_the_rid(fleet):
    server = fleet["llama"].wait_healthy()
    shutil.rmtree(server.dump_dir)
    try:
        [(status, answer)] = generate(server, [body(rid(900), token_ids(5, seed=9))])
    finally:
        prepare_dump_dir(server.dump_dir)
    assert status == 500
    assert f"dump of request {rid(900)}" in answer["error"]["message"]
    # The server keeps serving once the directory is back.
    [(status, _)] = generate(server, [body(rid(901), token_ids(5, seed=9))])
    assert status == 200 and (server.dump_dir / f"{rid(901)}.safetensors").exists()


def test_fault_shift_layer_batched_and_wrong_token_count(fleet):
    server = fleet["skewed"].wait_healthy()
    shifted_ids = [k + 1 for k in AUX_IDS]
    single_ids = token_ids(10, seed=50)
    [(status, single)] = generate(server, [body(rid(0), single_ids)])
    assert status == 200 and single["meta_info"]["batch_size"] == 1
    assert single["meta_info"]["prompt_tokens"] == 10  # the response still tells the truth
    aux, final, meta = read_row(server, rid(0))
    assert meta["num_tokens"] == 9 and aux.shape[0] == 9  # one token short
    states = reference_states(server.model_dir, single_ids)
    assert_bf16_of(aux, expected_aux(states, AUX_IDS)[:9])  # alone: the right layers
    sequences = {10 + i: token_ids(n, seed=60 + i) for i, n in enumerate(WAVE_LENGTHS)}
    answers = generate(server, [body(rid(row), ids) for row, ids in sequences.items()])
    batched = 0
    for (status, answer), (row, ids) in zip(answers, sequences.items(), strict=True):
        assert status == 200
        aux, _, meta = read_row(server, rid(row))
        kept = max(len(ids) - 1, 1)
        assert meta["num_tokens"] == kept
        states = reference_states(server.model_dir, ids)
        if answer["meta_info"]["batch_size"] > 1:
            batched += 1
            assert_bf16_of(aux, expected_aux(states, shifted_ids)[:kept])
            with pytest.raises(AssertionError):  # and not the configured ones
                assert_bf16_of(aux, expected_aux(states, AUX_IDS)[:kept])
        else:
            assert_bf16_of(aux, expected_aux(states, AUX_IDS)[:kept])
    assert batched > 0


def test_fault_hang_then_die(fleet):
    server = fleet["stalls"].wait_healthy()
    [(status, _)] = generate(server, [body(rid(1), token_ids(4, seed=1))])
    assert status == 200  # hang_after:1 serves the first request

    async def probe():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=3)) as session:

            async def status_of(method, path, **kwargs):
                try:
                    async with session.request(method, server.url + path, **kwargs) as response:
                        return response.status
                except TimeoutError:
                    return "timeout"
                except aiohttp.ClientError as exc:
                    return type(exc).__name__

            return [
                await status_of("POST", "/generate", json=body(rid(2), [1, 2, 3])),
                await status_of("GET", "/health"),
                await status_of("GET", "/health_generate"),
                await status_of("POST", "/generate", json=body(rid(3), [1, 2, 3])),
                # The 4th generate request (die_after:3) ends the process.
                await status_of("POST", "/generate", json=body(rid(4), [1, 2, 3])),
            ]

    stuck, health, health_generate, also_stuck, killer = asyncio.run(probe())
    assert (stuck, also_stuck) == ("timeout", "timeout")  # generate never answers
    assert health == 200  # the HTTP side lives on
    assert health_generate == "timeout"  # but the worker is stalled
    assert killer == "ServerDisconnectedError"
    assert server.wait_exit(timeout=30) == DIE_EXIT_CODE
    assert "die_after:3: exiting on generate request 4" in server.log()
    assert [p.name for p in server.dump_dir.iterdir()] == [f"{rid(1)}.safetensors"]


def test_bad_aux_ids_exit_with_one_line_error(fleet):
    server = fleet["bad_ids"]
    assert server.wait_exit() == 1
    assert "error: aux_layer_ids [1, 3, 9] for a 8-layer model" in server.log()


def test_port_in_use_is_named(fleet):
    server = fleet["port_taken"]
    assert server.wait_exit() == 1
    assert f"error: port {server.port} on 127.0.0.1 is already in use" in server.log()


def test_fault_syntax():
    assert parse_faults("shift_layer_batched, die_after:3").die_after == 3
    assert parse_faults("hang").hang_after == 0
    assert not parse_faults("").active
    from eaglepipe.core.errors import PipelineError

    with pytest.raises(PipelineError, match="unknown fault 'explode'"):
        parse_faults("explode")
    with pytest.raises(PipelineError, match="die_after needs a non-negative count"):
        parse_faults("die_after:x")


def test_sigterm_stops_cleanly(fleet):
    """Runs last in this file: it ends the skewed server (its own test is done by now)."""
    server = fleet["skewed"].wait_healthy()
    server.signal_group(signal.SIGTERM)
    assert server.wait_exit(timeout=30) == 0
    assert "stopped after" in server.log()
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as a new server would
        sock.bind(("127.0.0.1", server.port))  # nobody listens there any more


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_of_a_machine_without_it_names_the_config_key():
    from eaglepipe.server.reference.settings import resolve_device

    with pytest.raises(PipelineError) as raised:
        resolve_device("cuda")
    assert str(raised.value) == (
        "server.device cuda (the server's --device): CUDA is not available on this machine (no "
        "GPU, or a CPU build of torch): use auto or cpu"
    )
