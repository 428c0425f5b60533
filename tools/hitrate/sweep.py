"""Size lists and ranges for `--device/--host/--storage` (`8GiB,16GiB`, `4GiB:64GiB:x2`,
`1024p:8192p:+1024p`) and the sweep that replays every combination, for every eviction policy
given, through the real `HiRadixCache` (exact, one replay a point)."""

from __future__ import annotations

import itertools
from dataclasses import replace
from typing import Any

from hicache_client.errors import ConfigError
from tools.hitrate.arrays import PageArrays
from tools.hitrate.cost import ttft_saved
from tools.hitrate.simulate import TierConfig, replay_arrays
from tools.hitrate.sizes import parse_size

Spec = tuple[str, float] | None
MAX_POINTS = 10_000  # a range that would make more sizes than this is a typo


def _range(text: str, flag: str) -> list[Spec]:
    parts = text.split(":")
    if len(parts) != 3:
        raise ConfigError(f"{flag}: range {text!r} must be START:STOP:xFACTOR or START:STOP:+STEP")
    lo, hi = parse_size(parts[0]), parse_size(parts[1])
    if lo is None or hi is None or lo[0] != hi[0]:
        raise ConfigError(f"{flag}: range {text!r} needs two finite sizes in the same unit")
    unit, a, b = lo[0], lo[1], hi[1]
    step = parts[2].strip()
    out: list[Spec] = []
    if step[:1].lower() == "x":
        try:
            factor = float(step[1:])
        except ValueError:
            raise ConfigError(f"{flag}: bad factor {step!r} in {text!r}") from None
        if factor <= 1 or a <= 0:
            raise ConfigError(f"{flag}: {text!r} needs a factor > 1 and a start > 0")
        v = a
        while v <= b * (1 + 1e-9):
            out.append((unit, v))
            v *= factor
            if len(out) > MAX_POINTS:
                break
    elif step[:1] == "+":
        inc = parse_size(step[1:])
        if inc is None or inc[0] != unit or inc[1] <= 0:
            raise ConfigError(f"{flag}: step {step!r} in {text!r} must be a size > 0 in {unit}")
        v = a
        while v <= b * (1 + 1e-9):
            out.append((unit, v))
            v += inc[1]
            if len(out) > MAX_POINTS:
                break
    else:
        raise ConfigError(f"{flag}: step {step!r} in {text!r} must be xFACTOR or +STEP")
    if not out:
        raise ConfigError(f"{flag}: range {text!r} is empty (STOP below START)")
    if len(out) > MAX_POINTS:
        raise ConfigError(f"{flag}: range {text!r} makes more than {MAX_POINTS} sizes")
    return out


def parse_sizes(text: str, flag: str) -> list[Spec]:
    """`'8GiB,16GiB'`, `'4GiB:64GiB:x2'`, `'0,1024p:4096p:+1024p'` -> the sizes in order (each
    as `parse_size` returns it: (unit, value), or None for unbounded), duplicates dropped."""
    out: list[Spec] = []
    for item in text.split(","):
        item = item.strip()
        if not item:
            raise ConfigError(f"{flag}: empty size in {text!r}")
        try:
            specs = _range(item, flag) if ":" in item else [parse_size(item)]
        except ConfigError as e:
            raise ConfigError(str(e) if str(e).startswith(flag) else f"{flag}: {e}") from None
        for s in specs:
            if s not in out:
                out.append(s)
    return out


def run_sweep(
    arrs: PageArrays,
    base: TierConfig,
    grid: dict[str, list[int | None]],
    policies: list[str],
    *,
    kvb: float | None,
    prefill_tokens_per_s: float | None,
    host_bandwidth: float | None,
    storage_bandwidth: float | None,
    warmup: float = 0.0,
    progress: bool | None = None,
) -> list[dict[str, Any]]:
    """One exact replay per (policy, device, host, storage) point; rows in that order."""
    from tools.hitrate.simulate import _progress

    points = list(itertools.product(policies, grid["device"], grid["host"], grid["storage"]))
    bar = _progress(len(points), progress, "sweep")
    rows: list[dict[str, Any]] = []
    ps = base.page_size
    try:
        for policy, dev, host, sto in points:
            tiers = replace(base, eviction_policy=policy, device_pages=dev,
                            host_pages=host, storage_pages=sto)  # type: ignore[arg-type]
            sim = replay_arrays(arrs, tiers, progress=False, warmup=warmup)
            n_in = sim.input_tokens
            row: dict[str, Any] = {
                "eviction_policy": policy,
                "device_pages": dev,
                "host_pages": host,
                "storage_pages": sto,
                "device_bytes": None if dev is None or kvb is None else dev * ps * kvb,
                "host_bytes": None if host is None or kvb is None else host * ps * kvb,
                "storage_bytes": None if sto is None or kvb is None else sto * ps * kvb,
                "hit_tokens": sim.hit_tokens,
                "hit_rate": sim.hit_tokens / n_in if n_in else 0.0,
                "device_hit_tokens": sim.device_hit_tokens,
                "host_hit_tokens": sim.host_hit_tokens,
                "storage_hit_tokens": sim.storage_hit_tokens,
                "ttft_saved_seconds": None,
                "ttft_saved_per_request_seconds": None,
            }
            if prefill_tokens_per_s:
                sv = ttft_saved(sim.device_hit_tokens, sim.host_hit_tokens,
                                sim.storage_hit_tokens, prefill_tokens_per_s, kvb,
                                host_bandwidth, storage_bandwidth)
                row["ttft_saved_seconds"] = sv.ttft_s
                row["ttft_saved_per_request_seconds"] = sv.ttft_s / max(1, sim.requests)
            rows.append(row)
            if bar is not None:
                bar.update(1)
    finally:
        if bar is not None:
            bar.close()
    return rows

