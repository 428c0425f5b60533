"""`hicache-hitrate` on trace files with malformed lines: a clear error that names the file and
the line (exit status 2, no traceback), never a crash and never a silently wrong analysis."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tools.hitrate.cli import main as cli_main
from tools.hitrate.traces import TraceError, read_trace

REPO = Path(__file__).resolve().parents[2]


def mooncake_line(i: int) -> dict[str, Any]:
    return {"timestamp": 1000 * i, "input_length": 1024, "output_length": 8,
            "hash_ids": [0, 1 + i]}


def engine_line(i: int) -> dict[str, Any]:
    return {"rid": f"r{i}", "input_ids": [5, 6, 7, 8 + i], "output_ids": [9, 10],
            "extra_key": None, "cached_tokens": 0}


GOOD = {"mooncake": mooncake_line, "engine": engine_line}


def write_trace(path: Path, fmt: str, bad_line: int, bad: str | bytes, n: int = 6) -> Path:
    lines: list[bytes] = [json.dumps(GOOD[fmt](i)).encode() for i in range(n)]
    lines[bad_line - 1] = bad if isinstance(bad, bytes) else bad.encode()
    path.write_bytes(b"\n".join(lines) + b"\n")
    return path


def hitrate_argv() -> list[str]:
    exe = shutil.which("hicache-hitrate") or str(Path(sys.executable).parent / "hicache-hitrate")
    if os.path.exists(exe):
        return [exe]
    return [sys.executable, "-m", "tools.hitrate.cli"]


BAD_LINES: list[tuple[str, str]] = [
    ("mooncake", '{"timestamp": 0, "input_length": 1024, "output_length": 8, "hash_ids": [0,'),
    ("mooncake", '{"timestamp": 0, "input_length": "1024", "output_length": 8, "hash_ids": [0]}'),
    ("mooncake", '{"timestamp": 0, "input_length": 1024, "output_length": -1, "hash_ids": [0, 1]}'),
    ("mooncake", '{"timestamp": 0, "input_length": 99999, "output_length": 1, "hash_ids": [0]}'),
    ("mooncake", '{"timestamp": "soon", "input_length": 1024, "output_length": 1, '
                 '"hash_ids": [0, 1]}'),
    ("mooncake", '{"input_ids": [1, 2, 3]}'),
    ("mooncake", "[1, 2, 3]"),
    ("mooncake", "not json at all"),
    ("engine", '{"input_ids": [], "output_ids": []}'),
    ("engine", '{"input_ids": [1, -2, 3]}'),
    ("engine", '{"input_ids": [1, 2], "extra_key": 7}'),
    ("engine", '{"input_ids": "1 2 3"}'),
    ("engine", '{"hash_ids": [1], "input_length": 5, "output_length": 1}'),
    ("engine", "{}"),
]


@pytest.mark.parametrize(("fmt", "bad"), BAD_LINES, ids=[f"{f}-{i}" for i, (f, _) in
                                                         enumerate(BAD_LINES)])
def test_cli_names_the_bad_line(tmp_path: Path, capsys: pytest.CaptureFixture[str], fmt: str,
                                bad: str) -> None:
    trace = write_trace(tmp_path / "trace.jsonl", fmt, 4, bad)
    assert cli_main([str(trace), "--format", fmt, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hicache-hitrate: error:"), err
    assert f"{trace}:4:" in err, err
    # --skip-bad-lines analyses the rest, and says how many lines it skipped.
    argv = [str(trace), "--format", fmt, "--no-progress", "--skip-bad-lines", "--json", "--no-opt"]
    assert cli_main(argv) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["trace"]["bad_lines"], doc["trace"]["bad_line_numbers"]) == (1, [4])
    assert doc["trace"]["requests"] == 5


@pytest.mark.slow
def test_console_script_exits_2_naming_the_line(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "trace.jsonl", "mooncake", 3, BAD_LINES[0][1])
    r = subprocess.run([*hitrate_argv(), str(trace), "--no-progress"],
                       capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-1500:])
    assert f"{trace}:3: malformed JSON" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr


def mutate(draw: Callable[[st.SearchStrategy[Any]], Any], line: str) -> str:
    kind = draw(st.sampled_from(["truncate", "field", "insert", "drop"]))
    if kind == "truncate":
        return line[: draw(st.integers(0, max(0, len(line) - 1)))]
    obj = json.loads(line)
    key = draw(st.sampled_from(sorted(obj)))
    if kind == "drop":
        del obj[key]
    elif kind == "field":
        obj[key] = draw(st.none() | st.booleans() | st.integers(-(2**70), 2**70)
                        | st.floats(allow_nan=False) | st.text(max_size=8)
                        | st.lists(st.integers(-3, 5) | st.text(max_size=2), max_size=4)
                        | st.dictionaries(st.text(max_size=3), st.integers(), max_size=2))
    else:
        pos = draw(st.integers(0, len(line)))
        return line[:pos] + draw(st.text(max_size=4)) + line[pos:]
    return json.dumps(obj)


@settings(max_examples=300, deadline=None, derandomize=True, database=None,
          suppress_health_check=list(HealthCheck))
@given(data=st.data())
def test_mutated_lines_fail_with_their_line_number(tmp_path_factory: pytest.TempPathFactory,
                                                   data: st.DataObject) -> None:
    """A mutated line is read as a valid record, or refused with a `TraceError` naming it."""
    fmt = data.draw(st.sampled_from(sorted(GOOD)))
    lineno = data.draw(st.integers(2, 6))
    good = json.dumps(GOOD[fmt](lineno - 1))
    bad = mutate(data.draw, good)
    trace = write_trace(tmp_path_factory.mktemp("t") / "trace.jsonl", fmt, lineno, bad)
    try:
        t = read_trace(trace, fmt)
    except TraceError as e:
        assert e.line == lineno, (str(e), bad)
        assert f"{trace}:{lineno}: " in str(e)
        return
    assert len(t.requests) == 6 or not bad.strip()  # accepted: it is a valid record


def test_non_utf8_line_is_named(tmp_path: Path) -> None:
    trace = write_trace(tmp_path / "trace.jsonl", "mooncake", 4, b"\xff\xfe{}")
    with pytest.raises(TraceError) as e:
        read_trace(trace, "mooncake")
    assert e.value.line == 4, str(e.value)
    t = read_trace(trace, "mooncake", skip_bad_lines=True)
    assert (len(t.requests), t.bad_lines) == (5, 1)
