"""Incremental detokenization and stop strings: token ids in, text increments out.

`TextStream` is the one owner of a request's output text. Each new token costs one decode of a
short window of ids (vLLM / SGLang's prefix and read offsets), never a decode of the whole
output, and the stop strings are searched only in the text that can still contain a new match.

How the window works: `ids[:read]` has been turned into committed text; `ids[prefix:read]` is a
few tokens of context in front of it (a decoder may need the previous token to place a leading
space). The text of the new tokens is `decode(ids[prefix:])` minus `decode(ids[prefix:read])`.
It is committed only when it does not end in U+FFFD: byte-level BPE splits multi-byte UTF-8
characters across tokens, and an unfinished character decodes as U+FFFD until its last byte
arrives. With a byte-level tokenizer the committed text plus the pending tail is exactly
`decode(ids)` at every step (tests/engine/test_detokenizer.py checks it against that quadratic
reference).

Stop strings: a match ends the text just before it (the stop string is not part of the output;
with `trim=False`, SGLang's `no_stop_trim`, the text ends with the token that completed it).
Text that may still become the start of a match (a suffix equal to a stop string's prefix) is
held back from `take()`, so a client never receives text that a later match removes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence  # noqa: F401

# decode(ids, skip_special_tokens) -> str
DecodeFn = Callable[[list[int], bool], str]

REPLACEMENT_CHAR = "\ufffd"


class TextStream:
    """The output text of one request, built token by token.

    Call `push(ids)` after each new token with the request's whole output ids (only a window is
    decoded); it returns the stop string that matched, or None. `finish()` releases the pending
    text when the request ends for another reason (EOS, length, abort). `take()` returns the text
    released since the previous call; `text` is all the released text.
    """

    def __init__(self, decode: DecodeFn, *, skip_special_tokens: bool = True,
                 stop: Sequence[str] = (), trim: bool = True) -> None:
        self._decode = decode
        self._trim = trim
        self._skip = skip_special_tokens
        self.stop = [s for s in stop if s]
        self._keep = max((len(s) for s in self.stop), default=1) - 1  # tail chars to keep
        self._prefix = 0  # window start (context tokens)
        self._read = 0  # ids[:read] are committed text
        self._before_len = 0  # len(decode(ids[prefix:read]))
        self._committed_len = 0
        self._tail = ""  # the last `_keep` committed characters (where a match may start)
        self._held = ""  # committed characters not released yet (a possible stop start)
        self._pending = ""  # text of ids[read:], not committed (may end in U+FFFD)
        self._released: list[str] = []  # every released piece
        self._untaken: list[str] = []  # released pieces not yet returned by take()
        self.matched: str | None = None
        self.finished = False

    # ---- the text ---------------------------------------------------------------------------

    @property
    def text(self) -> str:
        """All released text (the whole output once finished)."""
        if len(self._released) > 1:
            self._released[:] = ["".join(self._released)]
        return self._released[0] if self._released else ""

    def take(self) -> str:
        """The text released since the previous `take()`."""
        out = "".join(self._untaken)
        self._untaken.clear()
        return out

    def _release(self, piece: str) -> None:
        if piece:
            self._released.append(piece)
            self._untaken.append(piece)

    # ---- tokens in ----------------------------------------------------------------------------

    def push(self, ids: list[int], check_stop: bool = True) -> str | None:
        """Account for the tokens of `ids` beyond those already seen. Returns the stop string
        that ended the text (the stream is then finished), or None. `check_stop=False` for a
        token that ends the request anyway (EOS, a stop token id): no stop string is searched."""
        if self.finished:
            raise RuntimeError("push() after the stream finished")
        after = self._decode(ids[self._prefix :], self._skip)
        new = after[self._before_len :]
        if self.stop and check_stop:
            hit = self._find_stop(new)
            if hit is not None:
                cut, s = hit
                self._release((self._held + new)[:cut] if self._trim else self._held + new)
                self._held = self._pending = ""
                self.matched, self.finished = s, True
                return s
        if new and not new.endswith(REPLACEMENT_CHAR):
            self._commit(new, ids)
            self._pending = ""
        else:
            self._pending = new
        return None

    def finish(self) -> None:
        """The request ended without a stop string: release everything, including a trailing
        unfinished character (as a full decode shows it)."""
        if self.finished:
            return
        self._release(self._held + self._pending)
        self._held = self._pending = ""
        self.finished = True

    def _commit(self, new: str, ids: list[int]) -> None:
        self._committed_len += len(new)
        held = self._held + new
        if self._keep:
            self._tail = (self._tail + new)[-self._keep :]
        hold = self._hold_len()
        self._release(held[: len(held) - hold])
        self._held = held[len(held) - hold :]
        self._prefix, self._read = self._read, len(ids)
        self._before_len = len(self._decode(ids[self._prefix : self._read], self._skip))

    def _hold_len(self) -> int:
        """How many trailing committed characters could begin a stop string."""
        tail, hold = self._tail, 0
        for s in self.stop:
            for k in range(min(len(s) - 1, len(tail)), hold, -1):
                if tail.endswith(s[:k]):
                    hold = k
                    break
        return hold

    def _find_stop(self, new: str) -> tuple[int, str] | None:
        """The first stop string (in the caller's order) found in the committed text plus `new`,
        as the position to cut at relative to the held-back text, and the string. Only a match
        that ends in `new` is possible: the committed text had none (else the stream would have
        ended), so the search starts `len(s) - 1` characters before `new`."""
        region = self._tail + new
        for s in self.stop:
            idx = region.find(s, max(0, len(self._tail) - len(s) + 1))
            if idx >= 0:
                # region starts len(tail) chars before new; held text len(held) chars before.
                return idx - len(self._tail) + len(self._held), s
        return None
