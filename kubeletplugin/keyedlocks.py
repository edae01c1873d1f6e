"""Locks by name (claim UID, GPU UUID) that exist while someone holds or waits for them.

A lock table that drops an entry while a thread still waits on it would hand the next caller a second lock
for the same name: two threads then run "exclusively" at once (this is how concurrent prepare and unprepare
of one claim once leaked MIG devices). Here an entry counts its holders and waiters and goes only when the
count is zero, so there is never more than one lock per name, and the table stays as small as the work in
flight.
"""
from __future__ import annotations

import threading
from collections.abc import Iterable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any


class KeyedLocks:
    def __init__(self) -> None:
        self._guard = threading.Lock()
        self._entries: dict[str, list[Any]] = {}     # name -> [lock, holders and waiters]

    @contextmanager
    def hold(self, name: str) -> Iterator[None]:
        with self._guard:
            entry = self._entries.setdefault(name, [threading.Lock(), 0])
            entry[1] += 1
        try:
            with entry[0]:
                yield
        finally:
            with self._guard:
                entry[1] -= 1
                if entry[1] == 0:
                    del self._entries[name]

    @contextmanager
    def hold_all(self, names: Iterable[str]) -> Iterator[None]:
        """Several names, always taken in sorted order so that two holders of overlapping sets cannot
        deadlock."""
        with ExitStack() as stack:
            for name in sorted(set(names)):
                stack.enter_context(self.hold(name))
            yield

    def __len__(self) -> int:
        with self._guard:
            return len(self._entries)
