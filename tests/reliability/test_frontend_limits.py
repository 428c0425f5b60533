"""The engine's front end under hostile and unlucky clients, on a real `hicache-engine` serving
the demo model:

- a body over the limit is a 413 whether it has a Content-Length or is chunked (counted while it
  streams in, never read whole);
- `/health` answers while a maximal request is parsed and tokenized (the parse runs on worker
  threads: the probe completes while the big request is still in flight);
- a text prompt that is certainly longer than the context is refused before it is tokenized;
- a client `rid` reused right after its client disconnected mid-stream gets its own output (the
  engine's ids are its own, unique per request), and the disconnected request is gone;
- clients that disconnect (streaming or not) leave no error in the log.
"""

from __future__ import annotations

import json
import socket
import threading
from collections.abc import Iterator

import httpx
import pytest

from engine.server.state import MAX_BODY_BYTES
from tests.engine.test_server_api import EngineServer
from tests.procs import wait_until

# " afternoons" is one token of the demo tokenizer: prompts long in characters, short in tokens.
WORD = " afternoons"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EngineServer]:
    srv = EngineServer(tmp_path_factory.mktemp("limits"), ["--page-size", "16"]).start()
    try:
        yield srv.wait_ready()
    finally:
        srv.stop()
        log = srv.proc.log()
        for bad in ("Traceback", "ERROR", "never retrieved"):
            assert bad not in log, log[-4000:]


def raw_request(port: int, path: str, body: bytes, chunked: bool = False,
                length: int | None = None) -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port))
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    if chunked:
        s.sendall((head + "Transfer-Encoding: chunked\r\n\r\n").encode())
    else:
        n = len(body) if length is None else length
        s.sendall((head + f"Content-Length: {n}\r\n\r\n").encode() + body)
    return s


def read_response(s: socket.socket) -> tuple[int, bytes]:
    data = b""
    while True:
        chunk = s.recv(65536)
        if not chunk:
            break
        data += chunk
        head, sep, rest = data.partition(b"\r\n\r\n")
        if sep and b"content-length:" in head.lower():
            n = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
            if len(rest) >= n:
                break
    status = int(data.split(b" ", 2)[1])
    return status, data.partition(b"\r\n\r\n")[2]


def test_body_limit_holds_for_chunked_bodies(server: EngineServer) -> None:
    s = raw_request(server.port, "/v1/completions", b"", chunked=True)
    sent = 0
    chunk = b" " * (1 << 20)
    stop = threading.Event()

    def feed() -> None:
        nonlocal sent
        try:
            while not stop.is_set() and sent <= 2 * MAX_BODY_BYTES:
                s.sendall(b"%x\r\n" % len(chunk) + chunk + b"\r\n")
                sent += len(chunk)
        except OSError:
            pass  # the server answered and closed the connection

    t = threading.Thread(target=feed)
    t.start()
    status, body = read_response(s)
    stop.set()
    t.join()
    s.close()
    assert status == 413, body[:300]
    assert json.loads(body)["error"]["code"] == "request_too_large"
    assert sent < 2 * MAX_BODY_BYTES  # refused while streaming, not after reading it all
    # With a Content-Length the refusal comes before any of the body is read.
    s = raw_request(server.port, "/generate", b"{}", length=MAX_BODY_BYTES + 1)
    status, body = read_response(s)
    s.close()
    assert status == 413 and json.loads(body)["error"]["code"] == "request_too_large"
    assert server.get("/health") == {"status": "ok"}


def test_health_answers_while_a_maximal_request_is_parsed(server: EngineServer) -> None:
    # 39 prompts of 4000 tokens and one of 4200 (> the 4096-token context): every prompt is
    # tokenized (each is under the character pre-check), then the request is refused.
    prompts = [WORD * 4000] * 39 + [WORD * 4200]
    body = json.dumps({"prompt": prompts, "max_tokens": 1}).encode()
    big = raw_request(server.port, "/v1/completions", body)
    try:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            r = c.get("/health")
        assert r.status_code == 200
        big.setblocking(False)
        with pytest.raises(BlockingIOError):  # the big request has not been answered yet
            big.recv(1)
        big.setblocking(True)
        status, out = read_response(big)
    finally:
        big.close()
    assert status == 400
    err = json.loads(out)["error"]
    assert (err["param"], err["code"]) == ("prompt.39", "context_length_exceeded")
    assert "4200 tokens" in err["message"]


def test_a_prompt_certainly_too_long_is_refused_before_tokenizing(server: EngineServer) -> None:
    info = server.get("/get_model_info")
    with server.client() as c:
        r = c.post("/v1/completions", json={"prompt": "x" * (14 * info["context_length"])})
    err = r.json()["error"]
    assert r.status_code == 400 and err["code"] == "context_length_exceeded"
    assert "characters" in err["message"]  # the pre-check, not the tokenizer's count


def test_reused_rid_after_a_disconnect_gets_its_own_output(server: EngineServer) -> None:
    sp = {"max_new_tokens": 8, "ignore_eos": True}
    prompts = [[7 + i, 11, 13, 17 + i, 19] for i in range(6)]
    want = server.post("/generate", {"input_ids": prompts, "sampling_params": sp})
    for i, prompt in enumerate(prompts):
        rid = f"reused-{i % 2}"
        with server.client() as c, c.stream("POST", "/generate", json={
                "input_ids": [900 + i] * 20, "rid": rid, "stream": True,
                "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True}}) as r:
            lines = r.iter_lines()
            first = next(line for line in lines if line)
            assert json.loads(first[6:])["meta_info"]["id"] == rid
        # The connection is closed mid-stream; the same rid at once:
        out = server.post("/generate", {"input_ids": prompt, "rid": rid, "sampling_params": sp})
        assert out["output_ids"] == want[i]["output_ids"]
        assert out["meta_info"]["id"] == rid
    wait_until(lambda: server.stats()["scheduler"]["running"] == 0, timeout=60, interval=0.1,
               what="aborted requests gone")


def test_disconnects_leave_no_error_in_the_log(server: EngineServer) -> None:
    base = server.stats()["scheduler"]["finished"]
    for path, body in (
        ("/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3000, "ignore_eos": True}),
        ("/generate", {"input_ids": [[5, 6], [7, 8]],
                       "sampling_params": {"max_new_tokens": 3000, "ignore_eos": True}}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}],
                                  "max_tokens": 3000, "ignore_eos": True, "stream": True}),
    ):
        s = raw_request(server.port, path, json.dumps(body).encode())
        wait_until(lambda: server.stats()["scheduler"]["running"] > 0, timeout=60,
                   interval=0.05, what="request running")
        s.close()
        wait_until(lambda: server.stats()["scheduler"]["running"] == 0, timeout=60,
                   interval=0.1, what="request aborted")
    assert server.stats()["scheduler"]["finished"] - base == 4
    # The fixture checks the whole log for errors once the server has stopped.
