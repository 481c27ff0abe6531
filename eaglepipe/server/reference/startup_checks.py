"""The reference server's checks before its (slow) model load: a free port, valid layer ids."""

from __future__ import annotations

import errno
import json
import socket
from pathlib import Path

from ...core.errors import PipelineError
from ...core.layers import validate_aux_layer_ids


def check_port_free(host: str, port: int) -> None:
    """Fail before the (slow) model load if the port is taken; binding later still checks."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except socket.gaierror as exc:
        raise PipelineError(f"--host {host}: cannot resolve ({exc})") from None
    with socket.socket(family, kind, proto) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind(address)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise PipelineError(f"port {port} on {host} is already in use") from None
            raise PipelineError(f"cannot listen on {host}:{port}: {exc}") from None


def check_aux_ids_against_config(model_dir: str, aux_layer_ids: list[int]) -> None:
    """Validate the layer ids from config.json alone, before the weights are loaded."""
    path = Path(model_dir) / "config.json"
    try:
        config = json.loads(path.read_text())
    except FileNotFoundError:
        raise PipelineError(f"--model {model_dir}: no config.json (a local HF model dir)") from None
    except ValueError as exc:
        raise PipelineError(f"{path} is not valid JSON: {exc}") from None
    depth = (config.get("text_config") or config).get("num_hidden_layers")
    if isinstance(depth, int):
        validate_aux_layer_ids(aux_layer_ids, depth)
