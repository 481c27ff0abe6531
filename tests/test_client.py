"""The extraction client against the real reference server (started by the real lifecycle):
checked and deleted dumps, bounded handoff bytes, retries with new attempt numbers (through a
small fault-injecting HTTP proxy in front of the real server), a row that keeps failing, and a
server that dies mid-run."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pytest
import torch
from aiohttp import web
from conftest import free_port

from eaglepipe.core.config_files import load_config
from eaglepipe.core.errors import PipelineError
from eaglepipe.core.run import resolve
from eaglepipe.extract.client import (
    ByteBudget,
    ClientSettings,
    ExtractedRow,
    ExtractionClient,
    RowRequest,
    extract_rows,
)
from eaglepipe.server.handoff.request_ids import parse_rid
from eaglepipe.server.lifecycle.leases import ServerPaths
from eaglepipe.server.lifecycle.shared_server import server_lease, stop_server
from eaglepipe.server.lifecycle.watch import liveness_check

REPO_ROOT = Path(__file__).resolve().parent.parent
H = 32


def client_config(root: Path, model_dir: Path) -> dict:
    config = load_config(REPO_ROOT / "config.yaml")
    config["model"]["path"] = str(model_dir)
    config["server"].update(
        port=free_port(),
        dump_root=str(root / "dumps"),
        device="cpu",
        dtype="float32",
        idle_timeout_s=120,
        health_timeout_s=300,
    )
    config["extract"].update(max_inflight_requests=4, retries=2, request_timeout_s=120)
    return config


@contextmanager
def lease(root: Path, config: dict):
    paths = ServerPaths.for_this_host(root / ".eaglepipe" / "server")
    try:
        with server_lease(resolve(config), paths=paths) as handle:
            yield handle
    finally:
        stop_server(paths=paths)


@pytest.fixture(scope="module")
def server(tiny_llama_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("client-server")
    config = client_config(root, tiny_llama_dir)
    with lease(root, config) as handle:
        yield config, handle


def make_rows(n: int, seed: int = 0) -> list[RowRequest]:
    rng = np.random.default_rng(seed)
    return [
        RowRequest(row_id, rng.integers(0, 300, int(rng.integers(2, 30))).tolist())
        for row_id in range(n)
    ]


def settings_for(config: dict, **overrides) -> ClientSettings:
    dump_root = Path(config["server"]["dump_root"])
    base = ClientSettings.from_run(
        resolve(config), H, dump_root, {"engine": "reference", "device": "cpu"}
    )
    return ClientSettings(**{**base.__dict__, **overrides})


def collect(handle, rows, settings, url=None):
    got: dict[int, ExtractedRow] = {}

    async def on_row(row: ExtractedRow) -> None:
        got[row.row_id] = row

    client = ExtractionClient(
        url or handle.url, handle.dump_dir, settings, liveness_check(handle), log=lambda s: None
    )
    stats = asyncio.run(client.run(rows, on_row))
    return got, stats


class FaultProxy:
    """An HTTP proxy in front of the real server that fails chosen attempts of chosen rows."""

    def __init__(
        self,
        upstream: str,
        fail: dict[int, tuple[str, int]],
        *,
        dump_dir: Path | None = None,
        land_dumps_after: int | None = None,
    ):
        self.upstream = upstream
        self.fail = fail  # row id -> (how, number of first attempts to fail)
        # With land_dumps_after, answers come before dumps, as with SGLang's hook (it writes
        # after the answer): each dump is held back under a hidden name until that many
        # requests have been answered.
        self.dump_dir = dump_dir
        self.land_dumps_after = land_dumps_after
        self.held: list[str] = []
        self.answered = 0
        self.seen: list[str] = []
        self.in_flight = 0
        self.max_in_flight = 0
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    async def _generate(self, request: web.Request) -> web.StreamResponse:
        import aiohttp

        body = await request.json()
        self.seen.append(body["rid"])
        _prefix, _nonce, row_id, attempt = parse_rid(body["rid"])
        how, count = self.fail.get(row_id, ("", 0))
        if attempt < count:
            if how == "reset":
                request.transport.close()
                return web.Response(status=500)
            return web.Response(status=503, text="overloaded")
        self.in_flight += 1
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            async with aiohttp.ClientSession() as session:
                async with session.post(f"{self.upstream}/generate", json=body) as resp:
                    answer = web.Response(status=resp.status, body=await resp.read())
        finally:
            self.in_flight -= 1
        if self.land_dumps_after is not None:
            self._hold_dump(body["rid"])
        return answer

    def _hold_dump(self, rid: str) -> None:
        dump = self.dump_dir / f"{rid}.safetensors"
        dump.rename(self.dump_dir / f".held-{rid}")
        self.held.append(rid)
        self.answered += 1
        if self.answered >= self.land_dumps_after:
            for held in self.held:
                (self.dump_dir / f".held-{held}").rename(self.dump_dir / f"{held}.safetensors")
            self.held.clear()

    async def _health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    def _serve(self) -> None:
        asyncio.set_event_loop(self._loop)
        app = web.Application()
        app.router.add_post("/generate", self._generate)
        app.router.add_get("/health", self._health)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        site = web.TCPSite(self._runner, "127.0.0.1", self.port)
        self._loop.run_until_complete(site.start())
        self._ready.set()
        self._loop.run_forever()

    def __enter__(self) -> FaultProxy:
        self._thread.start()
        self._ready.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


def test_rows_arrive_checked_and_dumps_are_deleted(server):
    config, handle = server
    rows = make_rows(12)
    got, stats = collect(handle, rows, settings_for(config))
    assert sorted(got) == [r.row_id for r in rows]
    for row in rows:
        extracted = got[row.row_id]
        assert extracted.aux_hidden_states.shape == (len(row.input_ids), 3 * H)
        assert extracted.final_hidden_states.shape == (len(row.input_ids), H)
        # The dump's bytes, without torch (the job only moves them); torch views them as bf16.
        assert extracted.aux_hidden_states.dtype == "BF16"
        assert extracted.aux_hidden_states.to_torch().dtype == torch.bfloat16
    assert stats.requests_sent == len(rows) and stats.retries == 0
    assert len(stats.nonce) == 12
    assert not list(Path(handle.dump_dir).glob("*.safetensors"))


def test_extract_rows_entry_point_uses_the_lifecycle_handle(server):
    config, handle = server
    rows = make_rows(3, seed=1)
    got = []

    async def on_row(row):
        got.append(row.row_id)

    stats = extract_rows(handle, rows, on_row, settings_for(config), log=lambda s: None)
    assert sorted(got) == [0, 1, 2] and stats.requests_sent == 3


def test_requests_in_flight_default_to_what_saturated_the_server_on_its_device(server):
    """`extract.max_inflight_requests: null` takes AUTO_INFLIGHT_REQUESTS by the server's own
    report: 32 a job from the CPU reference server here; from SGLang or a reference server on
    CUDA the H200's figures (64 an extraction job, 128 a regeneration job); a set value wins."""
    config, handle = server
    auto = {**config, "extract": {**config["extract"], "max_inflight_requests": None}}
    run = resolve(auto)
    assert handle.info["device"] == "cpu"
    settings = ClientSettings.from_run(run, H, Path(handle.dump_dir), handle.info)
    assert settings.max_inflight_requests == 32
    assert run.extract.inflight_requests("regenerate", handle.info) == 32
    on_gpu = [{**handle.info, "device": "cuda:0"}, {"engine": "sglang", "engine_version": "0.5.14"}]
    for info in on_gpu:
        assert run.extract.inflight_requests("extract", info) == 64
        assert run.extract.inflight_requests("regenerate", info) == 128
    assert resolve(config).extract.inflight_requests("regenerate", on_gpu[1]) == 4


