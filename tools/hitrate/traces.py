"""Trace readers for `hicache-hitrate`.

Every format is read into the same `Request` records. Two shapes exist:

* block traces (`mooncake`, `lmcache`): a request is a list of block ids (prefix-chained hashes,
  `block_size` tokens each) plus its input and output lengths. Block ids are remapped densely in
  order of first appearance, so token ids derived from them stay small (see `simulate.py`).
* token traces (`engine`, `chat`, `completion`): a request carries its prompt token ids (and, for
  `engine`, its output token ids).

Errors name the file and the 1-based line: `TraceError`. Every length and timestamp is bounded
(`Limits`): a line beyond a bound is a bad line like a malformed one, so a hostile or corrupt
trace cannot make the replay run without bound in time or memory.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import re
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from hicache_client.errors import ConfigError, HiCacheError
from tools.hitrate.sizes import FLOAT_DTYPE_BYTES

logger = logging.getLogger(__name__)

FORMATS = ("mooncake", "lmcache", "engine", "chat", "completion")

# Defaults of the bounds (docs/hitrate.md, "Bounds"); the CLI flags override the first two.
MAX_REQUEST_TOKENS = 1 << 24  # 16,777,216 tokens per prompt or per output
MAX_LINE_BYTES = 256 << 20  # 256 MiB per line
MAX_TIMESTAMP_S = 1e11  # arrival times: finite, >= 0 and below this (about 3,000 years)


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on one trace line. `max_request_tokens` bounds every input and output length
    (`input_length`, `output_length`, `seq_len`, `max_tokens`, `input_ids`, `output_ids`) and the
    block count (`hash_ids`, `chunk_hashes`: at most ceil(max_request_tokens / block size))."""

    max_request_tokens: int = MAX_REQUEST_TOKENS
    max_line_bytes: int = MAX_LINE_BYTES
    max_timestamp_s: float = MAX_TIMESTAMP_S

# LMCache's dtype names -> bytes per element (for kv bytes per token from a lookup log).
_DTYPE_BYTES = {**FLOAT_DTYPE_BYTES, "int8": 1, "int32": 4, "int64": 8}


class TraceError(HiCacheError):
    """A trace cannot be read: missing file, malformed line or a line of another format."""

    def __init__(self, path: str | Path, line: int | None, msg: str) -> None:
        where = f"{path}:{line}" if line is not None else f"{path}"
        super().__init__(f"{where}: {msg}")
        self.path = str(path)
        self.line = line


@dataclass(slots=True)
class Request:
    """One request of a trace, whatever its format."""

    rid: str
    ts: float  # arrival time in seconds (0 when the trace has none)
    input_len: int  # prompt tokens
    output_len: int  # generated tokens
    blocks: list[int] | None = None  # block traces: dense block ids, block_size tokens each
    prompt: list[int] | None = None  # token traces: prompt token ids
    output: list[int] | None = None  # engine traces: output token ids
    extra_key: str | None = None  # tenant / cache_salt namespace
    cached_tokens: int | None = None  # engine traces: what the engine reported
    cache_outcomes: dict[str, int] | None = None  # engine traces: its miss attribution


@dataclass
class Trace:
    path: str
    format: str
    requests: list[Request]
    block_size: int | None = None  # block traces only
    bad_lines: int = 0
    bad_line_numbers: list[int] = field(default_factory=list)  # the first 20
    kv_bytes_per_token: float | None = None  # known from the trace itself (lmcache logs)
    num_blocks: int = 0  # distinct block ids (block traces)
    count: int = 0  # requests read (== len(requests) unless they went to a sink)


def detect_format(obj: Any) -> str | None:
    """Format of one parsed line, or None when it matches none (or more than one)."""
    if not isinstance(obj, dict):
        return None
    hits = []
    if "hash_ids" in obj:
        hits.append("mooncake")
    if "chunk_hashes" in obj:
        hits.append("lmcache")
    if "input_ids" in obj:
        hits.append("engine")
    if "messages" in obj:
        hits.append("chat")
    if "prompt" in obj and "messages" not in obj:
        hits.append("completion")
    return hits[0] if len(hits) == 1 else None


class _LineTooLong(Exception):
    pass


