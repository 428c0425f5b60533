"""Trace readers: formats, auto-detection, errors that name the line, --skip-bad-lines."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.tools.conftest import mooncake_rows, write_jsonl
from tools.hitrate.pages import UNIQUE_TOKEN_BASE, Layout
from tools.hitrate.traces import TraceError, detect_format, read_trace


def test_detect_format() -> None:
    assert detect_format({"hash_ids": [1], "input_length": 3}) == "mooncake"
    assert detect_format({"chunk_hashes": [], "seq_len": 3}) == "lmcache"
    assert detect_format({"input_ids": [1]}) == "engine"
    assert detect_format({"messages": [], "model": "m"}) == "chat"
    assert detect_format({"prompt": "hi"}) == "completion"
    assert detect_format({"hash_ids": [], "input_ids": []}) is None
    assert detect_format([1, 2]) is None


def test_mooncake_dense_ids_and_layout(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "t.jsonl", mooncake_rows([([70, 71], 7), ([70, 99], 8)], 4))
    tr = read_trace(p, block_size=4)
    assert tr.format == "mooncake" and tr.block_size == 4 and tr.num_blocks == 3
    assert [r.blocks for r in tr.requests] == [[0, 1], [0, 2]]
    assert [r.input_len for r in tr.requests] == [7, 8]
    lay = Layout(tr, 2)
    prompt, output = lay.prompt_output(tr.requests[0])
    # Blocks are whole (the partial last block is padded) plus one unique token.
    assert prompt[:8] == [0, 0, 0, 0, 1, 1, 1, 1] and prompt[8] >= UNIQUE_TOKEN_BASE
    assert len(prompt) == 9 and output == []
    prompt2, _ = lay.prompt_output(tr.requests[1])
    assert prompt2[:8] == [0, 0, 0, 0, 2, 2, 2, 2] and prompt2[8] == prompt[8] + 1
    pr = lay.paged(tr.requests[1])
    assert pr.pages == [0, 1, 4, 5] and pr.n_lookup == 4 and pr.input_len == 8


def test_page_size_must_divide_block(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "t.jsonl", mooncake_rows([([1], 4)], 4))
    with pytest.raises(Exception, match="must divide"):
        Layout(read_trace(p, block_size=4), 3)


def test_engine_and_token_pages(tmp_path: Path) -> None:
    rows = [
        {
            "ts": 0.0,
            "rid": "a",
            "input_ids": [1, 2, 3, 4, 5],
            "output_ids": [6, 7],
            "extra_key": None,
            "cached_tokens": 0,
        },
        {
            "ts": 1.0,
            "rid": "b",
            "input_ids": [1, 2, 3, 4, 5, 6, 7, 8],
            "output_ids": [],
            "extra_key": "t1",
            "cached_tokens": 0,
        },
    ]
    tr = read_trace(write_jsonl(tmp_path / "e.jsonl", rows))
    assert tr.format == "engine" and tr.block_size is None
    a, b = tr.requests
    assert (a.rid, a.input_len, a.output_len, a.cached_tokens) == ("a", 5, 2, 0)
    assert b.extra_key == "t1"
    lay = Layout(tr, 2)
    pa, pb = lay.paged(a), lay.paged(b)
    # lookup: full pages of prompt[:-1]; insert: full pages of prompt + output.
    assert (pa.n_lookup, len(pa.pages)) == (2, 3)
    assert (pb.n_lookup, len(pb.pages)) == (3, 4)
    # Another extra_key is another namespace: no page in common.
    assert not set(pa.pages) & set(pb.pages)


def test_lmcache_format(tmp_path: Path) -> None:
    rows = [
        {
            "timestamp": 1.0,
            "request_id": "r1",
            "model_name": "m",
            "chunk_size": 256,
            "seq_len": 600,
            "dtypes": ["bfloat16"],
            "shapes": [[2, 4, 256, 8]],
            "chunk_hashes": ["0xaa", "0xbb"],
        },
        {
            "timestamp": 2.0,
            "request_id": "r2",
            "model_name": "m",
            "chunk_size": 256,
            "seq_len": 256,
            "dtypes": ["bfloat16"],
            "shapes": [[2, 4, 256, 8]],
            "chunk_hashes": ["0xaa"],
        },
    ]
    tr = read_trace(write_jsonl(tmp_path / "l.jsonl", rows))
    assert tr.format == "lmcache" and tr.block_size == 256
    assert [r.blocks for r in tr.requests] == [[0, 1], [0]]
    assert tr.kv_bytes_per_token == 2 * 4 * 8 * 2  # bytes of one chunk / chunk_size
    assert [r.rid for r in tr.requests] == ["r1", "r2"]


def test_lmcache_log_directory(tmp_path: Path) -> None:
    d = tmp_path / "logs"
    d.mkdir()
    row = {"chunk_size": 4, "seq_len": 8, "chunk_hashes": ["0xa", "0xb"]}
    write_jsonl(d / "lookup_hashes_2.jsonl", [{**row, "timestamp": 5.0, "request_id": "late"}])
    write_jsonl(
        d / "lookup_hashes_1.jsonl",
        [
            {**row, "timestamp": 9.0, "request_id": "last"},
            {**row, "timestamp": 1.0, "request_id": "first"},
        ],
    )
    (d / "notes.txt").write_text("ignored")
    tr = read_trace(d)
    assert tr.format == "lmcache"
    assert [r.rid for r in tr.requests] == ["first", "late", "last"]  # timestamp order
    write_jsonl(d / "lookup_hashes_3.jsonl", ["{oops"])
    with pytest.raises(TraceError, match=r"lookup_hashes_3.jsonl:1: malformed JSON"):
        read_trace(d)
    (tmp_path / "empty").mkdir()
    with pytest.raises(TraceError, match="directory holds no"):
        read_trace(tmp_path / "empty")


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match="no such file"):
        read_trace(tmp_path / "nope.jsonl")


def test_malformed_line_names_the_line(tmp_path: Path) -> None:
    rows: list = mooncake_rows([([1, 2], 0), ([1, 3], 0)], 4)
    rows.insert(1, '{"timestamp": 1, "input_length": ')
    p = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TraceError) as e:
        read_trace(p, block_size=4)
    assert f"{p}:2:" in str(e.value) and "malformed JSON" in str(e.value)
    assert e.value.line == 2


def test_wrong_record_names_the_line(tmp_path: Path) -> None:
    rows: list = mooncake_rows([([1, 2], 0)], 4)
    rows.append({"timestamp": 1, "input_length": 4, "output_length": 1, "hash_ids": "x"})
    rows.append({"input_ids": [1, 2]})
    p = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(TraceError, match=r":2: bad mooncake record"):
        read_trace(p, block_size=4)
    tr = read_trace(p, block_size=4, skip_bad_lines=True)
    assert tr.bad_lines == 2 and tr.bad_line_numbers == [2, 3] and len(tr.requests) == 1


def test_wrong_block_size_is_reported(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "t.jsonl", mooncake_rows([([1, 2], 1000)], 512))
    with pytest.raises(TraceError, match=r":1: .*wrong --block-size"):
        read_trace(p, block_size=256)


def test_undetectable_format(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "t.jsonl", [{"foo": 1}])
    with pytest.raises(TraceError, match=r":1: cannot detect the trace format"):
        read_trace(p)
    with pytest.raises(TraceError, match="unknown format"):
        read_trace(p, "csv")


def test_forced_format_mismatch(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "t.jsonl", [{"input_ids": [1, 2, 3]}])
    with pytest.raises(TraceError, match=r":1: looks like a engine record, not mooncake"):
        read_trace(p, "mooncake")


def test_completion_with_token_ids_and_chat_needs_tokenizer(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "c.jsonl", [{"model": "m", "prompt": [5, 6, 7], "max_tokens": 4}])
    tr = read_trace(p)
    assert tr.format == "completion"
    assert tr.requests[0].prompt == [5, 6, 7] and tr.requests[0].output_len == 4
    p = write_jsonl(tmp_path / "chat.jsonl", [{"messages": [{"role": "user", "content": "x"}]}])
    with pytest.raises(TraceError, match=r":1: .*needs --tokenizer"):
        read_trace(p)


def _tiny_tokenizer(path: Path) -> Path:
    """A real `transformers` fast tokenizer (word level) with a chat template, saved to disk."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["<unk>", "<s>", "user", "assistant", ":", "hello", "world", "again", "\n"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>")
    fast.chat_template = (
        "{{ bos_token }}{% for m in messages %}{{ m['role'] }} : {{ m['content'] }} "
        "{% endfor %}{% if add_generation_prompt %}assistant :{% endif %}"
    )
    fast.save_pretrained(path)
    return path