def test_handoff_bytes_are_bounded(server):
    config, handle = server
    rows = make_rows(8, seed=2)
    with FaultProxy(handle.url, {}) as proxy:
        # A bound below one dump: requests go one at a time, never two dumps in the handoff.
        got, stats = collect(handle, rows, settings_for(config, max_inflight_bytes=1), proxy.url)
    assert len(got) == len(rows)
    assert proxy.max_in_flight == 1
    # The timing says which bound held the rows back: here the dump bytes (part of the wait).
    assert 0 < stats.bytes_wait_s <= stats.budget_wait_s
    assert stats.timing()["bytes_wait_s"] == round(stats.bytes_wait_s, 3)


def test_a_request_frees_its_slot_when_answered_not_when_its_dump_lands(server, monkeypatch):
    """SGLang answers before its hook writes the dump. Here no dump lands before 6 requests
    have been answered, with 2 slots: a client that held a slot until the dump was read would
    keep the server at 2 answered requests and wait for dumps that never come (and fail after
    DUMP_WAIT_S per attempt); one that frees the slot at the answer sends the rest, and the
    server never has more than 2 of its requests at once."""
    import eaglepipe.extract.client as client_module

    monkeypatch.setattr(client_module, "DUMP_WAIT_S", 5.0)
    config, handle = server
    rows = make_rows(6, seed=7)
    settings = settings_for(config, max_inflight_requests=2, retries=0)
    dump_dir = Path(handle.dump_dir)
    with FaultProxy(handle.url, {}, dump_dir=dump_dir, land_dumps_after=6) as proxy:
        got, stats = collect(handle, rows, settings, proxy.url)
    assert sorted(got) == [r.row_id for r in rows]
    assert stats.requests_sent == 6 and stats.retries == 0
    assert proxy.max_in_flight == 2
    assert not list(dump_dir.iterdir())
    # Held back by the two request slots, not by the (ample) dump bytes.
    assert stats.bytes_wait_s < stats.budget_wait_s


