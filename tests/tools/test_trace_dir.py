"""`hicache-hitrate DIR`: a directory mixing formats (the repository's own traces/) is analysed
file by file as far as it can be, the rest skipped with a note naming each file and why; the
demo model's name works as --tokenizer and --model-path."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from tests.tools.conftest import REPO, mooncake_rows, write_jsonl
from tools.hitrate.cli import main

CHAT = REPO / "traces" / "chat_example.jsonl"
MOONCAKE = REPO / "traces" / "mooncake_conversation_trace.jsonl"


def run(capsys: pytest.CaptureFixture[str], argv: list[str]) -> tuple[int, dict, str]:
    rc = main([*argv, "--json", "--no-progress", "--no-opt"])
    out = capsys.readouterr()
    return rc, (json.loads(out.out) if rc == 0 else {}), out.err


def chats(folder: Path, *names: str) -> Path:
    """`folder` holding a copy of the chat example under each name."""
    folder.mkdir()
    for name in names:
        shutil.copy(CHAT, folder / name)
    return folder


def test_repository_traces_folder_skips_the_chat_trace(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rc, doc, _ = run(capsys, [str(REPO / "traces")])
    assert rc == 0
    assert doc["trace"]["format"] == "mooncake" and doc["trace"]["requests"] == 12031
    assert doc["trace"]["bad_lines"] == 0
    assert doc["config"]["replay_engine"] == "compiled"
    assert [n for n in doc["notes"] if not n.startswith("replayed by")] == [
        f"skipped {CHAT}: a chat trace needs --tokenizer DIR (the tokenizer of its model); "
        "analyse it on its own"
    ]


def test_folder_with_a_tokenizer_reads_the_chat_trace_and_skips_the_other_format(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    d = chats(tmp_path / "traces", "a_chat.jsonl", "b_chat.jsonl")
    write_jsonl(d / "c_blocks.jsonl", mooncake_rows([([0, 1], 0)], 16))
    rc, doc, _ = run(capsys, [str(d), "--tokenizer", "hicache-demo", "--page-size", "4"])
    assert rc == 0
    assert doc["trace"]["format"] == "chat" and doc["trace"]["requests"] == 12  # 6 + 6
    assert doc["notes"][0] == (f"skipped {d / 'c_blocks.jsonl'}: a mooncake trace, not chat "
                               "like the rest; analyse it on its own")
    # The same demo tokenizer by its directory gives the same figures.
    from engine.demo_model import ensure_demo_model

    rc, by_dir, _ = run(capsys, [str(d), "--tokenizer", str(ensure_demo_model()),
                                 "--page-size", "4"])
    assert rc == 0 and by_dir["result"] == doc["result"]


def test_folder_with_nothing_readable_is_an_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str],
) -> None:
    d = chats(tmp_path / "chats", "a.jsonl", "b.jsonl")
    rc, _, err = run(capsys, [str(d)])
    assert rc == 2
    assert err.startswith(f"hicache-hitrate: error: {d}: no usable trace file: skipped "
                          f"{d / 'a.jsonl'}: a chat trace needs --tokenizer DIR")
    # One file named on its own still says what it needs, at its first line.
    rc, _, err = run(capsys, [str(CHAT)])
    assert rc == 2 and "the chat format needs --tokenizer PATH" in err


def test_tokenizer_and_model_path_names(capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc, _ = run(capsys, [str(CHAT), "--tokenizer", "hicache-demo", "--model-path",
                              "hicache-demo", "--page-size", "4"])
    assert rc == 0
    assert doc["config"]["kv_bytes_per_token"] == 2 * 4 * 2 * 64 * 4  # float32 demo: 4096
    # A shipped config by name (the engine's --load-format dummy takes the same names).
    from tools.hitrate.sizes import kv_bytes_from_model

    assert kv_bytes_from_model("llama-3.1-8b") == 2 * 32 * 8 * 128 * 2  # bfloat16
    for flag in ("--tokenizer", "--model-path"):
        rc, _, err = run(capsys, [str(CHAT), flag, "no-such-model"])
        assert rc == 2
        assert err.startswith(f"hicache-hitrate: error: {flag} no-such-model: no such file or "
                              "directory (give a local Hugging Face checkpoint directory or GGUF "
                              "file, a model name: smollm2-135m-instruct, hicache-demo, "
                              "hicache-demo-mla")
