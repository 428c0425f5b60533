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
import signal
import sys
from collections.abc import Iterator
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


def commands(body: str, name: str) -> Iterator[tuple[int, str, int]]:
    """(first line, command, index of the line after it) of every `name ...` command in a
    block's body; continuation lines (after a trailing backslash, or inside an open quote) are
    joined with newlines."""
    lines = body.splitlines()
    j = 0
    while j < len(lines):
        if not lines[j].lstrip().startswith(name + " "):
            j += 1
            continue
        start, cmd = j, lines[j]
        while cmd.endswith("\\") or not _complete(cmd):
            j += 1
            cmd = (cmd[:-1] if cmd.endswith("\\") else cmd) + "\n" + lines[j]
        j += 1
        yield start, cmd, j


def examples(text: str) -> list[Example]:
    found: list[Example] = []
    bl = blocks(text)
    for i, (lang, first, body) in enumerate(bl):
        if lang != "bash":
            continue
        lines = body.splitlines()
        for start, cmd, j in commands(body, "curl"):
            comment = []
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


# --- every documented `hicache-engine` command line starts a server that answers -------------

DOC_FILES = [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]
# Shown with placeholders (`...`, a shell array of four alternatives for remote hosts): not
# runnable as written, and so not run. A new documented command is run unless it is added here.
NOT_RUNNABLE = {
    ("docs/deployment.md", '"${COMMON[@]}" "${L3[@]}" --port $port &'),
    ("docs/deployment.md", "... --kv-events-config"),
    ("docs/hicache-server.md", "--model-path ... --enable-hierarchical-cache"),
    ("docs/storage-distributed.md", "... --enable-hierarchical-cache"),
}


@dataclass
class EngineCommand:
    doc: str  # path relative to the repository
    line: int
    text: str  # the command as written, continuation lines joined
    block: str = ""  # the fenced block it is in (where its shell arrays are defined)


def engine_commands() -> list[EngineCommand]:
    """Every `hicache-engine ...` command in a ```bash block of README.md and docs/*.md."""
    found = []
    for path in DOC_FILES:
        text = path.read_text()
        for lang, first, body in blocks(text):
            if lang != "bash":
                continue
            for start, cmd, _ in commands(body, "hicache-engine"):
                found.append(EngineCommand(str(path.relative_to(REPO)), first + start,
                                           re.sub(r"\s*\n\s*", " ", cmd.strip()), body))
    return found


def runnable(cmd: EngineCommand) -> bool:
    rest = cmd.text.removeprefix("hicache-engine ")
    return not any(doc == cmd.doc and rest.startswith(prefix) for doc, prefix in NOT_RUNNABLE)


def test_engine_commands_found() -> None:
    """The extraction sees the commands the docs show, and every one left out is still there
    (an entry of NOT_RUNNABLE that matches nothing fails here)."""
    cmds = engine_commands()
    mla = ("hicache-engine --model-path hicache-demo-mla --tp-size 2 --enable-hierarchical-cache "
           "--hicache-storage-backend file --hicache-storage-backend-extra-config "
           "'{\"path\": \".hicache/pages\"}'")
    assert ("docs/tensor-parallel.md", mla) in {(c.doc, c.text) for c in cmds}
    for doc, prefix in NOT_RUNNABLE:
        assert any(c.doc == doc and c.text.removeprefix("hicache-engine ").startswith(prefix)
                   for c in cmds), (doc, prefix)
    assert sum(runnable(c) for c in cmds) >= 7


def rewrite(cmd: EngineCommand, tmp: Path, ckpt: Path, store_url: str, token: str,
            port: int) -> list[str]:
    """The command's arguments with this test's port, store and directories: /models/NAME is a
    copy of the demo checkpoint, the hicache-server at 127.0.0.1:7480 the test's, $port and
    $HICACHE_SERVER_AUTH_TOKEN what a shell would give them; a trailing `&` dropped."""
    text = cmd.text.removesuffix("&").strip()
    for name in re.findall(r'"\$\{(\w+)\[@\]\}"', text):  # a bash array of the same block
        [items] = re.findall(rf"^{name}=\((.*?)\)$", cmd.block, re.S | re.M)
        text = text.replace(f'"${{{name}[@]}}"', " ".join(items.split("\n")))
    text = text.replace("$HICACHE_SERVER_AUTH_TOKEN", token).replace("$port", str(port))
    assert "$" not in text, f"{cmd.doc}:{cmd.line}: a shell variable this test cannot give"
    text = text.replace("tcp://127.0.0.1:7480", store_url)
    text = re.sub(r"/models/[\w.-]+", str(ckpt), text)
    argv = shlex.split(text)[1:]
    argv = [a.replace(".hicache/pages", str(tmp / "pages")) for a in argv]
    if "--port" in argv:
        argv[argv.index("--port") + 1] = str(port)
    else:
        argv += ["--port", str(port)]
    if "--tp-size" in argv and int(argv[argv.index("--tp-size") + 1]) > 1:
        import torch

        if torch.cuda.device_count() < 2:  # one GPU per rank; the ranks share a CPU here
            argv += ["--device", "cpu"]
    return argv


def engine_argv(argv: list[str]) -> list[str]:
    """`hicache-engine ARGV` as a user runs it: the console script of this environment."""
    script = Path(sys.executable).parent / "hicache-engine"
    return [str(script) if script.exists() else sys.executable, *([] if script.exists() else
            ["-m", "engine"]), *argv]


