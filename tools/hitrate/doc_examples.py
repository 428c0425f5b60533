"""The examples of docs/hitrate.md, run: every fenced block that starts with `$ hicache-hitrate`
is a command and what it prints, and this module checks (or rewrites) the printed part.

    python -m tools.hitrate.doc_examples            # check: exit 1 and a diff when they differ
    python -m tools.hitrate.doc_examples --write    # rewrite the output blocks from a run

Commands run from the repository root as a user runs them there: in a scratch directory that
holds `traces/` (a link to the repository's), so relative paths in the commands and in their
output are the same as on a fresh clone (`hicache-demo` names the engine's demo checkpoint).
Output is captured at 80 columns (`COLUMNS=80`, what `rich` prints into a pipe). The one line allowed to differ is the timing line
(`read X s, replay Y s (Z requests/s), analyses W s`): it is compared by its shape, not its
numbers. Every other `hicache-hitrate` command line in the page must parse.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import io
import os
import re
import shlex
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "hitrate.md"
PROMPT = "$ hicache-hitrate "
COLUMNS = 80
TIMING = re.compile(
    r"^read \d+\.\d\d s, replay \d+\.\d\d s \([\d,]+ requests/s\), analyses \d+\.\d\d s$"
)
TIMING_PLACEHOLDER = "read <s> s, replay <s> s (<n> requests/s), analyses <s> s"


@dataclass
class Example:
    start: int  # index of the command's first line in the document's lines
    end: int  # index one past the block's last output line (the closing fence)
    command: list[str]  # the command's lines, as written
    argv: list[str]  # arguments after `hicache-hitrate`
    output: list[str]  # the documented output lines


def _blocks(lines: list[str]) -> Iterator[tuple[int, int]]:
    """(first line, closing fence) of each fenced block."""
    i = 0
    while i < len(lines):
        if lines[i].startswith("```"):
            j = i + 1
            while j < len(lines) and not lines[j].startswith("```"):
                j += 1
            yield i + 1, j
            i = j
        i += 1


def _join(cmd_lines: list[str]) -> list[str]:
    text = " ".join(line.rstrip().removesuffix("\\") for line in cmd_lines)
    text = text.split("  #", 1)[0]  # a trailing comment
    argv = shlex.split(text)
    if ">" in argv:
        argv = argv[: argv.index(">")]
    return argv


def parse(text: str) -> tuple[list[Example], list[list[str]]]:
    """The runnable examples, and the argv of every other `hicache-hitrate` command shown."""
    lines = text.split("\n")
    examples: list[Example] = []
    others: list[list[str]] = []
    for first, fence in _blocks(lines):
        body = lines[first:fence]
        if body and body[0].startswith(PROMPT):
            n = 1
            while n < len(body) and body[n - 1].rstrip().endswith("\\"):
                n += 1
            argv = _join(body[:n])[2:]
            examples.append(Example(first, fence, body[:n], argv, body[n:]))
            continue
        k = 0
        while k < len(body):
            if body[k].startswith("hicache-hitrate "):
                n = k + 1
                while n < len(body) and body[n - 1].rstrip().endswith("\\"):
                    n += 1
                others.append(_join(body[k:n])[1:])
                k = n
            else:
                k += 1
    return examples, others


@contextlib.contextmanager
def _scratch() -> Iterator[Path]:
    """A directory that looks like the repository root to the commands."""
    with tempfile.TemporaryDirectory(prefix="hitrate-doc-") as d:
        root = Path(d)
        (root / "traces").symlink_to(REPO / "traces")
        old_cwd, old_cols = os.getcwd(), os.environ.get("COLUMNS")
        os.chdir(root)
        os.environ["COLUMNS"] = str(COLUMNS)
        try:
            yield root
        finally:
            os.chdir(old_cwd)
            if old_cols is None:
                os.environ.pop("COLUMNS", None)
            else:
                os.environ["COLUMNS"] = old_cols


def run(argv: list[str]) -> list[str]:
    """What `hicache-hitrate ARGV` prints on stdout (lines, trailing blanks stripped); in the
    scratch directory of `_scratch`."""
    from tools.hitrate.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main(argv)
    if rc != 0:
        raise RuntimeError(f"hicache-hitrate {shlex.join(argv)}: exit {rc}: {err.getvalue()}")
    return [line.rstrip() for line in out.getvalue().rstrip("\n").split("\n")]


def _normal(lines: list[str]) -> list[str]:
    return [TIMING_PLACEHOLDER if TIMING.match(line) else line for line in lines]


def check(doc: Path = DOC, write: bool = False) -> list[str]:
    """Diffs between the documented and the printed output, one string per example that
    differs ([] when all match); with `write`, the document is rewritten with the printed
    output first (and [] returned)."""
    from tools.hitrate.cli import build_parser

    text = doc.read_text()
    examples, others = parse(text)
    parser = build_parser()
    problems = []
    from tools.hitrate.plan import build_plan_parser

    for argv in others:
        try:
            with contextlib.redirect_stderr(io.StringIO()):
                if argv[:1] == ["plan"]:
                    build_plan_parser().parse_args(argv[1:])
                else:
                    parser.parse_args(argv)
        except SystemExit:
            problems.append(f"does not parse: hicache-hitrate {shlex.join(argv)}")
    lines = text.split("\n")
    with _scratch():
        printed = [run(ex.argv) for ex in examples]
    if write:
        for ex, out in reversed(list(zip(examples, printed))):
            lines[ex.start + len(ex.command) : ex.end] = out
        doc.write_text("\n".join(lines))
        return problems
    for ex, out in zip(examples, printed):
        want, got = _normal(ex.output), _normal(out)
        if want != got:
            diff = difflib.unified_diff(want, got, "documented", "printed", lineterm="", n=1)
            problems.append(f"$ hicache-hitrate {shlex.join(ex.argv)}\n" + "\n".join(diff))
    return problems


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("doc", nargs="?", default=str(DOC), help="the page (default docs/hitrate.md)")
    p.add_argument("--write", action="store_true", help="rewrite the output blocks")
    args = p.parse_args(argv)
    problems = check(Path(args.doc), write=args.write)
    for prob in problems:
        print(prob, end="\n\n")
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
