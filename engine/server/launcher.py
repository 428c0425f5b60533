"""Start the scheduler process and the HTTP front end; stop both together.

The front end (this process) binds two ZeroMQ IPC sockets in a private temp directory and starts
`python -m engine.server.scheduler_proc` as its child. When the scheduler dies the front end
stops serving and exits nonzero; when the front end dies the scheduler gets SIGTERM from the
kernel (PR_SET_PDEATHSIG) and also notices its parent changed. SIGINT / SIGTERM on the front
end: stop accepting requests, tell the scheduler to shut down (it flushes its cache transfers),
wait for it, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import uvicorn
import zmq
import zmq.asyncio

from engine.args import EngineArgs
from engine.server import protocol as P
from hicache_client.errors import ConfigError

logger = logging.getLogger(__name__)

SCHEDULER_START_TIMEOUT = 600.0
SCHEDULER_STOP_TIMEOUT = 120.0
DEMO_MODEL_NAME = "hicache-demo"


class _Server(uvicorn.Server):
    """uvicorn without its own signal handling: the launcher owns SIGINT / SIGTERM."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def bind_listener(host: str, port: int) -> socket.socket:
    """The HTTP listening socket, bound now (uvicorn serves on it later)."""
    family, kind, proto, _, addr = socket.getaddrinfo(
        host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)  # not listening yet: connections are refused until uvicorn serves
    except OSError:
        sock.close()
        raise
    sock.set_inheritable(False)
    return sock


def served_model_name(args: EngineArgs) -> str:
    if args.model_id:
        return args.model_id
    return args.model_path if args.model_path else DEMO_MODEL_NAME


def ready_line(args: EngineArgs, info: P.Ready) -> str:
    storage = info.storage_backend or "none"
    return (
        f"hicache-engine ready on http://{args.host}:{args.port} "
        f"(model {served_model_name(args)}, storage {storage}, "
        f"context {info.context_length}, kv {info.max_total_tokens} tokens)"
    )


