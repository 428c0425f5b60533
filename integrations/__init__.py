"""Deprecated import paths of the SGLang and LMCache plugins, kept for one release.

The plugins live in the `hicache_client` package (the `hicache-client` distribution):
`hicache_client.sglang` and `hicache_client.lmcache`. `integrations.sglang` and
`integrations.lmcache` are aliases that warn once (`DeprecationWarning`) and re-export the same
objects; they ship in the main `hicache` distribution only and will be removed in 0.2.
"""

from __future__ import annotations

import warnings

_warned: set[str] = set()


def warn_moved(old: str, new: str) -> None:
    """Warn once per process that `old` is now `new`."""
    if old in _warned:
        return
    _warned.add(old)
    warnings.warn(
        f"{old} is deprecated and will be removed in hicache 0.2: name {new} instead "
        "(the same objects; see docs/sglang.md and docs/lmcache.md)",
        DeprecationWarning,
        stacklevel=3,
    )
