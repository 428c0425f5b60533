"""`hicache-hitrate` end to end: flags, JSON keys, plot, bad input, the reference figure."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.tools.conftest import REPO, mooncake_rows, write_jsonl
from tools.hitrate.cli import build_parser, main
from tools.hitrate.sizes import kv_bytes_from_model, parse_size

FLAGS = [
    "--format",
    "--block-size",
    "--tokenizer",
    "--limit",
    "--skip-bad-lines",
    "--max-request-tokens",
    "--max-line-bytes",
    "--ignore-output",
    "--page-size",
    "--device",
    "--host",
    "--storage",
    "--kv-bytes-per-token",
    "--codec",
    "--codec-ratio",
    "--model-path",
    "--model",
    "--kv-dtype",
    "--tp",
    "--eviction-policy",
    "--eviction-policy-config",
    "--write-policy",
    "--admission",
    "--prefetch-policy",
    "--prefetch-threshold",
    "--load-back-threshold",
    "--mrc",
    "--mrc-points",
    "--sample",
    "--sample-check",
    "--target",
    "--no-opt",
    "--warmup",
    "--prefill-tokens-per-s",
    "--host-bandwidth",
    "--storage-bandwidth",
    "--json",
    "--plot",
    "--no-progress",
    "--replay-mode",
    "--replay-engine",
    "--verbose",
]

TOP_KEYS = [
    "schema",
    "trace",
    "config",
    "result",
    "unbounded",
    "opt",
    "savings",
    "reuse_distance",
    "sharing",
    "mrc",
    "sweep",
    "engine",
    "timing",
    "notes",
]


@pytest.fixture
def small(tmp_path: Path) -> Path:
    reqs = [([0, 1], 0), ([0, 2], 0), ([0, 1, 3], 0), ([0, 2], 20), ([0, 1, 3, 4], 0)]
    return write_jsonl(tmp_path / "small.jsonl", mooncake_rows(reqs, 16, output=3))


def run_json(capsys: pytest.CaptureFixture[str], argv: list[str]) -> dict:
    assert main([*argv, "--json", "--no-progress"]) == 0
    return json.loads(capsys.readouterr().out)


def test_help_mentions_every_flag(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        main(["--help"])
    assert e.value.code == 0
    text = capsys.readouterr().out
    parser_flags = {s for a in build_parser()._actions for s in a.option_strings if s[:2] == "--"}
    assert set(FLAGS) | {"--help"} == parser_flags
    for flag in FLAGS:
        assert flag in text, flag


def test_docs_describe_every_flag() -> None:
    doc = (REPO / "docs" / "hitrate.md").read_text()
    for flag in FLAGS:
        assert f"`{flag}" in doc, flag


def test_parse_size() -> None:
    assert parse_size("2GiB") == ("bytes", 2 * 2**30)
    assert parse_size("500MB") == ("bytes", 500e6)
    assert parse_size("4096") == ("tokens", 4096)
    assert parse_size("2M") == ("tokens", 2e6)
    assert parse_size("64p") == ("pages", 64)
    assert parse_size("unbounded") is None
    with pytest.raises(ValueError, match="bad size"):
        parse_size("lots")


def test_kv_bytes_from_model(tmp_path: Path) -> None:
    cfg = {
        "num_hidden_layers": 28,
        "num_attention_heads": 16,
        "num_key_value_heads": 8,
        "hidden_size": 2048,
        "head_dim": 128,
        "torch_dtype": "bfloat16",
    }
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    assert kv_bytes_from_model(str(tmp_path)) == 2 * 28 * 8 * 128 * 2
    assert kv_bytes_from_model(str(tmp_path), "float8_e4m3fn") == 2 * 28 * 8 * 128
    # MLA (DeepSeek-V3's shape): one 512 + 64 latent per token and layer, whatever the heads.
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "deepseek_v3", "num_hidden_layers": 61, "num_attention_heads": 128,
        "num_key_value_heads": 128, "hidden_size": 7168, "kv_lora_rank": 512,
        "qk_rope_head_dim": 64, "torch_dtype": "bfloat16"}))
    assert kv_bytes_from_model(str(tmp_path)) == 61 * (512 + 64) * 2


def test_json_keys_and_values(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    doc = run_json(
        capsys,
        [
            str(small),
            "--block-size",
            "16",
            "--device",
            "4p",
            "--mrc",
            "--target",
            "0.2",
            "--prefill-tokens-per-s",
            "1000",
        ],
    )
    assert list(doc) == TOP_KEYS
    assert doc["schema"] == "hicache-hitrate/1"
    res = doc["result"]
    for k in [
        "requests",
        "input_tokens",
        "hit_tokens",
        "miss_tokens",
        "hit_rate",
        "device_hit_tokens",
        "host_hit_tokens",
        "storage_hit_tokens",
        "device_hit_rate",
        "host_hit_rate",
        "storage_hit_rate",
        "hit_requests",
        "request_hit_rate",
        "capped_tokens",
        "cache_stats",
    ]:
        assert k in res, k
    assert res["requests"] == 5 and res["input_tokens"] == 32 + 32 + 48 + 20 + 64
    assert doc["config"]["device_pages"] == 4 and doc["config"]["page_size"] == 16
    assert set(doc["unbounded"]) == {
        "hit_tokens",
        "hit_rate",
        "hit_requests",
        "request_hit_rate",
        "pages",
    }
    assert doc["unbounded"]["hit_tokens"] == 16 + 32 + 20 + 48  # r3 is capped at its 20 tokens
    assert doc["opt"]["capacity_pages"] == 4
    assert res["hit_tokens"] <= doc["opt"]["hit_tokens"] <= doc["unbounded"]["hit_tokens"]
    assert doc["savings"]["prefill_seconds_saved"] == res["hit_tokens"] / 1000
    pts = doc["mrc"]["points"]
    assert set(pts[0]) == {
        "capacity_pages",
        "capacity_tokens",
        "capacity_bytes",
        "hit_tokens",
        "hit_rate",
        "miss_ratio",
        "request_hit_rate",
    }
    assert [p["hit_tokens"] for p in pts] == sorted(p["hit_tokens"] for p in pts)
    assert pts[-1]["hit_tokens"] == doc["unbounded"]["hit_tokens"]
    tg = doc["mrc"]["target"]
    assert tg["hit_rate"] == 0.2 and tg["capacity_pages"] is not None
    assert set(doc["sharing"]) >= {"shared_prefix_tokens", "shared_prefix_ratio"}


def test_bytes_need_kv_size(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(small), "--block-size", "16", "--device", "1GiB"]) == 2
    assert "--kv-bytes-per-token" in capsys.readouterr().err
    doc = run_json(
        capsys,
        [str(small), "--block-size", "16", "--device", "64KiB", "--kv-bytes-per-token", "1024"],
    )
    assert doc["config"]["device_pages"] == 4  # 64 tokens of 1 KiB = 4 pages of 16


def test_plot_writes_png(small: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "hr.png"
    assert (
        main(
            [
                str(small),
                "--block-size",
                "16",
                "--device",
                "4p",
                "--host",
                "8p",
                "--plot",
                str(out),
                "--no-progress",
            ]
        )
        == 0
    )
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "hit (all tiers)" in capsys.readouterr().out


def test_malformed_line_exit_2(tmp_path: Path) -> None:
    rows: list = mooncake_rows([([0], 0), ([0, 1], 0)], 16)
    rows.insert(1, "{not json")
    p = write_jsonl(tmp_path / "bad.jsonl", rows)
    proc = subprocess.run(
        [sys.executable, "-m", "tools.hitrate.cli", str(p), "--block-size", "16"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert f"{p}:2: malformed JSON" in proc.stderr
    proc = subprocess.run(
        [sys.executable, "-m", "tools.hitrate.cli", str(tmp_path / "missing.jsonl")],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "missing.jsonl: no such file" in proc.stderr


def test_default_command_imports_no_torch_nor_engine(mooncake_trace: Path) -> None:
    """A whole default run (device-only LRU: the compiled replay, the curve, OPT) loads neither
    torch nor the engine nor HiRadixCache: checked at the end of the run, not at start-up."""
    code = ("import sys, io, contextlib\n"
            "from tools.hitrate.cli import main\n"
            "with contextlib.redirect_stdout(io.StringIO()):\n"
            f"    rc = main([{str(mooncake_trace)!r}, '--device', '2000p', '--mrc', "
            "'--mrc-points', '15', '--json', '--limit', '2000'])\n"
            "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', "
            "'transformers') or m == 'hicache.hiradix')\n"
            "print(rc, bad)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=300)
    assert proc.stdout.strip() == "0 []", proc.stderr


def test_skip_bad_lines(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rows: list = mooncake_rows([([0], 0), ([0, 1], 0), ([0, 1], 0)], 16)
    rows.insert(1, "{not json")
    rows.insert(3, json.dumps({"input_ids": [1, 2]}))
    p = write_jsonl(tmp_path / "bad.jsonl", rows)
    doc = run_json(capsys, [str(p), "--block-size", "16", "--skip-bad-lines"])
    assert doc["trace"]["bad_lines"] == 2 and doc["trace"]["bad_line_numbers"] == [2, 4]
    assert doc["result"]["requests"] == 3
    assert main([str(p), "--block-size", "16", "--skip-bad-lines", "--no-progress"]) == 0
    assert "skipped 2 bad lines" in capsys.readouterr().out


def test_bad_options_exit_2(small: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(small), "--block-size", "16", "--eviction-policy", "nope"]) == 2
    assert "unknown eviction policy 'nope'" in capsys.readouterr().err
    assert main([str(small), "--block-size", "16", "--page-size", "5"]) == 2
    assert "must divide" in capsys.readouterr().err


@pytest.mark.slow
def test_reference_figure_with_unbounded_storage(
    mooncake_trace: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """The README's 0.374, through the real HiRadixCache with a bounded device and host and
    unbounded storage."""
    doc = run_json(
        capsys,
        [
            str(mooncake_trace),
            "--device",
            "4096p",
            "--host",
            "16384p",
            "--storage",
            "unbounded",
            "--no-opt",
        ],
    )
    assert doc["result"]["requests"] == 12031
    assert round(doc["result"]["hit_rate"], 3) == 0.374
    assert doc["result"]["hit_tokens"] == doc["unbounded"]["hit_tokens"]
    assert doc["result"]["storage_hit_tokens"] > 0 and doc["result"]["host_hit_tokens"] > 0


def test_chat_trace_with_tokenizer(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from tests.tools.test_traces import _tiny_tokenizer

    tok = _tiny_tokenizer(tmp_path / "tok")
    msgs = [{"role": "user", "content": "hello world hello world again"}]
    rows = [
        {"model": "m", "messages": msgs, "max_tokens": 2},
        {"model": "m", "messages": [*msgs, {"role": "assistant", "content": "again"}]},
    ]
    p = write_jsonl(tmp_path / "chat.jsonl", rows)
    doc = run_json(capsys, [str(p), "--tokenizer", str(tok), "--page-size", "2"])
    assert doc["trace"]["format"] == "chat" and doc["config"]["page_size"] == 2
    # prompt 1: <s> user : hello world hello world again assistant : (10 tokens); prompt 2 is
    # the same 10 tokens, then again assistant : (13). Request 1 cached its 10 prompt tokens
    # (5 pages; its 2 output tokens are unique), so request 2 hits 10.
    assert doc["result"]["input_tokens"] == 10 + 13
    assert doc["result"]["hit_tokens"] == 10
    assert any("max_tokens unique tokens" in n for n in doc["notes"])


def test_lmcache_log_gives_bytes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    row = {"chunk_size": 16, "seq_len": 40, "dtypes": ["bfloat16"], "shapes": [[2, 2, 16, 4]]}
    rows = [{**row, "timestamp": float(i), "chunk_hashes": ["0xa", "0xb"]} for i in range(3)]
    p = write_jsonl(tmp_path / "lookup_hashes_0.jsonl", rows)
    doc = run_json(capsys, [str(p), "--device", "1KiB"])
    assert doc["config"]["kv_bytes_per_token"] == 2 * 2 * 4 * 2  # 32 bytes a token
    assert doc["config"]["device_pages"] == 2  # 1 KiB = 32 tokens = 2 pages of 16
    assert doc["result"]["hit_tokens"] == 2 * 32  # full chunks only; the 8-token tail never hits


def test_sample_prints_the_curve_and_its_error(small: Path, capsys: pytest.CaptureFixture[str],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """--sample gives the sampled curve alone (no replay, no exact analyses) with the error
    measured on the validation slice; at rate 1 it is the exact curve."""
    monkeypatch.setenv("COLUMNS", "400")  # the report wraps at the terminal's width
    exact = run_json(capsys, [str(small), "--block-size", "16", "--mrc"])
    doc = run_json(capsys, [str(small), "--block-size", "16", "--sample", "1"])
    for key in ("result", "unbounded", "opt", "savings", "reuse_distance", "sharing"):
        assert doc[key] is None, key
    sample = doc["mrc"]["sample"]
    assert sample["rate"] == 1.0 and sample["sampled_page_refs"] == sample["page_refs"] == 13
    assert sample["streamed"] and sample["check"]["whole_trace"]
    assert sample["check"]["requests"] == 5 and sample["check"]["max_abs_error"] == 0.0
    want = {p["capacity_pages"]: p["hit_rate"] for p in exact["mrc"]["points"]}
    for p in doc["mrc"]["points"]:
        assert p["hit_rate"] == pytest.approx(want[p["capacity_pages"]], abs=1e-12)
        assert p["check_exact_hit_rate"] == pytest.approx(p["hit_rate"], abs=1e-12)
        assert p["request_hit_rate"] is None
    assert main([str(small), "--block-size", "16", "--sample", "0.5", "--sample-check", "2",
                 "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "sampled at 0.5" in out and "error measured on the first 2 of 5 requests" in out
    doc = run_json(capsys, [str(small), "--block-size", "16", "--sample", "0.5",
                            "--sample-check", "0"])
    assert doc["mrc"]["sample"]["check"] is None
    assert main([str(small), "--sample", "0", "--no-progress"]) == 2
    assert "--sample must be a rate in (0, 1]" in capsys.readouterr().err
    assert main([str(small), "--sample", "0.5", "--device", "1p,2p", "--no-progress"]) == 2
    assert "--sample estimates the LRU curve only" in capsys.readouterr().err
    assert main([str(small), "--sample", "0.5", "--sample-check", "x", "--no-progress"]) == 2
    assert "--sample-check must be" in capsys.readouterr().err


def test_sample_stops_at_the_first_bad_line(small: Path,
                                            capsys: pytest.CaptureFixture[str]) -> None:
    """The sampled read is the same stream: a bad line stops it with its number."""
    rows = small.read_text().splitlines()
    bad = small.with_name("bad.jsonl")
    bad.write_text("\n".join([*rows[:3], '{"timestamp": 9, "input_length": 16, '
                              '"output_length": 1, "hash_ids": [1, -2]}', *rows[3:]]) + "\n")
    assert main([str(bad), "--block-size", "16", "--sample", "0.5", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl:4:" in err and "non-negative integers" in err
    doc = run_json(capsys, [str(bad), "--block-size", "16", "--sample", "1",
                            "--skip-bad-lines"])
    assert doc["trace"]["bad_lines"] == 1 and doc["trace"]["bad_line_numbers"] == [4]


def test_sample_of_an_lmcache_log_reads_it_whole(tmp_path: Path,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """An LMCache log (replayed in timestamp order) is read into arrays and sampled from them;
    its error is measured against the exact curve of the whole trace."""
    rows = [{"timestamp": float(5 - i), "chunk_size": 16, "seq_len": 48,
             "chunk_hashes": ["0xa", f"0x{i % 2}", "0xc"]} for i in range(6)]
    p = write_jsonl(tmp_path / "lookup_hashes_0.jsonl", rows)
    doc = run_json(capsys, [str(p), "--sample", "1"])
    smp = doc["mrc"]["sample"]
    assert not smp["streamed"] and smp["check"]["whole_trace"]
    assert smp["check"]["max_abs_error"] == 0.0 and smp["sampled_page_refs"] == 18
    assert any("read whole" in n for n in doc["notes"])


@pytest.mark.parametrize("device", ["unbounded", "3p", "40"])
def test_compiled_replay_engine_equals_hiradix(small: Path, device: str,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """--replay-engine compiled (what 'auto' picks for a device-only LRU at any size) gives the
    HiRadixCache replay's numbers; a configuration it does not model is refused, and auto
    falls back to HiRadixCache there with the reason."""
    argv = [str(small), "--block-size", "16", "--page-size", "4", "--device", device]
    real = run_json(capsys, [*argv, "--replay-engine", "hiradix"])["result"]
    comp = run_json(capsys, [*argv, "--replay-engine", "compiled"])
    for key in ("requests", "input_tokens", "hit_tokens", "device_hit_tokens", "hit_requests",
                "capped_tokens"):
        assert comp["result"][key] == real[key], key
    assert comp["result"]["cache_stats"]["evicted_tokens"] == real["cache_stats"]["evicted_tokens"]
    assert any("compiled device-only LRU" in n for n in comp["notes"])
    auto = run_json(capsys, argv)
    assert auto["config"]["replay_engine"] == "compiled" and auto["result"] == comp["result"]
    assert main([*argv, "--host", "8p", "--replay-engine", "compiled", "--no-progress"]) == 2
    assert "not exact for this configuration (a host tier (--host))" in capsys.readouterr().err
    fell = run_json(capsys, [*argv, "--host", "8p"])
    assert fell["config"]["replay_engine"] == "hiradix"
    assert any("not exact here (a host tier (--host))" in n for n in fell["notes"])
