"""The scheduler: continuous batching over a `PrefixCache` (`HiRadixCache`, or `NoPrefixCache`).

Each `step()`:

1. `cache.poll()` consumes finished transfers;
2. if a waiting request can be admitted (prefetch ready, pages available), run a prefill batch of
   up to `chunked_prefill_size` new tokens (a longer prompt continues in the next prefill step);
3. otherwise run one decode step for every running request, retracting requests (latest arrival
   first) when the device pool cannot give a page even after eviction.

A request's page table is `pages`: its first `tree_pages` pages belong to the radix tree (pinned
by the lock on `node`), the rest are the request's own until they are inserted or freed. A
retracted request inserts the KV it computed, unlocks, and goes back to the front of the queue; it
resumes from whatever of that prefix is still cached. No request fails because the pool is full:
only a request that cannot fit in an otherwise empty pool is aborted, with an error.
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections import deque
from collections.abc import Callable

import torch

from engine.batch_ops import forward_prefill, sample_reqs
from engine.model_runner import ModelRunner
from engine.req import FinishReason, Req
from engine.sampling import Sampler
from hicache.attribution import complete
from hicache.prefix_cache import NoPrefixCache, PrefixCache
from hicache.sync import SOLO, RankSync
from hicache.transfer import merge_wait_layer

logger = logging.getLogger(__name__)

__all__ = ["NoPrefixCache", "Req", "Scheduler"]
# Decode growth is reserved for at most this many more tokens per request (SGLang clips too).
CLIP_MAX_NEW_TOKENS = 1024
# new_token_ratio: the share of the remaining max_new_tokens reserved at admission. It starts
# high, decays each decode step (requests often stop early), and goes back up on a retraction.
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
NEW_TOKEN_RATIO_DECAY = 0.002


class Scheduler:
    def __init__(
        self,
        runner: ModelRunner,
        cache: PrefixCache,
        *,
        page_size: int,
        max_running_requests: int,
        chunked_prefill_size: int,
        schedule_policy: str,
        context_length: int,
        eos_token_ids: set[int],
        decode: Callable[[list[int], bool], str],
        random_seed: int = 0,
        request_log: str | None = None,
        sync: RankSync = SOLO,
    ) -> None:
        """`sync`: the other tensor-parallel ranks (they run this scheduler on the same calls)."""
        self.runner = runner
        self.sync = sync
        self.cache = cache
        self.page_size = page_size
        self.max_running = max_running_requests
        self.chunk_size = chunked_prefill_size
        self.policy = schedule_policy
        self.context_length = context_length
        self.eos_token_ids = eos_token_ids
        self.decode_text = decode
        self.seed_gen = torch.Generator().manual_seed(random_seed)
        self.sampler = Sampler(eos_token_ids)
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.chunked: Req | None = None  # the request whose prompt is being prefilled in chunks
        self.reqs: dict[str, Req] = {}
        self.finished_updates: list[Req] = []
        self._log = open(request_log, "a", encoding="utf-8") if request_log else None  # noqa: SIM115
        # Prompt tokens by outcome at a request's first admission (hicache.attribution), by rid.
        self.outcomes: dict[str, dict[str, int]] = {}
        # Totals over finished requests.
        self.num_finished = 0
        self.retracted_total = 0
        self.forward_steps = 0
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO

    # ---- requests -------------------------------------------------------------------------

    def add(self, req: Req) -> None:
        if req.rid in self.reqs:
            raise ValueError(f"request id {req.rid!r} is already in use")
        if req.params.temperature > 0 and not req.params.greedy:
            seed = req.params.seed
            if seed is None:
                seed = int(torch.randint(0, 2**62, (1,), generator=self.seed_gen).item())
            req.generator = torch.Generator().manual_seed(seed)
        self.reqs[req.rid] = req
        # An id reused after an abort: the old request's pending abort update is not this one's.
        self.finished_updates = [r for r in self.finished_updates if r.rid != req.rid]
        self.waiting.append(req)
        # Storage prefetch starts now and overlaps with the queueing time.
        self.cache.prefetch(req.rid, req.prompt[: req.match_len], extra_key=req.extra_key)

    def abort(self, rid: str) -> bool:
        """Abort a request now, idle or not: it leaves the queues, its pages and locks are given
        back, its prefetch is cancelled, and its id is free for a new request at once (its abort
        update still comes out of the next `step()`, unless the id was reused meanwhile)."""
        req = self.reqs.get(rid)
        if req is None or req.finished:
            return False
        if req in self.waiting:
            self.waiting.remove(req)
        elif req is self.chunked:
            self.chunked = None
        elif req in self.running:
            self.running.remove(req)
        self.cache.cancel_prefetch(rid)
        self._finish(req, {"type": "abort", "message": "aborted"}, compute_tail=False)
        del self.reqs[rid]
        return True

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.chunked)

    # ---- one step -------------------------------------------------------------------------

    def step(self) -> list[Req]:
        """Run one batch. Returns the requests with news (new tokens or finished)."""
        self.cache.poll()
        updated: list[Req] = []
        if not self._prefill_step(updated) and self.running:
            self._decode_step(updated)
        if not updated and self.waiting and not self.running:
            # Everything waits on L3 prefetches: block briefly (GIL released) instead of
            # spinning, which starved the prefetch thread (L3 hits at 25 MB/s).
            self.cache.wait_progress(0.002)
        updated.extend(self.finished_updates)
        self.finished_updates = []
        seen: set[str] = set()
        out = []
        for r in updated:
            if r.rid not in seen:
                seen.add(r.rid)
                out.append(r)
            if r.finished and self.reqs.get(r.rid) is r:
                del self.reqs[r.rid]
        return out

    # ---- prefill --------------------------------------------------------------------------

    def _ordered_waiting(self) -> list[Req]:
        reqs = list(self.waiting)
        if self.policy == "lpm" and len(reqs) <= 256:
            def hit(r: Req) -> int:
                m = self.cache.match_prefix(r.tokens[: r.match_len], extra_key=r.extra_key)
                return int(m.device_tokens + m.host_tokens)

            # Stable: equal matches keep arrival order. Retracted requests stay first.
            reqs.sort(key=lambda r: (r.retractions == 0, -hit(r)))
        return reqs

    def _admit(self, req: Req) -> None:
        """Lock the cached prefix of `req` and take its pages as the head of the page table."""
        tokens = req.tokens
        acq = self.cache.acquire(
            tokens[: req.match_len], extra_key=req.extra_key, request_id=req.rid,
            count=False, layerwise=True,
        )
        req.admission = acq  # counted once the request gets its pages (_prefill_step)
        req.node = acq.node
        req.pages = list(acq.device_pages)
        req.tree_pages = len(req.pages)
        req.kv_len = int(acq.cached_tokens)
        if req.cached_tokens < 0:
            req.cached_tokens = req.kv_len

    def _decode_reserve(self, reqs: list[Req]) -> int:
        """Pages to keep free for the decode growth of `reqs`: their remaining max_new_tokens
        (clipped) times `new_token_ratio`, as SGLang estimates it."""
        ps = self.page_size
        tokens = sum(
            min(r.params.max_new_tokens - len(r.output), CLIP_MAX_NEW_TOKENS) for r in reqs
        )
        return math.ceil(tokens * self.new_token_ratio / ps)

    def _room_for(self, req: Req, budget: int, batch: list[Req]) -> bool:
        """Whether to admit `req` now: the pool (free + evictable pages, without evicting
        anything) must hold its first chunk, the host pages it will load back, and the decode
        reserve of every running request and itself. Checked before `acquire`, so a request
        that must wait is not admitted (and its hits counted) twice. With nothing else running
        one page is enough: the request then proceeds chunk by chunk."""
        ps = self.page_size
        tokens = req.tokens
        m = self.cache.match_prefix(tokens[: req.match_len], extra_key=req.extra_key)
        matched, host = len(m.device_pages), m.host_tokens // ps
        rest = len(tokens) - matched * ps - host * ps
        need = host + math.ceil(min(rest, budget) / ps)
        need += self._decode_reserve([*self.running, *batch, req])
        free = self.runner.pool.allocator.num_free
        if free >= need:
            return True
        avail = free + max(0, self.cache.evictable_device_tokens() // ps - matched)
        if avail >= need:
            return True
        return not self.running and not batch and self.chunked is None and avail >= 1

    def _unadmit(self, req: Req) -> None:
        """Undo `_admit` for a request that got no pages (keeps any own pages it had: none)."""
        req.settle_load()
        if req.node is not None:
            self.cache.release(req.node)
        req.node, req.pages, req.tree_pages, req.kv_len = None, [], 0, 0

    def _grow(self, req: Req, n_tokens: int) -> int:
        """Make the page table cover `kv_len + k` tokens for the largest `k <= n_tokens` the pool
        allows (halving the ask on failure). Returns k (0: not even one page)."""
        ps = self.page_size
        have = len(req.pages) * ps - req.kv_len
        if have >= n_tokens:
            return n_tokens
        need = -(-(n_tokens - have) // ps)
        while need > 0:
            pages = self.cache.alloc_device(need)
            if pages is not None:
                req.pages.extend(pages)
                return min(n_tokens, have + need * ps)
            need //= 2
        return max(0, have)

    def _prefill_step(self, updated: list[Req]) -> bool:
        budget = self.chunk_size
        batch: list[tuple[Req, int]] = []  # (request, new tokens this step)
        if self.chunked is not None:
            req = self.chunked
            n = min(len(req.tokens) - req.kv_len, budget)
            k = self._grow(req, n)
            if k == 0:
                self._wait_transfers()
                k = self._grow(req, n)
            if k == 0:
                if not self.running:
                    self._abort_unfittable(req)
                    self.chunked = None
                    return False
                self._retract_one(exclude=req)
                return False
            batch.append((req, k))
            # A continuation cut short by the pool admits nobody new (one partial prompt a step).
            budget = budget - k if k == n else 0
            self.chunked = None
        if budget > 0 and self.waiting and len(self.running) + len(batch) < self.max_running:
            for req in self._ordered_waiting():
                if budget <= 0 or len(self.running) + len(batch) >= self.max_running:
                    break
                if not self.cache.prefetch_ready(req.rid):
                    continue
                if not self._room_for(req, budget, [r for r, _ in batch]):
                    if batch or self.running or self.chunked is not None:
                        break
                    self._wait_transfers()  # in-flight writes pin pages; let them land
                    if not self._room_for(req, budget, []):
                        self.waiting.remove(req)
                        self._abort_unfittable(req)
                        continue
                self._admit(req)
                n = min(len(req.tokens) - req.kv_len, budget)
                k = self._grow(req, n)
                if k == 0 and not batch and not self.running:
                    self._wait_transfers()
                    k = self._grow(req, n)
                if k == 0:
                    self._unadmit(req)
                    if not batch and not self.running and self.chunked is None:
                        self.waiting.remove(req)
                        self._abort_unfittable(req)
                        continue
                    break
                assert req.admission is not None
                self.cache.record_admission(req.admission, len(req.tokens))
                if req.admission.outcomes is not None and req.rid not in self.outcomes:
                    self.outcomes[req.rid] = complete(req.admission.outcomes, len(req.tokens))
                self.waiting.remove(req)
                batch.append((req, k))
                budget -= k
                if k < n:
                    break  # a partial prompt is continued next step; nothing after it
        if not batch:
            return False
        loads = [r.admission.load for r, _ in batch if r.admission and r.admission.load]
        t0 = time.perf_counter()
        logits = forward_prefill(self.runner, batch, merge_wait_layer(loads))
        self.forward_steps += 1
        if logits.device.type == "cuda":
            torch.cuda.synchronize(logits.device)  # time the compute, not its launch
        self.cache.observe_prefill(sum(k for _, k in batch), time.perf_counter() - t0)
        done: list[tuple[int, Req]] = []
        for i, (req, k) in enumerate(batch):
            req.kv_len += k
            if req.kv_len < len(req.tokens):
                self.chunked = req
                self._cache_partial(req)
                continue
            done.append((i, req))
        for _, req in done:
            if req.params.max_new_tokens == 0:
                self._finish(req, {"type": "length", "length": 0})
                updated.append(req)
        done = [(i, r) for i, r in done if r.params.max_new_tokens > 0]
        if done:
            toks = self._sample(logits[[i for i, _ in done]], [r for _, r in done])
            for (_, req), tok in zip(done, toks):
                self.running.append(req)
                self._append_token(req, tok)
                updated.append(req)
        return True

    def _cache_partial(self, req: Req) -> None:
        """Hand the full pages of a partly prefilled prompt to the tree and pin them."""
        full = req.kv_len // self.page_size
        if full <= req.tree_pages:
            return
        h = req.cache_hints
        res = self.cache.insert(
            req.tokens[: full * self.page_size], req.pages[:full], extra_key=req.extra_key,
            priority=h.priority, skip_write=h.skip_cache_write,
        )
        self.cache.lock(res.node)
        if req.node is not None:
            self.cache.release(req.node)
        req.node = res.node
        req.pages[:full] = list(res.device_pages)
        req.tree_pages = full

    # ---- decode ---------------------------------------------------------------------------

    def _decode_step(self, updated: list[Req]) -> None:
        waited = False
        while True:
            ok = True
            for req in self.running:
                if self._grow(req, 1) == 0:
                    ok = False
                    break
            if ok:
                break
            if not waited:
                # In-flight device -> host copies pin their pages: let them land first, it is
                # far cheaper than a retraction.
                waited = True
                self._wait_transfers()
                continue
            if self.chunked is not None:
                # A half-prefilled prompt gives way to running requests first.
                self._retract(self.chunked)
                self.chunked = None
                waited = False
                continue
            if len(self.running) == 1:
                # Alone and still no page: nothing more can be freed for it.
                req = self.running.pop()
                self._finish(req, {"type": "abort", "message": "the KV pool cannot hold the "
                                   "request's context"}, compute_tail=False)
                updated.append(req)
                return
            self._retract_one()
            waited = False  # the retracted pages may be pinned by their own write to host
            if not self.running:
                return
        reqs = list(self.running)
        seqs = [([r.tokens[r.kv_len]], r.kv_len, r.pages) for r in reqs]
        logits = self.runner.forward(seqs)
        self.forward_steps += 1
        self.new_token_ratio = max(MIN_NEW_TOKEN_RATIO,
                                   self.new_token_ratio - NEW_TOKEN_RATIO_DECAY)
        toks = self._sample(logits, reqs)
        for req, tok in zip(reqs, toks):
            req.kv_len += 1
            self._append_token(req, tok)
            updated.append(req)

    def _sample(self, logits: torch.Tensor, reqs: list[Req]) -> list[int]:
        """One token per request; tensor-parallel ranks check that they drew the same ones
        (another token would cache other KV under the same keys): `RankDivergence`."""
        toks = sample_reqs(self.sampler, logits, reqs)
        self.sync.check("sampled tokens", toks)
        return toks

    def _append_token(self, req: Req, tok: int) -> None:
        reason = req.append_token(tok, self.eos_token_ids, self.decode_text, self.context_length)
        if reason is not None:
            self.running.remove(req)
            self._finish(req, reason)

    # ---- retraction and completion --------------------------------------------------------

    def _release_pages(self, req: Req, n_tokens: int) -> None:
        """Insert the first `n_tokens` of `req` (their K/V computed) and give back everything
        else the request holds."""
        ps = self.page_size
        full = min(n_tokens, req.kv_len) // ps
        if full > 0:
            h = req.cache_hints  # the soft pin is taken once, when the request finishes
            self.cache.insert(req.tokens[: full * ps], req.pages[:full], extra_key=req.extra_key,
                              priority=h.priority, skip_write=h.skip_cache_write,
                              retention_s=h.retention_seconds if req.finished else 0.0)
        own = req.pages[max(full, req.tree_pages) :]
        req.settle_load()
        if own:
            self.cache.free_device(own)
        if req.node is not None:
            self.cache.release(req.node)
        req.node, req.pages, req.tree_pages, req.kv_len = None, [], 0, 0

    def _wait_transfers(self) -> None:
        self.cache.flush(timeout=60)

    def _retract_one(self, exclude: Req | None = None) -> None:
        cands = [r for r in self.running if r is not exclude]
        if not cands:
            return
        victim = max(cands, key=lambda r: (r.arrival, len(r.output)))
        self.running.remove(victim)
        self._retract(victim)

    def _retract(self, victim: Req) -> None:
        self._release_pages(victim, victim.kv_len)
        victim.retractions += 1
        self.retracted_total += 1
        self.new_token_ratio = 1.0
        self.waiting.appendleft(victim)
        logger.info("retracted %s (%d tokens) for lack of KV pages", victim.rid, len(victim.tokens))

    def _abort_unfittable(self, req: Req) -> None:
        msg = (
            f"request needs {len(req.tokens)} tokens of KV but the device pool holds "
            f"{self.runner.pool.num_pages * self.page_size}"
        )
        logger.warning("aborting %s: %s", req.rid, msg)
        self._release_pages(req, 0)
        self.cache.cancel_prefetch(req.rid)
        self._finish(req, {"type": "abort", "message": msg}, compute_tail=False)

    def _fill_tail(self, req: Req) -> int:
        """K/V of the last output token (never fed back) so that the full pages of
        prompt + output can be cached, as `simulate_request` assumes. Returns tokens with K/V."""
        total = len(req.tokens)
        if req.kv_len != total - 1 or total % self.page_size != 0:
            return req.kv_len
        if self._grow(req, 1) == 0:
            return req.kv_len
        self.runner.forward([([req.tokens[-1]], req.kv_len, req.pages)])
        req.kv_len += 1
        return req.kv_len

    def _finish(self, req: Req, reason: FinishReason, compute_tail: bool = True) -> None:
        req.finish_reason = reason
        n = self._fill_tail(req) if compute_tail else req.kv_len
        if req.pages or req.node is not None:
            self._release_pages(req, n)
        self.num_finished += 1
        self.finished_updates.append(req)
        req.cache_outcomes = self.outcomes.pop(req.rid, None)
        if self._log is not None and reason.get("type") != "abort":
            rec = {
                "ts": req.arrival,
                "rid": req.rid,
                "input_ids": req.prompt,
                "output_ids": req.output,
                "extra_key": req.extra_key,
                "cached_tokens": max(req.cached_tokens, 0),
                "cache_outcomes": req.cache_outcomes,  # hit tier / miss cause -> tokens, or None
                **req.cache_hints.as_dict(),  # hicache-hitrate replays the hints
            }
            self._log.write(json.dumps(rec, separators=(",", ":")) + "\n")
            self._log.flush()

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None
