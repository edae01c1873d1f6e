"""Exponential back-off per work item (a pool name, a request), as client-go's rate-limited queues do."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Hashable


@dataclass
class Backoff:
    """delay(n) = min(initial * factor**(n-1), maximum) for the n-th consecutive failure of a key."""

    initial: float = 0.25
    maximum: float = 30.0
    factor: float = 2.0
    _failures: dict[Hashable, int] = field(default_factory=dict)

    def failure(self, key: Hashable) -> float:
        """Records one more failure of key; returns how long to wait before the next attempt."""
        n = self._failures.get(key, 0) + 1
        self._failures[key] = n
        return min(self.initial * self.factor ** (n - 1), self.maximum)

    def success(self, key: Hashable) -> None:
        self._failures.pop(key, None)

    def failures(self, key: Hashable) -> int:
        return self._failures.get(key, 0)

    def failing(self) -> list[Hashable]:
        return list(self._failures)