def wait_ready(proc: ManagedProcess, timeout: float = 300) -> str:
    import time

    deadline = time.monotonic() + timeout
    while "hicache-engine ready on" not in proc.log():
        assert proc.alive(), proc.log()[-4000:]
        assert time.monotonic() < deadline, proc.log()[-4000:]
        time.sleep(0.1)
    return next(ln for ln in proc.log().splitlines() if "hicache-engine ready on" in ln)


@pytest.mark.slow
def test_every_documented_engine_command_serves(tmp_path: Path) -> None:
    """Each documented `hicache-engine` command line (README.md, docs/*.md) starts, answers one
    completion, and stops with exit code 0."""
    from tests.storage_backends.hicache_server_proc import HiCacheServerProc

    demo = ensure_demo_model()
    ckpt = tmp_path / "checkpoint"  # what /models/NAME stands for
    ckpt.symlink_to(demo, target_is_directory=True)
    token = "docs-token-0123456789abcdef"
    (tmp_path / "open").mkdir()
    (tmp_path / "authed").mkdir()
    store = HiCacheServerProc(tmp_path / "open", capacity="256MiB").start()
    authed = HiCacheServerProc(tmp_path / "authed", capacity="256MiB", auth_token=token).start()
    seen: set[tuple[str, ...]] = set()
    try:
        for cmd in engine_commands():
            if not runnable(cmd):
                continue
            port = free_port()
            url = (authed if "$HICACHE_SERVER_AUTH_TOKEN" in cmd.text else store).url
            argv = rewrite(cmd, tmp_path, ckpt, url, token, port)
            key = tuple(a for a in argv if a != str(port))
            if key in seen:
                continue
            seen.add(key)
            where = f"{cmd.doc}:{cmd.line}"
            proc = ManagedProcess(engine_argv(argv), tmp_path / f"engine-{len(seen)}.log",
                                  cwd=tmp_path)
            proc.start()
            try:
                ready = wait_ready(proc)
                model = argv[argv.index("--model-path") + 1] if "--model-path" in argv \
                    else "hicache-demo"
                assert f"http://127.0.0.1:{port} (model {model}," in ready, (where, ready)
                r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=120,
                               json={"prompt": "The lighthouse keeper", "max_tokens": 4,
                                     "ignore_eos": True})
                assert r.status_code == 200, (where, r.text)
                out = r.json()
                assert out["model"] == model and out["usage"]["completion_tokens"] == 4, where
                proc.proc.send_signal(signal.SIGINT)  # as Ctrl-C: a clean stop
                assert proc.proc.wait(timeout=120) == 0, (where, proc.log()[-4000:])
            finally:
                proc.stop(timeout=60)
    finally:
        store.stop()
        authed.stop()
    assert len(seen) >= 4


def test_model_path_names_and_missing_paths(tmp_path: Path) -> None:
    """A --model-path / --tokenizer-path that does not exist is refused at once, naming it and
    the names that do resolve; the demo names serve (before: 'cannot load a tokenizer')."""
    for flags in (["--model-path", str(tmp_path / "no-such-model")],
                  ["--tokenizer-path", str(tmp_path / "no-such-model")]):
        proc = ManagedProcess(engine_argv([*flags, "--port", str(free_port())]),
                              tmp_path / "missing.log", cwd=tmp_path)
        proc.start()
        assert proc.proc.wait(timeout=120) == 2
        want = (f"hicache-engine: error: {flags[0]} {tmp_path / 'no-such-model'}: no such file "
                "or directory (give a local Hugging Face checkpoint directory or GGUF file, a "
                "model name: smollm2-135m-instruct, hicache-demo, hicache-demo-mla, or, with "
                "--load-format dummy, a shipped config:")
        assert want in proc.log(), proc.log()[-2000:]
        assert "Repo id" not in proc.log() and "Traceback" not in proc.log()
        (tmp_path / "missing.log").unlink()
    ensure_demo_model()
    port = free_port()
    proc = ManagedProcess(engine_argv(["--model-path", "hicache-demo", "--tokenizer-path",
                                       "hicache-demo", "--port", str(port)]),
                          tmp_path / "demo.log", cwd=tmp_path)
    with proc:
        assert "(model hicache-demo, storage none," in wait_ready(proc)
        r = httpx.post(f"http://127.0.0.1:{port}/v1/chat/completions", timeout=120,
                       json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2})
        assert r.status_code == 200 and r.json()["model"] == "hicache-demo", r.text


def test_dummy_model_from_a_config_alone_serves_token_ids(tmp_path: Path) -> None:
    """`--load-format dummy` over a directory holding only config.json: the launcher starts
    without a tokenizer (as the engine does) and serves token ids."""
    cfg = tmp_path / "config-only"
    cfg.mkdir()
    (cfg / "config.json").write_bytes((ensure_demo_model() / "config.json").read_bytes())
    port = free_port()
    proc = ManagedProcess(engine_argv(["--model-path", str(cfg), "--load-format", "dummy",
                                       "--port", str(port)]), tmp_path / "dummy.log",
                          cwd=tmp_path)
    with proc:
        assert f"(model {cfg}, storage none," in wait_ready(proc)
        r = httpx.post(f"http://127.0.0.1:{port}/generate", timeout=120,
                       json={"input_ids": [5, 6, 7], "sampling_params": {
                           "max_new_tokens": 3, "ignore_eos": True}})
        assert r.status_code == 200, r.text
        out = r.json()
        assert out["text"] == "" and len(out["output_ids"]) == 3
        assert out["meta_info"]["prompt_tokens"] == 3
        # Text needs a tokenizer: the request's fault, said so (a 400, not an internal error).
        r = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                       json={"prompt": "a text prompt", "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert "no tokenizer" in r.json()["error"]["message"]
        assert "input_ids" in r.json()["error"]["message"]
