"""docs/server.md is executable: the engine is started with the documented command, its ready
line must be the documented one, and every documented `curl` request is sent (in document order)
and its answer compared with the JSON the docs show.

In the documented JSON, the string "…" stands for any value (ids, timestamps) and a key "…" in
an object for any further keys. A `curl` line's answer is either the `# {...}` comment lines
right after it or, for the last command of a ```bash block, the ```json block that follows.
`HICACHE_DOCS_PRINT=1` prints every actual answer (to write the docs from a real run).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.demo_model import ensure_demo_model
from tests.procs import ManagedProcess, free_port

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "server.md"
DOC_URL = "http://127.0.0.1:30000"
ANY = "…"


@dataclass
class Example:
    line: int  # 1-based line of the curl command in the doc
    argv: list[str]
    expected: Any


def blocks(text: str) -> list[tuple[str, int, str]]:
    """(language, first line number, body) of every fenced block."""
    out = []
    for m in re.finditer(r"^```(\w*)\n(.*?)^```", text, re.S | re.M):
        out.append((m.group(1), text[: m.start()].count("\n") + 2, m.group(2)))
    return out


def _complete(cmd: str) -> bool:
    try:
        shlex.split(cmd)
    except ValueError:  # no closing quotation
        return False
    return True


def examples(text: str) -> list[Example]:
    found: list[Example] = []
    bl = blocks(text)
    for i, (lang, first, body) in enumerate(bl):
        if lang != "bash" or "curl " not in body:
            continue
        lines = body.splitlines()
        j = 0
        while j < len(lines):
            if not lines[j].lstrip().startswith("curl "):
                j += 1
                continue
            start = j
            cmd = lines[j]
            while cmd.endswith("\\") or not _complete(cmd):  # continued, or inside a quote
                j += 1
                cmd = (cmd[:-1] if cmd.endswith("\\") else cmd) + "\n" + lines[j]
            comment = []
            j += 1
            while j < len(lines) and lines[j].startswith("# "):
                comment.append(lines[j][2:])
                j += 1
            if comment:
                expected = json.loads("\n".join(comment))
            else:
                nxt = bl[i + 1] if i + 1 < len(bl) else None
                assert nxt is not None and nxt[0] in ("json", "sse"), f"line {first + start}"
                expected = json.loads(nxt[2]) if nxt[0] == "json" else sse_events(nxt[2])
            found.append(Example(first + start, shlex.split(cmd), expected))
    return found


def sse_events(text: str) -> list[Any]:
    """The events of a Server-Sent Events body: each `data: ...` line as JSON ("[DONE]" kept)."""
    out: list[Any] = []
    for line in text.splitlines():
        if line:
            assert line.startswith("data: "), line
            out.append("[DONE]" if line == "data: [DONE]" else json.loads(line[6:]))
    return out


def send(client: httpx.Client, argv: list[str], base: str) -> httpx.Response:
    assert argv[0] == "curl"
    method, url, data, headers = "GET", None, None, {}
    k = 1
    while k < len(argv):
        a = argv[k]
        if a in ("-s", "-sN"):
            pass
        elif a == "-X":
            k += 1
            method = argv[k]
        elif a == "-H":
            k += 1
            name, _, value = argv[k].partition(":")
            headers[name.strip()] = value.strip()
        elif a == "-d":
            k += 1
            data = argv[k]
            method = "POST" if method == "GET" else method
        else:
            assert url is None and a.startswith(DOC_URL), a
            url = base + a[len(DOC_URL):]
        k += 1
    assert url is not None
    return client.request(method, url, content=data, headers=headers)


def matches(expected: Any, actual: Any, where: str = "") -> None:
    if expected == ANY:
        return
    if isinstance(expected, dict):
        assert isinstance(actual, dict), (where, actual)
        keys = set(expected) - {ANY}
        if ANY not in expected:
            assert set(actual) == keys, (where, sorted(actual), sorted(keys))
        for k in keys:
            assert k in actual, (where, k)
            matches(expected[k], actual[k], f"{where}.{k}")
        return
    if isinstance(expected, list):
        assert isinstance(actual, list) and len(actual) == len(expected), (where, actual)
        for n, (e, a) in enumerate(zip(expected, actual)):
            matches(e, a, f"{where}.{n}")
        return
    assert expected == actual and type(expected) is type(actual), (where, expected, actual)


def start_command(text: str) -> list[str]:
    """The flags of the documented `hicache-engine ...` start command."""
    m = re.search(r"^hicache-engine (.*?)(?<!\\)$", text, re.S | re.M)
    assert m is not None
    return shlex.split(m.group(1).replace("\\\n", " "))


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Any:
    ensure_demo_model()
    tmp = tmp_path_factory.mktemp("docs")
    text = DOC.read_text()
    flags = [f.replace(".hicache/pages", str(tmp / "pages")) for f in start_command(text)]
    port = free_port()
    proc = ManagedProcess([sys.executable, "-m", "engine", "--port", str(port), *flags],
                          tmp / "engine.log", cwd=REPO)
    proc.start()
    try:
        import time

        deadline = time.monotonic() + 300
        while "hicache-engine ready on" not in proc.log():
            assert proc.alive(), proc.log()[-4000:]
            assert time.monotonic() < deadline, proc.log()[-4000:]
            time.sleep(0.1)
        yield text, port, proc, tmp
    finally:
        proc.stop(timeout=60)


def test_documented_ready_line_and_requests(served: Any) -> None:
    text, port, proc, tmp = served
    ready = next(line for line in proc.log().splitlines() if "hicache-engine ready on" in line)
    documented = next(line for line in text.splitlines()
                      if line.startswith("hicache-engine ready on"))
    assert ready == documented.replace(":30000", f":{port}")
    found = examples(text)
    assert len(found) >= 8
    show = os.environ.get("HICACHE_DOCS_PRINT")
    with httpx.Client(timeout=120) as c:
        for ex in found:
            r = send(c, ex.argv, f"http://127.0.0.1:{port}")
            # The store's directory is a temporary one here; the docs show the command's.
            raw = r.text.replace(str(tmp / "pages"), ".hicache/pages")
            sse = r.headers.get("content-type", "").startswith("text/event-stream")
            actual = sse_events(raw) if sse else json.loads(raw)
            if show:
                print(f"--- docs/server.md:{ex.line} {r.status_code}\n" + (raw if sse else
                      json.dumps(actual, ensure_ascii=False)))
                continue
            matches(ex.expected, actual, f"docs/server.md:{ex.line}")


def test_flags_table_matches_the_cli() -> None:
    """Every flag row shows the flag's real default and choices."""
    from dataclasses import MISSING, fields

    from engine.args import EngineArgs
    from engine.cli import build_parser

    choices = {a.dest: a.choices for a in build_parser()._actions}
    rows = {}
    for line in DOC.read_text().splitlines():
        m = re.match(r"^\| `--([a-z0-9-]+)` \| (.*?) \| (.*?) \| (.*) \|$", line)
        if m:
            rows[m.group(1).replace("-", "_")] = (m.group(2), m.group(3))
    for f in fields(EngineArgs):
        assert f.name in rows, f.name
        shown, values = rows[f.name]
        default = f.default if f.default is not MISSING else None
        if default is None:
            want = "—"
        elif isinstance(default, bool):
            want = "on" if default else "off"
        else:
            want = f"`{default}`"
        assert shown == want, (f.name, shown, want)
        if choices.get(f.name):
            assert values == ", ".join(f"`{c}`" for c in choices[f.name]), (f.name, values)
