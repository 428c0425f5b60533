"""The TTFT cost model of `hicache-hitrate`: prefill seconds a hit saves against the seconds its
KV takes to arrive from host memory or storage (one formula for the report, sweeps and `plan`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Saving:
    prefill_s: float  # prefill seconds the hit tokens would have taken
    transfer_s: float  # seconds to move the host and storage hits to the device
    ttft_s: float  # prefill_s - transfer_s
    free_tiers: tuple[str, ...]  # tiers whose transfers were counted as free (no bandwidth)


def ttft_saved(
    device_tokens: float,
    host_tokens: float,
    storage_tokens: float,
    prefill_tokens_per_s: float,
    kv_bytes_per_token: float | None,
    host_bandwidth: float | None,
    storage_bandwidth: float | None,
    *,
    clamp: bool = False,
) -> Saving:
    """Prefill seconds saved by the hits minus the transfer seconds of the host and storage
    hits (`tokens * kv bytes / bandwidth`; a tier without a bandwidth or kv size is free).
    `clamp`: a tier whose transfer is slower than recomputing saves nothing instead of costing
    time (HiCache's cost model recomputes such a hit; `plan` counts it so)."""
    per_tok = 1.0 / prefill_tokens_per_s
    prefill = (device_tokens + host_tokens + storage_tokens) * per_tok
    transfer = 0.0
    free: list[str] = []
    saved = device_tokens * per_tok
    for tier, tokens, bw in (("host", host_tokens, host_bandwidth),
                             ("storage", storage_tokens, storage_bandwidth)):
        if not tokens:
            continue
        if not (bw and kv_bytes_per_token):
            free.append(tier)
            saved += tokens * per_tok
            continue
        move = tokens * kv_bytes_per_token / bw
        if clamp and move > tokens * per_tok:
            prefill -= tokens * per_tok  # recomputed: neither saved nor moved
            continue
        transfer += move
        saved += tokens * per_tok - move
    return Saving(prefill, transfer, saved, tuple(free))
