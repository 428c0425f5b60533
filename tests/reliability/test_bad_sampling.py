"""Extreme but well-typed sampling values must be refused (a 400 over HTTP) or served, never
crash the scheduler step (which, in `hicache-engine`, ends the scheduler process). Found by the
HTTP fuzz test of test_http.py (a subnormal temperature, NaN, a top_p below float32's
resolution made torch.multinomial raise), fixed in engine/sampling.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from engine.engine import Engine
from tests.reliability.conftest import SAMPLING, engine_kwargs


@pytest.mark.parametrize("params", [{"temperature": 1e-300}, {"temperature": 5e-324},
                                    {"temperature": float("nan")},
                                    {"temperature": 1.0, "top_p": 1e-300}],
                         ids=["temperature-1e-300", "temperature-subnormal", "temperature-nan",
                              "top_p-1e-300"])
def test_extreme_sampling_values_never_crash_a_step(tiny_model: Path,
                                                     params: dict[str, Any]) -> None:
    with Engine(**engine_kwargs(tiny_model)) as engine:
        try:
            out = engine.generate(input_ids=[5, 6, 7, 8],
                                  sampling_params={**params, "max_new_tokens": 2})
            assert len(out[0]["output_ids"]) == 2
        except ValueError:
            pass  # refused up front (ConfigError is a ValueError): a 400 over HTTP
        out = engine.generate(input_ids=[5, 6, 7, 8], sampling_params=SAMPLING)
        assert len(out[0]["output_ids"]) == SAMPLING["max_new_tokens"]