class Launcher:
    def __init__(self, args: EngineArgs, log_level: str = "info") -> None:
        self.args = args
        self.log_level = log_level
        self.stop_requested = False
        self.server: _Server | None = None
        self.proc: subprocess.Popen[bytes] | None = None
        self.scheduler_died: int | None = None
        self.stop_event: asyncio.Event | None = None

    def _on_signal(self, signum: int) -> None:
        logger.info("got %s; shutting down", signal.Signals(signum).name)
        if self.stop_requested and signum == signal.SIGINT and self.server is not None:
            self.server.force_exit = True
        self.stop_requested = True
        if self.stop_event is not None:
            self.stop_event.set()
        if self.server is not None:
            self.server.should_exit = True

    async def _watch(self, client: Any) -> None:
        assert self.proc is not None
        while self.proc.poll() is None:
            await asyncio.sleep(0.1)
        code = self.proc.returncode
        if not self.stop_requested:
            logger.error("the scheduler process exited with %s; stopping the front end", code)
            self.scheduler_died = code
        client.fail_all(f"the scheduler process exited with {code}")
        self.stop_requested = True
        if self.server is not None:
            self.server.should_exit = True

    async def run(self) -> int:
        from engine.demo_model import resolve_model_path
        from engine.server.client import SchedulerClient
        from engine.server.frontend import create_app
        from engine.server.metrics import ServerMetrics
        from engine.server.state import ServerState
        from engine.tokenizer import load_tokenizer

        args = self.args
        loop = asyncio.get_running_loop()
        stop_event = self.stop_event = asyncio.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, self._on_signal, sig)
        try:
            # Bound before anything slow starts: a port in use fails in a second, not after the
            # model has loaded.
            listener = bind_listener(args.host, args.port)
        except OSError as e:
            print(f"hicache-engine: cannot listen on {args.host}:{args.port}: {e}",
                  file=sys.stderr, flush=True)
            return 1
        try:
            # Demo names (hicache-demo, hicache-demo-mla) become their directories, written on
            # first use; a path that does not exist is refused here, before anything starts.
            model_dir = await asyncio.to_thread(resolve_model_path, args.model_path)
            tok_dir = (await asyncio.to_thread(resolve_model_path, args.tokenizer_path,
                                               "--tokenizer-path")
                       if args.tokenizer_path else model_dir)
        except ConfigError as e:
            listener.close()
            print(f"hicache-engine: error: {e}", file=sys.stderr, flush=True)
            return 2
        sched_args = dataclasses.replace(
            args, model_path=str(model_dir),
            tokenizer_path=str(tok_dir) if args.tokenizer_path else None,
        )
        tmp = Path(tempfile.mkdtemp(prefix="hicache-engine-"))
        in_addr, out_addr = f"ipc://{tmp}/to-scheduler", f"ipc://{tmp}/from-scheduler"
        ctx = zmq.asyncio.Context()
        client = SchedulerClient(ctx, in_addr, out_addr)
        recv_task = asyncio.create_task(client.recv_loop())
        env = {**os.environ, "HICACHE_LOG_LEVEL": self.log_level.upper()}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "engine.server.scheduler_proc",
             json.dumps(dataclasses.asdict(sched_args)), in_addr, out_addr],
            env=env,
        )
        watch_task = asyncio.create_task(self._watch(client))
        code = 0
        state: ServerState | None = None
        try:
            try:
                # A dummy-weight model over a config alone may have none: token ids in and out.
                tokenizer = await asyncio.to_thread(
                    load_tokenizer, tok_dir,
                    optional=args.load_format == "dummy" and not args.tokenizer_path,
                )
            except ConfigError as e:
                print(f"hicache-engine: error: {e}", file=sys.stderr, flush=True)
                return 2
            stop_wait = asyncio.create_task(stop_event.wait())
            waits: list[asyncio.Future[Any]] = [client.ready, watch_task, stop_wait]
            await asyncio.wait(
                waits, timeout=SCHEDULER_START_TIMEOUT,
                return_when=asyncio.FIRST_COMPLETED,
            )
            stop_wait.cancel()
            if self.stop_requested and self.scheduler_died is None:
                return 0
            if not client.ready.done():
                if self.scheduler_died is not None or self.proc.poll() is not None:
                    print("hicache-engine: the scheduler process failed to start "
                          f"(exit code {self.proc.poll()}); see the log above",
                          file=sys.stderr, flush=True)
                else:
                    print("hicache-engine: the scheduler did not get ready in "
                          f"{SCHEDULER_START_TIMEOUT}s", file=sys.stderr, flush=True)
                return 1
            info = client.ready.result()
            state = ServerState(
                args=args, tokenizer=tokenizer, client=client, info=info,
                model_name=served_model_name(args),
                metrics=ServerMetrics() if args.enable_metrics else None,
            )
            app = create_app(state)
            config = uvicorn.Config(
                app, host=args.host, port=args.port, log_level=self.log_level.lower(),
                access_log=False, lifespan="off", timeout_graceful_shutdown=5,
            )
            self.server = _Server(config)
            serve_task = asyncio.create_task(self.server.serve(sockets=[listener]))
            while not self.server.started and not serve_task.done():
                await asyncio.sleep(0.02)
            if self.server.started:
                print(ready_line(args, info), flush=True)
            try:
                await serve_task
            except SystemExit as e:  # uvicorn's way out of a failed start-up
                code = int(e.code or 1)
            if not self.server.started:
                print(f"hicache-engine: the HTTP server did not start on {args.host}:{args.port}",
                      file=sys.stderr, flush=True)
                code = code or 1
            if self.scheduler_died is not None:
                code = 1
            return code
        finally:
            listener.close()
            if state is not None:
                state.close()
            await self._stop_scheduler(client)
            watch_task.cancel()
            recv_task.cancel()
            ctx.destroy(linger=0)
            shutil.rmtree(tmp, ignore_errors=True)

    async def _stop_scheduler(self, client: Any) -> None:
        proc = self.proc
        if proc is None or proc.poll() is not None:
            return
        self.stop_requested = True
        # Never block here: a PUSH with no connected peer would wait forever. Not delivered
        # (the scheduler is still starting, or already closing): SIGTERM does the same job.
        try:
            await client.push.send(P.encode(P.ShutdownReq(reason="front end stopping")),
                                   zmq.NOBLOCK)
        except zmq.ZMQError:
            with contextlib.suppress(ProcessLookupError):
                proc.terminate()
        t0 = time.monotonic()
        try:
            await asyncio.to_thread(proc.wait, SCHEDULER_STOP_TIMEOUT)
            logger.info("scheduler exited with %s after %.1fs", proc.returncode,
                        time.monotonic() - t0)
        except subprocess.TimeoutExpired:
            logger.error("the scheduler did not stop in %ss; killing it", SCHEDULER_STOP_TIMEOUT)
            proc.kill()
            proc.wait()


def launch(args: EngineArgs, log_level: str = "info") -> int:
    """Serve until stopped; returns the exit code."""
    code = asyncio.run(Launcher(args, log_level).run())
    logger.info("front end exiting with %s", code)
    return code
