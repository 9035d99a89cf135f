"""A circuit breaker for a store that may hang or go away (the shared tier's Redis).

    Breaker(what, backoff_s, log)
      .allow() -> bool     may a call go out now?
      .failed(why)         a call could not reach it (a connection failure or a timeout)
      .succeeded()         a call was answered (refusals included: it is there)

Closed: every call goes out. The first failure opens it: for `backoff_s` calls are refused at
once (no round trip, no timeout), then one call goes out alone; its answer closes the breaker,
its failure opens it for another `backoff_s`. A trial that never reports back is given up after
`backoff_s`, and another goes out. Opening and closing are one log line each; the calls that
are refused meanwhile say nothing (their callers count them).
"""

from __future__ import annotations

import logging
import threading
import time


class Breaker:
    def __init__(self, what: str, backoff_s: float, log: logging.Logger) -> None:
        self.what = what
        self.backoff_s = backoff_s
        self.log = log
        self._open_until = 0.0  # monotonic; 0: closed
        self._trial_until = 0.0  # monotonic; while a trial call is out
        self._lock = threading.Lock()

    @property
    def is_open(self) -> bool:
        return bool(self._open_until)

    def allow(self) -> bool:
        with self._lock:
            if not self._open_until:
                return True
            now = time.monotonic()
            if now < self._open_until or now < self._trial_until:
                return False
            self._trial_until = now + self.backoff_s  # this call tries again, alone
            return True

    def failed(self, why: str) -> None:
        with self._lock:
            was_open = bool(self._open_until)
            self._open_until, self._trial_until = time.monotonic() + self.backoff_s, 0.0
        if not was_open:
            self.log.warning("%s failed (%s): skipped for %.0f s, then tried again",
                             self.what, why, self.backoff_s)

    def succeeded(self) -> None:
        with self._lock:
            was_open = bool(self._open_until)
            self._open_until = self._trial_until = 0.0
        if was_open:
            self.log.info("%s answers again: in use", self.what)
