"""The fake CUDA stream of tests/comm/fake_nccl.py, which the contract suite's NCCL groups run
on: ``synchronize`` returns only after every callable enqueued before it has run, also one
enqueued just as the stream's thread finds its queue empty after the previous callable (the
overlapped NcclGroup's read of a result waits so; that interleaving let the read see the
buffer before the allreduce wrote it)."""
from __future__ import annotations

import queue
import threading
import time
import types

import fake_nccl

PAUSE_S = 0.3  # the longest the test waits for the stream's thread to reach the pause


class PausingQueue(queue.Queue):
    """Holds the stream's thread the first time it finds the queue empty, until the test has
    enqueued the next callable (a stream that does not ask is not held)."""

    def __init__(self) -> None:
        super().__init__()
        self.paused, self.go = threading.Event(), threading.Event()

    def empty(self) -> bool:
        found = super().empty()
        if found and threading.current_thread().name.startswith("fake-stream") \
                and not self.go.is_set():
            self.paused.set()
            self.go.wait(PAUSE_S)
        return found


def test_synchronize_waits_for_a_callable_enqueued_as_the_previous_one_ends(monkeypatch):
    made: list[PausingQueue] = []
    monkeypatch.setattr(fake_nccl, "queue", types.SimpleNamespace(
        Queue=lambda: made.append(PausingQueue()) or made[-1]))
    stream = fake_nccl.Stream()
    ran: list[str] = []
    stream.enqueue(lambda: ran.append("first"))
    made[0].paused.wait(PAUSE_S)
    stream.enqueue(lambda: (time.sleep(0.2), ran.append("second")))
    made[0].go.set()
    stream.synchronize()
    assert ran == ["first", "second"]
