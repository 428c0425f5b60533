"""`hicache-hitrate`: cache hit-rate analysis of request traces, driving the real `HiRadixCache`
in simulated mode. Entry point: `tools.hitrate.cli:main`."""
