"""Source files as their raw records: JSONL, a JSON array, either gzip-compressed, or Parquet.

A record is one data row of the file, with its raw bytes (what the shard plan's per-shard
digests hash) and its row id, the 0-based index among the file's records:

- JSONL (`.jsonl`, `.jsonl.gz`): one record per non-blank line;
- a JSON array (`.json`, `.json.gz`): one record per element, read as a stream in blocks
  (never whole in memory) by the json module's C scanner; its raw bytes are the element's
  slice of the file. A `.json` file that does not start with `[` is read as JSONL (many
  datasets named `.json` hold one object per line);
- Parquet (`.parquet`): one record per row, read in batches.

An array that ends before its closing `]` (a download or a package cut off in the middle of a
record) or that cannot be read past some byte yields its whole records and then stops; the
reader's `cut` says where (`SourceCut`), and every caller decides what the cut means (the
shard plan counts only the whole records; the error policy stops on it).
"""

from __future__ import annotations

import codecs
import gzip
import json
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from ..core.errors import PipelineError

KINDS = ("jsonl", "json", "parquet")
SUFFIXES = (".jsonl", ".jsonl.gz", ".json", ".json.gz", ".parquet")
BLOCK_CHARS = 1 << 20
# A decoder error this close to the end of what was read may only mean the record goes on.
_NEAR_END = 16
_WHITESPACE = re.compile(r"[ \t\n\r]*")
_UNPARSED = object()


@dataclass(frozen=True)
class RawRecord:
    row_id: int
    raw: bytes
    line: int | None = None  # 1-based line number where the record starts (JSON text files)
    # The parsed value, where reading the file parsed it already (a JSON array's element).
    value: object = field(default=_UNPARSED, compare=False, repr=False)

    @property
    def parsed(self) -> bool:
        return self.value is not _UNPARSED


@dataclass(frozen=True)
class SourceCut:
    """Where a JSON array stops being readable: whole records before, then `why`."""

    path: str
    offset: int  # byte offset (of the decompressed stream for .gz) where reading stopped
    whole_records: int
    why: str
    compressed: bool = False

    def describe(self) -> str:
        where = "decompressed byte" if self.compressed else "byte"
        return (
            f"dataset.path {self.path}: the JSON array is {self.why} at {where} "
            f"{self.offset:,}, after {self.whole_records:,} whole records"
        )


def source_kind(path: str | os.PathLike) -> str:
    """`jsonl`, `json` or `parquet`, from the file name (`.gz` for gzip-compressed JSON text)."""
    name = str(path).lower()
    for suffix, kind in (
        (".jsonl", "jsonl"),
        (".jsonl.gz", "jsonl"),
        (".json", "json"),
        (".json.gz", "json"),
        (".parquet", "parquet"),
    ):
        if name.endswith(suffix):
            return kind
    raise PipelineError(
        f"dataset.path {path}: unsupported file type (expected {', '.join(SUFFIXES)})"
    )


