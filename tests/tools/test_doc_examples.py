"""docs/hitrate.md cannot drift: every `$ hicache-hitrate` block is run and its output compared
(only the timing line may differ, by its numbers), every other command shown must parse."""

from __future__ import annotations

from pathlib import Path

from tools.hitrate import doc_examples
from tools.hitrate.doc_examples import check, parse

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "hitrate.md"


def test_doc_examples_print_what_the_doc_shows() -> None:
    examples, others = parse(DOC.read_text())
    assert [ex.argv[0] for ex in examples] == [
        "plan",
        "traces/mooncake_conversation_trace.jsonl",
        "traces/mooncake_conversation_trace.jsonl",
        "traces/chat_example.jsonl",
    ]
    assert len(others) == 5  # the three commands at the top of the page, --model, a sweep
    assert all(ex.output for ex in examples)
    assert check(DOC) == []
    text = DOC.read_text()
    assert "/work/" not in text and "../shared" not in text and "/models/" not in text


CHAT = """# page

```
hicache-hitrate traces/chat_example.jsonl --tokenizer hicache-demo {flag}
```

```
$ hicache-hitrate traces/chat_example.jsonl --tokenizer hicache-demo --page-size 4 \\
      --device 64p --no-opt
{output}
```
"""


def test_checker_rewrites_then_accepts_then_catches_a_change(tmp_path: Path) -> None:
    doc = tmp_path / "page.md"
    doc.write_text(CHAT.format(flag="--no-opt", output="stale"))
    [problem] = check(doc)
    assert problem.startswith("$ hicache-hitrate traces/chat_example.jsonl --tokenizer hicache-demo")
    assert "-stale" in problem
    assert check(doc, write=True) == []
    written = doc.read_text()
    assert "prefill tokens saved: 132" in written and "stale" not in written
    assert check(doc) == []
    # One changed figure is caught ...
    doc.write_text(written.replace("prefill tokens saved: 132", "prefill tokens saved: 133"))
    [problem] = check(doc)
    assert "-prefill tokens saved: 133" in problem and "+prefill tokens saved: 132" in problem
    # ... and so is a command that does not parse.
    doc.write_text(written.replace("hicache-demo --no-opt", "hicache-demo --no-such-flag", 1))
    assert check(doc) == [
        "does not parse: hicache-hitrate traces/chat_example.jsonl --tokenizer hicache-demo "
        "--no-such-flag"
    ]


def test_timing_line_is_compared_by_shape_only() -> None:
    a = "read 0.72 s, replay 5.20 s (2,313 requests/s), analyses 1.89 s"
    b = "read 10.01 s, replay 0.00 s (12,964 requests/s), analyses 0.00 s"
    assert doc_examples._normal([a]) == doc_examples._normal([b])
    assert doc_examples._normal(["read 0.72 s, replay 5.20 s"]) == ["read 0.72 s, replay 5.20 s"]
    assert doc_examples._normal(["prefill tokens saved: 1"]) != doc_examples._normal(
        ["prefill tokens saved: 2"])
