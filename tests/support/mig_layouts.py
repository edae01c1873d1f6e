"""Layout enumeration over the MIG placement rule, for tests: whole layouts checked at once, and every
maximal layout of a GPU (the exhaustive oracle the property tests compare the counters with)."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from dra.model.gpu import MigProfile
from dra.model.mig import Placement, can_place


def check_layout(profiles: Sequence[MigProfile], layout: Iterable[Placement]) -> str | None:
    """None if all placements can coexist, else the first reason found."""
    state: list[Placement] = []
    for pid, start in layout:
        reason = can_place(profiles, state, pid, start)
        if reason is not None:
            return reason
        state.append((pid, start))
    return None


def addable(profiles: Sequence[MigProfile], state: Sequence[Placement]) -> list[Placement]:
    """Every placement that could be added to ``state``."""
    return [(p.profile_id, s) for p in profiles for s in p.starts if can_place(profiles, state, p.profile_id, s) is None]


def maximal_layouts(profiles: Sequence[MigProfile]) -> list[tuple[Placement, ...]]:
    """Every layout (as a sorted tuple of placements) to which nothing more can be added."""
    seen: set[tuple[Placement, ...]] = set()
    result: set[tuple[Placement, ...]] = set()

    def walk(state: tuple[Placement, ...]) -> None:
        if state in seen:
            return
        seen.add(state)
        options = addable(profiles, state)
        if not options:
            result.add(state)
            return
        for opt in options:
            walk(tuple(sorted((*state, opt))))

    walk(())
    return sorted(result)


def maximal_multisets(profiles: Sequence[MigProfile]) -> list[tuple[int, ...]]:
    """Distinct profile multisets (sorted profile ids) of the maximal layouts."""
    return sorted({tuple(sorted(pid for pid, _ in layout)) for layout in maximal_layouts(profiles)})
