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

from engine.args import EngineArgs
from engine.demo_model import resolve_model_path
from engine.distributed import TPGroup, destroy_tp_group, init_tp_group
from engine.model_runner import ModelRunner
from engine.models.config import kv_bytes_per_token
from engine.models.dummy import dummy_fingerprint
from engine.models.loader import load_model, model_fingerprint
from engine.req import Req
from engine.req_logprobs import ReqLogprobs
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import NoTokenizer, Tokenizer, load_tokenizer
from engine.tp import RankFailure, RankProcesses, collective, free_port
from hicache.admission import CacheHints
from hicache.calibration import PROBE_BYTES, calibrate_transfers
from hicache.hiradix import HiRadixCache
from hicache.pools import dtype_name
from hicache.prefix_cache import NoPrefixCache, PrefixCache
from hicache.sync import SOLO, GroupSync, RankSync
from hicache_client.errors import CapacityError, ConfigError, HiCacheError
from hicache_client.keys import namespace_seed

if TYPE_CHECKING:
    from engine.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# On CPU the default KV pool is mem_fraction_static of this budget (the host pool comes on top).
_CPU_KV_BUDGET_BYTES = 256 << 20
# The start-up calibration's forward (tokens; at most chunked_prefill_size) and L3 probe. On CPU
# a forward's speed barely depends on its length, and engines start often in tests.
_CALIBRATION_TOKENS = 2048
_CPU_CALIBRATION_TOKENS = 256
_CPU_PROBE_BYTES = 8 << 20


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dev = torch.device(name)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for but CUDA is not available")
    return dev


