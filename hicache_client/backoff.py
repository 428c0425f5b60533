"""`Backoff`: exponential backoff with a circuit breaker, for anything that talks to a store that
can go away (the L3 backends; the transfer controller's storage calls). Wrap each batch operation like this::

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

import logging
import random
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TypeVar

from hicache_client.errors import ConfigError, StorageUnavailable

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
