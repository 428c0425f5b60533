"""The rank processes of a tensor-parallel engine (`--tp-size N`).

Rank 0 is the `Engine` the caller holds (in the HTTP server: the scheduler process). It starts
ranks 1..N-1 as processes (`spawn`), each building the same `Engine` over its shard of the model
and of the KV. One scheduler decides: every call that changes the scheduler or the cache
(`add_request`, `step`, `abort`, the cache admin calls, `shutdown`) is made on rank 0 and
replayed, in the same order, on every other rank (`engine.engine.collective`), which therefore
makes the same decisions; where a decision depends on something rank-local (L3 results,
background transfers, timers) the ranks' caches agree through `hicache.sync` inside the call.

Calls travel to the other ranks over pipes, not collectives: an idle engine waits on its pipe for
as long as it likes, while every collective (the model's all-reduces, the cache's agreement)
happens inside a call that all ranks are making, so the group's timeout (`--dist-timeout`) bounds
how long a rank can wait for a dead or diverged peer. A rank that fails reports why over its pipe
and exits; rank 0 then raises `RankFailure` with that reason instead of hanging.
"""

from __future__ import annotations

import contextlib
import logging
import multiprocessing as mp
import os
import socket
import traceback
from dataclasses import replace
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from hicache_client.errors import HiCacheError

if TYPE_CHECKING:
    from engine.args import EngineArgs

logger = logging.getLogger(__name__)

# How long rank 0 waits for the other ranks to build their engines (model load included).
START_TIMEOUT_S = 600.0


