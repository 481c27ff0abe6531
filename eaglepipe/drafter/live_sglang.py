"""Live acceptance through SGLang itself (server.engine sglang).

SGLang serves the target twice, one server after the other (each needs the target's GPUs):
once plain, for the greedy reference outputs (skipped when the caller has them already), and
once with the exported drafter as its EAGLE-3 draft model, by default chain drafting
`train.ttt_length` tokens (or a given `SpeculativeSetting`'s steps / top-k / draft tokens):

    --speculative-algorithm EAGLE3 --speculative-draft-model-path drafter/export/sglang
    --speculative-num-steps k --speculative-eagle-topk 1 --speculative-num-draft-tokens k+1

Requests are greedy (`temperature: 0`, which SGLang turns into top-k 1) and run one at a time,
each stopping at the end of the turn (`stop_token_ids`) or after `evaluate.live_new_tokens`
tokens; their wall time gives the decode speed-up. The plain requests ask for the top two
logprobs of every output token (`return_logprob`, `top_logprobs_num`), the target's margin where
an output with the drafter first differs. SGLang's answer reports per request `spec_verify_ct`
(verification rounds), `spec_num_correct_drafts` (accepted draft tokens) and
`spec_accept_length` (= completion_tokens / spec_verify_ct, the prefill's token counted);
live.json's acceptance length is that ratio pooled over the prompts, the definition the
transformers harness and the offline decode-order walk use. Every flag and field is checked
against the SGLang sources by tests/test_live_sglang_contract.py.

These servers are the project's usual kind of process, started, awaited and stopped by the
same code as the hidden-state server (`server/lifecycle/process_group.py`): under the
supervisor in their own process group with unbuffered logs under logs/live_acceptance/, after
a port check naming any holder, awaited on /health with a deadline (log tail on failure), kept
alive by a lease (a killed job leaves a server that stops itself after
`server.idle_timeout_s`), and stopped as a whole group. Their command comes from the one
builder of SGLang commands (`server/sglang/recipe.server_argv`): `server.sglang` (tp_size,
mem_fraction_static, extra_args) and `server.dtype` as for the hidden-state server, but never
the project's dump hook.
"""

from __future__ import annotations

import json
import os
import secrets
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import psutil

from ..core import config as cfg
from ..core.errors import PipelineError
from ..core.run import RunSpec
from ..server.lifecycle.handle import http_get_json, log_tail, probe_health, supervisor_process
from ..server.lifecycle.leases import (
    Lease,
    ProcessRef,
    ServerPaths,
    hostname,
    live_leases,
    read_json,
)
from ..server.lifecycle.ports import describe_port_holders, port_is_free
from ..server.lifecycle.process_group import (
    sigterm_raises,
    start_supervised,
    stop_group,
    wait_healthy,
)
from ..server.lifecycle.shared_server import current_run_token, stop_if_started_by
from ..server.sglang.recipe import (
    draft_model_flags,
    free_server_port,
    server_argv,
    server_path_entries,
)
from .live_run import (
    ExportInfo,
    LiveTurn,
    PlainOutput,
    PromptRun,
    SpeculativeSetting,
    first_difference,
)

LIVE_STATE_ROOT = cfg.STATE_DIR / "live-server"
LIVE_LOG_DIR = cfg.LOG_DIR / "live_acceptance"
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


# ---------------------------------------------------------------- command line


def serve_command(
    run: RunSpec,
    *,
    host: str,
    port: int,
    draft_dir: str | os.PathLike | None = None,
    speculative: SpeculativeSetting | None = None,
) -> list[str]:
    """`python -m sglang.launch_server` for the target, with the EAGLE-3 draft when given
    (drafting with `speculative`, by default a chain of `train.ttt_length` tokens).

    No `--forward-hooks`: these servers generate, they dump nothing.
    """
    flags = []
    if draft_dir is not None:
        setting = speculative or SpeculativeSetting.chain(run.train.ttt_length)
        flags = draft_model_flags(
            draft_dir, steps=setting.steps, topk=setting.topk, draft_tokens=setting.draft_tokens
        )
    return server_argv(run, host=host, port=port, flags=flags)


