"""The scheduler process: holds the `Engine` and its model loop, driven by ZeroMQ messages.

Started by the launcher as `python -m engine.server.scheduler_proc ARGS_JSON IN_ADDR OUT_ADDR`.
It PULLs `GenerateReq` / `AbortReq` / `ControlReq` / `ShutdownReq` from the front end, steps the
engine whenever it has work and PUSHes one `BatchOut` per step with every request's new tokens.
While idle it still applies the cache's transfer acks every `IDLE_POLL_MS`, so write-through
reaches L3 without waiting for the next request. With `--kv-events-config` it publishes the
cache's events (one batch per loop pass) through `engine.kv_events.KVEventPublisher`.
It exits when told to, on SIGTERM, or when its parent (the front end) goes away. SIGINT is
ignored: Ctrl-C reaches the front end, which shuts this process down in order.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import zmq

from engine.args import CACHE_EXTRA_KEYS, EngineArgs
from engine.kv_events import EventCollector, KVEventPublisher, KVEventsConfig
from engine.server import protocol as P
from hicache_client.errors import CapacityError, ConfigError, HiCacheError

logger = logging.getLogger(__name__)

# Keys of a backend's extra config whose values are never echoed back by GET.
_SECRET_WORDS = ("token", "password", "secret", "key", "credential")
# How long (ms) an idle loop waits for a message before it applies transfer acks again. This bounds
# how late an idle engine submits the L3 backup of a page whose device->host copy finished: a
# prefix reaches L3 within IDLE_POLL_MS plus the backend's write time of its request finishing.
IDLE_POLL_MS = 20
# How often (seconds) the transfer counters are sampled for the bandwidth histograms.
_BANDWIDTH_PERIOD = 0.25
_MAX_SAMPLES = 4096


def redact(extra: dict[str, Any]) -> dict[str, Any]:
    return {
        k: ("***" if any(w in k.lower() for w in _SECRET_WORDS) else v) for k, v in extra.items()
    }


def _logprob_args(spec: dict[str, int] | None) -> dict[str, Any]:
    """`Engine.add_request` keywords of a `GenerateReq.logprobs`."""
    if spec is None:
        return {}
    return {"return_logprob": True, "top_logprobs_num": int(spec.get("top_logprobs_num", 0)),
            "logprob_start_len": int(spec.get("logprob_start_len", -1))}


def _set_parent_death_signal() -> None:
    """Ask Linux to SIGTERM us when the parent dies (no orphans even after a kill -9)."""
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        pr_set_pdeathsig = 1
        libc.prctl(pr_set_pdeathsig, signal.SIGTERM)
    except OSError:
        logger.debug("prctl unavailable; relying on the parent-pid check")


def l3_decision(cache: Any, match_len: int, cached: int, page_size: int) -> dict[str, Any]:
    """Whether a request for a prompt of `match_len` reusable tokens, `cached` of them on
    device or host here, would ask L3 for the rest (`hicache.prefetch.Prefetcher.start`'s
    rules, without starting anything): `prefetch`, the `gap_tokens` it would ask, the
    `floor_tokens` it is held against, and `reason` when it would not."""
    from hicache.config import DEFAULT_PREFETCH_THRESHOLD
    from hicache.prefetch import PREFETCH_MIN_SAVING_S

    gap = max(0, match_len // page_size * page_size - cached)
    out: dict[str, Any] = {"prefetch": False, "gap_tokens": gap, "floor_tokens": None,
                           "reason": None}
    pf = getattr(cache, "prefetcher", None)
    if pf is None or not getattr(cache, "has_storage", False):
        out["reason"] = "no L3 storage backend attached"
        return out
    floor = pf.c.config.prefetch_threshold
    out["floor_tokens"] = DEFAULT_PREFETCH_THRESHOLD if floor is None else floor
    if gap <= 0:
        out["reason"] = "nothing beyond what device and host hold"
    elif not pf.c.controller.storage_usable():
        out["reason"] = "L3 is backing off after errors"
    elif floor is not None and gap < floor:
        out["reason"] = f"the {gap}-token gap is under prefetch_threshold ({floor} tokens)"
    elif floor is None and gap < DEFAULT_PREFETCH_THRESHOLD:
        cost = pf.c.controller.cost
        saving = None if cost is None else cost.load_saving("storage", gap)
        if saving is None or saving < PREFETCH_MIN_SAVING_S:
            out["reason"] = (
                f"the {gap}-token gap is under the {DEFAULT_PREFETCH_THRESHOLD}-token prefetch "
                f"floor and loading it is not expected to save {PREFETCH_MIN_SAVING_S * 1000:g} "
                "ms (prefetch_threshold sets the floor)")
    if out["reason"] is None and pf._allowance() <= 0:  # noqa: SLF001
        out["reason"] = "the host share for prefetches is in use"
    out["prefetch"] = out["reason"] is None
    return out


@dataclass
class _Bandwidth:
    """GB/s samples from the deltas of the cache's transfer counters."""

    prefetch: list[float] = field(default_factory=list)
    backup: list[float] = field(default_factory=list)
    last: tuple[float, float, float, float] = (0.0, 0.0, 0.0, 0.0)
    at: float = 0.0

    def sample(self, stats: Any) -> None:
        cur = (
            float(stats.prefetch_bytes),
            float(stats.prefetch_seconds),
            float(stats.storage_backup_bytes),
            float(stats.storage_backup_seconds),
        )
        pb, ps, bb, bs = (c - p for c, p in zip(cur, self.last))
        if pb > 0 and ps > 0:
            self.prefetch.append(pb / ps / 1e9)
        if bb > 0 and bs > 0:
            self.backup.append(bb / bs / 1e9)
        del self.prefetch[:-_MAX_SAMPLES], self.backup[:-_MAX_SAMPLES]
        self.last = cur

    def drain(self) -> dict[str, list[float]]:
        out = {"prefetch": self.prefetch, "backup": self.backup}
        self.prefetch, self.backup = [], []
        return out


