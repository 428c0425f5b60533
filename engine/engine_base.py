"""`EngineBase`: how an `Engine` is built: device and dtype, the tensor-parallel group (rank 0
starts the other ranks' processes, `engine.tp`), the model shard, the device KV pool, the cache
(with its page-key namespace) and the scheduler. `engine.engine.Engine` adds the API."""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch

from engine.args import EngineArgs
from engine.demo_model import resolve_model_path
from engine.distributed import TPGroup, destroy_tp_group, init_tp_group
from engine.model_runner import ModelRunner
from engine.models.config import kv_bytes_per_token
from engine.models.dummy import dummy_fingerprint
from engine.models.loader import load_model, model_fingerprint
from engine.scheduler import Scheduler
from engine.tokenizer import NoTokenizer, Tokenizer, load_tokenizer
from engine.tp import RankFailure, RankProcesses, free_port
from hicache.calibration import PROBE_BYTES, calibrate_transfers
from hicache.hiradix import HiRadixCache
from hicache.pools import dtype_name
from hicache.prefix_cache import NoPrefixCache, PrefixCache
from hicache.sync import SOLO, GroupSync, RankSync
from hicache_client.errors import ConfigError
from hicache_client.keys import namespace_seed

if TYPE_CHECKING:
    from engine.grammar import GrammarCompiler

logger = logging.getLogger("engine.engine")

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


class EngineBase:
    """Construction of an `Engine` (model, pools, cache, scheduler; the tensor-parallel group
    and its rank processes) and what the rest of it reads."""

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