# ---------------------------------------------------------------- the server process


@contextmanager
def served(
    argv: list[str],
    *,
    run: RunSpec,
    name: str,
    host: str,
    port: int,
    env: dict[str, str] | None = None,
    state_root: Path = LIVE_STATE_ROOT,
    log_dir: Path = LIVE_LOG_DIR,
) -> Iterator[str]:
    """Run `argv` as a server for the block and yield its URL once /health answers.

    Refuses a port someone holds (naming the process), waits for health with a deadline of
    `server.health_timeout_s` (the log tail in the error), and stops the whole process group
    afterwards, on failure and on Ctrl-C too, waiting until the port is free.
    """
    server = run.server
    what = f"SGLang server '{name}'"
    if not port_is_free(host, port):
        raise PipelineError(f"cannot start the {what}: {describe_port_holders(host, port)}")
    paths = ServerPaths(Path(state_root) / hostname())
    # The supervisor stops the server after server.idle_timeout_s without this lease: the last
    # resort when this job is killed before it can stop the server itself.
    lease = Lease(paths, ttl_s=server.lease_ttl_s, run_token=current_run_token(), kind=name)
    instance_id = f"live-{name}-{secrets.token_hex(3)}"
    log_path = (Path(log_dir) / f"{hostname()}-{instance_id}.log").resolve()
    log_path.parent.mkdir(parents=True, exist_ok=True)
    # The server's own path first (patch/, EAGLEPIPE_SGLANG_PYTHONPATH): as the extraction server.
    path = {"PYTHONPATH": os.pathsep.join(server_path_entries())}
    # SIGTERM (a cancelled Snakemake job) unwinds like Ctrl-C: the group is stopped below.
    with sigterm_raises():
        proc = None
        try:
            lease.acquire()
            proc, _ = start_supervised(
                argv,
                state_dir=paths.root.resolve(),
                instance_id=instance_id,
                idle_timeout_s=server.idle_timeout_s,
                lease_ttl_s=server.lease_ttl_s,
                log_path=log_path,
                extra_env={**path, **(env or {})},
            )
            try:
                create_time = ProcessRef.of(proc.pid).create_time
            except psutil.NoSuchProcess:  # exited at once; the health wait reports it
                create_time = time.time()
            print(f"started the {what}: pid {proc.pid}, port {port}, log {log_path}", flush=True)
            url = f"http://{host}:{port}"
            wait_healthy(
                proc,
                lambda: True if probe_health(url) is None else None,
                what=f"the {what}",
                timeout_s=server.health_timeout_s,
                log_path=log_path,
            )
            try:
                yield url
            except PipelineError as exc:
                code = proc.poll()
                if code is None:
                    raise
                raise PipelineError(
                    f"{exc}: the {what} exited with code {code}; last lines of {log_path}:\n"
                    f"{log_tail(log_path)}"
                ) from None
        finally:
            if proc is not None:
                if not stop_group(proc.pid, create_time, instance_id, host=host, port=port):
                    print(f"warning: port {port} still held after stopping the {what}", flush=True)
                proc.wait()
            lease.release()


def release_pipeline_server(run: RunSpec) -> None:
    """Stop this run's idle hidden-state server: the live servers need its GPUs. A server in
    use, pinned, or started by another run is left alone, with a warning."""
    paths = ServerPaths.for_this_host()
    state = read_json(paths.state)
    if not state or supervisor_process(state) is None:
        return
    if live_leases(paths, run.server.lease_ttl_s):
        print(
            "warning: the hidden-state server is in use by another job and keeps its GPUs; "
            "the live servers may not fit",
            flush=True,
        )
    elif not stop_if_started_by(current_run_token()):
        print(
            f"warning: a hidden-state server this run did not start (port {state['port']}) "
            "keeps its GPUs (`eaglepipe server stop` ends it); the live servers may not fit",
            flush=True,
        )


