"""`Engine`: the in-process serving engine (offline `generate`, and a step-wise API for servers).

```python
with Engine(enable_hierarchical_cache=True, hicache_storage_backend="file",
            hicache_storage_backend_extra_config={"path": "/tmp/pages"}) as engine:
    out = engine.generate(["Hello", "Hello again"], {"max_new_tokens": 16})
```
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from engine.args import EngineArgs
from engine.demo_model import ensure_demo_model
from engine.model_runner import ModelRunner
from engine.models.loader import load_model, model_fingerprint
from engine.req import Req
from engine.req_logprobs import ReqLogprobs
from engine.sampling import SamplingParams
from engine.scheduler import Scheduler
from engine.tokenizer import Tokenizer
from hicache.errors import CapacityError, ConfigError
from hicache.hiradix import HiRadixCache
from hicache.keys import namespace_seed
from hicache.pools import dtype_name
from hicache.prefix_cache import NoPrefixCache, PrefixCache
from hicache.units import kv_bytes_per_token

if TYPE_CHECKING:
    from engine.grammar import GrammarCompiler

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# On CPU the default KV pool is mem_fraction_static of this budget (the host pool comes on top).
_CPU_KV_BUDGET_BYTES = 256 << 20


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
    """

    def __init__(self, args: EngineArgs | None = None, **kwargs: Any) -> None:
        if args is None:
            args = EngineArgs(**kwargs)
        elif kwargs:
            args = replace(args, **kwargs)
        self.args = args
        self.model_path = Path(args.model_path) if args.model_path else ensure_demo_model()
        self.device = resolve_device(args.device)
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
            context_length=self.context_length,
        )
        self.model_config = cfg
        self.tokenizer = Tokenizer(args.tokenizer_path or self.model_path)
        self.model_id = args.model_id or model_fingerprint(self.model_path)
        ps = args.page_size
        num_pages = self._num_device_pages(cfg)
        self.runner = ModelRunner(
            self.model, num_pages=num_pages, page_size=ps, dtype=self.dtype,
            device=self.device, attention_backend=args.attention_backend,
            cuda_graph_max_bs=0 if args.disable_cuda_graph else args.cuda_graph_max_bs,
            context_length=self.context_length,
        )
        self.cache: PrefixCache
        if not args.disable_radix_cache:
            hc = args.to_hicache_config()
            ns = namespace_seed(
                model_fingerprint=self.model_id, dtype=dtype_name(self.dtype), page_size=ps,
                layout=hc.mem_layout,
            )
            self.cache = HiRadixCache(
                hc, device_pool=self.runner.pool, namespace=ns,
                num_host_pages=None if args.enable_hierarchical_cache else 0,
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
            random_seed=args.random_seed, request_log=args.request_log,
        )
        self._closed = False
        self._grammar_compiler: GrammarCompiler | None = None
        self.max_total_tokens = num_pages * ps
        logger.info(
            "engine ready: model=%s device=%s dtype=%s kv=%d tokens cache=%s",
            self.model_path, self.device, dtype_name(self.dtype), self.max_total_tokens,
            "off" if args.disable_radix_cache else
            ("hierarchical" if args.enable_hierarchical_cache else "device"),
        )

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
        per_token = kv_bytes_per_token(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim, elem)
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
        req = Req(rid=rid or uuid.uuid4().hex, prompt=ids, params=params, extra_key=extra_key)
        if return_logprob:
            req.logprobs = ReqLogprobs.make(top_logprobs_num, logprob_start_len, len(ids))
        if params.grammar is not None:
            req.matcher = self._grammars().matcher(*params.grammar)
        self.scheduler.add(req)
        return req.rid

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

    def step(self) -> list[dict[str, Any]]:
        """Run one batch; return one update per request with news:
        `{"rid", "new_token_ids", "output_ids", "text", "text_delta", "finished", "meta_info"}`
        (`text` is the whole output once finished; `text_delta` the text released since the
        previous update, held back where it may start a stop string; `meta_info` as in
        `generate`)."""
        out = []
        for req in self.scheduler.step():
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

    def abort(self, rid: str) -> bool:
        return self.scheduler.abort(rid)

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
            for rid in rids:  # all or nothing: do not leave half a batch queued
                self.abort(rid)
                self.scheduler.reqs.pop(rid, None)
            sched = self.scheduler
            sched.finished_updates = [r for r in sched.finished_updates if r.rid not in rids]
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

    def encode_chat(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        ids = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
        assert isinstance(ids, list)
        return ids

    # ---- cache management -----------------------------------------------------------------

    def flush_cache(self) -> bool:
        """Drop every cached page on device and host (L3 keeps its pages). False while requests
        are in flight."""
        if self.has_unfinished():
            return False
        self.cache.reset()
        return True

    def wait_transfers(self, timeout: float | None = None) -> None:
        """Wait for background cache transfers (backups to host and L3) to finish."""
        self.cache.flush(timeout)

    def cache_stats(self) -> dict[str, Any]:
        """Per-tier hit tokens and transfer counters (`hicache.stats.CacheStats` fields), pool
        usage, the storage backend's counters, and the scheduler's totals."""
        self.cache.poll()
        out: dict[str, Any] = dict(self.cache.stats.as_dict())
        out["usage"] = self.cache.usage()
        st = self.cache.storage_stats()
        out["storage"] = st.as_dict() if st is not None else None
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
        self._closed = True
        for rid in list(self.scheduler.reqs):
            self.scheduler.abort(rid)
        self.cache.close()
        self.scheduler.close()
        logger.info("engine shut down")

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


