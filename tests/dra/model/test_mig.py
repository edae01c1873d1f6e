"""The MIG placement model against NVIDIA's published placement facts."""
from __future__ import annotations

from itertools import combinations

import pytest
from gpu_fixtures import a30_profiles, from_catalog, h100_profiles
from hypothesis import given, settings
from hypothesis import strategies as st
from mig_layouts import check_layout, maximal_layouts, maximal_multisets

from dra.model.mig import budget_of, can_place, fits, full_profile, max_instances_alone, memory_slice_count

H100 = h100_profiles()
A30 = a30_profiles()
ID = {p.name: p.profile_id for p in H100}  # "1g.10gb" -> 19, ...
ONE, ONE_ME, ONE_2M, TWO, THREE, FOUR, SEVEN = (ID[n] for n in (
    "1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"))


def without_me(profiles):
    return tuple(p for p in profiles if "+me" not in p.name)


def test_geometry_and_budget():
    assert memory_slice_count(H100) == 8
    assert memory_slice_count(A30) == 4
    assert full_profile(H100).name == "7g.80gb"
    assert full_profile(A30).name == "4g.24gb"
    b = budget_of(H100)
    assert (b.memory_slices, b.compute_slices, b.ofa_engines) == (8, 7, 1)


@pytest.mark.parametrize("profiles", [H100, A30], ids=["slots8", "slots4"])
def test_max_instances_match_nvml(profiles):
    for p in profiles:
        assert max_instances_alone(profiles, p.profile_id) == p.max_instances, p.name
        assert not isinstance(fits(profiles, [p.profile_id] * p.max_instances), str)
        assert isinstance(fits(profiles, [p.profile_id] * (p.max_instances + 1)), str)


def test_4g_then_3g_valid_but_3g_at_0_blocks_4g():
    assert check_layout(H100, [(FOUR, 0), (THREE, 4)]) is None
    reason = check_layout(H100, [(THREE, 0), (FOUR, 0)])
    assert reason is not None and "overlaps" in reason
    # 3g at 0 already placed: no room for a 4g anywhere
    assert isinstance(fits(H100, [FOUR], state=[(THREE, 0)]), str)
    # but asked together, the search finds the one layout that works
    assert sorted(fits(H100, [THREE, FOUR])) == [(FOUR, 0), (THREE, 4)]


def test_rejections_from_the_reference():
    assert isinstance(fits(H100, [ONE] * 8), str)                      # an 8th 1g
    for pid in (ONE, ONE_2M, TWO, THREE, FOUR, SEVEN):                # 7g + anything
        assert isinstance(fits(H100, [SEVEN, pid]), str)
    reason = fits(H100, [ONE_ME, ONE_ME])                              # two +me
    assert isinstance(reason, str) and "OFA" in reason
    assert "OFA" in check_layout(H100, [(ONE_ME, 0), (ONE_ME, 3)])
    assert can_place(H100, [], ONE, 7) is not None                     # 1g never starts at slice 7
    assert "unknown" in can_place(H100, [], 99, 0)


@pytest.mark.parametrize("combo", [
    [FOUR, THREE], [THREE, THREE], [THREE, TWO, ONE, ONE], [TWO, TWO, TWO, ONE], [ONE_2M] * 4,
    [FOUR, TWO, ONE], [THREE, ONE_2M, ONE_2M], [ONE_ME, THREE, TWO, ONE],
])
def test_accepted_combinations(combo):
    placed = fits(H100, combo)
    assert not isinstance(placed, str), placed
    assert sorted(pid for pid, _ in placed) == sorted(combo)
    assert check_layout(H100, placed) is None


def test_mig_guide_creation_order_example_fits_with_explicit_placement():
    # The MIG guide's 3-2-1-1 mix fails under NVML auto-placement when created as 19,19,14,9; explicit
    # placements exist.
    placed = fits(H100, [ONE, ONE, TWO, THREE])
    assert not isinstance(placed, str)
    assert check_layout(H100, placed) is None


def test_38_maximal_multisets_without_media_extensions():
    assert len(maximal_multisets(without_me(H100))) == 38
    # the same on every catalog model of the 8-slice family (profiles come from the catalog there)
    for model in ("A100-40GB", "H200-141GB", "B200"):
        profiles = from_catalog(model).mig_profiles
        assert len(maximal_multisets(without_me(profiles))) == 38, model


def test_maximal_layouts_are_valid_and_maximal():
    for profiles in (H100, A30):
        layouts = maximal_layouts(profiles)
        assert layouts
        for layout in layouts:
            assert check_layout(profiles, layout) is None
            for p in profiles:
                for s in p.starts:
                    assert can_place(profiles, layout, p.profile_id, s) is not None
            # every maximal layout on these geometries stays within the compute budget
            assert sum(next(p for p in profiles if p.profile_id == pid).compute_slices for pid, _ in layout) <= \
                budget_of(profiles).compute_slices


def test_at_most_one_media_extension_profile_on_a30():
    me = [p.profile_id for p in A30 if "+me" in p.name]
    for a, b in combinations(me + me, 2):
        assert isinstance(fits(A30, [a, b]), str)
    assert isinstance(fits(A30, [0, me[0]]), str)  # 4g takes the OFA too


def _independent_ok(profiles, layout) -> bool:
    """Restatement of the NVML rules without dra.model.mig: valid starts, no overlap, counts, OFA and compute budget."""
    by_id = {p.profile_id: p for p in profiles}
    used: set[int] = set()
    for pid, s in layout:
        p = by_id[pid]
        if s not in p.starts:
            return False
        cells = set(range(s, s + p.memory_slices))
        if cells & used:
            return False
        used |= cells
    for p in profiles:
        if sum(1 for pid, _ in layout if pid == p.profile_id) > p.max_instances:
            return False
    full = max(profiles, key=lambda p: p.memory_slices)
    if sum(by_id[pid].ofa_engines for pid, _ in layout) > full.ofa_engines:
        return False
    return sum(by_id[pid].compute_slices for pid, _ in layout) <= full.compute_slices


def _placements(profiles):
    return [(p.profile_id, s) for p in profiles for s in p.starts]


@settings(max_examples=80, deadline=None)
@given(st.data())
def test_check_layout_agrees_with_independent_rules(data):
    profiles = data.draw(st.sampled_from([H100, A30]))
    layout = data.draw(st.lists(st.sampled_from(_placements(profiles)), max_size=6))
    assert (check_layout(profiles, layout) is None) == _independent_ok(profiles, layout)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_fits_finds_a_layout_exactly_when_one_exists(data):
    profiles = data.draw(st.sampled_from([H100, A30]))
    wanted = data.draw(st.lists(st.sampled_from([p.profile_id for p in profiles]), min_size=1, max_size=5))
    result = fits(profiles, wanted)
    if isinstance(result, str):
        # exhaustive check that no placement of the multiset is valid
        by_id = {p.profile_id: p for p in profiles}

        def any_valid(i, layout):
            if i == len(wanted):
                return _independent_ok(profiles, layout)
            return any(any_valid(i + 1, layout + [(wanted[i], s)]) for s in by_id[wanted[i]].starts)

        assert not any_valid(0, [])
    else:
        assert sorted(pid for pid, _ in result) == sorted(wanted)
        assert _independent_ok(profiles, result)