# ---------------------------------------------------------------- requests and answers


@dataclass(frozen=True)
class Generation:
    """One greedy /generate answer of SGLang, with its speculative counters when present."""

    output_ids: list[int]
    completion_tokens: int
    spec_verify_ct: int | None
    spec_num_correct_drafts: int | None
    spec_accept_length: float | None
    # top-1 minus top-2 logprob of each output position, when asked for
    margins: list[float | None] | None = None


def _margins(top_logprobs, where: str) -> list[float | None]:
    """SGLang's `output_top_logprobs` ([[logprob, token id, text], ...] per output position)
    as top-1 minus top-2 per position."""
    if not isinstance(top_logprobs, list):
        raise PipelineError(f"{where}: the answer has no output_top_logprobs list")
    margins: list[float | None] = []
    for entry in top_logprobs:
        try:
            margins.append(float(entry[0][0]) - float(entry[1][0]))
        except (TypeError, IndexError, ValueError):
            margins.append(None)
    return margins


def parse_generation(
    answer, *, speculative: bool, where: str, with_margins: bool = False
) -> Generation:
    """Check and read SGLang's non-streaming /generate answer (`text`, `output_ids`,
    `meta_info`); with `speculative`, the counters SGLang adds when it drafted; with
    `with_margins`, the top-two logprobs per output token."""
    if not isinstance(answer, dict) or not isinstance(answer.get("meta_info"), dict):
        raise PipelineError(f"{where}: the answer is not SGLang's JSON with meta_info")
    meta = answer["meta_info"]
    output = answer.get("output_ids")
    if not isinstance(output, list) or any(
        isinstance(t, bool) or not isinstance(t, int) for t in output
    ):
        raise PipelineError(f"{where}: output_ids is not a list of token ids")
    completion = meta.get("completion_tokens")
    if completion != len(output):
        raise PipelineError(f"{where}: completion_tokens {completion} but {len(output)} output_ids")
    verify = meta.get("spec_verify_ct")
    correct = meta.get("spec_num_correct_drafts")
    if speculative and (not isinstance(verify, int) or not isinstance(correct, int) or verify <= 0):
        raise PipelineError(
            f"{where}: the answer has no speculative counters (spec_verify_ct {verify!r}, "
            f"spec_num_correct_drafts {correct!r}): SGLang did not draft"
        )
    margins = _margins(meta.get("output_top_logprobs"), where) if with_margins else None
    return Generation(output, completion, verify, correct, meta.get("spec_accept_length"), margins)


def generate_greedy(
    url: str,
    input_ids: list[int],
    new_tokens: int,
    timeout_s: float,
    *,
    speculative: bool,
    stops=(),
    with_margins: bool = False,
) -> Generation:
    payload = {
        "input_ids": [int(t) for t in input_ids],
        "sampling_params": {
            "temperature": 0.0,
            "max_new_tokens": new_tokens,
            "stop_token_ids": [int(t) for t in stops],
        },
    }
    if with_margins:
        payload.update(return_logprob=True, top_logprobs_num=2)
    request = urllib.request.Request(
        f"{url}/generate",
        data=json.dumps(payload).encode(),
        headers={"Content-Type": "application/json"},
    )
    try:
        with _DIRECT.open(request, timeout=timeout_s) as response:
            answer = json.loads(response.read())
    except urllib.error.HTTPError as exc:
        body = exc.read()[:300].decode(errors="replace")
        raise PipelineError(f"{url}/generate answered {exc.code}: {body}") from None
    except (urllib.error.URLError, OSError, TimeoutError) as exc:
        raise PipelineError(f"{url}/generate failed: {exc}") from None
    except ValueError:
        raise PipelineError(f"{url}/generate answered with something other than JSON") from None
    return parse_generation(
        answer, speculative=speculative, where=f"{url}/generate", with_margins=with_margins
    )


# ---------------------------------------------------------------- the harness


