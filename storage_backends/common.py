"""Helpers shared by the L3 backends: backoff / circuit breaking, config look-ups, small utilities.

`Backoff` is the piece every networked backend needs. Wrap each batch operation like this::

    self._backoff = Backoff("redis", initial_s=0.1, max_s=5.0)

    def batch_exists(self, keys):
        try:
            self._backoff.check()          # raises StorageUnavailable while "down"
            n = self._do_exists(keys)      # the real round trip
        except (ConnectionError, TimeoutError) as e:
            self._backoff.failure(e)       # opens the breaker, schedules the next try
            ...                            # count the error, degrade to "miss"
        else:
            self._backoff.success()        # closes the breaker, resets the delay

While the breaker is open every call fails fast (no connection attempt, no timeout wait), so a
dead server costs the caller nothing after the first failure. Once the delay has passed, exactly
one caller at a time is let through as a probe ("half-open"); its success closes the breaker,
its failure doubles the delay (up to `max_s`, with jitter).
"""

from __future__ import annotations

import functools
import logging
import os
import random
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, TypeVar

from hicache.errors import ConfigError, StorageUnavailable
from hicache.storage import StorageConfig

logger = logging.getLogger(__name__)

T = TypeVar("T")


class Backoff:
    """Exponential backoff with a circuit breaker, thread-safe.

    States: *closed* (healthy: every call goes through), *open* (down: `check()` raises
    `StorageUnavailable` until `retry_at`), *half-open* (the delay has passed: one probe call
    goes through, others still fail fast until the probe reports `success()` or `failure()`).

    `initial_s` is the first delay after a failure, multiplied by `factor` on each consecutive
    failure up to `max_s`; `jitter` is the +/- fraction of random spread (so many clients do not
    retry in lockstep). `clock` is injectable for tests.
    """

    def __init__(
        self,
        name: str,
        *,
        initial_s: float = 0.05,
        max_s: float = 5.0,
        factor: float = 2.0,
        jitter: float = 0.1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if initial_s < 0 or max_s < initial_s or factor < 1 or not 0 <= jitter < 1:
            raise ConfigError(
                f"bad backoff: initial_s={initial_s} max_s={max_s} factor={factor} "
                f"jitter={jitter}"
            )
        self.name = name
        self.initial_s = initial_s
        self.max_s = max_s
        self.factor = factor
        self.jitter = jitter
        self._clock = clock
        self._lock = threading.Lock()
        self._failures = 0  # consecutive failures; 0 = closed
        self._retry_at = 0.0
        self._probing = False
        self._last_error = ""
        self.total_failures = 0  # failures reported over the object's life
        self.total_rejected = 0  # calls refused by check() while open

    # -- state ------------------------------------------------------------------------------

    @property
    def down(self) -> bool:
        """True while the breaker is open or half-open (the last call failed)."""
        with self._lock:
            return self._failures > 0

    @property
    def consecutive_failures(self) -> int:
        with self._lock:
            return self._failures

    @property
    def last_error(self) -> str:
        with self._lock:
            return self._last_error

    def seconds_until_retry(self) -> float:
        """0 when a call may go through now."""
        with self._lock:
            if self._failures == 0:
                return 0.0
            return max(0.0, self._retry_at - self._clock())

    # -- protocol ---------------------------------------------------------------------------

    def check(self) -> None:
        """Let the call through, or raise `StorageUnavailable` while the backend is down."""
        with self._lock:
            if self._failures == 0:
                return
            now = self._clock()
            if now >= self._retry_at and not self._probing:
                self._probing = True  # half-open: this caller is the probe
                return
            self.total_rejected += 1
            wait = max(0.0, self._retry_at - now)
            err = self._last_error
        raise StorageUnavailable(f"{self.name} is down (retry in {wait:.2f}s; last error: {err})")

    def success(self) -> None:
        """The call worked: close the breaker."""
        with self._lock:
            was_down = self._failures > 0
            self._failures = 0
            self._probing = False
            self._retry_at = 0.0
        if was_down:
            logger.info("%s: back up", self.name)

    def failure(self, error: BaseException | str = "") -> float:
        """The call failed with a transient error: open the breaker. Returns the delay (s)."""
        with self._lock:
            self._failures += 1
            self.total_failures += 1
            self._probing = False
            delay = min(self.max_s, self.initial_s * self.factor ** (self._failures - 1))
            if self.jitter:
                delay *= 1.0 + random.uniform(-self.jitter, self.jitter)
            self._retry_at = self._clock() + delay
            self._last_error = str(error) or type(error).__name__
            first = self._failures == 1
        if first:
            logger.warning("%s: unavailable (%s); retrying with backoff", self.name, error)
        else:
            logger.debug("%s: still unavailable (%s); next try in %.2fs", self.name, error, delay)
        return delay

    def reset(self) -> None:
        """Forget all failures (e.g. after an explicit reconnect)."""
        with self._lock:
            self._failures = 0
            self._probing = False
            self._retry_at = 0.0

    @contextmanager
    def attempt(self, transient: tuple[type[BaseException], ...] = (OSError,)) -> Iterator[None]:
        """`with backoff.attempt((ConnectionError,)): ...` = check(), then success()/failure().

        A `transient` exception is recorded and re-raised as `StorageUnavailable`; any other
        exception is re-raised untouched (and releases the probe slot without judging health).
        """
        self.check()
        try:
            yield
        except transient as e:
            self.failure(e)
            raise StorageUnavailable(f"{self.name}: {e}") from e
        except BaseException:
            with self._lock:
                self._probing = False
            raise
        self.success()

    def call(
        self, fn: Callable[[], T], transient: tuple[type[BaseException], ...] = (OSError,)
    ) -> T:
        """Run `fn()` under `attempt(transient)` and return its result."""
        with self.attempt(transient):
            return fn()
        raise AssertionError("unreachable")  # pragma: no cover - for type checkers


# ------------------------------------------------------------------------------------------
# Config look-ups
# ------------------------------------------------------------------------------------------

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def as_bool(value: Any, key: str = "value") -> bool:
    """Parse a JSON/env boolean ("true", "1", True...) or raise `ConfigError`."""
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and value in (0, 1):
        return bool(value)
    s = str(value).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ConfigError(f"{key}: expected a boolean, got {value!r}")


def setting(
    config: StorageConfig,
    key: str,
    default: T,
    *,
    env: str | None = None,
    cast: Callable[[Any], T] | None = None,
) -> T:
    """`config.extra[key]`, else env var `env`, else `default`; converted with `cast`
    (default: the type of `default`; bool uses `as_bool`). A bad value raises `ConfigError`."""
    raw: Any
    if key in config.extra and config.extra[key] is not None:
        raw = config.extra[key]
    elif env and os.environ.get(env) not in (None, ""):
        raw = os.environ[env]
    else:
        return default
    conv = cast if cast is not None else _converter(default, key)
    try:
        value: Any = conv(raw)
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{key}: bad value {raw!r} ({e})") from e
    return value


def _converter(default: object, key: str) -> Callable[[Any], Any]:
    """How to convert a raw setting whose default is `default`."""
    if isinstance(default, bool):
        return functools.partial(as_bool, key=key)
    if default is None:
        return lambda v: v
    conv: Callable[[Any], Any] = type(default)
    return conv


def check_known_keys(config: StorageConfig, known: Sequence[str], backend: str) -> None:
    """Reject extra-config keys a backend does not know (typos fail at start-up)."""
    unknown = sorted(set(config.extra) - set(known))
    if unknown:
        raise ConfigError(
            f"{backend} backend: unknown extra config key(s) {unknown}; known: {sorted(known)}"
        )


# ------------------------------------------------------------------------------------------
# Small utilities
# ------------------------------------------------------------------------------------------


def leading_run(flags: Sequence[bool] | Sequence[int]) -> int:
    """Length of the leading run of truthy flags: what `batch_exists` returns."""
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)


def byte_view(buf: memoryview | bytes | bytearray) -> memoryview:
    """A flat unsigned-byte view of any buffer (no copy)."""
    mv = memoryview(buf)
    if mv.format != "B" or mv.ndim != 1:
        mv = mv.cast("B")
    return mv
