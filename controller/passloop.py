"""A pass repeated on a thread of its own: again after ``interval`` seconds while passes succeed, after the
back-off's delay while they fail. The cluster controller's reconcile pass and the pending-claims pass run so."""
from __future__ import annotations

import threading
from collections.abc import Callable

from kube.backoff import Backoff


class PassLoop:
    def __init__(self, name: str, run_pass: Callable[[], bool], interval: float, backoff: Backoff) -> None:
        """``run_pass`` returns whether the pass succeeded (it logs its own failures)."""
        self.name, self.interval = name, interval
        self._run_pass = run_pass
        self._backoff = backoff
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()
            self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
            self._thread = None

    def _loop(self) -> None:
        while not self._stop.is_set():
            if self._run_pass():
                self._backoff.success("pass")
                delay = self.interval
            else:
                delay = self._backoff.failure("pass")
            self._stop.wait(delay)