def run_sglang(
    run: RunSpec,
    export: ExportInfo,
    captured: list[int],
    turns: list[LiveTurn],
    stops,
    *,
    speculative: SpeculativeSetting,
    plain: dict[tuple[int, int], PlainOutput] | None = None,
) -> tuple[list[PromptRun], dict]:
    """Greedy outputs from SGLang without the drafter (unless `plain` holds them already), then
    with it; the counters per prompt. `extra["plain"]` holds the plain outputs used."""
    new_tokens = run.evaluate.live_new_tokens
    timeout = run.extract.request_timeout_s
    host = run.server.host
    release_pipeline_server(run)

    if plain is None:
        plain = {}
        port = free_server_port(host)
        with served(serve_command(run, host=host, port=port), run=run, name="target",
                    host=host, port=port) as url:  # fmt: skip
            for turn in turns:
                started = time.perf_counter()
                answer = generate_greedy(
                    url, turn.prompt, new_tokens, timeout, speculative=False, stops=stops,
                    with_margins=True,
                )  # fmt: skip
                seconds = time.perf_counter() - started
                plain[(turn.row_id, turn.turn)] = PlainOutput(
                    answer.output_ids, seconds, answer.margins
                )

    runs = []
    port = free_server_port(host)
    command = serve_command(
        run, host=host, port=port, draft_dir=export.directory, speculative=speculative
    )
    with served(command, run=run, name="target+drafter", host=host, port=port) as url:
        version = _server_version(url)
        for i, turn in enumerate(turns, 1):
            started = time.perf_counter()
            answer = generate_greedy(
                url, turn.prompt, new_tokens, timeout, speculative=True, stops=stops
            )
            seconds = time.perf_counter() - started
            greedy = plain[(turn.row_id, turn.turn)]
            at = first_difference(answer.output_ids, greedy.output_ids)
            margin = None
            if at is not None and greedy.margins and at < len(greedy.margins):
                margin = greedy.margins[at]
            prompt_run = PromptRun(
                turn.row_id,
                turn.turn,
                answer.output_ids,
                greedy.output_ids,
                completion_tokens=answer.completion_tokens,
                rounds=answer.spec_verify_ct,
                accepted=answer.spec_num_correct_drafts,
                seconds=seconds,
                greedy_seconds=greedy.seconds,
                margin_at_difference=margin,
                extra={"spec_accept_length": answer.spec_accept_length},
            )
            runs.append(prompt_run)
            print(
                f"live prompt {i}/{len(turns)} (row {turn.row_id}, turn {turn.turn}): "
                f"{answer.completion_tokens} tokens in {answer.spec_verify_ct} rounds "
                f"(SGLang spec_accept_length {answer.spec_accept_length})",
                flush=True,
            )
    extra = {
        # "auto": SGLang's choice from the model's config (the check then only counts).
        "dtype": run.server.dtype,
        "sglang": {"version": version, "command": command},
        "plain": plain,
    }
    return runs, extra


@contextmanager
def plain_decoder(run: RunSpec, stops, new_tokens: int) -> Iterator:
    """SGLang serving the target alone for the block: yields `decode(prompt ids) ->
    PlainOutput` (greedy, one request at a time, with the top-two margins), the reference
    `run_sglang` takes as `plain`, for prompts that depend on earlier plain answers (a
    conversation's later turns)."""
    host, timeout = run.server.host, run.extract.request_timeout_s
    release_pipeline_server(run)
    port = free_server_port(host)
    with served(serve_command(run, host=host, port=port), run=run, name="target",
                host=host, port=port) as url:  # fmt: skip

        def decode(prompt: list[int]) -> PlainOutput:
            started = time.perf_counter()
            answer = generate_greedy(
                url, prompt, new_tokens, timeout, speculative=False, stops=stops,
                with_margins=True,
            )  # fmt: skip
            return PlainOutput(answer.output_ids, time.perf_counter() - started, answer.margins)

        yield decode


def _server_version(url: str) -> str | None:
    try:
        return http_get_json(f"{url}/server_info", 10.0).get("version")
    except (urllib.error.URLError, OSError, ValueError):
        return None
