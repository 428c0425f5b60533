"""guidellm (vLLM's benchmarking tool, 0.8.1) against a real `hicache-engine` (demo model), run
as a user runs it: its default OpenAI HTTP backend, streaming (it always sends
`stream_options: {"include_usage": true, "continuous_usage_stats": true}`), synthetic prompts
tokenized with the demo model's tokenizer directory, no network. Every request of a chat and of a
completions run succeeds, with the token counts the server reported.

`make setup` installs guidellm in `.venv/guidellm`, off sys.path (its pins would move the main
venv's); it runs as a subprocess with that directory on its PYTHONPATH."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.demo_model import ensure_demo_model
from tests.engine.test_server_api import EngineServer, engine_server

pytestmark = pytest.mark.slow

GUIDELLM_DIR = Path(sys.prefix) / "guidellm"
REQUESTS = 4
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 8


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    if not (GUIDELLM_DIR / "guidellm").is_dir():
        pytest.skip(f"guidellm is not installed in {GUIDELLM_DIR} (make setup installs it)")
    with engine_server(tmp_path_factory.mktemp("guidellm")) as srv:
        yield srv


def guidellm_command(url: str, route: str, out: Path) -> list[str]:
    """The command docs/server.md gives (python -m guidellm is the `guidellm` script)."""
    return [sys.executable, "-m", "guidellm", "run",
            "--backend", f"kind=openai_http,target={url},model=hicache-demo,request_format={route}",
            "--profile", "kind=synchronous",
            "--constraint", f"kind=max_requests,count={REQUESTS}",
            "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                      f"output_tokens={OUTPUT_TOKENS}",
            "--tokenizer", f"kind=huggingface_auto,model={ensure_demo_model()}",
            "--output", f"kind=json,path={out}",
            "--disable-console-interactive"]


@pytest.mark.parametrize("route", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_default_streaming_run(server: EngineServer, tmp_path: Path,
                                        route: str) -> None:
    out = tmp_path / "benchmarks.json"
    env = {**os.environ, "PYTHONPATH": str(GUIDELLM_DIR), "HF_HUB_OFFLINE": "1",
           "HF_DATASETS_OFFLINE": "1", "GUIDELLM__LOGGING__CONSOLE_LOG_LEVEL": "WARNING"}
    run = subprocess.run(guidellm_command(server.url, route, out), cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=540)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    (bench,) = json.loads(out.read_text())["benchmarks"]
    requests = bench["requests"]
    assert (len(requests["successful"]), len(requests["errored"]),
            len(requests["incomplete"])) == (REQUESTS, 0, 0), run.stdout[-3000:]
    for req in requests["successful"]:
        body = json.loads(req["request_args"])["body"]
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True, "continuous_usage_stats": True}
        # Token counts are the server's usage: every output token, the prompt as tokenized.
        assert req["output_tokens"] == OUTPUT_TOKENS
        assert req["prompt_tokens"] >= PROMPT_TOKENS
        assert req["response_id"].startswith("chatcmpl-" if "chat" in route else "cmpl-")
