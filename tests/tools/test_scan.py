"""The Mooncake reader's fast paths (the compiled scanner, orjson) read exactly what the ordinary
reader reads: the same arrays, the same bad lines, the same error; compressed traces too."""

from __future__ import annotations

import gzip
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zstandard

from tools.hitrate import traces
from tools.hitrate.arrays import BlockSink
from tools.hitrate.traces import Limits, TraceError, read_trace

GOOD = '{"timestamp": 5, "input_length": 40, "output_length": 3, "hash_ids": [1, 2, 3]}'
LINES = [
    GOOD,
    '{"hash_ids":[7,8],"output_length":0,"input_length":32,"timestamp":10}',  # any key order
    ' \t{ "input_length" : 17 , "output_length" : 1 , "hash_ids" : [ 4 , 9 ] } \r',  # no ts
    "",  # blank lines count in the numbering
    "   ",
    "\x0c",  # blank to bytes.strip, not to JSON: the ordinary reader skips it
    '{"timestamp": 1.5, "input_length": 16, "output_length": 0, "hash_ids": [1]}',  # float ts
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [1], "request_id": "a"}',
    '{"timestamp": 2, "timestamp": 3, "input_length": 16, "output_length": 0, "hash_ids": [5]}',
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [12345678901234567890]}',
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [123456789012345678901234]}',
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [1234567890123456789]}',
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [18446744073709551616]}',
    '{"timestamp": 2, "input_length": 18446744073709551616, "output_length": 0, "hash_ids": [1]}',
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [012]}',  # bad JSON
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [-1]}',
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [true]}',
    '{"timestamp": 2, "input_length": 99, "output_length": 0, "hash_ids": [1]}',  # misfit
    '{"timestamp": 2, "input_length": 0, "output_length": 0, "hash_ids": []}',
    '{"timestamp": 2, "input_length": 16, "output_length": 0}',  # no ids
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [1], }',
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [1]} x',
    '{"timestamp": NaN, "input_length": 16, "output_length": 0, "hash_ids": [1]}',
    '{"timestamp": 2, "input_length": 16, "output_length": 9999999, "hash_ids": [1]}',  # bound
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [1], "chunk_hashes": []}',
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [3' + ", 3" * 300 + "]}",
    "not json at all",
    '{"timestamp": 2, "inp\\u0075t_length": 16, "output_length": 0, "hash_ids": [1]}',
    '{"timestamp": 2, "input_length": 16, "output_length": 0, "hash_ids": [1]}',
]


class Plain:
    """A sink without `add` / `add_many`: the ordinary reader, one `Request` a line."""

    def __init__(self) -> None:
        self.sink = BlockSink()

    def __call__(self, req: Any) -> None:
        self.sink(req)

    def __len__(self) -> int:
        return len(self.sink)


def _read(path: Path, sink: Any, **kw: Any) -> tuple[Any, BlockSink]:
    kw.setdefault("limits", Limits(max_request_tokens=1 << 20, max_line_bytes=600))
    tr = read_trace(path, block_size=16, sink=sink, skip_bad_lines=True, **kw)
    return tr, sink.sink if isinstance(sink, Plain) else sink


def _same(a: BlockSink, b: BlockSink) -> None:
    for name in ("blocks", "n_blocks", "input_len", "output_len", "ts"):
        assert getattr(a, name).tolist() == getattr(b, name).tolist(), name
    assert a._big == b._big


@pytest.mark.parametrize("chunk", [64, 300, 1 << 20])
def test_scanner_reads_what_the_reader_reads(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             chunk: int) -> None:
    monkeypatch.setattr(traces, "CHUNK_BYTES", chunk)  # lines cut at every chunk boundary
    monkeypatch.setattr(traces, "SCAN_FROM_BYTES", 0)
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join(LINES * 3))  # no newline at the end
    want, ws = _read(p, Plain())
    got, gs = _read(p, BlockSink())
    _same(gs, ws)
    assert (got.count, got.bad_lines, got.bad_line_numbers) == (
        want.count, want.bad_lines, want.bad_line_numbers)
    assert got.count == 3 * 14 and got.bad_lines == 3 * 12  # the line over 600 bytes is bad
    for limit in (1, 5, 13):
        a, sa = _read(p, Plain(), limit=limit)
        b, sb = _read(p, BlockSink(), limit=limit)
        _same(sb, sa)
        assert b.count == a.count == limit and b.bad_lines == a.bad_lines


@pytest.mark.parametrize("line", [i for i, x in enumerate(LINES) if i in (14, 15, 17, 21, 26)])
def test_scanner_stops_with_the_readers_error(tmp_path: Path, line: int,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(traces, "SCAN_FROM_BYTES", 0)
    p = tmp_path / "t.jsonl"
    p.write_text("\n".join([GOOD, GOOD, LINES[line], GOOD]) + "\n")
    errs = []
    for sink in (Plain(), BlockSink()):
        with pytest.raises(TraceError) as e:
            read_trace(p, block_size=16, sink=sink)
        errs.append(str(e.value))
    assert errs[0] == errs[1] and ":3: " in errs[0]


@pytest.mark.parametrize("scan_from", [0, 1 << 40])
def test_compressed_traces_stream(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                  scan_from: int) -> None:
    """A .gz or .zst trace (detected by its magic bytes) reads as the plain file does, by the
    scanner or line by line."""
    monkeypatch.setattr(traces, "SCAN_FROM_BYTES", scan_from)
    text = ("\n".join(LINES[:3] * 500) + "\n").encode()
    plain = tmp_path / "t.jsonl"
    plain.write_bytes(text)
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress(text))
    zst = tmp_path / "t.jsonl.zst"
    zst.write_bytes(zstandard.ZstdCompressor().compress(text))
    _, want = _read(plain, BlockSink())
    for p in (gz, zst):
        for sink in (BlockSink(), Plain()):
            tr, got = _read(p, sink)
            _same(got, want)
            assert tr.count == 1500
        tr = read_trace(p, block_size=16)  # Requests kept: the line-by-line reader
        assert [r.input_len for r in tr.requests[:3]] == [40, 32, 17]
    assert np.frombuffer(want.blocks, np.int64)[:5].tolist() == [1, 2, 3, 7, 8]