def test_byte_budget_lets_an_oversized_request_through_alone():
    async def scenario():
        budget = ByteBudget(100)
        await budget.acquire(60)
        waiter = asyncio.ensure_future(budget.acquire(500))
        await asyncio.sleep(0.05)
        assert not waiter.done()
        await budget.release(60)
        await asyncio.wait_for(waiter, 5)
        assert budget.in_use == 500

    asyncio.run(scenario())


def test_transient_errors_are_retried_with_new_attempt_numbers(server):
    config, handle = server
    rows = make_rows(6, seed=3)
    with FaultProxy(handle.url, {2: ("503", 1), 4: ("reset", 2)}) as proxy:
        got, stats = collect(handle, rows, settings_for(config), proxy.url)
    assert sorted(got) == list(range(6))
    attempts = {}
    for rid in proxy.seen:
        _p, _n, row_id, attempt = parse_rid(rid)
        attempts.setdefault(row_id, []).append(attempt)
    assert attempts[2] == [0, 1] and attempts[4] == [0, 1, 2] and attempts[0] == [0]
    assert stats.retries == 3 and stats.requests_sent == 9
    assert not list(Path(handle.dump_dir).glob("*.safetensors"))


def test_a_row_that_keeps_failing_fails_naming_it(server):
    config, handle = server
    rows = make_rows(5, seed=4)
    with FaultProxy(handle.url, {3: ("503", 99)}) as proxy:
        with pytest.raises(PipelineError, match=r"row 3 failed after 3 attempt\(s\): .*503"):
            collect(handle, rows, settings_for(config), proxy.url)


def test_server_death_fails_the_run_naming_the_server(tiny_llama_dir, tmp_path, monkeypatch):
    config = client_config(tmp_path, tiny_llama_dir)
    monkeypatch.setenv("EAGLEPIPE_FAULT", "die_after:4")
    with lease(tmp_path, config) as handle:
        monkeypatch.delenv("EAGLEPIPE_FAULT")
        with pytest.raises(PipelineError, match=r"server.*(exited|died)"):
            collect(handle, make_rows(20, seed=5), settings_for(config))


def test_a_server_that_stops_answering_fails_the_run(server):
    config, handle = server
    engine_pid = handle.state.get("engine_pid") or handle.pid
    os.kill(engine_pid, signal.SIGSTOP)  # frozen: neither /generate nor /health answers
    try:
        with pytest.raises(PipelineError, match="stopped answering"):
            collect(handle, make_rows(4, seed=6), settings_for(config, request_timeout_s=600))
    finally:
        os.kill(engine_pid, signal.SIGCONT)
