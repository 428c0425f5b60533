"""A compiled scanner of Mooncake trace lines (`read_trace`'s fast path for a streamed block
trace): one pass over a chunk of whole lines, in bytes, for the strict common shape

    {"timestamp": INT, "input_length": INT, "output_length": INT, "hash_ids": [INT, ...]}

(the keys in any order, each at most once, `timestamp` optional, JSON whitespace anywhere, no
other key, integers of at most 18 digits without sign or leading zero) with `read_trace`'s
checks of the values (`Limits`, the block fit). A line of any other shape, or that fails a
check, is marked for the ordinary reader, which parses it again and gives its answer or its
exact error: the scanner only ever takes lines that reader would take the same way."""

from __future__ import annotations

import numpy as np
from numba import njit

OK, SLOW, BLANK = 0, 1, 2

_KEYS = (b"timestamp", b"input_length", b"output_length", b"hash_ids")


@njit(cache=True, inline="always")
def _ws(c):  # type: ignore[no-untyped-def]
    return c == 32 or c == 9 or c == 10 or c == 13


@njit(cache=True, inline="always")
def _past(buf, i, end, c):  # type: ignore[no-untyped-def]
    """The index after whitespace, the byte `c` and whitespace from i; -1 when `c` is not next."""
    while i < end and _ws(buf[i]):
        i += 1
    if i >= end or buf[i] != c:
        return -1
    i += 1
    while i < end and _ws(buf[i]):
        i += 1
    return i


@njit(cache=True, inline="always")
def _int_at(buf, i, end):  # type: ignore[no-untyped-def]
    """(value, next index), or (-1, i) when no JSON integer of <= 18 digits starts at i."""
    j = i
    v = 0
    while j < end and 48 <= buf[j] <= 57:
        v = v * 10 + (buf[j] - 48)
        j += 1
    n = j - i
    if n == 0 or n > 18 or (n > 1 and buf[i] == 48):
        return -1, i
    return v, j


@njit(cache=True)
def _key(buf, i, end):  # type: ignore[no-untyped-def]
    """Which key ('"' at i): 0 timestamp, 1 input_length, 2 output_length, 3 hash_ids, -1 none;
    and the index after its closing quote."""
    j = i + 1
    while j < end and buf[j] != 34:
        if buf[j] == 92:  # an escape: the ordinary reader decides
            return -1, j
        j += 1
    n = j - i - 1
    k = -1
    if n == 9 and buf[i + 1] == 116:  # timestamp
        k = 0
    elif n == 12 and buf[i + 1] == 105:  # input_length
        k = 1
    elif n == 13 and buf[i + 1] == 111:  # output_length
        k = 2
    elif n == 8 and buf[i + 1] == 104:  # hash_ids
        k = 3
    return k, j + 1


@njit(cache=True)
def scan_chunk(buf, keys, ids, meta, max_tokens, max_blocks, block_size, max_ts, max_line):  # type: ignore[no-untyped-def]
    """Scans `buf` (uint8, whole lines). Per line r: meta[r] = (status, line start, line end,
    first id in `ids`, id count, input_length, output_length, timestamp). Returns (lines, ids
    used); stops early (fewer lines) when `ids` or `meta` is full. `keys`: the four key names,
    concatenated (checked byte for byte)."""
    n = len(buf)
    r = 0
    nid = 0
    pos = 0
    koff = (0, 9, 21, 34)
    klen = (9, 12, 13, 8)
    while pos < n and r < len(meta):
        end = pos
        while end < n and buf[end] != 10:
            end += 1
        if nid + (end - pos) // 2 + 1 > len(ids):  # room for every id this line could hold
            break
        meta[r, 1] = pos
        meta[r, 2] = end
        status = 0
        i = pos
        if end - pos + 1 > max_line:  # too long (with its newline): the reader says so
            status = 1
            i = end
        while i < end and _ws(buf[i]):
            i += 1
        if status:
            pass
        elif i == end:
            status = 2
        elif buf[i] != 123:
            status = 1
        else:
            i += 1
            seen = 0
            ts = 0
            il = -1
            ol = -1
            first = nid
            cnt = 0
            closed = False
            while status == 0:
                while i < end and _ws(buf[i]):
                    i += 1
                if i < end and buf[i] == 125 and seen == 0:  # {}
                    closed = True
                    i += 1
                    break
                if i >= end or buf[i] != 34:
                    status = 1
                    break
                k, j = _key(buf, i, end)
                if k < 0 or (seen >> k) & 1:
                    status = 1
                    break
                for q in range(klen[k]):
                    if buf[i + 1 + q] != keys[koff[k] + q]:
                        status = 1
                if status:
                    break
                seen |= 1 << k
                i = j
                i = _past(buf, i, end, 58)  # ':'
                if i < 0:
                    status = 1
                    break
                if k < 3:
                    v, i2 = _int_at(buf, i, end)
                    if v < 0:
                        status = 1
                        break
                    i = i2
                    if k == 0:
                        ts = v
                    elif k == 1:
                        il = v
                    else:
                        ol = v
                else:
                    i = _past(buf, i, end, 91)  # '['
                    if i < 0:
                        status = 1
                        break
                    if i < end and buf[i] == 93:
                        i += 1
                    else:
                        while True:
                            v, i2 = _int_at(buf, i, end)
                            if v < 0:
                                status = 1
                                break
                            ids[nid] = v
                            nid += 1
                            cnt += 1
                            i = i2
                            while i < end and _ws(buf[i]):
                                i += 1
                            if i < end and buf[i] == 44:
                                i += 1
                                while i < end and _ws(buf[i]):
                                    i += 1
                                continue
                            if i < end and buf[i] == 93:
                                i += 1
                                break
                            status = 1
                            break
                        if status:
                            break
                while i < end and _ws(buf[i]):
                    i += 1
                if i < end and buf[i] == 44:
                    i += 1
                    continue
                if i < end and buf[i] == 125:
                    i += 1
                    closed = True
                    break
                status = 1
            if status == 0:
                while i < end and _ws(buf[i]):
                    i += 1
                if (not closed or i != end or (seen & 14) != 14 or il > max_tokens
                        or ol > max_tokens or cnt > max_blocks
                        or not (il == 0 or (block_size * (cnt - 1) < il <= block_size * cnt))
                        or not float(ts) * 1e-3 < max_ts):
                    status = 1
            if status:
                nid = first
            else:
                meta[r, 3] = first
                meta[r, 4] = cnt
                meta[r, 5] = il
                meta[r, 6] = ol
                meta[r, 7] = ts
        meta[r, 0] = status
        r += 1
        pos = end + 1
    return r, nid


KEYS = np.frombuffer(b"".join(_KEYS), np.uint8)