def open_trace(path: Path) -> Any:
    """`path` opened for reading bytes; a gzip (`.gz`, or its magic bytes) or zstd (`.zst`,
    `.zstd`, or its magic) file is decompressed as it is read (a stream: never whole in
    memory)."""
    fh = open(path, "rb")  # noqa: SIM115 - the caller closes it
    try:
        magic = fh.read(4)
        fh.seek(0)
    except OSError:
        fh.close()
        raise
    if magic[:2] == b"\x1f\x8b":
        import gzip

        return gzip.GzipFile(fileobj=fh, mode="rb")
    if magic == b"\x28\xb5\x2f\xfd":
        import io

        import zstandard

        return io.BufferedReader(zstandard.ZstdDecompressor().stream_reader(fh, closefd=True))
    return fh


def _open(path: Path) -> Any:
    """`open_trace(path)`, its errors as `TraceError`s naming the file."""
    try:
        return open_trace(path)
    except FileNotFoundError:
        raise TraceError(path, None, "no such file") from None
    except IsADirectoryError:
        raise TraceError(path, None, "is a directory, not a trace file") from None
    except OSError as e:
        raise TraceError(path, None, f"cannot open: {e.strerror}") from None


def _iter_lines(
    path: Path, max_line_bytes: int = MAX_LINE_BYTES, bar: Any = None, raw_bytes: bool = False
) -> Iterator[tuple[int, Any]]:
    """Non-blank lines with their 1-based numbers; a line that is not UTF-8 comes as the
    decode error, one longer than `max_line_bytes` as `_LineTooLong` (read past, never held
    whole), so the reader can name (or skip) that very line. `bar`: a tqdm bar in bytes, moved
    on every 4 MiB read and at the end of the file (decompressed bytes of a compressed file).
    `raw_bytes`: the lines as bytes, undecoded (the caller decodes what it must)."""
    fh = _open(path)
    with fh:
        lineno = 0
        unshown = 0  # bytes read and not yet on the bar
        while raw := fh.readline(max_line_bytes + 1):
            lineno += 1
            if bar is not None:
                unshown += len(raw)
                if unshown >= 1 << 22:
                    bar.update(unshown)
                    unshown = 0
            if len(raw) > max_line_bytes:
                while not raw.endswith(b"\n") and (raw := fh.readline(1 << 20)):
                    pass
                yield lineno, _LineTooLong(f"line longer than {max_line_bytes:,} bytes")
                continue
            if not raw.strip():
                continue
            if raw_bytes:
                yield lineno, raw
                continue
            try:
                yield lineno, raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield lineno, e
        if bar is not None:
            bar.update(unshown)


CHUNK_BYTES = 8 << 20  # what the compiled scanner takes at once
SCAN_FROM_BYTES = 64 << 20  # the compiled scanner reads traces of this size and more


def _iter_chunks(path: Path, max_line_bytes: int, bar: Any) -> Iterator[tuple[int, bytes]]:
    """(number of the first line, whole lines) of about `CHUNK_BYTES`; a line longer than
    `max_line_bytes` is cut after `max_line_bytes + 1` of its bytes and read past (the reader
    sees it too long, as `_iter_lines` says)."""
    fh = _open(path)
    with fh:
        lineno = 1
        while data := fh.read(CHUNK_BYTES):
            if not data.endswith(b"\n"):
                tail = fh.readline(max_line_bytes + 1)
                data += tail
                if len(tail) > max_line_bytes and not tail.endswith(b"\n"):
                    while not tail.endswith(b"\n") and (tail := fh.readline(1 << 20)):
                        pass
                    data += b"\n"
            if bar is not None:
                bar.update(len(data))
            yield lineno, data
            lineno += data.count(b"\n") + (0 if data.endswith(b"\n") else 1)


