"""The dump handoff: one safetensors file per request, written by the server, read by the client.

For each request whose id starts with `<prefix>-` the server writes
`<dump_dir>/<rid>.safetensors` holding `aux_hidden_states` ([T, 3H], the aux layers
concatenated in id order) and `final_hidden_states` ([T, H]), each bf16 or, with an FP8 store,
e4m3 beside its float32 `<name>_scale` [T, k] (core/hidden_store.py), with string metadata `rid`,
`num_tokens`, `hidden_size`, `aux_layer_ids`, and `batch_requests` / `batch_tokens`: how many
requests (any prefix, health checks included) and real tokens the forward pass that computed the
request held. The file is written under the dot-prefixed temp name `.<rid>.safetensors.tmp` and
renamed into place, so a reader never sees a partial dump: a dump is complete exactly when its
final name exists, and `await_dump` / `wait_for_dump` are the one way the pipeline waits for that
(the SGLang hook writes from a background thread, so its dump can land after the HTTP answer).
A dump the writer could not write (a full handoff, most often) leaves `<rid>.failed` instead,
holding the error: SGLang has already answered the request, and without it a reader would wait
`DUMP_WAIT_S` for a file that never comes and then not know why.

The client reads dumps without torch (`read_dump_raw`); `read_dump` gives torch tensors.
The writer is `dump_writer.py` (shared by the reference server and the SGLang hook); the
request ids are `request_ids.py`'s.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import pwd
import re
import shutil
import stat
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from ...core.errors import PipelineError
from ...core.hidden_store import AUX_KEY, BF16_STORE, FINAL_KEY, SCALE_DTYPE, HiddenStore, scale_key
from ...core.space import format_bytes, free_bytes
from ...core.tensor_bytes import RawTensor, read_safetensors, torch_dtype_text

if TYPE_CHECKING:
    import torch

DUMP_SUFFIX = ".safetensors"
TEMP_SUFFIX = ".safetensors.tmp"
FAILED_SUFFIX = ".failed"
# How long a reader waits for the dump of an answered request. The reference server answers
# after the rename; SGLang answers when the forward is done and its hook's writer thread renames
# the file a little later (longer behind a backlog of large batches).
DUMP_WAIT_S = 60.0
DUMP_POLL_S = 0.005
# A request id becomes a file name: no separators, no leading dot (temp names start with one).
_SAFE_NAME_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]*$")


def dump_path(dump_dir: str | os.PathLike, rid: str) -> Path:
    if not isinstance(rid, str) or not _SAFE_NAME_RE.match(rid):
        raise PipelineError(f"request id {rid!r} cannot name a dump file")
    return Path(dump_dir) / f"{rid}{DUMP_SUFFIX}"


def temp_dump_path(dump_dir: str | os.PathLike, rid: str) -> Path:
    dump_path(dump_dir, rid)
    return Path(dump_dir) / f".{rid}{TEMP_SUFFIX}"


def failed_dump_path(dump_dir: str | os.PathLike, rid: str) -> Path:
    """Where the writer says why the dump of `rid` was not written."""
    dump_path(dump_dir, rid)
    return Path(dump_dir) / f"{rid}{FAILED_SUFFIX}"


def mark_dump_failed(dump_dir: str | os.PathLike, rid: str, error: str) -> None:
    """Leave `<rid>.failed` holding `error`. Best effort: on a full file system the note may
    stay empty (its reader then names the server's answer or log) or not be created at all
    (its reader then times out, naming the handoff's free space); a rid that cannot name a
    file gets none."""
    with contextlib.suppress(OSError, PipelineError):
        failed_dump_path(dump_dir, rid).write_text(error)


# ----------------------------------------------------------------------------- directory


def prepare_dump_dir(
    path: str | os.PathLike, *, what: str = "dump directory", refuse_open_mode: bool = False
) -> Path:
    """Create the dump directory with mode 0700 (missing parents too), or check an existing one;
    returns its real path.

    The handoff dir usually lives in a shared tmpfs where another user could otherwise read or
    plant dumps. So the path to it is resolved one component at a time, and refused when it
    passes through a directory another user owns or may write (sticky ones such as /tmp and
    /dev/shm excepted: there only an entry's owner may replace it), or through a symlink another
    user owns: that user could redirect it. The directory itself must be a real directory owned
    by this user: a wrong owner or a symlink is refused. Any other mode than 0700 is fixed (the
    directory is ours), except that with `refuse_open_mode` (the handoff root, a predictable
    path that may have sat open for a while) one writable by group or others is refused.
    """
    given = Path(path).absolute()
    parent = _resolve_trusted(given.parent, given, what)
    path = parent / given.name
    missing = []
    probe = path
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = probe.parent
    for directory in reversed(missing):
        try:
            os.mkdir(directory, 0o700)
        except FileExistsError:
            pass  # created concurrently by another process; checked below
        except OSError as exc:
            raise PipelineError(f"cannot create {what} {directory}: {exc}") from None
    mode = _check_own_directory(path, given, what, refuse_open_mode)
    if mode != 0o700:
        try:
            os.chmod(path, 0o700)
        except OSError as exc:
            raise PipelineError(f"cannot set mode 0700 on {what} {given}: {exc}") from None
    return path


def check_dump_root(path: str | os.PathLike, *, what: str = "server.dump_root") -> None:
    """What `prepare_dump_dir` would refuse about an existing handoff root, found when the
    workflow starts (before a toy build or a server start) and without creating anything. A
    root that does not exist yet is left to the server's start: on a cluster it may exist only
    on the compute nodes."""
    given = Path(path).absolute()
    target = _resolve_trusted(given.parent, given, what) / given.name
    if os.path.lexists(target):
        _check_own_directory(target, given, what, refuse_open_mode=True)


def _check_own_directory(path: Path, given: Path, what: str, refuse_open_mode: bool) -> int:
    """Refuse `path` unless it is a real directory of this user (and, with `refuse_open_mode`,
    not writable by group or others); returns its mode bits."""
    info = os.lstat(path)
    if stat.S_ISLNK(info.st_mode):
        raise PipelineError(f"{what} {given} is a symlink; refusing to write through it")
    if not stat.S_ISDIR(info.st_mode):
        raise PipelineError(f"{what} {given} exists but is not a directory")
    if info.st_uid != os.getuid():
        raise PipelineError(
            f"{what} {given} is owned by {_user_name(info.st_uid)}, not by this user "
            f"({_user_name(os.getuid())}): another user could read or plant dumps there; remove "
            "it or choose another server.dump_root"
        )
    mode = stat.S_IMODE(info.st_mode)
    if mode & 0o022 and refuse_open_mode:
        raise PipelineError(
            f"{what} {given} has mode {mode:o} (writable by group or others): check what is in "
            f"it, then `chmod 700 {path}`, or choose another server.dump_root"
        )
    return mode


_MAX_SYMLINKS = 40  # the kernel's limit on links followed in one lookup


def _resolve_trusted(directory: Path, given: Path, what: str) -> Path:
    """The real path of `directory` (an absolute path whose tail may not exist yet), checking
    every directory and symlink passed on the way: each must belong to root or to this user,
    and a directory writable by group or others must be sticky."""
    trusted_uids = {0, os.getuid()}

    def refuse(place: Path, why: str) -> PipelineError:
        return PipelineError(
            f"{what} {given} is reached through {place}, {why}: that user could redirect or "
            "replace what lies below it; choose another server.dump_root"
        )

    current = Path("/")
    pending = list(directory.parts[1:])
    followed = 0
    while pending:
        part = pending.pop(0)
        if part in ("", "."):
            continue
        if part == "..":
            current = current.parent
            continue
        candidate = current / part
        try:
            info = os.lstat(candidate)
        except FileNotFoundError:
            # The rest is created below a checked directory.
            return Path(os.path.normpath(candidate.joinpath(*pending)))
        if info.st_uid not in trusted_uids:
            kind = "a symlink" if stat.S_ISLNK(info.st_mode) else "a directory"
            raise refuse(candidate, f"{kind} owned by {_user_name(info.st_uid)}")
        if stat.S_ISLNK(info.st_mode):
            followed += 1
            if followed > _MAX_SYMLINKS:
                raise PipelineError(f"{what} {given}: too many levels of symlinks")
            target = Path(os.readlink(candidate))
            if target.is_absolute():
                current, target = Path("/"), target.relative_to("/")
            pending = [*target.parts, *pending]
            continue
        if not stat.S_ISDIR(info.st_mode):
            raise PipelineError(f"{what} {given}: {candidate} is not a directory")
        mode = stat.S_IMODE(info.st_mode)
        if mode & 0o022 and not mode & stat.S_ISVTX:
            raise refuse(candidate, f"a directory others may write (mode {mode:o}, not sticky)")
        current = candidate
    return current


def _user_name(uid: int) -> str:
    try:
        return f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        return f"uid {uid}"


# ----------------------------------------------------------------------------- completion


class DumpNotWritten(PipelineError):
    """The server answered a request but its dump did not appear in time, or its writer
    said it could not write it."""


def handoff_space_note(dump_dir: str | os.PathLike) -> str:
    """`the handoff DIR has N free`, for messages about dumps that did not come."""
    try:
        free = free_bytes(dump_dir)
    except OSError as exc:
        return f"the handoff {dump_dir} cannot be read: {exc}"
    return f"the handoff {dump_dir} has {format_bytes(free)} free"


def handoff_usage(dump_dir: str | os.PathLike) -> dict | None:
    """What waits in a server's dump dir (dumps, with temp files of writes in progress, and
    failed-write notes) and its file system's free and total bytes; None when it is gone."""
    dumps = dump_bytes = failed = 0
    try:
        with os.scandir(dump_dir) as entries:
            for entry in entries:
                if entry.name.endswith(FAILED_SUFFIX):
                    failed += 1
                elif entry.name.endswith((DUMP_SUFFIX, TEMP_SUFFIX)):
                    dumps += 1
                    dump_bytes += entry.stat(follow_symlinks=False).st_size
        usage = shutil.disk_usage(dump_dir)
    except FileNotFoundError:
        return None
    return {
        "dumps": dumps,
        "dump_bytes": dump_bytes,
        "failed_notes": failed,
        "free_bytes": usage.free,
        "total_bytes": usage.total,
    }


def take_dump_failure(path: str | os.PathLike, known_error: str | None = None) -> str | None:
    """When the writer left a note for the dump at `path`: one line with its error (or
    `known_error`, the server's answer, when the note is empty: on a full file system the note
    is created but its text may not fit) and the handoff's free space; the note is removed.
    None when there is no note."""
    path = Path(path)
    marker = failed_dump_path(path.parent, path.name.removesuffix(DUMP_SUFFIX))
    try:
        error = marker.read_text(errors="replace").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        error = f"(its note {marker} is unreadable: {exc})"
    marker.unlink(missing_ok=True)
    error = error or known_error or "(its error did not fit there either; the server's log has it)"
    return (
        f"the server could not write dump {path}: {error}; {handoff_space_note(path.parent)} "
        "(free space there, or lower extract.max_inflight_bytes)"
    )


async def await_dump(path: str | os.PathLike, within_s: float = DUMP_WAIT_S) -> Path:
    """Wait until the dump at `path` is complete (its final name exists); return the path.

    Raises DumpNotWritten after `within_s` seconds. The writer renames a finished temp file into
    place, so existence of the final name is completeness; nothing else needs to be polled.
    """
    path = Path(path)
    deadline = time.monotonic() + within_s
    while not path.exists():
        failure = take_dump_failure(path)
        if failure is not None:
            raise DumpNotWritten(failure)
        if time.monotonic() > deadline:
            raise DumpNotWritten(
                f"the server answered request {path.name.removesuffix(DUMP_SUFFIX)} but wrote "
                f"no dump {path} within {within_s:g}s; {handoff_space_note(path.parent)}"
            )
        await asyncio.sleep(DUMP_POLL_S)
    return path


def wait_for_dump(path: str | os.PathLike, within_s: float = DUMP_WAIT_S) -> Path:
    """`await_dump` for synchronous callers (the validation spot check)."""
    return asyncio.run(await_dump(path, within_s))


# ----------------------------------------------------------------------------- reading


def read_dump_raw(
    path: str | os.PathLike, store: HiddenStore | None = None
) -> tuple[dict[str, RawTensor], dict]:
    """Load one complete dump without torch: its tensors as RawTensors (core/tensor_bytes.py),
    `aux_hidden_states` [T, 3H] and `final_hidden_states` [T, H] in bf16 or e4m3, with a
    `<name>_scale` [T, k] beside each e4m3 one, and its metadata with ints decoded and `store`
    (the HiddenStore its dtypes make). With `store`, a dump of another store is refused.

    The tensors map the file rather than copy it, so no copy is made on the client's hot path;
    deleting the file frees its space only once the tensors are gone."""
    path = Path(path)
    try:
        raw_meta, tensors = read_safetensors(path)
    except FileNotFoundError:
        raise PipelineError(f"dump {path} does not exist") from None
    except Exception as exc:  # a torn or foreign file: say which, in one line
        raise PipelineError(f"dump {path} is unreadable: {exc}") from None
    missing = {AUX_KEY, FINAL_KEY} - set(tensors)
    if missing:
        raise PipelineError(f"dump {path} lacks tensor(s) {', '.join(sorted(missing))}")
    try:
        meta = {
            "rid": raw_meta["rid"],
            "num_tokens": int(raw_meta["num_tokens"]),
            "hidden_size": int(raw_meta["hidden_size"]),
            "aux_layer_ids": [int(i) for i in raw_meta["aux_layer_ids"].split(",")],
            "batch_requests": int(raw_meta["batch_requests"]),
            "batch_tokens": int(raw_meta["batch_tokens"]),
        }
    except (KeyError, ValueError) as exc:
        raise PipelineError(f"dump {path} has bad or missing metadata ({exc})") from None
    try:
        found = HiddenStore.from_dtypes(tensors[AUX_KEY].dtype, tensors[FINAL_KEY].dtype)
    except ValueError:
        found = None
    wanted = store or found or BF16_STORE
    if found is not None and store is not None and found != store:
        raise PipelineError(
            f"dump {path} holds a {found.label()} store, the config's extract.store is "
            f"{store.label()}: the server was started for another store (stop it: eaglepipe "
            "server stop)"
        )
    tokens, hidden = meta["num_tokens"], meta["hidden_size"]
    num_aux = len(meta["aux_layer_ids"])
    expected = {AUX_KEY: (wanted.dtype(AUX_KEY), (tokens, num_aux * hidden))}
    expected[FINAL_KEY] = (wanted.dtype(FINAL_KEY), (tokens, hidden))
    for name, layers in ((AUX_KEY, num_aux), (FINAL_KEY, 1)):
        if wanted.quantized(name):
            expected[scale_key(name)] = (SCALE_DTYPE, (tokens, layers))
    for name, (dtype, shape) in expected.items():
        tensor = tensors.get(name)
        if tensor is None:
            raise PipelineError(f"dump {path} lacks tensor {name}")
        if tensor.dtype != dtype or tensor.shape != shape:
            raise PipelineError(
                f"dump {path}: {name} is {torch_dtype_text(tensor.dtype)} {list(tensor.shape)}, "
                f"expected {torch_dtype_text(dtype)} {list(shape)}"
            )
    meta["store"] = wanted
    return {name: tensors[name] for name in expected}, meta


def read_dump(path: str | os.PathLike) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """(aux, final, metadata) of a dump as torch tensors: bf16 views of the mapped file, or
    e4m3 states dequantized to float32."""
    from ...core.hidden_store import dequantize

    tensors, meta = read_dump_raw(path)
    out = []
    for name in (AUX_KEY, FINAL_KEY):
        values = tensors[name].to_torch()
        if meta["store"].quantized(name):
            import torch

            values = dequantize(values, tensors[scale_key(name)].to_torch(), torch.float32)
        out.append(values)
    return out[0], out[1], meta


def concat_aux(aux_hidden_states: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """The packed [T, k*H] layout from a list of per-layer [T, H] tensors (or pass one through).

    Engines hand aux states over either way (SGLang as a list or already concatenated).
    """
    import torch  # the engines' side, where torch is loaded already

    if isinstance(aux_hidden_states, torch.Tensor):
        return aux_hidden_states
    return torch.cat(list(aux_hidden_states), dim=-1)
