"""What the storage and integration benchmarks share: the folder a run works in, the host it ran
on, writing its JSON report, and the raw clients' `exists` count."""

from __future__ import annotations

import json
import os
import platform
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from itertools import takewhile
from pathlib import Path
from typing import Any


@contextmanager
def work_dir(path: str, prefix: str) -> Iterator[Path]:
    """`path` (made if missing), or with `path` empty a temporary folder removed at the end."""
    if path:
        Path(path).mkdir(parents=True, exist_ok=True)
        yield Path(path)
    else:
        with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
            yield Path(tmp)


def host() -> dict[str, Any]:
    """The machine a report's numbers come from."""
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpus": os.cpu_count()}


def save_json(out: str | Path, report: dict[str, Any], **dumps: Any) -> None:
    """Write `report` to `out` as JSON (its folder made if missing) and say where."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(out).write_text(json.dumps(report, indent=1, **dumps))
    print(f"wrote {out}")


def leading(found: Iterable[object]) -> int:
    """How many keys of a batch, from the first, are found (what `exists` returns), given
    whether each one is, in order; stops at the first miss."""
    return sum(1 for _ in takewhile(bool, found))