def _bytes_bar(files: Sequence[Path], enabled: bool | None) -> Any:
    """A tqdm bar over the files' bytes on stderr, or None (`enabled` None: when stderr is a
    terminal)."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled:
        return None
    from tqdm import tqdm

    total = sum(f.stat().st_size for f in files if f.is_file())  # compressed: an underestimate
    return tqdm(total=total, desc="reading", unit="B", unit_scale=True, file=sys.stderr,
                mininterval=0.5)


def _int(obj: dict[str, Any], key: str, minimum: int = 0, maximum: int | None = None) -> int:
    v = obj.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < minimum:
        raise ValueError(f"{key!r} must be an integer >= {minimum}, got {_short(v)}")
    if maximum is not None and v > maximum:
        raise ValueError(f"{key!r} is {v:,}, over the bound of {maximum:,} (--max-request-tokens)")
    return v


def _short(v: Any) -> str:
    r = repr(v)
    return r if len(r) <= 60 else r[:57] + "..."


def _int_list(
    obj: dict[str, Any], key: str, allow_empty: bool = True, max_len: int | None = None
) -> list[int]:
    v = obj.get(key)
    if not isinstance(v, list):
        raise ValueError(f"{key!r} must be a list of non-negative integers")
    if max_len is not None and len(v) > max_len:
        raise ValueError(
            f"{key!r} has {len(v):,} entries, over the bound of {max_len:,} (--max-request-tokens)"
        )
    # one C-level pass over the types (bool is not int here), then the smallest value: the same
    # test as isinstance per element at 0.6 of its cost (0.9 against 1.5 us on a 28-id line)
    if v and (set(map(type, v)) != {int} or min(v) < 0):
        raise ValueError(f"{key!r} must be a list of non-negative integers")
    if not allow_empty and not v:
        raise ValueError(f"{key!r} is empty")
    return v


def _outcomes(v: Any) -> dict[str, int] | None:
    """An engine log's `cache_outcomes` (outcome -> tokens), or None."""
    if v is None:
        return None
    if not isinstance(v, dict) or not all(
        isinstance(k, str) and type(n) is int and n >= 0 for k, n in v.items()
    ):
        raise ValueError(f"'cache_outcomes' must map outcomes to token counts, got {v!r}")
    return dict(v)


def _timestamp(obj: dict[str, Any], key: str, scale: float, limits: Limits) -> float:
    """The arrival time in seconds (`scale` converts the trace's unit); 0 when absent. Must be a
    finite, non-negative number below `limits.max_timestamp_s` (JSON's NaN / Infinity are not)."""
    v = obj.get(key)
    if v is None:
        return 0.0
    if not isinstance(v, (int, float)) or isinstance(v, bool):
        raise ValueError(f"{key!r} must be a number, got {_short(v)}")
    ts = float(v) * scale
    if not math.isfinite(ts) or ts < 0 or ts >= limits.max_timestamp_s:
        raise ValueError(
            f"{key!r} must be a finite number >= 0 (below {limits.max_timestamp_s:g} s), "
            f"got {_short(v)}"
        )
    return ts