def resolve_dtype(name: str, checkpoint_dtype: str, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32
    return _DTYPES.get(checkpoint_dtype, torch.bfloat16)


class Engine:
    """A continuous-batching engine whose KV lives in `HiRadixCache` pools.

    Construct with `Engine(EngineArgs(...))`, `Engine(**fields)` or both (keywords override).
    With `tp_size > 1` this object is rank 0 and starts the other ranks (`engine.tp`).
    """

    # ---- construction: device, TP group, model shard, pools, cache, scheduler -------------

    def __init__(self, args: EngineArgs | None = None, **kwargs: Any) -> None:
        # Set by engine.tp for ranks > 0 of a tensor-parallel engine (not user arguments).
        self.tp_rank: int = kwargs.pop("_tp_rank", 0)
        init_method: str | None = kwargs.pop("_tp_init_method", None)
        if args is None:
            args = EngineArgs(**kwargs)
        elif kwargs:
            args = replace(args, **kwargs)
        self.args = args
        self._closed = True  # until built
        self._ranks: RankProcesses | None = None
        self.tp = TPGroup.solo()
        self.sync: RankSync = SOLO
        self.model_path = resolve_model_path(args.model_path)
        self.device = resolve_device(args.device)
        if args.tp_size > 1:
            self._start_tp(init_method)
        try:
            self._build(args)
            if self._ranks is not None:
                self._ranks.wait_ready()
        except BaseException as e:
            # A rank that failed to build leaves this one's collectives failing ("connection
            # closed by peer"): raise the rank's own reason instead.
            reason = None
            if self._ranks is not None and not isinstance(e, RankFailure):
                reason = self._ranks.reported()
            self._close_local()
            self._stop_tp()
            if reason is not None:
                raise RankFailure(f"failed to start: {reason}") from e
            raise

    def _start_tp(self, init_method: str | None) -> None:
        """Join (rank > 0) or start (rank 0: the other ranks' processes first) the group."""
        args = self.args
        if self.device.type == "cuda":
            base = self.device.index or 0
            visible = torch.cuda.device_count()
            if base + args.tp_size > visible:
                # One GPU per rank, as in SGLang: NCCL refuses two ranks on one device.
                raise ConfigError(
                    f"tp_size {args.tp_size} needs {args.tp_size} CUDA devices from cuda:{base}; "
                    f"{visible} visible (CUDA_VISIBLE_DEVICES); use fewer ranks or --device cpu"
                )
            self.device = torch.device("cuda", base + self.tp_rank)
        if self.tp_rank == 0:
            init_method = f"tcp://127.0.0.1:{args.nccl_port or free_port()}"
            rank_args = replace(args, model_path=str(self.model_path))
            threads = torch.get_num_threads()
            if self.device.type == "cpu":  # the ranks share this process's CPU threads
                threads = max(1, threads // args.tp_size)
                torch.set_num_threads(threads)
            self._ranks = RankProcesses(type(self), rank_args, init_method, threads)
        assert init_method is not None
        try:
            self.tp = init_tp_group(self.tp_rank, args.tp_size, init_method=init_method,
                                    device=self.device, timeout_s=float(args.dist_timeout))
        except BaseException:
            self._stop_tp()
            raise
        self.sync = GroupSync(self.tp.cpu_group, self.tp_rank, args.tp_size)

    def _close_local(self) -> None:
        """Stop this rank's transfer threads and close its L3 backend and scheduler (what of
        them was built), with no collective."""
        cache = getattr(self, "cache", None)
        controller = getattr(cache, "controller", None)
        if controller is not None:
            controller.close()
        storage = getattr(cache, "storage", None)
        if storage is not None:
            storage.close()
        scheduler = getattr(self, "scheduler", None)
        if scheduler is not None:
            scheduler.close()

    def _stop_tp(self) -> None:
        if self._ranks is not None:
            self._ranks.stop()
            self._ranks = None
        destroy_tp_group(self.tp)
        self.tp = TPGroup.solo()

    def _build(self, args: EngineArgs) -> None:
        from engine.models.config import ModelConfig

        cfg = ModelConfig.from_dir(self.model_path)
        self.dtype = resolve_dtype(args.dtype, cfg.torch_dtype, self.device)
        self.context_length = args.context_length or cfg.max_position_embeddings
        if cfg.sliding_window and self.context_length > cfg.sliding_window:
            # Full attention equals sliding-window attention only within the window.
            logger.warning(
                "context_length %d exceeds the model's sliding window %d; using %d",
                self.context_length, cfg.sliding_window, cfg.sliding_window,
            )
            self.context_length = cfg.sliding_window
        self.model = load_model(
            self.model_path, dtype=self.dtype, device=self.device,
            context_length=self.context_length, tp=self.tp, load_format=args.load_format,
            seed=args.random_seed,
        )
        self.model_config = cfg
        dummy = args.load_format == "dummy"
        # A dummy model over a config alone may have no tokenizer: token ids in and out.
        self.tokenizer: Tokenizer | NoTokenizer = load_tokenizer(
            args.tokenizer_path or self.model_path, optional=dummy and not args.tokenizer_path
        )
        self.model_id = args.model_id or (
            dummy_fingerprint(self.model_path, args.random_seed, self.device) if dummy
            else model_fingerprint(self.model_path)
        )
        ps = args.page_size
        # Page ids are shared by every rank's pool: all ranks take the smallest pool any can.
        num_pages = self.sync.agree_min(self._num_device_pages(cfg))[0]
        graphs = not args.disable_cuda_graph and args.tp_size == 1  # (TP graphs: untested)
        self.runner = ModelRunner(
            self.model, num_pages=num_pages, page_size=ps, dtype=self.dtype,
            device=self.device, attention_backend=args.attention_backend,
            cuda_graph_max_bs=args.cuda_graph_max_bs if graphs else 0,
            context_length=self.context_length,
        )
        self.cache: PrefixCache
        if not args.disable_radix_cache:
            hc = args.to_hicache_config()
            # MLA keeps one latent per token, bit-identical on every rank: one set of L3 pages
            # for all ranks (rank 0 writes, all read). Otherwise each rank's KV heads are its
            # own. The TP size stays in the seed: under another TP size the latent differs by
            # float rounding, and equal keys must mean equal bytes.
            mla = bool(getattr(cfg, "is_mla", False))
            ns = namespace_seed(
                model_fingerprint=self.model_id, dtype=dtype_name(self.dtype), page_size=ps,
                layout=hc.mem_layout, tp_rank=0 if mla else self.tp_rank, tp_size=args.tp_size,
            )
            self.cache = HiRadixCache(
                hc, device_pool=self.runner.pool, namespace=ns,
                num_host_pages=None if args.enable_hierarchical_cache else 0,
                sync=self.sync, shared_storage=mla,
            )
        else:
            self.cache = NoPrefixCache(self.runner.pool.allocator, ps)
        self.eos_token_ids = self.tokenizer.eos_token_ids(self.model_path) | set(cfg.eos_token_ids)
        self.scheduler = Scheduler(
            self.runner, self.cache, page_size=ps,
            max_running_requests=args.max_running_requests,
            chunked_prefill_size=args.chunked_prefill_size,
            schedule_policy=args.schedule_policy, context_length=self.context_length,
            eos_token_ids=self.eos_token_ids, decode=self._decode,
            random_seed=args.random_seed,
            request_log=args.request_log if self.tp_rank == 0 else None, sync=self.sync,
        )
        self._calibrate(args, num_pages * ps)
        self._matchers: dict[str, Any] = {}  # compiled on rank 0 before a request is queued
        self._closed = False
        self._grammar_compiler: GrammarCompiler | None = None
        self.max_total_tokens = num_pages * ps
        logger.info(
            "engine ready: model=%s device=%s dtype=%s kv=%d tokens cache=%s tp=%d/%d",
            self.model_path, self.device, dtype_name(self.dtype), self.max_total_tokens,
            "off" if args.disable_radix_cache else
            ("hierarchical" if args.enable_hierarchical_cache else "device"),
            self.tp_rank, args.tp_size,
        )

    def _calibrate(self, args: EngineArgs, pool_tokens: int) -> None:
        """Measure what the load-vs-recompute decision needs before the first request (a
        prefill forward, the host and L3 load paths: `hicache.calibration`), so that a tier is
        used only where it beats recomputing from the first request on."""
        cost = getattr(getattr(self.cache, "controller", None), "cost", None)
        if cost is None or not args.enable_hierarchical_cache:
            return
        cuda = self.device.type == "cuda"
        ps = args.page_size
        tokens = min(args.chunked_prefill_size, _CALIBRATION_TOKENS if cuda else
                     _CPU_CALIBRATION_TOKENS, self.context_length - 1, pool_tokens // 2)
        tokens -= tokens % ps
        if tokens >= ps:
            cost.calibrate_prefill(tokens, self.runner.measure_prefill(tokens))
        calibrate_transfers(self.cache, PROBE_BYTES if cuda else _CPU_PROBE_BYTES)

    @property
    def caching(self) -> bool:
        """Whether prefixes are cached (False with `disable_radix_cache`)."""
        return isinstance(self.cache, HiRadixCache)

    def _num_device_pages(self, cfg: Any) -> int:
        a = self.args
        ps = a.page_size
        if a.max_total_tokens is not None:
            return max(1, a.max_total_tokens // ps)
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_token = kv_bytes_per_token(cfg, elem, self.args.tp_size)  # one rank's share
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            budget = int(free * a.mem_fraction_static)
        else:
            budget = int(_CPU_KV_BUDGET_BYTES * a.mem_fraction_static)
        tokens = min(budget // per_token, 64 * self.context_length)
        return max(1, tokens // ps)

    def _decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

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
        cache_hints: CacheHints | Mapping[str, Any] | None = None,
    ) -> str:
        """Queue a request; returns its id. Raises `ValueError` for an empty prompt, one longer
        than the context or than the whole device pool (it could never be served), a token id
        of `logit_bias` / `stop_token_ids` outside the vocabulary, or a structured-output spec
        that does not compile. `return_logprob`: logprobs of the output tokens (and of the
        prompt from token `logprob_start_len` on, -1: none) with `top_logprobs_num`
        alternatives each, in the updates of `step()` (engine.req_logprobs). `cache_hints`:
        `{"skip_cache_write", "retention_seconds", "priority"}` (hicache.admission.CacheHints;
        a wrong type raises `TypeError` naming the field)."""
        if self._closed:
            raise RuntimeError("the engine is shut down")
        hints = CacheHints.from_any(cache_hints).as_dict()
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
            self._enqueue(rid, ids, params, extra_key, logprobs, time.time(), hints)
        finally:
            self._matchers.pop(rid, None)
        return rid

    @collective
    def _enqueue(
        self, rid: str, ids: list[int], params: SamplingParams, extra_key: str | None,
        logprobs: tuple[int, int] | None, arrival: float, hints: dict[str, Any] | None = None,
    ) -> None:
        """Queue a request `add_request` checked (on every rank of a TP group)."""
        req = Req(rid=rid, prompt=ids, params=params, extra_key=extra_key, arrival=arrival,
                  cache_hints=CacheHints.from_any(hints))
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
            # Each prompt token's outcome (hicache.attribution), once the request finished.
            "cache_outcomes": req.cache_outcomes,
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
        cache_hints: CacheHints | Mapping[str, Any] | None = None,
    ) -> list[dict[str, Any]]:
        """Run prompts (text or token ids) to completion, batched; results in input order:
        `{"text", "output_ids", "meta_info": {prompt_tokens, completion_tokens, cached_tokens,
        finish_reason, ...}}`. `cache_hints`: as `add_request`'s, for every prompt."""
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
                rids.append(self.add_request(text, sp, input_ids=ids, extra_key=ek,
                                             cache_hints=cache_hints))
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


