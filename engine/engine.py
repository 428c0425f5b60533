"""`Engine`: the in-process serving engine (offline `generate`, and a step-wise API for servers).

```python
with Engine(enable_hierarchical_cache=True, hicache_storage_backend="file",
            hicache_storage_backend_extra_config={"path": "/tmp/pages"}) as engine:
    out = engine.generate(["Hello", "Hello again"], {"max_new_tokens": 16})
```
"""

from __future__ import annotations

import hashlib
import logging
import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed

from engine.engine_base import EngineBase
from engine.req import Req
from engine.req_logprobs import ReqLogprobs
from engine.sampling import SamplingParams
from engine.tp import RankFailure, collective
from hicache.hiradix import HiRadixCache
from hicache_client.errors import CapacityError, ConfigError, HiCacheError

if TYPE_CHECKING:
    from engine.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

class Engine(EngineBase):
    """A continuous-batching engine whose KV lives in `HiRadixCache` pools.

    Construct with `Engine(EngineArgs(...))`, `Engine(**fields)` or both (keywords override).
    With `tp_size > 1` this object is rank 0 and starts the other ranks (`engine.tp`).
    """

    # ---- step-wise API --------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | None = None,
        sampling_params: SamplingParams | Mapping[str, Any] | None = None,
        *,
        input_ids: Sequence[int] | None = None,
        rid: str | None = None,
        extra_key: str | None = None,
        return_logprob: bool = False,
        top_logprobs_num: int = 0,
        logprob_start_len: int = -1,
    ) -> str:
        """Queue a request; returns its id. Raises `ValueError` for an empty prompt, one longer
        than the context or than the whole device pool (it could never be served), a token id
        of `logit_bias` / `stop_token_ids` outside the vocabulary, or a structured-output spec
        that does not compile. `return_logprob`: logprobs of the output tokens (and of the
        prompt from token `logprob_start_len` on, -1: none) with `top_logprobs_num`
        alternatives each, in the updates of `step()` (engine.req_logprobs)."""
        if self._closed:
            raise RuntimeError("the engine is shut down")
        params = SamplingParams.from_any(sampling_params)
        if input_ids is None:
            if prompt is None:
                raise ValueError("give a prompt or input_ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in input_ids]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"token ids out of the vocabulary (size {vocab}): {bad[:5]}")
        if len(ids) >= self.context_length:
            raise ValueError(
                f"the prompt has {len(ids)} tokens; the context length is {self.context_length}"
            )
        if len(ids) + 1 > self.max_total_tokens:
            raise CapacityError(
                f"the prompt has {len(ids)} tokens; the device KV pool holds "
                f"{self.max_total_tokens}"
            )
        room = self.context_length - len(ids)
        if params.max_new_tokens > room:
            params = replace(params, max_new_tokens=room)
        params.check_vocab(vocab)
        rid = rid or uuid.uuid4().hex
        if rid in self.scheduler.reqs:
            raise ValueError(f"request id {rid!r} is already in use")
        if params.grammar is not None:  # compiled here: a spec that does not compile fails now
            self._matchers[rid] = self._grammars().matcher(*params.grammar)
        logprobs = (top_logprobs_num, logprob_start_len) if return_logprob else None
        try:
            self._enqueue(rid, ids, params, extra_key, logprobs, time.time())
        finally:
            self._matchers.pop(rid, None)
        return rid

    @collective
    def _enqueue(
        self, rid: str, ids: list[int], params: SamplingParams, extra_key: str | None,
        logprobs: tuple[int, int] | None, arrival: float,
    ) -> None:
        """Queue a request `add_request` checked (on every rank of a TP group)."""
        req = Req(rid=rid, prompt=ids, params=params, extra_key=extra_key, arrival=arrival)
        if logprobs is not None:
            req.logprobs = ReqLogprobs.make(logprobs[0], logprobs[1], len(ids))
        if params.grammar is not None:
            req.matcher = self._matchers.pop(rid, None) or self._grammars().matcher(
                *params.grammar
            )
        self.scheduler.add(req)

    def _grammars(self) -> GrammarCompiler:
        """The structured-output compiler, made on first use (engine.grammar). JSON output is
        compact (no whitespace but `", "` and `": "`, vLLM's `disable-any-whitespace`): a weak
        model cannot pad a JSON value with whitespace until max_tokens."""
        if self._grammar_compiler is None:
            from engine.grammar import GrammarCompiler

            self._grammar_compiler = GrammarCompiler(
                self.tokenizer.hf, self.model_config.vocab_size, sorted(self.eos_token_ids),
                any_whitespace=False,
            )
        return self._grammar_compiler

    @collective
    def step(self) -> list[dict[str, Any]]:
        """Run one batch; return one update per request with news:
        `{"rid", "new_token_ids", "output_ids", "text", "text_delta", "finished", "meta_info"}`
        (`text` is the whole output once finished; `text_delta` the text released since the
        previous update, held back where it may start a stop string; `meta_info` as in
        `generate`)."""
        out = []
        reqs = self.scheduler.step()
        if self.args.enable_tp_state_check:
            self.check_tp_state()
        for req in reqs:
            new = req.output[req.sent_tokens :]
            req.sent_tokens = len(req.output)
            out.append(
                {
                    "rid": req.rid,
                    "new_token_ids": new,
                    "output_ids": list(req.output),
                    "text": req.text,
                    "text_delta": req.detok.take() if req.detok is not None else "",
                    "finished": req.finished,
                    "meta_info": self._meta(req),
                    # New logprobs since the previous update (engine.req_logprobs), or None.
                    "logprobs": req.logprobs.take() if req.logprobs is not None else None,
                }
            )
        return out

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    @collective
    def abort(self, rid: str) -> bool:
        return self.scheduler.abort(rid)

    def check_tp_state(self) -> None:
        """Raise `hicache.sync.RankDivergence` unless every tensor-parallel rank's scheduler
        and cache are in the same state (one collective; nothing with one rank)."""
        if self.sync.solo:
            return
        sched = self.scheduler
        reqs = [*sched.waiting, *sched.running, *([sched.chunked] if sched.chunked else [])]
        state = repr([(r.rid, r.kv_len, r.output, r.pages) for r in reqs]).encode()
        h = int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little") >> 2
        digest = getattr(self.cache, "state_digest", None)
        self.sync.check("scheduler and cache state",
                        [h, *(digest() if digest is not None else [])])

    @staticmethod
    def _meta(req: Req) -> dict[str, Any]:
        return {
            "id": req.rid,
            "prompt_tokens": len(req.prompt),
            "completion_tokens": len(req.output),
            "cached_tokens": max(req.cached_tokens, 0),
            "finish_reason": req.finish_reason,
            "ttft": (req.first_token_time - req.arrival) if req.first_token_time else None,
            "retractions": req.retractions,
        }

    # ---- offline API ----------------------------------------------------------------------

    def generate(
        self,
        prompts: str | Sequence[str] | None = None,
        sampling_params: SamplingParams | Mapping[str, Any] | Sequence[Any] | None = None,
        input_ids: Sequence[int] | Sequence[Sequence[int]] | None = None,
        extra_key: str | Sequence[str | None] | None = None,
    ) -> list[dict[str, Any]]:
        """Run prompts (text or token ids) to completion, batched; results in input order:
        `{"text", "output_ids", "meta_info": {prompt_tokens, completion_tokens, cached_tokens,
        finish_reason, ...}}`."""
        if (prompts is None) == (input_ids is None):
            raise ValueError("give exactly one of prompts and input_ids")
        items: list[tuple[str | None, list[int] | None]]
        if prompts is not None:
            plist = [prompts] if isinstance(prompts, str) else list(prompts)
            items = [(p, None) for p in plist]
        else:
            assert input_ids is not None
            seqs: list[Any] = list(input_ids)
            if seqs and isinstance(seqs[0], int):
                items = [(None, [int(t) for t in seqs])]
            else:
                items = [(None, [int(t) for t in x]) for x in seqs]
        n = len(items)
        if isinstance(sampling_params, Sequence) and not isinstance(sampling_params, str):
            plist_sp = list(sampling_params)
            if len(plist_sp) != n:
                raise ValueError(f"{len(plist_sp)} sampling params for {n} prompts")
        else:
            plist_sp = [sampling_params] * n
        keys: list[Any] = (
            list(extra_key) if isinstance(extra_key, (list, tuple)) else [extra_key] * n
        )
        rids: list[str] = []
        try:
            for (text, ids), sp, ek in zip(items, plist_sp, keys):
                rids.append(self.add_request(text, sp, input_ids=ids, extra_key=ek))
        except Exception:
            self._forget(rids)  # all or nothing: do not leave half a batch queued
            raise
        results: dict[str, dict[str, Any]] = {}
        while len(results) < n:
            if not self.has_unfinished():
                raise RuntimeError("the scheduler stopped with requests unfinished")
            for u in self.step():
                if u["finished"] and u["rid"] in rids:
                    results[u["rid"]] = {
                        "text": u["text"], "output_ids": u["output_ids"],
                        "meta_info": u["meta_info"],
                    }
        return [results[r] for r in rids]

    @collective
    def _forget(self, rids: list[str]) -> None:
        """Abort `rids` and drop every trace of them (no abort update will come out)."""
        for rid in rids:
            self.abort.__wrapped__(self, rid)
            self.scheduler.reqs.pop(rid, None)
        sched = self.scheduler
        sched.finished_updates = [r for r in sched.finished_updates if r.rid not in rids]

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert isinstance(ids, list)
        return ids

    # ---- cache management -----------------------------------------------------------------

    @collective
    def flush_cache(self) -> bool:
        """Drop every cached page on device and host (L3 keeps its pages). False while requests
        are in flight."""
        if self.has_unfinished():
            return False
        self.cache.reset()
        return True

    @collective
    def wait_transfers(self, timeout: float | None = None) -> None:
        """Wait for background cache transfers (backups to host and L3) to finish."""
        self.cache.flush(timeout)

    @collective
    def poll_cache(self) -> int:
        """Apply finished cache transfers now (an idle server does, so write-through reaches
        L3 without waiting for the next request); returns how many were applied."""
        return self.cache.poll()

    @collective
    def attach_storage(self, name: str, extra: dict[str, Any] | None = None) -> None:
        """Attach (or replace) the L3 backend; call while idle. Under tensor parallelism every
        rank attaches or none does (a rank that fails makes the others detach again)."""
        self._storage_admin(lambda c: c.attach_storage(name, extra or {}), undo=True)

    @collective
    def detach_storage(self) -> None:
        """Detach the L3 backend (its pages stay in it); call while idle."""
        self._storage_admin(lambda c: c.detach_storage())

    @collective
    def clear_storage(self) -> None:
        """Delete this engine's pages from the L3 backend (its namespace where the backend can
        tell namespaces apart, else every page: docs/storage.md); call while idle."""
        self._storage_admin(lambda c: c.clear_storage())

    def _storage_admin(self, op: Any, undo: bool = False) -> None:
        if not isinstance(self.cache, HiRadixCache):
            raise ConfigError("no prefix cache (disable_radix_cache)")
        err: BaseException | None = None
        try:
            op(self.cache)
        except (HiCacheError, ValueError, TypeError, OSError) as e:
            err = e
        if not self.sync.all_true(err is None)[0]:
            if err is None and undo:
                self.cache.detach_storage()
            raise err if err is not None else ConfigError("failed on another tensor-parallel rank")
        if err is not None:
            raise err

    @collective
    def rank_cache_stats(self) -> list[dict[str, Any]]:
        """Per tensor-parallel rank (in rank order): its cache counters and its L3 backend's
        (each rank reads and writes its own pages, or, for MLA, reads the pages rank 0 wrote).
        One entry with one rank."""
        self.cache.poll()
        st = self.cache.storage_stats()
        mine = {"rank": self.tp_rank, **self.cache.stats.as_dict(),
                "storage": st.as_dict() if st is not None else None}
        if self.sync.solo:
            return [mine]
        out: list[Any] = [None] * self.args.tp_size
        torch.distributed.all_gather_object(out, mine, group=self.tp.cpu_group)
        return out

    @collective
    def cache_stats(self) -> dict[str, Any]:
        """Per-tier hit tokens and transfer counters (`hicache.stats.CacheStats` fields), pool
        usage, the storage backend's counters, the cost model's estimates (`cost_model`, None
        without a host tier), and the scheduler's totals."""
        self.cache.poll()
        out: dict[str, Any] = dict(self.cache.stats.as_dict())
        out["usage"] = self.cache.usage()
        st = self.cache.storage_stats()
        out["storage"] = st.as_dict() if st is not None else None
        cost = getattr(getattr(self.cache, "controller", None), "cost", None)
        # The load-vs-recompute estimates and the start-up calibration (hicache.calibration).
        out["cost_model"] = cost.as_dict() if cost is not None else None
        out["scheduler"] = {
            "waiting": len(self.scheduler.waiting),
            "running": len(self.scheduler.running),
            "finished": self.scheduler.num_finished,
            "retractions": self.scheduler.retracted_total,
            "forward_steps": self.scheduler.forward_steps,
        }
        return out

    # ---- lifecycle ------------------------------------------------------------------------

    def shutdown(self) -> None:
        if self._closed:
            return
        try:
            self._shutdown()
        except RankFailure as e:  # a rank is gone: close what this rank holds, no collective
            logger.error("shutting down without the other ranks: %s", e)
            self.shutdown_local()
        finally:
            self._stop_tp()

    @collective
    def _shutdown(self) -> None:
        self._closed = True
        for rid in list(self.scheduler.reqs):
            self.scheduler.abort(rid)
        self.cache.close()
        self.scheduler.close()
        logger.info("engine shut down")

    def shutdown_local(self) -> None:
        """Leave without the other ranks (one of them, or rank 0, is gone): stop this rank's
        transfer threads and close its backend and the group, with no collective."""
        self._closed = True
        self._close_local()
        self._stop_tp()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:  # best effort: background threads must not outlive the engine
        try:
            if not getattr(self, "_closed", True):
                self.shutdown()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


