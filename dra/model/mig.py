"""MIG placement model: which GPU instances can live together on one GPU.

Pure functions over the GPU-instance profiles NVML reports (``MigProfile``). A layout is a collection of
placements ``(profile_id, start)``. A placement is valid next to the others when

1. ``start`` is one of the profile's valid starts;
2. its memory-slice interval ``[start, start + memory_slices)`` overlaps no other placement (the NVML rule);
3. the profile's instance count stays within ``max_instances``;
4. the engine budgets hold: the compute slices and OFA engines of all placements add up to at most those of
   the full-GPU profile (the one spanning every memory slice). The OFA budget is what limits a GPU to one
   ``+me`` instance: the full GPU has one OFA and each ``+me`` profile takes it. No profile name is special.

The same rules are encoded as ResourceSlice counters in dra/model/devices.py; tests check the two agree. The
simulated NVML (dra/sim/fakenvml.py) and fleet-file validation refuse placements through ``placement_problem``.
"""
from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

from dra.model.gpu import MigProfile

Placement = tuple[int, int]  # (profile_id, start)


@dataclass(frozen=True)
class MigBudget:
    """GPU-wide limits for one GPU's MIG layouts. None: not limited beyond the memory slices."""

    memory_slices: int
    compute_slices: int | None
    ofa_engines: int | None


def memory_slice_count(profiles: Sequence[MigProfile]) -> int:
    """Number of memory slices, as the furthest end of any valid placement (8, or 4 on A30)."""
    return max((s + p.memory_slices for p in profiles for s in p.starts), default=0)


def full_profile(profiles: Sequence[MigProfile]) -> MigProfile | None:
    """The profile that spans every memory slice (7g on the 8-slice family, 4g on A30), if any."""
    m = memory_slice_count(profiles)
    full = [p for p in profiles if p.memory_slices == m and 0 in p.starts]
    return max(full, key=lambda p: (p.compute_slices, p.ofa_engines, -p.profile_id), default=None)


def budget_of(profiles: Sequence[MigProfile]) -> MigBudget:
    """Budgets taken from the full-GPU profile: its compute slices and OFA engines are the whole GPU's."""
    full = full_profile(profiles)
    return MigBudget(
        memory_slices=memory_slice_count(profiles),
        compute_slices=full.compute_slices if full else None,
        ofa_engines=full.ofa_engines if full else None,
    )


def profile_by_id(profiles: Sequence[MigProfile]) -> dict[int, MigProfile]:
    return {p.profile_id: p for p in profiles}


def interval(profile: MigProfile, start: int) -> range:
    """Memory slices a placement covers."""
    return range(start, start + profile.memory_slices)


class PlacementProblem(NamedTuple):
    """Why a GPU instance cannot be placed. ``kind`` says how NVML refuses it: ``start`` (not a valid start:
    INVALID_ARGUMENT), ``overlap`` / ``count`` / ``engines`` (INSUFFICIENT_RESOURCES), ``unknown`` (a profile
    the GPU does not have)."""

    kind: str
    reason: str


def placement_problem(profiles: Sequence[MigProfile], state: Iterable[Placement], profile_id: int,
                      start: int) -> PlacementProblem | None:
    """The placement rule: None if ``profile_id`` can be placed at ``start`` next to ``state``, else why not.

    The device model's counters, the simulated NVML and fleet-file validation all ask this one function.
    When several budgets are exceeded at once (a second ``+me``: its instance count and the OFA engine), the
    first kind is reported with every reason."""
    by_id = profile_by_id(profiles)
    prof = by_id.get(profile_id)
    if prof is None:
        return PlacementProblem("unknown", f"unknown MIG profile id {profile_id}")
    if start not in prof.starts:
        return PlacementProblem("start", f"{prof.name} cannot start at memory slice {start} "
                                         f"(valid starts: {', '.join(map(str, prof.starts))})")
    placed = list(state)
    new = set(interval(prof, start))
    for pid, s in placed:
        other = by_id[pid]
        common = sorted(new & set(interval(other, s)))
        if common:
            slices = f"{common[0]}" if len(common) == 1 else f"{common[0]}-{common[-1]}"
            return PlacementProblem("overlap", f"{prof.name}@{start} overlaps {other.name}@{s} (memory slices {slices})")
    problems: list[tuple[str, str]] = []
    if sum(1 for pid, _ in placed if pid == profile_id) + 1 > prof.max_instances:
        problems.append(("count", f"{prof.name} allows at most {prof.max_instances} instance(s) per GPU"))
    budget = budget_of(profiles)
    if budget.compute_slices is not None:
        used = sum(by_id[pid].compute_slices for pid, _ in placed)
        if used + prof.compute_slices > budget.compute_slices:
            problems.append(("engines", f"{prof.name}@{start} needs {prof.compute_slices} compute slice(s); only "
                                        f"{budget.compute_slices - used} left"))
    if budget.ofa_engines is not None and prof.ofa_engines:
        if sum(by_id[pid].ofa_engines for pid, _ in placed) + prof.ofa_engines > budget.ofa_engines:
            problems.append(("engines", f"{prof.name}@{start} needs an OFA engine (media extensions); the GPU has "
                                        f"{budget.ofa_engines} and it is taken"))
    if problems:
        return PlacementProblem(problems[0][0], "; ".join(reason for _, reason in problems))
    return None