class RankFailure(HiCacheError):
    """A tensor-parallel rank failed or went away; the engine cannot go on without it."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class RankProcesses:
    """Rank 0's handle on ranks 1..N-1: start them, replay calls on them, stop them."""

    def __init__(
        self, engine_cls: type, args: EngineArgs, init_method: str, num_threads: int
    ) -> None:
        """Start ranks 1..N-1, each building `engine_cls(args)` as its rank."""
        ctx = mp.get_context("spawn")
        self.procs: list[Any] = []
        self.conns: list[Connection] = []
        self.failed: str | None = None
        for rank in range(1, args.tp_size):
            parent, child = ctx.Pipe()
            p = ctx.Process(
                target=rank_main,
                args=(engine_cls, rank, args, init_method, child, num_threads),
                name=f"hicache-tp{rank}", daemon=True,
            )
            p.start()
            child.close()
            self.procs.append(p)
            self.conns.append(parent)

    def wait_ready(self, timeout_s: float = START_TIMEOUT_S) -> None:
        """Every rank has built its engine (raises `RankFailure` with its error if one did not)."""
        for rank, conn in enumerate(self.conns, start=1):
            if not conn.poll(timeout_s):
                self._fail(f"tp rank {rank} did not start within {timeout_s:.0f} s")
            msg = self._recv(rank, conn)
            if msg[0] != "ready":
                self._fail(f"tp rank {rank} failed to start: {msg[1]}")

    def _recv(self, rank: int, conn: Connection) -> tuple[str, str]:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return ("error", f"tp rank {rank} exited (code {self.procs[rank - 1].exitcode})")
        return msg  # type: ignore[no-any-return]

    def _fail(self, why: str) -> None:
        self.failed = why
        raise RankFailure(why)

    def check(self) -> None:
        """Raise `RankFailure` if a rank has reported an error or exited."""
        if self.failed is not None:
            raise RankFailure(self.failed)
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if conn.poll():
                msg = self._recv(rank, conn)
                self._fail(f"tp rank {rank}: {msg[1]}")
            if not p.is_alive():
                self._fail(f"tp rank {rank} exited (code {p.exitcode})")

    def reported(self, wait_s: float = 1.0) -> str | None:
        """What a rank reported when it failed or exited (waiting up to `wait_s` on each for
        its report); None if every rank is alive and silent."""
        for rank, (p, conn) in enumerate(zip(self.procs, self.conns), start=1):
            if conn.poll(wait_s):
                msg = self._recv(rank, conn)
                if msg[0] != "ready":
                    self.failed = f"tp rank {rank}: {msg[1]}"
                    return self.failed
            if not p.is_alive():
                self.failed = f"tp rank {rank} exited (code {p.exitcode})"
                return self.failed
        return None

    def why(self, err: BaseException) -> RankFailure:
        """The `RankFailure` behind a failed call: a rank's own report when it sent one
        (waiting briefly for it), else the call's error. Every later call raises it too."""
        self.failed = self.reported() or f"a collective failed: {type(err).__name__}: {err}"
        return RankFailure(self.failed)

    def send(self, name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """Replay `name(*args, **kwargs)` on every other rank."""
        self.check()
        for rank, conn in enumerate(self.conns, start=1):
            try:
                conn.send((name, args, kwargs))
            except (BrokenPipeError, OSError) as e:
                self._fail(f"tp rank {rank} is gone ({e})")

    def stop(self, timeout_s: float = 30.0) -> None:
        for conn in self.conns:
            with contextlib.suppress(BrokenPipeError, OSError):
                conn.send(None)
        for p in self.procs:
            p.join(timeout_s)
            if p.is_alive():
                p.terminate()
                p.join(5)
        for conn in self.conns:
            conn.close()


def rank_main(
    engine_cls: Any, rank: int, args: EngineArgs, init_method: str, conn: Connection,
    num_threads: int,
) -> None:
    """A rank > 0: build the engine, then replay rank 0's calls until told to stop."""
    import torch

    level = os.environ.get("HICACHE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(level=level,
                        format=f"%(asctime)s tp{rank} %(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(num_threads)
    try:
        engine = engine_cls(replace(args), _tp_rank=rank, _tp_init_method=init_method)
    except BaseException as e:  # noqa: BLE001 - reported to rank 0, which raises it
        conn.send(("error", f"{type(e).__name__}: {e}"))
        logger.exception("tp rank %d failed to start", rank)
        return
    conn.send(("ready", ""))
    try:
        while True:
            try:
                call = conn.recv()
            except (EOFError, OSError):
                logger.error("tp rank %d: rank 0 went away; stopping", rank)
                break
            if call is None:
                break
            name, cargs, ckwargs = call
            try:
                getattr(engine, name)(*cargs, **ckwargs)
            except EXPECTED_ERRORS as e:  # rank 0 raised the same to its caller
                logger.debug("tp rank %d: %s raised %s", rank, name, e)
            except HiCacheError as e:
                if _is_sync_error(e):
                    raise
                logger.debug("tp rank %d: %s raised %s", rank, name, e)
            if name == "_shutdown":
                break
    except BaseException as e:  # noqa: BLE001
        logger.exception("tp rank %d failed", rank)
        with contextlib.suppress(BrokenPipeError, OSError):
            conn.send(("error", f"{type(e).__name__}: {e}\n{traceback.format_exc(limit=8)}"))
        os._exit(1)  # do not run other ranks' collectives from atexit handlers
    finally:
        engine.shutdown_local()


# Exceptions a replayed call may raise on every rank alike (rank 0 raises it to its caller):
# another rank then goes on. Anything else ends the rank (and rank 0 learns why).
EXPECTED_ERRORS: tuple[type[BaseException], ...] = (ValueError, TypeError, TimeoutError)


def collective(method: Any) -> Any:
    """Mark an `Engine` method that changes the scheduler or the cache: on rank 0 of a
    tensor-parallel group it is replayed on every other rank (in call order) before it runs
    here. Without other ranks it is the method itself."""
    import functools

    name = method.__name__

    @functools.wraps(method)
    def run(self: Any, *args: Any, **kwargs: Any) -> Any:
        ranks: RankProcesses | None = self._ranks
        if ranks is None:
            return method(self, *args, **kwargs)
        ranks.send(name, args, kwargs)
        try:
            return method(self, *args, **kwargs)
        except EXPECTED_ERRORS:
            raise
        except HiCacheError as e:
            if _is_sync_error(e):
                raise ranks.why(e) from e
            raise
        except Exception as e:
            raise ranks.why(e) from e

    return run


def _is_sync_error(e: BaseException) -> bool:
    from hicache.sync import RankDivergence

    return isinstance(e, (RankDivergence, RankFailure))
