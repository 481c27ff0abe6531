"""Tensors as bytes, without torch: what a job that only moves hidden states needs.

An extraction job reads the server's dumps and writes checksummed chunks; it never computes
with the values, and importing torch alone takes seconds of a job's start-up. So
the client and the chunk writer handle tensors as `RawTensor`s: a numpy view of the bytes plus
the safetensors dtype name (bf16 has no numpy dtype; its bytes are viewed as uint16, and
float8 e4m3's as uint8).
`read_safetensors` maps a file's tensors as RawTensors (mapped, not copied). The helpers below
(`dtype_name`, `torch_dtype_text`, `byte_view`, `nbytes`) accept a RawTensor, a numpy array or
a torch tensor alike, so callers that do hold torch tensors keep passing them.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
from dataclasses import dataclass

import numpy as np

# safetensors dtype name -> the numpy dtype its bytes are viewed as, and torch's name for it.
_DTYPES = {
    "BF16": (np.uint16, "bfloat16"),
    "F8_E4M3": (np.uint8, "float8_e4m3fn"),
    "F16": (np.float16, "float16"),
    "F32": (np.float32, "float32"),
    "F64": (np.float64, "float64"),
    "I64": (np.int64, "int64"),
    "I32": (np.int32, "int32"),
    "I16": (np.int16, "int16"),
    "I8": (np.int8, "int8"),
    "U8": (np.uint8, "uint8"),
    "BOOL": (np.bool_, "bool"),
}
_BY_TORCH_NAME = {torch_name: name for name, (_, torch_name) in _DTYPES.items()}
# numpy dtypes that name their safetensors dtype unambiguously (uint16 could be bf16: it is not
# listed, so a plain uint16 array never passes for bf16; uint8 is U8, never float8).
_BY_NUMPY = {
    np.dtype(np.float16): "F16",
    np.dtype(np.float32): "F32",
    np.dtype(np.float64): "F64",
    np.dtype(np.int64): "I64",
    np.dtype(np.int32): "I32",
    np.dtype(np.int16): "I16",
    np.dtype(np.int8): "I8",
    np.dtype(np.uint8): "U8",
    np.dtype(np.bool_): "BOOL",
}
# The largest header safetensors itself accepts.
_MAX_HEADER_BYTES = 100_000_000


@dataclass(frozen=True)
class RawTensor:
    """A tensor's bytes as a numpy array of the element's size, and its safetensors dtype."""

    data: np.ndarray  # shaped like the tensor (bf16 as uint16)
    dtype: str  # safetensors name: BF16, F8_E4M3, F32, I32, U8, ...

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.data.shape)

    @property
    def nbytes(self) -> int:
        return int(self.data.nbytes)

    def rows(self, start: int, end: int) -> RawTensor:
        """Rows `start:end` of the first dimension (a view)."""
        return RawTensor(self.data[start:end], self.dtype)

    def to_torch(self):
        """The same bytes as a torch tensor of the same dtype (a view, not a copy)."""
        import torch

        if self.dtype not in _DTYPES:
            raise ValueError(f"no torch dtype for safetensors dtype {self.dtype}")
        tensor = torch.from_numpy(self.data)
        return tensor.view(getattr(torch, _DTYPES[self.dtype][1]))


def dtype_name(tensor) -> str:
    """The safetensors dtype name of a RawTensor, numpy array or torch tensor."""
    if isinstance(tensor, RawTensor):
        return tensor.dtype
    if isinstance(tensor, np.ndarray):
        return _BY_NUMPY.get(tensor.dtype, str(tensor.dtype))
    text = str(tensor.dtype)  # a torch dtype: torch.bfloat16, ...
    return _BY_TORCH_NAME.get(text.removeprefix("torch."), text)


def torch_dtype_text(name: str) -> str:
    """How torch prints a safetensors dtype (`torch.bfloat16`): the name error messages use."""
    return f"torch.{_DTYPES[name][1]}" if name in _DTYPES else name


def dtype_text(tensor) -> str:
    """`torch_dtype_text` of a RawTensor, numpy array or torch tensor."""
    return torch_dtype_text(dtype_name(tensor))


def itemsize(name: str) -> int:
    return np.dtype(_DTYPES[name][0]).itemsize


def nbytes(tensor) -> int:
    if isinstance(tensor, RawTensor | np.ndarray):
        return int(tensor.nbytes)
    return tensor.numel() * tensor.element_size()


def byte_view(tensor) -> memoryview:
    """A zero-copy flat byte view of a RawTensor, numpy array or contiguous CPU torch tensor."""
    if isinstance(tensor, RawTensor):
        tensor = tensor.data
    if isinstance(tensor, np.ndarray):
        return memoryview(np.ascontiguousarray(tensor).reshape(-1).view(np.uint8))
    import torch  # a torch tensor: torch is imported already

    tensor = tensor.detach().contiguous()
    if tensor.device.type != "cpu":
        tensor = tensor.cpu()
    return memoryview(tensor.reshape(-1).view(torch.uint8).numpy())


def read_safetensors(path: str | os.PathLike) -> tuple[dict[str, str], dict[str, RawTensor]]:
    """A safetensors file's metadata and tensors, the tensors mapped from the file.

    The mapping is private (copy on write), so the arrays are writable and deleting the file
    afterwards keeps them valid. Raises FileNotFoundError, or ValueError naming what is wrong
    with a file that is not a complete safetensors file.
    """
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size < 8:
            raise ValueError(f"{size} bytes is too short for a safetensors header")
        (header_len,) = struct.unpack("<Q", f.read(8))
        if header_len > min(_MAX_HEADER_BYTES, size - 8):
            raise ValueError(f"header length {header_len} exceeds the file ({size} bytes)")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise ValueError(f"the header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items()
        ):
            raise ValueError("__metadata__ is not a mapping of strings")
        data_start = 8 + header_len
        entries = sorted(_entries(header), key=lambda e: e[3])
        expected_begin = 0
        for name, _, _, begin, end in entries:
            if begin != expected_begin:
                raise ValueError(f"tensor {name} starts at {begin}, expected {expected_begin}")
            expected_begin = end
        if data_start + expected_begin != size:
            raise ValueError(
                f"the tensors end at byte {data_start + expected_begin}, the file has {size}"
            )
        mapped = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if expected_begin else None
    tensors = {}
    for name, dtype, shape, begin, end in entries:
        np_dtype = _DTYPES[dtype][0]
        count = (end - begin) // np.dtype(np_dtype).itemsize
        if count:
            data = np.frombuffer(mapped, dtype=np_dtype, count=count, offset=data_start + begin)
        else:
            data = np.zeros(0, dtype=np_dtype)
        tensors[name] = RawTensor(data.reshape(shape), dtype)
    return metadata, tensors


def _entries(header: dict):
    for name, info in header.items():
        try:
            dtype = info["dtype"]
            shape = [int(d) for d in info["shape"]]
            begin, end = (int(o) for o in info["data_offsets"])
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"tensor {name}: bad header entry {info!r}") from None
        if dtype not in _DTYPES:
            raise ValueError(f"tensor {name}: unsupported dtype {dtype}")
        if any(d < 0 for d in shape) or end < begin:
            raise ValueError(f"tensor {name}: bad shape {shape} or offsets {[begin, end]}")
        if (end - begin) != int(np.prod(shape, dtype=np.int64)) * itemsize(dtype):
            raise ValueError(f"tensor {name}: {end - begin} bytes for shape {shape} of {dtype}")
        yield name, dtype, shape, begin, end
