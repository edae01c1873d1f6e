"""The built-in GPU catalog: model facts, MIG geometry against NVIDIA's published tables, families."""
from __future__ import annotations

import pynvml
import pytest

from dra.model.catalog import (
    CATALOG,
    UnknownModelError,
    family_of,
    get_model,
    model_for_product_name,
    profile_name_from_memory,
)
from dra.sim.fakenvml import auto_start
from dra.sim.fakenvml import place_problem as placement_problem

REQUIRED = ["T4", "L4", "L40S", "A10", "A30", "A100-40GB", "A100-80GB", "H100-80GB", "H100-NVL", "H200-141GB", "B200"]
SLOTS8_MODELS = ["A100-40GB", "A100-80GB", "H100-80GB", "H100-NVL", "H200-141GB", "B200"]

# nvidia-smi profile id -> (compute slices, memory slices, starts, max instances): MIG guide / -lgipp captures
SLOTS8 = {
    19: (1, 1, (0, 1, 2, 3, 4, 5, 6), 7),
    20: (1, 1, (0, 1, 2, 3, 4, 5, 6), 1),
    15: (1, 2, (0, 2, 4, 6), 4),
    14: (2, 2, (0, 2, 4), 3),
    9: (3, 4, (0, 4), 2),
    5: (4, 4, (0,), 1),
    0: (7, 8, (0,), 1),
}
SLOTS4_A30 = {
    14: (1, 1, (0, 1, 2, 3), 4),
    21: (1, 1, (0, 1, 2, 3), 1),
    5: (2, 2, (0, 2), 2),
    6: (2, 2, (0, 2), 1),
    0: (4, 4, (0,), 1),
}
# Names per model in the order 1g, 1g+me, 1g.2m, 2g, 3g, 4g, 7g (operator ConfigMap / MIG guide)
NAMES = {
    "A100-40GB": ["1g.5gb", "1g.5gb+me", "1g.10gb", "2g.10gb", "3g.20gb", "4g.20gb", "7g.40gb"],
    "A100-80GB": ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    "H100-80GB": ["1g.10gb", "1g.10gb+me", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb", "7g.80gb"],
    "H100-NVL": ["1g.12gb", "1g.12gb+me", "1g.24gb", "2g.24gb", "3g.47gb", "4g.47gb", "7g.94gb"],
    "H200-141GB": ["1g.18gb", "1g.18gb+me", "1g.35gb", "2g.35gb", "3g.71gb", "4g.71gb", "7g.141gb"],
    "B200": ["1g.23gb", "1g.23gb+me", "1g.45gb", "2g.45gb", "3g.90gb", "4g.90gb", "7g.180gb"],
}
SLOTS8_ORDER = [19, 20, 15, 14, 9, 5, 0]


def test_required_models_exist():
    assert set(REQUIRED) <= set(CATALOG)


@pytest.mark.parametrize("model,product", [
    ("T4", "Tesla T4"), ("H100-80GB", "NVIDIA H100 80GB HBM3"), ("A100-40GB", "NVIDIA A100-SXM4-40GB"),
    ("L4", "NVIDIA L4"), ("H200-141GB", "NVIDIA H200"), ("B200", "NVIDIA B200"),
])
def test_product_names_as_nvml_reports_them(model, product):
    assert get_model(model).product_name == product
    assert model_for_product_name(product) is get_model(model)


@pytest.mark.parametrize("name", SLOTS8_MODELS)
def test_slots8_geometry_matches_reference(name):
    model = get_model(name)
    assert model.mig_memory_slices == 8 and model.mig_compute_slices == 7
    got = {p.profile_id: (p.compute_slices, p.memory_slices, p.starts, p.max_instances) for p in model.mig_profiles}
    assert got == SLOTS8


def test_a30_geometry_matches_reference():
    model = get_model("A30")
    assert model.mig_memory_slices == 4
    got = {p.profile_id: (p.compute_slices, p.memory_slices, p.starts, p.max_instances) for p in model.mig_profiles}
    assert got == SLOTS4_A30
    assert [p.name for p in model.mig_profiles] == ["1g.6gb", "1g.6gb+me", "2g.12gb", "2g.12gb+me", "4g.24gb"]


@pytest.mark.parametrize("name", SLOTS8_MODELS)
def test_profile_names(name):
    model = get_model(name)
    assert [model.profile_by_id(pid).name for pid in SLOTS8_ORDER] == NAMES[name]


def test_nvml_profile_indices():
    model = get_model("H100-80GB")
    idx = {p.name: p.nvml_index for p in model.mig_profiles}
    assert idx["1g.10gb"] == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE
    assert idx["1g.10gb+me"] == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1
    assert idx["1g.20gb"] == pynvml.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2
    assert idx["7g.80gb"] == pynvml.NVML_GPU_INSTANCE_PROFILE_7_SLICE
    assert get_model("A30").profile("2g.12gb+me").nvml_index == pynvml.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1


@pytest.mark.parametrize("name", list(CATALOG))
def test_profile_names_agree_with_memory(name):
    """Each name is what go-nvlib computes from the profile's memory (so derived MiB values are consistent)."""
    model = get_model(name)
    for p in model.mig_profiles:
        base, plus, attr = p.name.partition("+")
        assert profile_name_from_memory(p.compute_slices, p.memory_mib, model.memory_mib,
                                        f"+{attr}" if plus else "") == p.name


@pytest.mark.parametrize("name", list(CATALOG))
def test_profiles_fit_the_gpu(name):
    model = get_model(name)
    for p in model.mig_profiles:
        assert p.memory_mib <= model.memory_mib
        assert p.multiprocessors <= model.multiprocessors
        assert all(s + p.memory_slices <= model.mig_memory_slices for s in p.starts)
    full = model.full_mig_profile
    if model.mig_capable:
        assert full is not None and full.ofa_engines == 1
        assert all(p.ofa_engines <= full.ofa_engines for p in model.mig_profiles)


def test_captured_memory_values():
    a100 = get_model("A100-40GB")
    assert (a100.profile("1g.5gb").memory_mib, a100.profile("1g.10gb").memory_mib,
            a100.profile("7g.40gb").memory_mib) == (4864, 9984, 40320)
    h100 = get_model("H100-80GB")
    assert [h100.profile(n).multiprocessors for n in ("1g.10gb", "1g.20gb", "2g.20gb", "3g.40gb", "4g.40gb",
                                                       "7g.80gb")] == [16, 26, 32, 60, 64, 132]


# What NVML answered on a real H200 SXM (driver 580.159.04, MIG mode off): profile index, id, name, compute
# slices, max instances, SMs, memory MiB, copy engines, decoders, JPEG, OFA, placement starts, placement size.
H200_MEASURED = [
    (0, 19, "1g.18gb", 1, 7, 16, 16384, 1, 1, 1, 0, (0, 1, 2, 3, 4, 5, 6), 1),
    (1, 14, "2g.35gb", 2, 3, 32, 33280, 2, 2, 2, 0, (0, 2, 4), 2),
    (2, 9, "3g.71gb", 3, 2, 60, 71424, 3, 3, 3, 0, (0, 4), 4),
    (3, 5, "4g.71gb", 4, 1, 64, 71424, 4, 4, 4, 0, (0,), 4),
    (4, 0, "7g.141gb", 7, 1, 132, 143360, 8, 7, 7, 1, (0,), 8),
    (7, 20, "1g.18gb+me", 1, 1, 16, 16384, 1, 1, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),
    (9, 15, "1g.35gb", 1, 4, 26, 33280, 1, 1, 1, 0, (0, 2, 4, 6), 2),
]


def test_h200_profiles_as_measured_on_hardware():
    model = get_model("H200-141GB")
    assert (model.memory_mib, model.multiprocessors, model.pci_device_id) == (143771, 132, 0x2335)
    got = sorted((p.nvml_index, p.profile_id, p.name, p.compute_slices, p.max_instances, p.multiprocessors,
                  p.memory_mib, p.copy_engines, p.decoders, p.jpeg_engines, p.ofa_engines, p.starts,
                  p.memory_slices) for p in model.mig_profiles)
    assert got == H200_MEASURED


@pytest.mark.parametrize("name", ["T4", "L4", "L40S", "A10"])
def test_non_mig_models_have_no_profiles(name):
    model = get_model(name)
    assert not model.mig_capable and model.mig_memory_slices == 0
    with pytest.raises(ValueError, match="does not support MIG"):
        model.profile("1g.5gb")


def test_unknown_model_lists_known_ones():
    with pytest.raises(UnknownModelError) as exc:
        get_model("H100-81GB")
    for name in REQUIRED:
        assert name in str(exc.value)


def test_model_lookup_is_case_insensitive():
    assert get_model("h100-80gb").name == "H100-80GB"


def test_unknown_profile_lists_profiles():
    with pytest.raises(ValueError, match=r"no MIG profile '3g\.20gb'.*3g\.40gb"):
        get_model("H100-80GB").profile("3g.20gb")


@pytest.mark.parametrize("cc,family", [
    ((1, 3), "tesla"), ((2, 1), "fermi"), ((3, 7), "kepler"), ((5, 2), "maxwell"), ((6, 1), "pascal"),
    ((7, 0), "volta"), ((7, 2), "volta"), ((7, 5), "turing"), ((8, 0), "ampere"), ((8, 6), "ampere"),
    ((8, 7), "ampere"), ((8, 9), "ada-lovelace"), ((9, 0), "hopper"), ((10, 0), "blackwell"),
    ((11, 0), "blackwell"), ((12, 0), "blackwell"), ((13, 0), "rubin"), ((4, 0), "undefined"),
    ((14, 0), "undefined"), ((0, 0), "undefined"),
])
def test_family_of(cc, family):
    assert family_of(*cc) == family


@pytest.mark.parametrize("name,family", [("T4", "turing"), ("L4", "ada-lovelace"), ("A10", "ampere"),
                                         ("H200-141GB", "hopper"), ("B200", "blackwell")])
def test_model_family(name, family):
    assert get_model(name).family == family


def test_family_of_importable_from_catalog():
    from dra.model.catalog import family_of as f
    assert f(9, 0) == "hopper"


# -- placement rules -----------------------------------------------------------------------------------------


def _place(model, layout):
    placed = []
    for name, start in layout:
        p = model.profile(name)
        problem = placement_problem(model, placed, p, start)
        if problem:
            return problem
        placed.append((p, start))
    return None


def test_placement_rules():
    m = get_model("A100-40GB")
    assert _place(m, [("4g.20gb", 0), ("3g.20gb", 4)]) is None
    assert _place(m, [("3g.20gb", 0), ("4g.20gb", 0)])[0] == "overlap"
    kind, reason = _place(m, [("2g.10gb", 4), ("3g.20gb", 4)])
    assert kind == "overlap" and "3g.20gb@4 overlaps 2g.10gb@4" in reason and "4-5" in reason
    assert _place(m, [("1g.5gb", 7)])[0] == "start"
    assert _place(m, [("7g.40gb", 0), ("1g.5gb", 0)])[0] == "overlap"
    assert _place(m, [("1g.5gb+me", 0), ("1g.5gb+me", 1)])[0] == "count"
    assert _place(m, [("1g.5gb", s) for s in range(7)]) is None
    a30 = get_model("A30")
    assert _place(a30, [("1g.6gb+me", 0), ("2g.12gb+me", 2)])[0] == "engines"


def test_auto_start_reproduces_mig_guide_example():
    m = get_model("A100-40GB")

    def create(ids):
        placed = []
        for pid in ids:
            p = m.profile_by_id(pid)
            start = auto_start(placed, p)
            if start is None or placement_problem(m, placed, p, start):
                return None
            placed.append((p, start))
        return placed

    assert create([19, 19, 14, 9]) is None
    assert create([9, 19, 14, 19]) is not None


def _maximal_multisets(model, profiles):
    found: set[tuple[int, ...]] = set()

    def rec(placed, first):
        grew = False
        for i in range(len(profiles)):
            for s in profiles[i].starts:
                if placement_problem(model, placed, profiles[i], s) is None:
                    grew = True
                    if i >= first:
                        rec(placed + [(profiles[i], s)], i)
        if not grew:
            found.add(tuple(sorted(p.profile_id for p, _ in placed)))

    rec([], 0)
    return found


def test_slots8_has_38_maximal_multisets_without_me():
    m = get_model("A100-40GB")
    profiles = [p for p in m.mig_profiles if "+me" not in p.name]
    assert len(_maximal_multisets(m, profiles)) == 38