class _Reader:
    """Parses the lines of one format into `Request`s; keeps the dense block-id map."""

    def __init__(
        self,
        fmt: str,
        block_size: int,
        tokenizer: Any | None,
        add_generation_prompt: bool,
        limits: Limits,
    ) -> None:
        self.fmt = fmt
        self.limits = limits
        self.max_tokens = limits.max_request_tokens
        self.block_size = block_size
        self.tokenizer = tokenizer
        self.add_generation_prompt = add_generation_prompt
        self.block_ids: dict[Any, int] = {}
        # Mooncake hash ids handed on as they are (a streaming sink densifies them in numpy,
        # without a dict entry per distinct block).
        self.raw_ids = False
        self.kv_bytes_per_token: float | None = None
        self.lm_chunk: int | None = None
        self.parse: Callable[[dict[str, Any], int], Request] = getattr(self, f"_{fmt}")

    def _dense(self, raw: list[Any]) -> list[int]:
        ids = self.block_ids
        out = []
        for h in raw:
            b = ids.get(h)
            if b is None:
                b = ids[h] = len(ids)
            out.append(b)
        return out

    def _mooncake(self, obj: dict[str, Any], n: int) -> Request:
        bs = self.block_size
        hashes = _int_list(obj, "hash_ids", max_len=-(-self.max_tokens // bs))
        input_len = _int(obj, "input_length", maximum=self.max_tokens)
        output_len = _int(obj, "output_length", maximum=self.max_tokens)
        if not (bs * (len(hashes) - 1) < input_len <= bs * len(hashes)) and input_len > 0:
            raise ValueError(
                f"input_length {input_len} does not fit {len(hashes)} blocks of {bs} tokens "
                f"(wrong --block-size?)"
            )
        ts = _timestamp(obj, "timestamp", 1e-3, self.limits)
        return Request(
            rid=str(obj.get("request_id", n)),
            ts=ts,
            input_len=input_len,
            output_len=output_len,
            blocks=hashes if self.raw_ids else self._dense(hashes),
        )

    def _lmcache(self, obj: dict[str, Any], n: int) -> Request:
        hashes = obj.get("chunk_hashes")
        if not isinstance(hashes, list) or not all(isinstance(h, (str, int)) for h in hashes):
            raise ValueError("'chunk_hashes' must be a list of hash strings")
        seq_len = _int(obj, "seq_len", maximum=self.max_tokens)
        chunk = _int(obj, "chunk_size", 1, maximum=self.max_tokens)
        if self.lm_chunk is None:
            self.lm_chunk = self.block_size = chunk
        elif chunk != self.lm_chunk:
            raise ValueError(f"chunk_size {chunk} differs from earlier lines ({self.lm_chunk})")
        if len(hashes) * chunk > seq_len:
            raise ValueError(f"{len(hashes)} chunks of {chunk} tokens exceed seq_len {seq_len}")
        if self.kv_bytes_per_token is None:
            total = 0
            for shape, dt in zip(obj.get("shapes") or [], obj.get("dtypes") or []):
                size = 1
                for d in shape:
                    size *= int(d)
                total += size * _DTYPE_BYTES.get(str(dt), 0)
            if total:
                self.kv_bytes_per_token = total / chunk
        ts = _timestamp(obj, "timestamp", 1.0, self.limits)
        return Request(
            rid=str(obj.get("request_id", n)),
            ts=ts,
            input_len=seq_len,
            output_len=0,
            blocks=self._dense(hashes),
        )

    def _engine(self, obj: dict[str, Any], n: int) -> Request:
        prompt = _int_list(obj, "input_ids", allow_empty=False, max_len=self.max_tokens)
        output = (
            _int_list(obj, "output_ids", max_len=self.max_tokens) if "output_ids" in obj else []
        )
        extra = obj.get("extra_key")
        if extra is not None and not isinstance(extra, str):
            raise ValueError(f"'extra_key' must be a string or null, got {extra!r}")
        cached = obj.get("cached_tokens")
        if cached is not None and (not isinstance(cached, int) or isinstance(cached, bool)):
            raise ValueError(f"'cached_tokens' must be an integer, got {cached!r}")
        ts = _timestamp(obj, "ts", 1.0, self.limits)
        return Request(
            rid=str(obj.get("rid", n)),
            ts=ts,
            input_len=len(prompt),
            output_len=len(output),
            prompt=prompt,
            output=output,
            extra_key=extra,
            cached_tokens=cached,
            cache_outcomes=_outcomes(obj.get("cache_outcomes")),
        )

    def _max_tokens(self, obj: dict[str, Any]) -> int:
        for k in ("max_completion_tokens", "max_tokens"):
            v = obj.get(k)
            if isinstance(v, int) and not isinstance(v, bool) and v >= 0:
                if v > self.max_tokens:
                    raise ValueError(
                        f"{k!r} is {v:,}, over the bound of {self.max_tokens:,} "
                        "(--max-request-tokens)"
                    )
                return v
        return 0

    def _need_tokenizer(self) -> Any:
        if self.tokenizer is None:
            raise ValueError(f"the {self.fmt} format needs --tokenizer PATH")
        return self.tokenizer

    def _chat(self, obj: dict[str, Any], n: int) -> Request:
        msgs = obj.get("messages")
        if not isinstance(msgs, list) or not msgs or not all(isinstance(m, dict) for m in msgs):
            raise ValueError("'messages' must be a non-empty list of objects")
        tok = self._need_tokenizer()
        ids = tok.apply_chat_template(
            msgs, tokenize=True, add_generation_prompt=self.add_generation_prompt
        )
        if isinstance(ids, dict) or hasattr(ids, "input_ids"):
            ids = ids["input_ids"]
        return self._openai(obj, n, [int(t) for t in ids])

    def _completion(self, obj: dict[str, Any], n: int) -> Request:
        p = obj.get("prompt")
        if isinstance(p, str):
            ids = self._need_tokenizer().encode(p)
        elif isinstance(p, list) and p and all(isinstance(t, int) for t in p):
            ids = p  # pre-tokenised prompt, as the OpenAI API allows
        else:
            raise ValueError("'prompt' must be a string or a list of token ids")
        return self._openai(obj, n, [int(t) for t in ids])

    def _openai(self, obj: dict[str, Any], n: int, ids: list[int]) -> Request:
        if not ids:
            raise ValueError("prompt tokenises to nothing")
        if len(ids) > self.max_tokens:
            raise ValueError(
                f"the prompt is {len(ids):,} tokens, over the bound of {self.max_tokens:,} "
                "(--max-request-tokens)"
            )
        salt = obj.get("cache_salt")
        return Request(
            rid=str(obj.get("request_id", obj.get("user", n))) if "request_id" in obj else str(n),
            ts=0.0,
            input_len=len(ids),
            output_len=self._max_tokens(obj),
            prompt=ids,
            extra_key=salt if isinstance(salt, str) else None,
        )


def load_tokenizer(path: str) -> Any:
    """A Hugging Face tokenizer from a local directory, or the engine's demo tokenizer by its
    model name (`hicache-demo`; `engine.demo_model.resolve_model_path`)."""
    from transformers import AutoTokenizer

    from engine.demo_model import resolve_model_path

    directory = resolve_model_path(path, "--tokenizer")
    try:
        return AutoTokenizer.from_pretrained(str(directory))
    except (OSError, ValueError) as e:
        raise ConfigError(f"--tokenizer {path}: cannot load a tokenizer: {e}") from None


_UNREAD = object()
# orjson reads an integer past 64 bits as a float: a line with a number of 19 digits or more
# is json's to read (its ints are exact at any size).
_LONG_NUMBER = re.compile(rb"\d{19}")
_INT_ONLY = {int}


def _fast_loads() -> Callable[[bytes], Any] | None:
    """orjson's `loads` (about 5x json's on a Mooncake line, from bytes), or None without it.
    It is stricter than json (no NaN, no lone surrogate): a line it refuses is parsed again by
    json, whose answer (or error) stands; a line with a number of 19 digits or more goes to
    json directly (orjson makes an integer past 64 bits a float)."""
    try:
        import orjson
    except ImportError:  # pragma: no cover - a pinned dependency
        return None
    return orjson.loads


def read_trace(
    path: str | Path,
    fmt: str = "auto",
    *,
    block_size: int = 512,
    tokenizer: Any | None = None,
    skip_bad_lines: bool = False,
    limit: int | None = None,
    add_generation_prompt: bool = True,
    limits: Limits | None = None,
    files: Sequence[Path] | None = None,
    sink: Callable[[Request], None] | None = None,
    progress: bool | None = False,
) -> Trace:
    """Reads a whole trace. `fmt="auto"` detects the format from the first valid line.

    A line that is not JSON, or not a valid record of the format, raises `TraceError` naming the
    file and line, unless `skip_bad_lines` (then it is counted in `Trace.bad_lines`). A directory
    is read as its `lookup_hashes_*.jsonl` files (LMCache's rotated logs), or else its `*.jsonl`
    files, in name order. LMCache records are replayed in timestamp order, as LMCache's simulator
    does. `limits` bounds every line (`Limits()` by default); a line over a bound is a bad line.
    `files`: read these instead of the directory's (`trace_dir.read_path` picks them).
    `sink`: each block-trace request (mooncake, lmcache) goes to `sink` instead of
    `Trace.requests`, which is then empty and `Trace.count` says how many there were (a stream:
    `arrays.BlockSink` keeps only their block ids); token-trace requests are kept as usual.
    Mooncake requests reach the sink with their raw `hash_ids` (the sink makes them dense, and
    `Trace.num_blocks` is then 0). `progress`: a bar of the bytes read on stderr (None: when
    stderr is a terminal).
    """
    path = Path(path)
    limits = limits or Limits()
    if limits.max_request_tokens < 1 or limits.max_line_bytes < 1:
        raise TraceError(path, None, f"bounds must be >= 1: {limits}")
    if fmt != "auto" and fmt not in FORMATS:
        raise TraceError(path, None, f"unknown format {fmt!r}; known: auto, {', '.join(FORMATS)}")
    if files:
        files = list(files)
    elif path.is_dir():
        files = sorted(path.glob("lookup_hashes_*.jsonl")) or sorted(path.glob("*.jsonl"))
        if not files:
            raise TraceError(path, None, "directory holds no *.jsonl trace files")
    else:
        files = [path]
    current = files[0]
    reader: _Reader | None = None
    requests: list[Request] = []
    count = 0
    bad = 0
    bad_numbers: list[int] = []

    def reject(lineno: int, msg: str) -> None:
        nonlocal bad
        if not skip_bad_lines:
            raise TraceError(current, lineno, msg)
        bad += 1
        if len(bad_numbers) < 20:
            bad_numbers.append(lineno)
        logger.debug("%s:%d: skipped: %s", current, lineno, msg)

    bar = _bytes_bar(files, progress)

    fast_loads = _fast_loads()
    add: Any = getattr(sink, "add", None)  # a sink that takes a Mooncake line's fields directly
    add_many: Any = getattr(sink, "add_many", None)  # ... and the scanner's arrays of them
    # The scanner for traces of SCAN_FROM_BYTES and more: below, its compile on a first run
    # (seconds) would cost more than orjson's few microseconds a line save.
    scanning = (add_many is not None and fmt in ("auto", "mooncake")
                and sum(f.stat().st_size for f in files if f.is_file()) >= SCAN_FROM_BYTES)
    ids = np.empty(0, np.int64)
    meta = np.empty((1 << 16 if scanning else 1, 8), np.int64)
    mc = False  # the Mooncake fast paths are on (format known, raw ids to a sink with add)
    max_tokens = limits.max_request_tokens
    max_blocks = -(-max_tokens // block_size)
    max_ts = limits.max_timestamp_s

    def one(lineno: int, raw: Any) -> None:
        """One line (bytes, or `_LineTooLong`) read the ordinary way."""
        nonlocal count, reader, mc
        if not isinstance(raw, _LineTooLong) and len(raw) > limits.max_line_bytes:
            raw = _LineTooLong(f"line longer than {limits.max_line_bytes:,} bytes")
        if isinstance(raw, _LineTooLong):
            reject(lineno, f"{raw} (--max-line-bytes)")
            return
        if not raw.strip():
            return
        obj = _UNREAD
        if fast_loads is not None and not _LONG_NUMBER.search(raw):
            with contextlib.suppress(ValueError):  # json's own error, or wider grammar, below
                obj = fast_loads(raw)
        if mc and type(obj) is dict:
            # A Mooncake line the checks of `_Reader._mooncake` and `detect_format` pass, taken
            # in one pass: anything else goes the long way and gets its exact error.
            h = obj.get("hash_ids")
            il = obj.get("input_length")
            ol = obj.get("output_length")
            ts = obj.get("timestamp", 0)
            tt = type(ts)
            if (type(h) is list and type(il) is int and type(ol) is int
                    and 0 <= il <= max_tokens and 0 <= ol <= max_tokens
                    and len(h) <= max_blocks
                    and (not h or (set(map(type, h)) == _INT_ONLY and min(h) >= 0))
                    and (il == 0 or block_size * (len(h) - 1) < il <= block_size * len(h))
                    and (tt is int or tt is float or ts is None)
                    and (ts is None or 0 <= ts * 1e-3 < max_ts)
                    and "chunk_hashes" not in obj and "input_ids" not in obj
                    and "messages" not in obj and "prompt" not in obj):
                add(h, il, ol, 0.0 if ts is None else float(ts) * 1e-3)
                count += 1
                return
        if obj is _UNREAD:
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                reject(lineno, f"not UTF-8 text ({e.reason})")
                return
            try:
                obj = json.loads(line)
            except json.JSONDecodeError as e:
                reject(lineno, f"malformed JSON ({e.msg} at column {e.colno})")
                return
            except (ValueError, RecursionError) as e:  # an integer of > 4300 digits, deep nesting
                reject(lineno, f"malformed JSON ({str(e).split(':')[0]})")
                return
        if reader is None:
            detected = detect_format(obj)
            use = fmt if fmt != "auto" else detected
            if use is None:
                keys = sorted(obj) if isinstance(obj, dict) else type(obj).__name__
                reject(
                    lineno,
                    f"cannot detect the trace format from this line (keys {keys}); "
                    f"pass --format ({', '.join(FORMATS)})",
                )
                return
            reader = _Reader(use, block_size, tokenizer, add_generation_prompt, limits)
            reader.raw_ids = sink is not None and use == "mooncake"
            mc = reader.raw_ids and add is not None
        if not isinstance(obj, dict):
            reject(lineno, f"expected a JSON object, got {type(obj).__name__}")
            return
        detected = detect_format(obj)
        if detected is not None and detected != reader.fmt:
            reject(lineno, f"looks like a {detected} record, not {reader.fmt}")
            return
        try:
            req = reader.parse(obj, count)
        except (ValueError, TypeError, KeyError) as e:
            reject(lineno, f"bad {reader.fmt} record: {e}")
            return
        count += 1
        if sink is not None and req.blocks is not None:
            sink(req)
        else:
            requests.append(req)

    def chunk(lineno: int, data: bytes) -> bool:
        """The whole lines `data` from line `lineno` on, by the compiled scanner while the
        Mooncake fast path is on; False once `limit` requests are read."""
        nonlocal count, ids
        from tools.hitrate import scan

        buf = np.frombuffer(data, np.uint8)
        if len(ids) < len(buf) // 2 + 16:
            ids = np.empty(len(buf) // 2 + 16, np.int64)
        pos = 0
        while pos < len(buf):
            r, _ = scan.scan_chunk(buf[pos:], scan.KEYS, ids, meta, max_tokens, max_blocks,
                                   block_size, max_ts, limits.max_line_bytes)
            st = meta[:r, 0]
            slow = np.flatnonzero(st != scan.OK)
            i = 0
            while i < r:
                if limit is not None and count >= limit:
                    return False
                if mc and st[i] == scan.OK:
                    j = int(slow[np.searchsorted(slow, i)]) if len(slow) and slow[-1] > i else r
                    if limit is not None:
                        j = min(j, i + limit - count)
                    m = meta[i:j]
                    add_many(ids[m[0, 3]: m[-1, 3] + m[-1, 4]], m[:, 4], m[:, 5], m[:, 6],
                             m[:, 7] * 1e-3)
                    count += j - i
                    i = j
                    continue
                if st[i] != scan.BLANK:
                    one(lineno + i, data[pos + int(meta[i, 1]): pos + int(meta[i, 2]) + 1])
                i += 1
            lineno += r
            pos += int(meta[r - 1, 2]) + 1
        return True

    try:
        for f in files:
            current = f
            if scanning:
                for lineno, data in _iter_chunks(f, limits.max_line_bytes, bar):
                    if not chunk(lineno, data):
                        break
                else:
                    continue
                break
            for lineno, raw in _iter_lines(f, limits.max_line_bytes, bar, raw_bytes=True):
                if limit is not None and count >= limit:
                    break
                one(lineno, raw)
            else:
                continue
            break
    finally:
        if bar is not None:
            bar.close()
    if reader is None:
        if bad:
            raise TraceError(path, None, f"no valid line ({bad} bad lines skipped)")
        raise TraceError(path, None, "empty trace")
    block_fmt = reader.fmt in ("mooncake", "lmcache")
    if reader.fmt == "lmcache":
        requests.sort(key=lambda r: r.ts)
    return Trace(
        path=str(path),
        format=reader.fmt,
        requests=requests,
        block_size=reader.block_size if block_fmt else None,
        bad_lines=bad,
        bad_line_numbers=bad_numbers,
        kv_bytes_per_token=reader.kv_bytes_per_token,
        num_blocks=len(reader.block_ids),
        count=count,
    )
