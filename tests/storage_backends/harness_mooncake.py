"""Contract harness for `mooncake`: a real `mooncake_master` plus a helper store client (its own
process) that contributes the memory segment; every backend object the suite makes is a further
store client in the test process, with no segment of its own.

Runs only inside a loopback-only network namespace (Mooncake binds every interface).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.storage_backends.harness import BackendFactory, Harness, closing_factory, config
from tests.storage_backends.mooncake_procs import (
    SegmentHolder,
    client_config,
    mooncake_master,
    skip_reason,
)

# The helper's segment: far more than the suite stores, so nothing is evicted under it.
SEGMENT_BYTES = 256 << 20


@contextmanager
def _start(tmp: Path) -> Iterator[BackendFactory]:
    from storage_backends.mooncake_backend import MooncakeBackend

    with (
        mooncake_master(tmp) as master,
        SegmentHolder(master, SEGMENT_BYTES, tmp),
        closing_factory(
            lambda **extra: MooncakeBackend(config(client_config(master, 0, **extra)))
        ) as f,
    ):
        yield f


HARNESS = Harness(name="mooncake", start=_start, marks=[pytest.mark.mooncake],
                  skip_reason=skip_reason)
