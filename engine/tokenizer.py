"""The tokenizer of a checkpoint (transformers `AutoTokenizer`), with chat templates and EOS ids."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from hicache.errors import ConfigError


class Tokenizer:
    def __init__(self, path: str | Path) -> None:
        from transformers import AutoTokenizer

        try:
            self.hf = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise ConfigError(f"cannot load a tokenizer from {path}: {e}") from e
        self.path = Path(path)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def eos_token_ids(self, model_dir: str | Path | None = None) -> set[int]:
        """EOS ids from the tokenizer, generation_config.json and config.json."""
        ids: set[int] = set()
        if self.hf.eos_token_id is not None:
            ids.add(int(self.hf.eos_token_id))
        for d in {self.path, Path(model_dir) if model_dir else self.path}:
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
