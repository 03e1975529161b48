"""The watchdog: one daemon thread that ends the job when a blocked wait passes its deadline,
or when a peer it waits for has exited (comm/group.py's ``Work.wait`` arms it around the
backend's blocking wait, which cannot be interrupted)."""
from __future__ import annotations

import threading
import time
from typing import Any

# a wait pending this long whose peer process on this host has been gone this long fails
DEAD_CHECK_AFTER_S = 1.0
DEAD_GRACE_S = 2.0


class _Watchdog:
    """One daemon thread that aborts the job when an armed wait passes its deadline, or when
    a peer it waits for has exited."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._armed: dict[int, tuple[float, Any, float]] = {}
        self._next = 0
        self._thread: threading.Thread | None = None

    def arm(self, work: Any) -> int:
        with self._lock:
            self._next += 1
            now = time.monotonic()
            self._armed[self._next] = (now + work.group.timeout, work, now)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="ngdist-watchdog",
                                                daemon=True)
                self._thread.start()
            return self._next

    def disarm(self, token: int) -> None:
        with self._lock:
            self._armed.pop(token, None)

    def _run(self) -> None:  # pragma: no cover - exercised in multi-rank tests
        next_check = 0.0
        gone_since: dict[int, float] = {}  # token -> when a peer of that wait was seen gone
        while True:
            time.sleep(0.05)
            now = time.monotonic()
            with self._lock:
                armed = dict(self._armed)
            expired = next((v for v in armed.values() if v[0] < now), None)
            if expired is not None:  # aborts the job: this thread goes no further
                work = expired[1]
                _abort(work, "CommTimeoutError",
                       work.group.timeout_message(work.what, work.peers))
            if now < next_check:
                continue
            next_check = now + 0.5
            for token in set(gone_since) - set(armed):
                del gone_since[token]
            for token, (_, work, start) in armed.items():
                dead = work.group.gone(work.peers) if now - start >= DEAD_CHECK_AFTER_S else []
                if not dead:
                    gone_since.pop(token, None)
                    continue
                with self._lock:
                    pending = token in self._armed  # not completed meanwhile
                if pending and now - gone_since.setdefault(token, now) >= DEAD_GRACE_S:
                    _abort(work, "CommError", work.group.gone_message(work.what, dead))


def _abort(work: Any, kind: str, message: str) -> None:
    rank = work.group.world_ranks()[work.group.rank]
    work.group.abort(f"ngdist: error on rank {rank}: {kind}: {message}\n")


WATCHDOG = _Watchdog()
