"""The front end's connection to the scheduler process (ZeroMQ PUSH / PULL, `protocol` messages).

Requests are sent under ids the front end makes (unique per request, never a client's `rid`),
so a client that reuses an id can never receive the output of another request. Outputs are
routed to one queue per request; control requests wait for their answer by control id.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from typing import Any

import zmq
import zmq.asyncio

from engine.server import protocol as P
from engine.server.schemas import ApiError

logger = logging.getLogger(__name__)

CONTROL_TIMEOUT = 120.0


class SchedulerClient:
    """PUSH requests to the scheduler, PULL its outputs; route them to per-request queues."""

    def __init__(self, ctx: zmq.asyncio.Context, in_addr: str, out_addr: str) -> None:
        self.push = ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 0)
        self.push.bind(in_addr)
        self.pull = ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.LINGER, 0)
        self.pull.bind(out_addr)
        self.queues: dict[str, asyncio.Queue[Any]] = {}
        self.controls: dict[str, asyncio.Future[P.ControlResp]] = {}
        self.ready: asyncio.Future[P.Ready] = asyncio.get_running_loop().create_future()
        self.dead: str | None = None

    @staticmethod
    def new_id() -> str:
        return uuid.uuid4().hex

    async def recv_loop(self) -> None:
        while True:
            frame = await self.pull.recv()
            try:
                msg = P.decode(frame)
            except P.ProtocolError as e:
                logger.error("dropping a malformed frame from the scheduler: %s", e)
                continue
            if isinstance(msg, P.BatchOut):
                for out in msg.outputs:
                    q = self.queues.get(out.rid)
                    if q is not None:
                        q.put_nowait(out)
            elif isinstance(msg, P.ReqError):
                q = self.queues.get(msg.rid)
                if q is not None:
                    q.put_nowait(msg)
            elif isinstance(msg, P.ControlResp):
                fut = self.controls.pop(msg.cid, None)
                if fut is not None and not fut.done():
                    fut.set_result(msg)
            elif isinstance(msg, P.Ready):
                if not self.ready.done():
                    self.ready.set_result(msg)
            else:
                logger.warning("unexpected %s from the scheduler", type(msg).__name__)

    def fail_all(self, reason: str) -> None:
        """The scheduler is gone: wake every waiter with an error."""
        self.dead = reason
        for rid, q in self.queues.items():
            q.put_nowait(P.ReqError(rid=rid, message=reason, status=503))
        for fut in self.controls.values():
            if not fut.done():
                fut.set_result(P.ControlResp(cid="", status=503, error=reason))
        self.controls.clear()

    def _check_alive(self) -> None:
        if self.dead:
            raise ApiError(503, f"the engine is not running: {self.dead}", type="server_error",
                           code="unavailable")

    async def send(self, msg: Any) -> None:
        self._check_alive()
        await self.push.send(P.encode(msg))

    def send_nowait(self, msg: Any) -> None:
        """Send without awaiting (usable while the caller is being cancelled, e.g. an abort when
        a client disconnects). pyzmq sends at once when the socket can take the frame."""
        if self.dead:
            return
        fut: Any = self.push.send(P.encode(msg), zmq.NOBLOCK)
        if fut.done() and fut.exception() is not None:
            logger.warning("could not send %s to the scheduler: %s", type(msg).__name__,
                           fut.exception())

    def open(self, rid: str) -> asyncio.Queue[Any]:
        if rid in self.queues:  # ids are made here, unique: this is a bug, not a bad request
            raise RuntimeError(f"request id {rid!r} is already in use")
        q: asyncio.Queue[Any] = asyncio.Queue()
        self.queues[rid] = q
        return q

    def close(self, rid: str) -> None:
        self.queues.pop(rid, None)

    async def control(self, op: str, payload: dict[str, Any] | None = None) -> P.ControlResp:
        cid = self.new_id()
        fut: asyncio.Future[P.ControlResp] = asyncio.get_running_loop().create_future()
        self.controls[cid] = fut
        try:
            await self.send(P.ControlReq(cid=cid, op=op, payload=payload or {}))
            return await asyncio.wait_for(fut, CONTROL_TIMEOUT)
        except asyncio.TimeoutError as e:  # not the builtin before Python 3.11
            raise ApiError(503, f"the scheduler did not answer {op}", type="server_error",
                           code="timeout") from e
        finally:
            self.controls.pop(cid, None)