class SchedulerProcess:
    def __init__(self, args: EngineArgs, in_addr: str, out_addr: str) -> None:
        from engine.engine import Engine

        self.args = args
        self.parent = os.getppid()
        self.stop = False
        self.ctx = zmq.Context()
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.connect(in_addr)
        self.push = self.ctx.socket(zmq.PUSH)
        self.push.setsockopt(zmq.LINGER, 2000)
        self.push.connect(out_addr)
        self.engine = Engine(args)
        self.backend: str | None = (
            args.hicache_storage_backend if args.enable_hierarchical_cache else None
        )
        self.backend_extra: dict[str, Any] = args.storage_extra_config() if self.backend else {}
        self.bandwidth = _Bandwidth()
        if self.backend is not None and self.engine.caching:
            self.warn_host_room()
        self.events: EventCollector | None = None
        self.publisher: KVEventPublisher | None = None
        kv_events = KVEventsConfig.from_any(args.kv_events_config)
        if kv_events.enabled:
            if not self.engine.caching:
                logger.warning("--kv-events-config: no prefix cache (disable_radix_cache), "
                               "no KV events to publish")
            else:
                self.publisher = KVEventPublisher(kv_events)
                self.events = EventCollector()
                self.engine.cache.set_event_sink(self.events)

    def warn_host_room(self) -> None:
        """An L3 prefetch lands in free host pages, and host eviction drops only pages that are
        off the device; with write-through every device page has a host copy. So a host pool no
        larger than the device pool leaves prefetches room only while the device pool has free
        pages (SGLang refuses such a configuration)."""
        u = self.engine.cache.usage()
        host, device = int(u.get("host_pages_total", 0)), int(u.get("device_pages_total", 0))
        if host <= device:
            logger.warning(
                "the host pool (%d pages) is not larger than the device pool (%d pages): L3 "
                "prefetches find host room only while the device pool has free pages; raise "
                "--hicache-ratio above 1 or --hicache-size", host, device)

    def publish_events(self) -> None:
        """One batch per loop pass: the cache events of this step (or of idle acks)."""
        if self.events is not None and self.publisher is not None and self.events.events:
            self.publisher.publish(self.events.take())

    def send(self, msg: Any) -> None:
        self.push.send(P.encode(msg))

    def ready(self) -> None:
        e = self.engine
        self.send(
            P.Ready(
                pid=os.getpid(),
                model_path=str(e.model_path),
                model_id=e.model_id,
                context_length=int(e.context_length),
                max_total_tokens=int(e.max_total_tokens),
                vocab_size=int(e.model_config.vocab_size),
                page_size=int(self.args.page_size),
                storage_backend=self.backend,
                eos_token_ids=sorted(int(t) for t in e.eos_token_ids),
            )
        )

    # ---- messages -------------------------------------------------------------------------

    def handle(self, msg: Any) -> None:
        if isinstance(msg, P.GenerateReq):
            try:
                self.engine.add_request(
                    input_ids=msg.input_ids,
                    sampling_params=msg.sampling_params,
                    rid=msg.rid,
                    extra_key=msg.extra_key,
                    cache_hints=msg.cache_hints,
                    **_logprob_args(msg.logprobs),
                )
            except (ValueError, TypeError, CapacityError) as e:
                self.send(P.ReqError(rid=msg.rid, message=str(e), status=400))
        elif isinstance(msg, P.AbortReq):
            self.engine.abort(msg.rid)
        elif isinstance(msg, P.ControlReq):
            self.send(self.control(msg))
        elif isinstance(msg, P.ShutdownReq):
            logger.info("shutdown requested: %s", msg.reason)
            self.stop = True
        else:
            logger.warning("ignoring unexpected message %s", type(msg).__name__)

    def cost_model(self) -> dict[str, Any] | None:
        """What the cache's load-vs-recompute model has measured (EWMAs; None: not yet), or None
        without a cost model (no hierarchical cache)."""
        controller = getattr(self.engine.cache, "controller", None)
        cost = getattr(controller, "cost", None)
        if cost is None:
            return None
        out: dict[str, Any] = cost.as_dict()  # with the start-up calibration
        return out

    def control(self, msg: P.ControlReq) -> P.ControlResp:
        op, payload = msg.op, msg.payload

        def resp(status: int = 200, error: str | None = None, **kw: Any) -> P.ControlResp:
            return P.ControlResp(cid=msg.cid, status=status, payload=kw, error=error)

        e = self.engine
        busy = e.has_unfinished()
        try:
            if op == "stats":
                stats = e.cache_stats()
                if e.args.tp_size > 1:
                    stats["ranks"] = e.rank_cache_stats()
                stats["storage_backend"] = self.backend
                stats["cost_model"] = self.cost_model()
                if payload.get("bandwidth"):
                    stats["bandwidth"] = self.bandwidth.drain()
                return resp(**stats)
            if op == "lookup":  # what a request for these tokens would find cached here
                ids, key = payload.get("input_ids"), payload.get("extra_key")
                if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                    return resp(400, "'input_ids' must be a list of token ids")
                n = max(len(ids) - 1, 0)  # the last token is always computed (Req.match_len)
                m = e.cache.match_prefix(ids[:n], extra_key=key)
                ns = getattr(e.cache, "namespace", None)
                return resp(tokens=len(ids), match_len=n, device_tokens=m.device_tokens,
                            host_tokens=m.host_tokens, page_size=e.args.page_size,
                            namespace=ns.hex() if ns else None, storage_backend=self.backend,
                            l3=l3_decision(e.cache, n, m.device_tokens + m.host_tokens,
                                           e.args.page_size))
            if op == "flush_cache":
                if not e.flush_cache():
                    return resp(409, "requests are in flight; flush the cache when idle")
                return resp(flushed=True)
            if op == "get_storage":
                return resp(backend=self.backend, extra_config=redact(self.backend_extra))
            if op in ("attach_storage", "detach_storage", "clear_storage"):
                if busy:
                    return resp(409, f"requests are in flight; {op.replace('_', ' ')} when idle")
                if not e.caching or not self.args.enable_hierarchical_cache:
                    return resp(400, "an L3 backend needs --enable-hierarchical-cache")
            if op == "attach_storage":
                name = payload.get("backend")
                extra = payload.get("extra_config") or {}
                if not isinstance(name, str) or not name:
                    return resp(400, "'backend' must be a backend name")
                if not isinstance(extra, dict):
                    return resp(400, "'extra_config' must be a JSON object")
                backend_extra = {k: v for k, v in extra.items() if k not in CACHE_EXTRA_KEYS}
                e.attach_storage(name, backend_extra)
                self.backend, self.backend_extra = name, backend_extra
                logger.info("attached storage backend %s", name)
                return resp(backend=name, extra_config=redact(backend_extra))
            if op == "detach_storage":
                e.detach_storage()
                old, self.backend, self.backend_extra = self.backend, None, {}
                logger.info("detached storage backend %s", old)
                return resp(backend=None, detached=old)
            if op == "clear_storage":
                if getattr(e.cache, "storage", None) is None:
                    return resp(400, "no storage backend is attached")
                e.clear_storage()
                logger.info("cleared storage backend %s", self.backend)
                return resp(backend=self.backend, cleared=True)
        except (ConfigError, HiCacheError, ValueError, TypeError, OSError) as err:
            logger.warning("%s failed: %s", op, err)
            return resp(400, f"{op} failed: {err}")
        return resp(400, f"unknown control op {op!r}")

    # ---- the loop -------------------------------------------------------------------------

    def drain(self, timeout_ms: int) -> None:
        if not self.pull.poll(timeout_ms):
            return
        while True:
            try:
                frame = self.pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = P.decode(frame)
            except P.ProtocolError as err:
                logger.error("dropping a malformed frame: %s", err)
                continue
            self.handle(msg)

    def run(self) -> None:
        e = self.engine
        next_sample = 0.0
        while not self.stop:
            if os.getppid() != self.parent:
                logger.error("the front end went away; stopping")
                break
            busy = e.has_unfinished()
            self.drain(0 if busy else IDLE_POLL_MS)
            if self.stop:
                break
            if not e.has_unfinished():
                # Idle: apply acks anyway, so that finished device->host copies start their
                # host->L3 backups now rather than when the next request wakes the scheduler.
                e.poll_cache()
            if e.has_unfinished():
                steps = e.scheduler.forward_steps
                updates = e.step()
                if updates:
                    self.send(
                        P.BatchOut(
                            outputs=[
                                P.ReqOut(
                                    rid=u["rid"],
                                    new_token_ids=[int(t) for t in u["new_token_ids"]],
                                    finished=bool(u["finished"]),
                                    finish_reason=u["meta_info"]["finish_reason"],
                                    prompt_tokens=int(u["meta_info"]["prompt_tokens"]),
                                    completion_tokens=int(u["meta_info"]["completion_tokens"]),
                                    cached_tokens=int(u["meta_info"]["cached_tokens"]),
                                    text=u["text_delta"],
                                    logprobs=u.get("logprobs"),
                                    cache_outcomes=u["meta_info"].get("cache_outcomes"),
                                )
                                for u in updates
                            ]
                        )
                    )
                elif e.scheduler.forward_steps == steps:
                    # Waiting on a prefetch (or nothing admissible): do not spin.
                    self.drain(2)
            self.publish_events()
            now = time.monotonic()
            if e.caching and now >= next_sample:
                next_sample = now + _BANDWIDTH_PERIOD
                self.bandwidth.sample(e.cache.stats)

    def close(self) -> None:
        try:
            self.engine.shutdown()
            self.publish_events()  # the last backups' events
        finally:
            if self.publisher is not None:
                self.publisher.close()
            self.pull.close(0)
            self.push.close(0)
            self.ctx.term()


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 3:
        print("usage: python -m engine.server.scheduler_proc ARGS_JSON IN_ADDR OUT_ADDR",
              file=sys.stderr)
        return 2
    args_json, in_addr, out_addr = argv
    _set_parent_death_signal()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    level = os.environ.get("HICACHE_LOG_LEVEL", "INFO").upper()
    logging.basicConfig(
        level=level, format="%(asctime)s scheduler %(levelname)s %(name)s: %(message)s"
    )
    args = EngineArgs(**json.loads(args_json))
    proc = SchedulerProcess(args, in_addr, out_addr)

    def on_term(signum: int, frame: Any) -> None:
        proc.stop = True

    signal.signal(signal.SIGTERM, on_term)
    proc.ready()
    try:
        proc.run()
    finally:
        proc.close()
    return 0


if __name__ == "__main__":
    code = main()
    # Everything is closed (engine, backends, request log, sockets): skip the slow interpreter
    # teardown of torch and friends.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