def is_compressed(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(".gz")


def require_file(path: str | os.PathLike) -> Path:
    path = Path(path)
    if path.is_dir():
        raise PipelineError(f"dataset.path {path} is a directory, not a dataset file")
    if not path.is_file():
        raise PipelineError(f"dataset.path {path} does not exist")
    return path


def _open_binary(path: Path):
    if is_compressed(path):
        return gzip.open(path, "rb")
    return open(path, "rb")


# What a damaged gzip stream raises (BadGzipFile is an OSError).
_READ_ERRORS = (EOFError, OSError)


class SourceRecords:
    """The raw records of a JSONL or JSON-array file, in row-id order; after the iteration,
    `cut` is the SourceCut of an array that stopped early (else None)."""

    def __init__(self, path: str | os.PathLike):
        self.path = require_file(path)
        if source_kind(self.path) == "parquet":
            raise PipelineError(f"dataset.path {self.path}: a Parquet file has no raw records")
        self.cut: SourceCut | None = None

    def __iter__(self) -> Iterator[RawRecord]:
        try:
            with _open_binary(self.path) as f:
                if source_kind(self.path) == "json" and _starts_array(f.peek(4096)):
                    yield from self._array(f)
                else:
                    yield from self._lines(f)
        except _READ_ERRORS as exc:
            raise PipelineError(f"dataset.path {self.path}: cannot read: {exc}") from None

    def _lines(self, f) -> Iterator[RawRecord]:
        row_id = 0
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            yield RawRecord(row_id, line.rstrip(b"\r\n"), line_no)
            row_id += 1

    def _array(self, f) -> Iterator[RawRecord]:
        decoder = json.JSONDecoder()
        text = _TextBuffer(f)
        pos = text.skip(0)
        if text.buf.startswith("\ufeff"):
            pos = text.skip(1)
        pos += 1  # the "[" _starts_array saw
        row_id = 0
        expect_value = True  # after "[" or ",": a value (or "]" right after "[")
        while True:
            pos = text.skip(pos)
            if pos >= len(text.buf):
                self._stop(text, pos, row_id, "cut off before its closing ]")
                return
            char = text.buf[pos]
            if char == "]" and (not expect_value or row_id == 0):
                end = text.skip(pos + 1)
                if end < len(text.buf):
                    self._stop(text, end, row_id, "followed by data after its closing ]")
                return
            if not expect_value:
                if char != ",":
                    self._stop(text, pos, row_id, "not readable (expected , or ])")
                    return
                pos += 1
                expect_value = True
                continue
            try:
                value, end = text.value_end(decoder, pos)
            except _Unreadable as stop:
                self._stop(text, pos, row_id, stop.why)
                return
            yield RawRecord(row_id, text.raw(pos, end), text.line_at(pos), value)
            row_id += 1
            expect_value = False
            pos = text.consume(end)

    def _stop(self, text: _TextBuffer, pos: int, whole: int, why: str) -> None:
        self.cut = SourceCut(str(self.path), text.offset(pos), whole, why, is_compressed(self.path))


class _Unreadable(Exception):
    def __init__(self, why: str):
        super().__init__(why)
        self.why = why


class _TextBuffer:
    """The decoded text of a byte stream from some point on, read further on demand."""

    def __init__(self, f):
        self.f = f
        # surrogateescape: an invalid UTF-8 byte becomes a lone surrogate, which the row's check
        # reports as a bad row, and encodes back to the same byte for the record's raw bytes.
        self.decoder = codecs.getincrementaldecoder("utf-8")("surrogateescape")
        self.buf = ""
        self.base = 0  # bytes of the stream before buf[0]
        self.lines_to = 0  # the line number at buf[lines_to] is line_before
        self.line_before = 1
        self.eof = False

    def more(self, chars: int = BLOCK_CHARS) -> bool:
        if self.eof:
            return False
        block = self.f.read(chars)
        self.eof = not block
        self.buf += self.decoder.decode(block, final=self.eof)
        return bool(block)

    def skip(self, pos: int) -> int:
        """The first non-whitespace position at or after `pos` (len(buf) at the end of file)."""
        while True:
            pos = _WHITESPACE.match(self.buf, pos).end()
            if pos < len(self.buf) or not self.more():
                return pos

    def value_end(self, decoder, pos: int) -> tuple[object, int]:
        """The JSON value starting at `pos` and its end, reading more of the file as needed."""
        while True:
            try:
                value, end = decoder.raw_decode(self.buf, pos)
            except json.JSONDecodeError as exc:
                incomplete = exc.msg.startswith("Unterminated string") or (
                    len(self.buf) - exc.pos <= _NEAR_END
                )
                # Read as much again as the record holds so far: a long record costs O(size).
                if incomplete and self.more(max(BLOCK_CHARS, len(self.buf) - pos)):
                    continue
                if incomplete:
                    raise _Unreadable("cut off in the middle of a record") from None
                raise _Unreadable(f"not readable ({exc.msg})") from None
            if end >= len(self.buf) and self.more():
                continue  # a number or literal at the end of the buffer may go on
            return value, end

    def raw(self, start: int, end: int) -> bytes:
        return self.buf[start:end].encode("utf-8", "surrogateescape")

    def line_at(self, pos: int) -> int:
        """The line number at `pos` (positions are asked in increasing order)."""
        self.line_before += self.buf.count("\n", self.lines_to, pos)
        self.lines_to = pos
        return self.line_before

    def offset(self, pos: int) -> int:
        return self.base + len(self.buf[:pos].encode("utf-8", "surrogateescape"))

    def consume(self, pos: int) -> int:
        """Drop the text before `pos` once it is a block or so; returns `pos` in the new buffer."""
        if pos <= BLOCK_CHARS:
            return pos
        self.line_at(pos)
        self.lines_to = 0
        self.base = self.offset(pos)
        self.buf = self.buf[pos:]
        return 0


def _skip(text: str, pos: int) -> int:
    return _WHITESPACE.match(text, pos).end()


def _starts_array(head: bytes) -> bool:
    return head.lstrip(b"\xef\xbb\xbf \t\r\n")[:1] == b"["


def iter_parquet_records(path: str | os.PathLike, batch_size: int = 1024) -> Iterator[dict]:
    """Rows of a Parquet file as plain Python dicts, streamed in batches."""
    import pyarrow.parquet as pq

    path = require_file(path)
    try:
        parquet = pq.ParquetFile(path)
        for batch in parquet.iter_batches(batch_size=batch_size):
            yield from batch.to_pylist()
    except (OSError, ValueError) as exc:  # pyarrow's errors derive from these
        raise PipelineError(f"dataset.path {path}: cannot read Parquet: {exc}") from None


def parquet_num_rows(path: str | os.PathLike) -> int:
    import pyarrow.parquet as pq

    path = require_file(path)
    try:
        return pq.ParquetFile(path).metadata.num_rows
    except (OSError, ValueError) as exc:
        raise PipelineError(f"dataset.path {path}: cannot read Parquet: {exc}") from None