def can_place(profiles: Sequence[MigProfile], state: Iterable[Placement], profile_id: int, start: int) -> str | None:
    """None if ``profile_id`` can be placed at ``start`` next to the placements in ``state``, else why not."""
    problem = placement_problem(profiles, state, profile_id, start)
    return None if problem is None else problem.reason


def fits(
    profiles: Sequence[MigProfile],
    wanted_profile_ids: Sequence[int],
    state: Sequence[Placement] = (),
) -> list[Placement] | str:
    """Placements for every wanted profile next to ``state``, or the reason none exists.

    Backtracking over starts; the largest profiles and those with the fewest starts are placed first, which
    finds a layout quickly when one exists (small profiles fill whatever gaps remain).
    """
    by_id = profile_by_id(profiles)
    for pid in wanted_profile_ids:
        if pid not in by_id:
            return f"unknown MIG profile id {pid}"
    order = sorted(
        wanted_profile_ids,
        key=lambda pid: (-by_id[pid].memory_slices, -by_id[pid].compute_slices, len(by_id[pid].starts), pid),
    )
    chosen: list[Placement] = []
    deepest: list[tuple[int, list[str]]] = [(-1, [])]  # depth of the furthest failure and its reasons

    def search(i: int) -> bool:
        if i == len(order):
            return True
        pid = order[i]
        reasons: list[str] = []
        for start in by_id[pid].starts:
            reason = can_place(profiles, [*state, *chosen], pid, start)
            if reason is None:
                chosen.append((pid, start))
                if search(i + 1):
                    return True
                chosen.pop()
            else:
                reasons.append(reason)
        if reasons and i >= deepest[0][0]:
            deepest[0] = (i, reasons)
        return False

    if search(0):
        # Report in the caller's order of wanted profiles.
        out: list[Placement] = []
        remaining = list(chosen)
        for pid in wanted_profile_ids:
            for j, (cp, cs) in enumerate(remaining):
                if cp == pid:
                    out.append((cp, cs))
                    del remaining[j]
                    break
        return out
    names = ", ".join(by_id[pid].name for pid in wanted_profile_ids)
    depth, reasons = deepest[0]
    if not reasons:
        return f"{names} do not fit together"
    blocked = by_id[order[depth]]
    # A budget reason (engines, instance count) explains more than "every start overlaps something".
    budget_reasons = [r for r in reasons if " overlaps " not in r]
    why = budget_reasons[0] if budget_reasons else (
        f"no free memory slices for {blocked.name} at any of its starts ({', '.join(map(str, blocked.starts))})"
    )
    return f"{names} do not fit together: {why}"


def free_starts(name: str, profile_id: int, starts: Sequence[int], limit: int, taken: Iterable[Placement],
                count: int) -> list[int] | str:
    """``count`` starts for new instances of one profile (``starts``: its placements, at most ``limit`` at
    once) next to the MIG devices ``taken``, highest first like the placement layout's device order; or why
    not. The profile's placements do not overlap (dra/model/devices.py checks it before publishing it this
    way), so a start is free exactly when no instance sits there; a device of another profile on the GPU
    (none is created in this layout) is reported, not placed around."""
    taken = list(taken)
    others = sorted({pid for pid, _ in taken if pid != profile_id})
    placed = [s for pid, s in taken if pid == profile_id]
    free = [s for s in sorted(starts, reverse=True) if s not in placed]
    if others or len(placed) + count > limit or count > len(free):
        extra = f"; MIG devices of other profiles ({', '.join(map(str, others))}) are on the GPU" if others else ""
        return (f"{name}: {count} more instance(s) do not fit next to the {len(placed)} at memory slices "
                f"{', '.join(map(str, sorted(placed))) or 'none'} (free placements: "
                f"{', '.join(map(str, sorted(free))) or 'none'}; at most {limit} at once{extra})")
    return free[:count]


def max_instances_alone(profiles: Sequence[MigProfile], profile_id: int) -> int:
    """How many instances of one profile the geometry and budgets admit, ignoring ``max_instances``."""
    # Every GPU of a model has the same profiles: the placement search runs once per model, not per GPU.
    return _max_instances_alone(tuple(profiles), profile_id)


@lru_cache(maxsize=256)
def _max_instances_alone(profiles: tuple[MigProfile, ...], profile_id: int) -> int:
    by_id = profile_by_id(profiles)
    relaxed = [p if p.profile_id != profile_id else _with_max(p, len(p.starts)) for p in profiles]
    k = 0
    while k < len(by_id[profile_id].starts) and not isinstance(fits(relaxed, [profile_id] * (k + 1)), str):
        k += 1
    return k


def _with_max(p: MigProfile, n: int) -> MigProfile:
    from dataclasses import replace

    return replace(p, max_instances=n)
