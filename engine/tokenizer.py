"""The tokenizer of a checkpoint (transformers `AutoTokenizer`), with chat templates and EOS ids."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache_client.errors import ConfigError

# What a tokenizer directory holds one of (fast, sentencepiece, or BPE vocabulary files).
_TOKENIZER_FILES = ("tokenizer*", "*.model", "vocab.*", "merges.txt")


def config_eos_ids(path: Path, model_dir: str | Path | None = None) -> set[int]:
    """EOS ids named by generation_config.json and config.json in `path` and `model_dir`."""
    ids: set[int] = set()
    for d in {path, Path(model_dir) if model_dir else path}:
        for name in ("generation_config.json", "config.json"):
            f = d / name
            if not f.is_file():
                continue
            eos = json.loads(f.read_text()).get("eos_token_id")
            if isinstance(eos, int):
                ids.add(eos)
            elif isinstance(eos, list):
                ids.update(int(e) for e in eos)
    return ids


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        """`path`: a tokenizer (or checkpoint) directory, or a demo name (`hicache-demo`,
        `hicache-demo-mla`: engine.demo_model.resolve_model_path)."""
        from transformers import AutoTokenizer

        from engine.demo_model import resolve_model_path

        path = resolve_model_path(path, what="tokenizer path")
        try:
            self.hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load a tokenizer from {path}: {e}") from e
        if Path(path).is_dir() and not any(
            any(Path(path).glob(pattern)) for pattern in _TOKENIZER_FILES
        ):  # transformers builds an empty tokenizer (no vocabulary) from a config alone
            raise ConfigError(f"no tokenizer files in {path}")
        self.path = Path(path)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def eos_token_ids(self, model_dir: str | Path | None = None) -> set[int]:
        """EOS ids from the tokenizer, generation_config.json and config.json."""
        ids = config_eos_ids(self.path, model_dir)
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        return ids

    def max_token_chars(self) -> int:
        """An upper bound on the characters of text one token stands for (vocabulary and added
        tokens), so that a text of C characters has at least C / max_token_chars() tokens.
        Four times the longest token when the tokenizer normalizes text (which may drop
        characters)."""
        longest = max((len(t) for t in self.hf.get_vocab()), default=1)
        backend = getattr(self.hf, "backend_tokenizer", None)
        normalizes = backend is None or getattr(backend, "normalizer", None) is not None
        return max(1, longest) * (4 if normalizes else 1)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=True))

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self.hf.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        add_generation_prompt: bool = True,
        tokenize: bool = True,
        **kwargs: Any,
    ) -> list[int] | str:
        if not getattr(self.hf, "chat_template", None):
            raise ConfigError(f"the tokenizer of {self.path} has no chat template")
        out: Any = self.hf.apply_chat_template(
            [dict(m) for m in messages],
            add_generation_prompt=add_generation_prompt,
            tokenize=tokenize,
            **kwargs,
        )
        if not tokenize:
            return str(out)
        if isinstance(out, Mapping) or hasattr(out, "input_ids"):  # BatchEncoding (transformers 5)
            out = out["input_ids"]
        return [int(t) for t in out]


class NoTokenizer:
    """The stand-in of an engine that has no tokenizer (`--load-format dummy` over a config
    alone): requests give token ids (`input_ids`), and outputs are token ids (their text is
    empty). Anything that needs text refuses with a `ConfigError` (a `ValueError`: a 400 over
    HTTP) saying so."""

    def __init__(self, path: str | Path, reason: str = "") -> None:
        self.path = Path(path)
        self.reason = reason

    def _refuse(self, what: str) -> ConfigError:
        return ConfigError(
            f"this engine has no tokenizer ({self.path} holds none; --load-format dummy): "
            f"{what}; send token ids (input_ids) instead"
        )

    @property
    def hf(self) -> Any:
        raise self._refuse("structured output needs one")

    @property
    def vocab_size(self) -> int:
        raise self._refuse("no vocabulary")

    def eos_token_ids(self, model_dir: str | Path | None = None) -> set[int]:
        """EOS ids from generation_config.json and config.json."""
        return config_eos_ids(self.path, model_dir)

    def max_token_chars(self) -> int:
        return 1

    def encode(self, text: str) -> list[int]:
        raise self._refuse("a text prompt cannot be tokenized")

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return ""

    def apply_chat_template(self, messages: Sequence[Mapping[str, Any]], **kwargs: Any) -> Any:
        raise self._refuse("chat messages cannot be tokenized")


def load_tokenizer(path: str | Path, *, optional: bool = False) -> Tokenizer | NoTokenizer:
    """The tokenizer at `path`; with `optional` (a dummy-weight model), a `NoTokenizer` when
    there is none."""
    try:
        return Tokenizer(path)
    except ConfigError as e:
        if not optional:
            raise
        return NoTokenizer(path, str(e))
