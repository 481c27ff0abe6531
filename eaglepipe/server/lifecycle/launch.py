"""What a server runs: its launch settings, their fingerprint, and the engine's command line."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

from ...core.errors import PipelineError
from ...core.fingerprint import hash_json
from ...core.run import RunSpec
from .identity import CAPTURE, server_identity, server_purpose


def launch_settings(run: RunSpec, purpose: str = CAPTURE) -> dict:
    """Everything that decides what the server computes (`identity.server_identity`); its hash
    is the fingerprint: a job never uses a running server whose fingerprint differs."""
    return server_identity(run, purpose)


def server_fingerprint(run: RunSpec, purpose: str = CAPTURE) -> str:
    return hash_json(launch_settings(run, purpose))


def engine_command(
    run: RunSpec,
    *,
    host: str,
    port: int,
    dump_dir: Path,
    instance_id: str,
    purpose: str = CAPTURE,
) -> tuple[list[str], dict[str, str]]:
    """The engine's argv and extra environment (the supervisor runs it)."""
    engine = run.server.engine
    if engine == "sglang":
        try:
            sglang = importlib.import_module("eaglepipe.server.sglang.recipe")
        except ModuleNotFoundError as exc:
            if exc.name != "eaglepipe.server.sglang.recipe":
                raise
            raise PipelineError(
                "server.engine sglang: the sglang engine is unavailable in this installation "
                "(eaglepipe/server/sglang/recipe.py is missing)"
            ) from None
        return sglang.launch_command(
            run,
            host=host,
            port=port,
            dump_dir=dump_dir,
            instance_id=instance_id,
            capture=server_purpose(run, purpose) == CAPTURE,
        )
    server = run.server
    argv = [
        sys.executable,
        "-u",
        "-m",
        "eaglepipe.server.reference.server",
        "--model",
        str(run.model.directory.resolve()),
        "--aux-layer-ids",
        ",".join(str(i) for i in run.aux_layer_ids),
        "--host",
        host,
        "--port",
        str(port),
        "--dump-dir",
        str(dump_dir),
        "--request-prefix",
        run.extract.request_prefix,
        "--device",
        server.device,
        "--dtype",
        server.dtype,
        "--max-batch-tokens",
        str(server.max_batch_tokens),
        "--attention",
        server.attention,
        "--instance-id",
        instance_id,
    ]
    if run.model.trust_remote_code:
        argv.append("--trust-remote-code")
    store = run.extract.store
    argv += ["--store-aux", store.aux, "--store-final", store.final]
    return argv, {}