def test_chat_and_completion_tokenised(tmp_path: Path) -> None:
    from tools.hitrate.traces import load_tokenizer

    tok = load_tokenizer(str(_tiny_tokenizer(tmp_path / "tok")))
    chat = [
        {"model": "m", "messages": [{"role": "user", "content": "hello world"}], "max_tokens": 3},
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "again"},
            ],
        },
    ]
    tr = read_trace(write_jsonl(tmp_path / "chat.jsonl", chat), tokenizer=tok)
    assert tr.format == "chat"
    a, b = tr.requests
    assert a.prompt == [1, 2, 4, 5, 6, 3, 4]  # <s> user : hello world assistant :
    assert a.output_len == 3 and b.output_len == 0
    assert b.prompt[:5] == a.prompt[:5]
    comp = [{"model": "m", "prompt": "hello again world"}]
    tr = read_trace(write_jsonl(tmp_path / "comp.jsonl", comp), tokenizer=tok)
    assert tr.format == "completion" and tr.requests[0].prompt == [5, 7, 6]


def test_limit(tmp_path: Path) -> None:
    p = write_jsonl(tmp_path / "t.jsonl", mooncake_rows([([i], 0) for i in range(10)], 4))
    assert len(read_trace(p, block_size=4, limit=3).requests) == 3


def test_real_trace_reads(mooncake_trace: Path) -> None:
    tr = read_trace(mooncake_trace)
    assert tr.format == "mooncake" and len(tr.requests) == 12031 and tr.bad_lines == 0
    first = json.loads(mooncake_trace.read_text().split("\n", 1)[0])
    assert tr.requests[0].input_len == first["input_length"]


def test_progress_bar_counts_every_byte_read(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`progress=True` shows a bar of the bytes read on stderr, ending at the file's size; the
    trace read is the same as without it."""
    from tqdm import tqdm

    reqs = [([i, i + 1, i + 2], 0) for i in range(0, 3000, 3)]
    path = write_jsonl(tmp_path / "t.jsonl", mooncake_rows(reqs, 16, output=4))
    size = path.stat().st_size
    assert size > 1 << 16
    plain = read_trace(path, block_size=16)
    capsys.readouterr()
    shown = read_trace(path, block_size=16, progress=True)
    err = capsys.readouterr().err
    assert "reading: 100%" in err
    last = err.replace("\r", "\n").strip().splitlines()[-1]
    want = tqdm.format_sizeof(size)  # as the bar prints it (3 significant digits)
    assert f"{want}/{want}" in last, last
    assert shown.count == plain.count == len(reqs)
    assert [r.blocks for r in shown.requests] == [r.blocks for r in plain.requests]
    # Off: nothing on stderr.
    read_trace(path, block_size=16, progress=False)
    assert capsys.readouterr().err == ""
