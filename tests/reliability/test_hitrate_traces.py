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


# Bounds (issue 18): lengths over --max-request-tokens, lines over --max-line-bytes, timestamps
# that are not finite non-negative numbers, integers JSON cannot hold and nesting too deep are
# bad lines like malformed ones: exit status 2 naming the line, or skipped and counted.

def mooncake_bad(**fields: Any) -> str:
    obj: dict[str, Any] = {"timestamp": 0, "input_length": 1024, "output_length": 8,
                           "hash_ids": [0, 1]}
    obj.update(fields)
    return json.dumps(obj)


BOUND_CASES: list[tuple[str, str, list[str], str]] = [
    # (format, bad line 3, extra flags, what the error says)
    ("mooncake", mooncake_bad(output_length=10**11), [],
     "'output_length' is 100,000,000,000, over the bound of 16,777,216 (--max-request-tokens)"),
    ("mooncake", mooncake_bad(output_length=1e11), [],
     "'output_length' must be an integer >= 0, got 100000000000.0"),
    ("mooncake", mooncake_bad(input_length=5000, hash_ids=list(range(10))), ["--max-request-tokens",
                                                                             "4096"],
     "'hash_ids' has 10 entries, over the bound of 8 (--max-request-tokens)"),
    ("mooncake", mooncake_bad(input_length=1 << 25, hash_ids=[0, 1]), [],
     "'input_length' is 33,554,432, over the bound of 16,777,216 (--max-request-tokens)"),
    ("mooncake", mooncake_bad().replace('"timestamp": 0', '"timestamp": Infinity'), [],
     "'timestamp' must be a finite number >= 0 (below 1e+11 s), got inf"),
    ("mooncake", mooncake_bad().replace('"timestamp": 0', '"timestamp": NaN'), [],
     "'timestamp' must be a finite number >= 0 (below 1e+11 s), got nan"),
    ("mooncake", mooncake_bad().replace('"timestamp": 0', '"timestamp": -Infinity'), [],
     "'timestamp' must be a finite number >= 0 (below 1e+11 s), got -inf"),
    ("mooncake", mooncake_bad(timestamp=-1), [],
     "'timestamp' must be a finite number >= 0 (below 1e+11 s), got -1"),
    ("mooncake", mooncake_bad(timestamp=True), [], "'timestamp' must be a number, got True"),
    ("mooncake", mooncake_bad(timestamp=1e300), [],
     "'timestamp' must be a finite number >= 0 (below 1e+11 s), got 1e+300"),
    ("mooncake", mooncake_bad().replace('"output_length": 8', '"output_length": 1' + "0" * 5000),
     [], "malformed JSON (Exceeds the limit (4300 digits) for integer string conversion)"),
    ("mooncake", "[" * 100_000 + "]" * 100_000, [], "malformed JSON (maximum recursion depth"),
    ("mooncake", mooncake_bad(pad="x" * 5000), ["--max-line-bytes", "4096"],
     "line longer than 4,096 bytes (--max-line-bytes)"),
    ("engine", json.dumps({"ts": "soon", "input_ids": [1, 2]}), [],
     "'ts' must be a number, got 'soon'"),
    ("engine", '{"ts": NaN, "input_ids": [1, 2]}', [],
     "'ts' must be a finite number >= 0 (below 1e+11 s), got nan"),
    ("engine", json.dumps({"input_ids": list(range(100)), "output_ids": []}),
     ["--max-request-tokens", "64"],
     "'input_ids' has 100 entries, over the bound of 64 (--max-request-tokens)"),
    ("engine", json.dumps({"input_ids": [1, 2], "output_ids": list(range(65))}),
     ["--max-request-tokens", "64"],
     "'output_ids' has 65 entries, over the bound of 64 (--max-request-tokens)"),
]


def run_cli(args: list[str]) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    # The timeout only stops a runaway; the assertions are on the exit status and the message.
    return subprocess.run([*hitrate_argv(), *args], capture_output=True, text=True, timeout=120,
                          cwd=REPO, env=env)


@pytest.mark.parametrize(("fmt", "bad", "flags", "msg"), BOUND_CASES,
                         ids=[f"{c[0]}-{i}" for i, c in enumerate(BOUND_CASES)])
def test_cli_bounds_exit_2_naming_the_line(tmp_path: Path, fmt: str, bad: str, flags: list[str],
                                           msg: str) -> None:
    trace = write_trace(tmp_path / "trace.jsonl", fmt, 3, bad)
    r = run_cli([str(trace), "--format", fmt, "--no-progress", *flags])
    assert r.returncode == 2, (r.returncode, r.stdout[-500:], r.stderr[-1500:])
    assert "Traceback" not in r.stderr
    assert r.stderr.startswith(f"hicache-hitrate: error: {trace}:3: "), r.stderr[:500]
    assert msg in r.stderr, r.stderr[:500]
    assert r.stdout == ""


def test_cli_skip_bad_lines_counts_bound_violations(tmp_path: Path) -> None:
    lines = [json.dumps(mooncake_line(i)) for i in range(8)]
    lines[1] = mooncake_bad(output_length=10**11)
    lines[3] = mooncake_bad().replace('"timestamp": 0', '"timestamp": Infinity')
    lines[4] = mooncake_bad().replace('"timestamp": 0', '"timestamp": NaN')
    lines[6] = mooncake_bad(timestamp=-3)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    r = run_cli([str(trace), "--no-progress", "--skip-bad-lines", "--json", "--no-opt"])
    assert r.returncode == 0, r.stderr[-1500:]
    doc = json.loads(r.stdout)
    assert (doc["trace"]["bad_lines"], doc["trace"]["bad_line_numbers"]) == (4, [2, 4, 5, 7])
    assert (doc["trace"]["requests"], doc["result"]["requests"]) == (4, 4)
    assert doc["trace"]["output_tokens"] == 4 * 8
    r = run_cli([str(trace), "--no-progress", "--skip-bad-lines", "--no-opt"])
    assert r.returncode == 0, r.stderr[-1500:]
    assert "skipped 4 bad lines (first: 2, 4, 5, 7)" in r.stdout, r.stdout


def test_bound_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    trace = write_trace(tmp_path / "trace.jsonl", "mooncake", 1, json.dumps(mooncake_line(0)))
    for flags, msg in [
        (["--max-request-tokens", "0"], "--max-request-tokens must be >= 1, got 0"),
        (["--max-line-bytes", "-1"], "--max-line-bytes must be >= 1, got -1"),
    ]:
        assert cli_main([str(trace), "--no-progress", *flags]) == 2
        assert capsys.readouterr().err == f"hicache-hitrate: error: {msg}\n"
    # A bound that admits the line: read as usual.
    assert cli_main([str(trace), "--no-progress", "--json", "--max-request-tokens", "1024"]) == 0
    assert json.loads(capsys.readouterr().out)["trace"]["requests"] == 6
    # One under the line's input length: refused, naming it.
    assert cli_main([str(trace), "--no-progress", "--max-request-tokens", "1023"]) == 2
    assert capsys.readouterr().err == (
        f"hicache-hitrate: error: {trace}:1: bad mooncake record: 'input_length' is 1,024, over "
        "the bound of 1,023 (--max-request-tokens)\n")
