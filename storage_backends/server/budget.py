"""Byte budgets for what the server holds for its clients beyond the page store.

For each connection (ZeroMQ routing id) the server counts the bytes *held* for it:

- reply bytes handed to ZeroMQ and not yet written to the socket (each reply carrying pages is
  sent with a tracked last frame; ZeroMQ frees a message's frames in order once it has written
  them, or drops them when the peer goes away, so the tracker says when all of it is gone);
- the bytes of its requests that wait for room (parked, in arrival order).

A request runs only when its reply fits both budgets: held(client) + reply <= per-client
budget and held(all) + reply <= total budget. A request that does not fit waits in its
connection's queue (its later requests queue behind it, so one connection's requests keep
their order) and runs when earlier replies have been written; a request that would push the
waiting bytes over a budget is refused at once (a `busy` error reply, a few bytes). A client
that does not read its replies is so throttled: the server holds at most the budgets for it,
never more, whatever it sends.

With tenants, the connections of one tenant (its partition: `assign`) together hold at most
`group_bytes`, the total divided among the partitions (at least the per-client budget): a
tenant whose connections never read their replies fills its share, not every tenant's.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any


@dataclass
class _Conn:
    sent: deque[tuple[Any, int]] = field(default_factory=deque)  # (zmq.MessageTracker, bytes)
    parked: deque[tuple[Any, int]] = field(default_factory=deque)  # (request, bytes)
    sent_bytes: int = 0
    parked_bytes: int = 0
    group: str = ""  # the tenant's partition ("": none)

    @property
    def held(self) -> int:
        return self.sent_bytes + self.parked_bytes


class ReplyBudget:
    """Per-connection and total byte accounting (one thread: the server's loop)."""

    def __init__(self, total_bytes: int, per_client_bytes: int) -> None:
        if per_client_bytes <= 0 or total_bytes < per_client_bytes:
            raise ValueError(
                f"reply budgets: need 0 < per-client ({per_client_bytes}) <= total ({total_bytes})"
            )
        self.total_bytes = total_bytes
        self.per_client_bytes = per_client_bytes
        self._conns: OrderedDict[bytes, _Conn] = OrderedDict()
        self.held = 0  # bytes held for every connection together
        self.peak = 0
        self.refused = 0  # requests answered `busy`
        self.waited = 0  # requests that had to wait for room
        self.group_bytes = total_bytes  # most bytes held for one group (`set_groups`)
        self._group_held: dict[str, int] = {}
        self._groups: OrderedDict[bytes, str] = OrderedDict()  # ident -> its group

    def set_groups(self, n: int) -> None:
        """`n` groups (tenant partitions) share the total budget equally."""
        self.group_bytes = max(self.per_client_bytes, self.total_bytes // max(1, n))

    def assign(self, ident: bytes, group: str) -> None:
        """Connection `ident` is of `group` (its tenant's partition), from its next reply on."""
        if self._groups.get(ident) == group:
            return
        self._groups[ident] = group
        while len(self._groups) > 1 << 16:  # idents of gone connections are never told
            self._groups.popitem(last=False)

    def _group_fits(self, ident: bytes, nbytes: int, own: int = 0) -> bool:
        group = self._groups.get(ident, "")
        return not group or self._group_held.get(group, 0) - own + nbytes <= self.group_bytes

    def _conn(self, ident: bytes) -> _Conn:
        c = self._conns.get(ident)
        if c is None:
            c = self._conns[ident] = _Conn(group=self._groups.get(ident, ""))
        return c

    def _held_change(self, c: _Conn, nbytes: int) -> None:
        if c.group:
            self._group_held[c.group] = self._group_held.get(c.group, 0) + nbytes
            if not self._group_held[c.group]:
                del self._group_held[c.group]

    def held_by(self, ident: bytes) -> int:
        c = self._conns.get(ident)
        return c.held if c is not None else 0

    def fits(self, ident: bytes, nbytes: int, waiting: bool = False) -> bool:
        """Whether a reply of `nbytes` may be sent to `ident` now (`waiting`: for the request
        at the head of its queue, whose own bytes are then not counted)."""
        c = self._conns.get(ident)
        mine = c.held if c is not None else 0
        if waiting and c is not None and c.parked:
            mine -= c.parked[0][1]
        own = c.parked[0][1] if waiting and c is not None and c.parked else 0
        others = self.held - own
        return (mine + nbytes <= self.per_client_bytes and others + nbytes <= self.total_bytes
                and self._group_fits(ident, nbytes, own))

    def sent(self, ident: bytes, tracker: Any, nbytes: int) -> None:
        c = self._conn(ident)
        c.sent.append((tracker, nbytes))
        c.sent_bytes += nbytes
        self._held_change(c, nbytes)
        self._add(nbytes)

    def has_waiting(self, ident: bytes) -> bool:
        c = self._conns.get(ident)
        return c is not None and bool(c.parked)

    @property
    def waiting(self) -> bool:
        return any(c.parked for c in self._conns.values())

    @property
    def busy(self) -> bool:
        """Anything held (the loop then polls often, to notice written replies)."""
        return bool(self._conns)

    def park(self, ident: bytes, request: Any, nbytes: int) -> bool:
        """Queue a request behind the connection's others; False (counted) when it does not
        fit the budgets: the caller refuses it."""
        if self.held_by(ident) + nbytes > self.per_client_bytes or (
            self.held + nbytes > self.total_bytes
        ) or not self._group_fits(ident, nbytes):
            self.refused += 1
            return False
        c = self._conn(ident)
        c.parked.append((request, nbytes))
        c.parked_bytes += nbytes
        self._held_change(c, nbytes)
        self._add(nbytes)
        self.waited += 1
        return True

    def peek(self, ident: bytes) -> Any | None:
        c = self._conns.get(ident)
        return c.parked[0][0] if c is not None and c.parked else None

    def unpark(self, ident: bytes) -> Any:
        c = self._conns[ident]
        request, nbytes = c.parked.popleft()
        c.parked_bytes -= nbytes
        self._held_change(c, -nbytes)
        self.held -= nbytes
        self._forget_if_idle(ident, c)
        return request

    def waiting_idents(self) -> list[bytes]:
        return [i for i, c in self._conns.items() if c.parked]

    def refresh(self) -> None:
        """Release the bytes of every reply ZeroMQ has finished with."""
        for ident, c in list(self._conns.items()):
            while c.sent and c.sent[0][0].done:
                _t, n = c.sent.popleft()
                c.sent_bytes -= n
                self._held_change(c, -n)
                self.held -= n
            self._forget_if_idle(ident, c)

    def _add(self, nbytes: int) -> None:
        self.held += nbytes
        self.peak = max(self.peak, self.held)

    def _forget_if_idle(self, ident: bytes, c: _Conn) -> None:
        if not c.sent and not c.parked:
            self._conns.pop(ident, None)

    def counters(self) -> dict[str, int]:
        return {
            "reply_held_bytes": self.held,
            "reply_held_peak_bytes": self.peak,
            "reply_budget_bytes": self.total_bytes,
            "client_reply_budget_bytes": self.per_client_bytes,
            "requests_waited": self.waited,
            "requests_refused_busy": self.refused,
        }


def cap_reply(lengths: list[int], limit: int) -> tuple[list[int], int]:
    """`lengths` with every page from the first that would take the total past `limit`
    marked absent (-1); and the total of the rest."""
    out: list[int] = []
    total = 0
    for i, n in enumerate(lengths):
        if n >= 0 and total + n > limit:
            out.extend([-1] * (len(lengths) - i))
            break
        out.append(n)
        total += max(n, 0)
    return out, total
