"""Tensor parallelism on CPU with 2 ranks (gloo): real rank processes, the real `file` L3.

Every TP engine here runs with `enable_tp_state_check`: after each step the ranks' schedulers
and caches (tree, pins, pages, free lists, pending prefetches) are compared, so "no divergence"
is checked at every step, not only in the final outputs. Greedy outputs must equal the TP=1
engine with caching off.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.engine import Engine
from engine.tp import RankFailure
from hicache_client.codec import HEADER_BYTES
from hicache_client.keys import namespace_seed
from tests.engine.tp_faults import RankOneFailsToBuild
from tests.engine.workload import make_sessions, run_sessions

pytestmark = pytest.mark.slow

PS = 8
# One GPU per rank (NCCL refuses two ranks on one device): with fewer than two GPUs every engine
# of this module, the TP=1 references included, runs on the CPU, so outputs compare like for like.
TP_DEVICE = "auto" if torch.cuda.device_count() >= 2 else "cpu"
PARAMS = {"max_new_tokens": 6, "ignore_eos": True}
FAULTY = "tests.engine.tp_faults:RankFaultyFileBackend"


def _args(model: Path, **kw: Any) -> dict[str, Any]:
    base: dict[str, Any] = {"model_path": str(model), "page_size": PS, "max_total_tokens": 2048,
                            "random_seed": 1, "device": TP_DEVICE}
    if kw.get("tp_size", 1) > 1:
        base.update(enable_tp_state_check=True, dist_timeout=60)
    base.update(kw)
    return base


def _l3(store: Path, backend: str = "file", policy: str = "wait_complete",
        **extra: Any) -> dict[str, Any]:
    return {"enable_hierarchical_cache": True, "hicache_storage_backend": backend,
            "hicache_storage_prefetch_policy": policy,
            "hicache_storage_backend_extra_config": {"path": str(store),
                                                     "prefetch_threshold": PS, **extra}}


@pytest.fixture(scope="module")
def sessions() -> list[Any]:
    return make_sessions(5, seed=11, turns=(2, 3), system_len=(30, 50))


@pytest.fixture(scope="module")
def follow_ups(tiny_model: Path, sessions: list[Any]) -> list[list[int]]:
    """One more turn of each session, to be asked of a restarted engine."""
    with Engine(**_args(tiny_model, disable_radix_cache=True)) as e:
        run_sessions(e, sessions)
    return [s.history + [7, 8, 9, 10, 11] for s in sessions]


@pytest.fixture(scope="module")
def reference(tiny_model: Path, sessions: list[Any],
              follow_ups: list[list[int]]) -> dict[str, Any]:
    """TP=1, caching off: the outputs every configuration must reproduce."""
    with Engine(**_args(tiny_model, disable_radix_cache=True)) as e:
        outs = run_sessions(e, sessions)
        follow = [r["output_ids"] for r in e.generate(input_ids=follow_ups,
                                                      sampling_params=PARAMS)]
    return {"sessions": outs, "follow_ups": follow}


@pytest.mark.parametrize("cache", ["off", "device", "host"])
def test_tp2_outputs_equal_tp1(tiny_model: Path, sessions: list[Any], reference: dict[str, Any],
                               cache: str) -> None:
    kw: dict[str, Any] = {"off": {"disable_radix_cache": True}, "device": {},
                          "host": {"enable_hierarchical_cache": True}}[cache]
    with Engine(**_args(tiny_model, tp_size=2, max_total_tokens=512, **kw)) as e:
        got = run_sessions(e, sessions)
        ranks = e.rank_cache_stats()
    assert got == reference["sessions"]
    assert [r["rank"] for r in ranks] == [0, 1]
    if cache != "off":  # both ranks' caches served the same hits
        hits = {(r["device_hit_tokens"], r["host_hit_tokens"]) for r in ranks}
        assert len(hits) == 1 and sum(next(iter(hits))) > 0


def _fill_store(model: Path, store: Path, sessions: list[Any], tp: int = 2) -> list[dict]:
    with Engine(**_args(model, tp_size=tp, **_l3(store))) as e:
        run_sessions(e, sessions)
        e.wait_transfers(timeout=60)
        return e.rank_cache_stats()


def test_restart_from_l3_with_tp2(tiny_model: Path, tmp_path: Path, sessions: list[Any],
                                  follow_ups: list[list[int]],
                                  reference: dict[str, Any]) -> None:
    store = tmp_path / "pages"
    wrote = _fill_store(tiny_model, store, sessions)
    # Each rank backs up its own shard of every page under its own keys.
    assert wrote[0]["storage_backup_pages"] == wrote[1]["storage_backup_pages"] > 0
    files = [p for p in store.rglob("*") if p.is_file()]
    assert len(files) == 2 * wrote[0]["storage_backup_pages"]
    with Engine(**_args(tiny_model, tp_size=2, **_l3(store))) as e:
        got = [r["output_ids"] for r in e.generate(input_ids=follow_ups, sampling_params=PARAMS)]
        ranks = e.rank_cache_stats()
    assert got == reference["follow_ups"]
    hit = ranks[0]["storage_hit_tokens"]
    assert hit > 0 and ranks[1]["storage_hit_tokens"] == hit
    assert all(r["storage"]["get_hits"] * PS >= hit for r in ranks)


def _rank_files(store: Path, model_id: str, rank: int) -> list[Path]:
    ns = namespace_seed(model_fingerprint=model_id, dtype="float32", page_size=PS,
                        layout="layer_first", tp_rank=rank, tp_size=2)
    out = []
    for p in store.rglob("*"):
        if p.is_file() and p.read_bytes()[8:40] == ns:
            out.append(p)
    return out


@pytest.mark.parametrize("fault", ["raise", "corrupt", "slow"])
def test_one_rank_l3_read_fails_all_ranks_fall_back(
    tiny_model: Path, tmp_path: Path, sessions: list[Any], follow_ups: list[list[int]],
    reference: dict[str, Any], fault: str,
) -> None:
    """Rank 1 cannot read its pages (an I/O error, corrupt records on disk, or reads that stall
    past the prefetch budget); rank 0 reads its own fine. Both ranks must load the same (none),
    recompute together and agree at every step; nothing hangs."""
    store = tmp_path / "pages"
    _fill_store(tiny_model, store, sessions)
    if fault == "corrupt":
        with Engine(**_args(tiny_model, disable_radix_cache=True)) as e:
            model_id = e.model_id
        bad = _rank_files(store, model_id, 1)
        assert bad and len(bad) == len(_rank_files(store, model_id, 0))
        for p in bad:
            raw = bytearray(p.read_bytes())
            raw[HEADER_BYTES + 3] ^= 0x5A
            p.write_bytes(bytes(raw))
        l3 = _l3(store)
    elif fault == "raise":
        l3 = _l3(store, FAULTY, fault="raise", fault_rank=1)
    else:  # rank 1's reads stall for 3 s; the timeout policy lets requests go after ~0.3 s
        l3 = _l3(store, FAULTY, policy="timeout", fault="slow", fault_rank=1, slow_s=3.0,
                 prefetch_timeout_base=0.3, prefetch_timeout_per_ki_token=0.0)
    t0 = time.monotonic()
    with Engine(**_args(tiny_model, tp_size=2, dist_timeout=30, **l3)) as e:
        got = [r["output_ids"] for r in e.generate(input_ids=follow_ups, sampling_params=PARAMS)]
        ranks = e.rank_cache_stats()
    elapsed = time.monotonic() - t0
    assert got == reference["follow_ups"]
    assert ranks[0]["storage_hit_tokens"] == ranks[1]["storage_hit_tokens"] == 0
    assert ranks[0]["storage"]["get_hits"] > 0  # rank 0 did read its pages, then let them go
    if fault != "slow":  # (a stalled read is given up once rank 1's worker is done with it)
        assert ranks[0]["prefetch_revoked_pages"] > 0
    if fault == "corrupt":
        assert ranks[1]["corrupt_pages"] > 0 and ranks[0]["corrupt_pages"] == 0
    elif fault == "raise":
        assert ranks[1]["storage_errors"] > 0 and ranks[0]["storage_errors"] == 0
    assert elapsed < 60


def test_a_dead_rank_is_an_error_not_a_hang(tiny_model: Path) -> None:
    with Engine(**_args(tiny_model, tp_size=2, dist_timeout=10)) as e:
        assert e.generate(input_ids=[5, 6, 7, 8, 9], sampling_params=PARAMS)
        assert e._ranks is not None
        e._ranks.procs[0].kill()
        e._ranks.procs[0].join(10)
        t0 = time.monotonic()
        with pytest.raises(RankFailure, match="tp rank 1"):
            e.generate(input_ids=[5, 6, 7, 8, 10], sampling_params=PARAMS)
        assert time.monotonic() - t0 < 30
        with pytest.raises(RankFailure):  # and it stays failed
            e.add_request(input_ids=[1, 2, 3])


@pytest.mark.parametrize("where", ["in_a_collective", "after_the_last"])
def test_a_rank_that_fails_to_start_is_reported_with_its_reason(
    tiny_model: Path, tmp_path: Path, where: str
) -> None:
    """Rank 0 raises rank 1's own reason, whether it was waiting for rank 1 in a collective
    (which fails as "connection closed by peer") or had built its engine and was waiting."""
    before = {t.ident for t in threading.enumerate()}
    t0 = time.monotonic()
    if where == "in_a_collective":
        cls, kw, why = RankOneFailsToBuild, {}, "cannot size its pool"
    else:
        cls, why = Engine, "cannot open the store"
        kw = _l3(tmp_path / "pages", FAULTY, fault="start", fault_rank=1)
    with pytest.raises(RankFailure, match=f"tp rank 1.*injected: rank 1 {why}"):
        cls(**_args(tiny_model, tp_size=2, dist_timeout=10, **kw))
    assert time.monotonic() - t0 < 60
    # What rank 0 had built is closed: no L3 reader or transfer thread outlives the failure
    # (hicache-check: the process's one record-check pool, made on first use).
    left = [t.name for t in threading.enumerate() if t.ident not in before
            and t.name.startswith("hicache") and not t.name.startswith("hicache-check")]
    assert left == []


# -- MLA: one latent per token, the same on every rank -----------------------------------------


@pytest.fixture(scope="module")
def mla_model(checkpoint_factory: Any) -> Path:
    from tests.engine.test_mla_models import MLA_CASES

    kind, extra = MLA_CASES["v3_yarn"]  # q LoRA, MoE with sigmoid routing, YaRN
    return checkpoint_factory(kind, **extra)


def test_mla_tp2_writes_l3_once_and_every_rank_reads_it(
    mla_model: Path, tmp_path: Path, sessions: list[Any]
) -> None:
    store = tmp_path / "pages"
    with Engine(**_args(mla_model, disable_radix_cache=True)) as e:
        expect = run_sessions(e, sessions)
        follow = [s.history + [7, 8, 9, 10, 11] for s in sessions]
        expect_follow = [r["output_ids"] for r in e.generate(input_ids=follow,
                                                             sampling_params=PARAMS)]
    wrote = _fill_store(mla_model, store, sessions)
    assert [s.history + [7, 8, 9, 10, 11] for s in sessions] == follow
    # Rank 0 wrote every page once; rank 1, holding the same latents, wrote none of them.
    assert wrote[0]["storage_backup_pages"] > 0 and wrote[1]["storage_backup_pages"] == 0
    assert wrote[1]["storage_backup_skipped_pages"] >= wrote[0]["storage_backup_pages"]
    files = [p for p in store.rglob("*") if p.is_file()]
    assert len(files) == wrote[0]["storage_backup_pages"]
    with Engine(**_args(mla_model, tp_size=2, **_l3(store))) as e:
        got = [r["output_ids"] for r in e.generate(input_ids=follow, sampling_params=PARAMS)]
        ranks = e.rank_cache_stats()
    assert got == expect_follow
    hit = ranks[0]["storage_hit_tokens"]
    assert hit > 0 and ranks[1]["storage_hit_tokens"] == hit
    assert all(r["storage"]["get_hits"] * PS >= hit for r in ranks)  # both read the one copy
    # One rank cannot read the shared pages: neither uses them.
    with Engine(**_args(mla_model, tp_size=2, **_l3(store, FAULTY, fault="raise"))) as e:
        got = [r["output_ids"] for r in e.generate(input_ids=follow, sampling_params=PARAMS)]
        ranks = e.rank_cache_stats()
    assert got == expect_follow
    assert ranks[0]["storage_hit_tokens"] == ranks[1]["storage_hit_tokens"] == 0
    assert ranks[1]["storage_errors"] > 0
    # And the whole workload, caching on, equals caching off at TP=1.
    with Engine(**_args(mla_model, tp_size=2, enable_hierarchical_cache=True,
                        max_total_tokens=512)) as e:
        assert run_sessions(e, sessions) == expect


@pytest.mark.gpu
@pytest.mark.skipif(not 0 < torch.cuda.device_count() < 2, reason="needs exactly one GPU")
def test_tp_on_too_few_gpus_is_refused_with_the_count(tiny_model: Path) -> None:
    """Two ranks on one GPU: a clear ConfigError before any rank starts (NCCL would refuse two
    ranks on one device, or rank 1 would ask for a cuda:1 that does not exist)."""
    from hicache_client.errors import ConfigError

    with pytest.raises(ConfigError, match=r"tp_size 2 needs 2 CUDA devices from cuda:0; 1 visible"):
        Engine(**{**_args(tiny_model, tp_size=2), "device": "cuda"})
