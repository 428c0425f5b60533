"""A directory of traces as `hicache-hitrate DIR` reads it: the files of one format, the others
skipped with a note saying why (a chat / completion trace without `--tokenizer`, or a trace of
another format than the first usable file's), instead of stopping on the first such line.

One replay is one workload: files of different formats (block traces of different block sizes,
token traces of different tokenizers) are not merged, and a chat trace is never tokenized with a
tokenizer the user did not name (its hit rate depends on the model's tokenizer).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tools.hitrate.traces import Limits, Trace, TraceError, _iter_lines, detect_format, read_trace


def _first_record(path: Path, limits: Limits) -> Any:
    """The first line of `path` that parses as JSON, or None."""
    for _, line in _iter_lines(path, limits.max_line_bytes):
        if isinstance(line, str):
            try:
                return json.loads(line)
            except (ValueError, RecursionError):
                continue
    return None


def _needs_tokenizer(fmt: str, record: dict[str, Any]) -> bool:
    return fmt == "chat" or (fmt == "completion" and isinstance(record.get("prompt"), str))


def read_path(
    path: str | Path, fmt: str = "auto", *, tokenizer: Any | None = None,
    limits: Limits | None = None, **kw: Any,
) -> tuple[Trace, list[str]]:
    """`read_trace` of a file, or of a directory's usable files; also a note per skipped file."""
    path, limits = Path(path), limits or Limits()
    files = []
    if path.is_dir():
        files = sorted(path.glob("lookup_hashes_*.jsonl")) or sorted(path.glob("*.jsonl"))
    if len(files) < 2:  # one file: its errors are the user's to see
        return read_trace(path, fmt, tokenizer=tokenizer, limits=limits, **kw), []
    kept: list[Path] = []
    notes: list[str] = []
    chosen = None if fmt == "auto" else fmt
    for f in files:
        record = _first_record(f, limits)
        found = detect_format(record)
        why = None
        if found is not None and tokenizer is None and _needs_tokenizer(found, record):
            why = f"a {found} trace needs --tokenizer DIR (the tokenizer of its model)"
        elif found is not None and chosen is not None and found != chosen:
            why = f"a {found} trace, not {chosen} like the rest"
        if why:
            notes.append(f"skipped {f}: {why}; analyse it on its own")
            continue
        chosen = chosen or found
        kept.append(f)
    if not kept:
        raise TraceError(path, None, "no usable trace file: " + "; ".join(notes))
    return read_trace(path, fmt, tokenizer=tokenizer, limits=limits, files=kept, **kw), notes
