"""`gpu-dra advise`'s sizing on every GPU model of the catalog: the smallest MIG profile that holds a need (at each
profile's memory and one byte past it), memory shares rounded to their step within their range, MPS slots as
devices and as capacity, SM needs, and what the driver's own slices offer (the device model of a node policy)."""
from __future__ import annotations

from fractions import Fraction

import pytest
from gpu_fixtures import from_catalog, inventory

from api.quantity import GIB, MIB
from dra.model.catalog import CATALOG, GpuModel
from dra.model.policy import parse_node_policy
from dra.model.slices import ApiFeatures, plan_pool
from ops.advise.offers import Offer, ShareOffer, SlotOffer, read_offers
from ops.advise.sizing import Candidate, Need, candidates, mig_fraction, share_size, slot_candidates, smallest

D = "gpu.dra-driver.io"
MIG_MODELS = [m for m in CATALOG.values() if m.mig_capable]


def everything(model: GpuModel, slots: int = 4, capacity: bool = False) -> Offer:
    """Every kind of device of ``model``: whole, every MIG profile, MPS slots, 1Gi memory shares."""
    top = 1 * GIB + (model.memory_mib * MIB - GIB) // GIB * GIB
    return Offer(model.product_name, model.memory_mib * MIB, model.multiprocessors, True,
                 {p.name for p in model.mig_profiles}, {SlotOffer(slots, capacity)}, {ShareOffer(GIB, GIB, top, "mps")})


def only_mig(model: GpuModel) -> Offer:
    return Offer(model.product_name, model.memory_mib * MIB, model.multiprocessors, True,
                 {p.name for p in model.mig_profiles})


def pick(model: GpuModel, offer: Offer, need: Need, kinds: tuple[str, ...] = ("mig", "slot", "share", "gpu")) \
        -> Candidate | None:
    return smallest(candidates(model, offer, need, kinds), need)


# ------------------------------------------------------------------------------------------------------- MIG

@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.name)
def test_each_profile_holds_its_own_memory_and_a_byte_more_moves_past_it(model: GpuModel) -> None:
    offer = only_mig(model)
    for p in model.mig_profiles:
        at = pick(model, offer, Need(p.memory_mib * MIB))
        assert at is not None and at.memory_bytes >= p.memory_mib * MIB
        # Nothing the model offers that holds it takes less of the GPU.
        holding = [q for q in model.mig_profiles if q.memory_mib >= p.memory_mib]
        assert at.fraction == min(mig_fraction(model, q) for q in holding), (p.name, at.describe())
        past = pick(model, offer, Need(p.memory_mib * MIB + 1))
        assert past is not None and past.memory_bytes > p.memory_mib * MIB, (p.name, past)


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.name)
def test_the_largest_profile_then_the_whole_gpu_then_nothing(model: GpuModel) -> None:
    full = max(model.mig_profiles, key=lambda p: p.memory_mib)
    offer = only_mig(model)
    top = pick(model, offer, Need(full.memory_mib * MIB))
    assert top is not None and top.kind == "mig" and top.profile == full.name
    past = pick(model, offer, Need(full.memory_mib * MIB + 1))
    assert past is not None and past.kind == "gpu" and past.memory_bytes == model.memory_mib * MIB
    assert pick(model, offer, Need(model.memory_mib * MIB + 1)) is None


@pytest.mark.parametrize("model", MIG_MODELS, ids=lambda m: m.name)
def test_a_plain_profile_comes_before_its_media_extension_twin(model: GpuModel) -> None:
    for p in model.mig_profiles:
        if "+" in p.name:
            chosen = pick(model, only_mig(model), Need(p.memory_mib * MIB))
            assert chosen is not None and "+" not in chosen.profile


def test_h100_boundaries_by_name() -> None:
    h100 = CATALOG["H100-80GB"]
    offer = only_mig(h100)
    cases = [(1, "1g.10gb"), (9984 * MIB, "1g.10gb"), (9984 * MIB + 1, "1g.20gb"), (20096 * MIB, "1g.20gb"),
             (20096 * MIB + 1, "3g.40gb"), (40448 * MIB, "3g.40gb"), (40448 * MIB + 1, "7g.80gb"),
             (81152 * MIB, "7g.80gb")]
    for need, name in cases:
        got = pick(h100, offer, Need(need))
        assert got is not None and got.profile == name, (need, got)
    # 1g.10gb takes 1/7 (a compute slice), 1g.20gb 1/4 (two memory slices), 2g.20gb 2/7, 3g.40gb 1/2, 4g.40gb 4/7.
    fractions = {p.name: mig_fraction(h100, p) for p in h100.mig_profiles}
    assert fractions["1g.10gb"] == Fraction(1, 7) and fractions["1g.20gb"] == Fraction(1, 4)
    assert fractions["3g.40gb"] == Fraction(1, 2) and fractions["7g.80gb"] == 1


def test_sms_pick_a_profile_with_enough_of_them() -> None:
    h100 = CATALOG["H100-80GB"]
    offer = only_mig(h100)
    for sms, name in [(16, "1g.10gb"), (16.1, "1g.20gb"), (26, "1g.20gb"), (30, "2g.20gb"), (60, "3g.40gb"),
                      (61, "4g.40gb"), (65, "7g.80gb")]:
        got = pick(h100, offer, Need(GIB, sms))
        assert got is not None and got.profile == name, (sms, got)
    whole = pick(h100, offer, Need(GIB, 132))
    assert whole is not None and whole.profile == "7g.80gb"      # 132 SMs: the 7g has them all
    assert pick(h100, offer, Need(GIB, 133)) is None


def test_only_the_profiles_the_cluster_publishes_are_candidates() -> None:
    h100 = CATALOG["H100-80GB"]
    offer = Offer(h100.product_name, h100.memory_mib * MIB, 132, False, {"3g.40gb"})
    got = pick(h100, offer, Need(GIB))
    assert got is not None and got.profile == "3g.40gb"
    assert pick(h100, offer, Need(41 * GIB)) is None        # no whole GPU published, nothing larger


@pytest.mark.parametrize("model", [m for m in CATALOG.values() if not m.mig_capable], ids=lambda m: m.name)
def test_a_gpu_without_mig_never_gets_a_profile(model: GpuModel) -> None:
    offer = Offer(model.product_name, model.memory_mib * MIB, model.multiprocessors, True, {"1g.10gb"})
    got = pick(model, offer, Need(GIB))
    assert got is not None and got.kind == "gpu"


# ---------------------------------------------------------------------------------------------- memory shares

@pytest.mark.parametrize("model", list(CATALOG.values()), ids=lambda m: m.name)
def test_a_share_is_the_need_rounded_up_to_its_step(model: GpuModel) -> None:
    offer = everything(model)
    share, = offer.shares
    for need, size in [(1, GIB), (GIB, GIB), (GIB + 1, 2 * GIB), (int(7.03 * GIB), 8 * GIB),
                       (share.maximum, share.maximum)]:
        got = pick(model, offer, Need(need), ("share",))
        assert got is not None and got.kind == "share" and got.memory_bytes == size, (need, got)
        assert got.fraction == Fraction(size, model.memory_mib * MIB)
    assert pick(model, offer, Need(share.maximum + 1), ("share",)) is None


def test_share_sizes_with_a_minimum_and_a_step() -> None:
    share = ShareOffer(minimum=2 * GIB, step=4 * GIB, maximum=30 * GIB, strategy="mps")
    assert share_size(share, 1) == 2 * GIB
    assert share_size(share, 2 * GIB + 1) == 6 * GIB
    assert share_size(share, 30 * GIB) == 30 * GIB
    assert share_size(share, 30 * GIB + 1) is None


# ------------------------------------------------------------------------------------------------- MPS slots

@pytest.mark.parametrize("model", list(CATALOG.values()), ids=lambda m: m.name)
@pytest.mark.parametrize("n", [2, 4, 7])
def test_a_slot_holds_its_share_of_memory_and_sms(model: GpuModel, n: int) -> None:
    offer = everything(model, slots=n)
    one = model.memory_mib // n * MIB
    got = pick(model, offer, Need(one), ("slot",))
    assert got is not None and (got.slots, got.slot_count, got.fraction) == (1, n, Fraction(1, n))
    assert got.thread_percentage == 100 // n and got.sms == max(1, model.multiprocessors // n)
    assert pick(model, offer, Need(one + 1), ("slot",)) is None            # slot devices: one each
    assert pick(model, offer, Need(GIB, model.multiprocessors // n + 1), ("slot",)) is None


def test_slots_as_capacity_take_as_many_as_the_need_asks() -> None:
    h100 = CATALOG["H100-80GB"]
    offer = everything(h100, slots=4, capacity=True)
    two = pick(h100, offer, Need(30000 * MIB), ("slot",))
    assert two is not None and (two.slots, two.memory_bytes, two.thread_percentage) == (2, 2 * 20389 * MIB, 50)
    three = pick(h100, offer, Need(GIB, 34 * 2 + 1), ("slot",))
    assert three is not None and three.slots == 3 and three.fraction == Fraction(3, 4)
    assert [c.slots for c in slot_candidates(SlotOffer(4, True), h100.memory_mib * MIB, 132)] == [1, 2, 3, 4]


# ------------------------------------------------------------------------------------------- across the kinds

def test_the_smallest_fraction_wins_then_isolation() -> None:
    h100 = CATALOG["H100-80GB"]
    offer = everything(h100)
    need = Need(7200 * MIB)
    assert pick(h100, offer, need).describe() == "share 8Gi"                   # 0.10 of the GPU
    assert pick(h100, offer, need, ("mig", "slot")).describe() == "mig 1g.10gb"   # 1/7
    # 18000 MiB: a 1g.20gb and an MPS slot of 4 both take 1/4: the partition isolates better.
    assert pick(h100, offer, Need(18000 * MIB), ("mig", "slot")).describe() == "mig 1g.20gb"
    assert pick(h100, offer, Need(18000 * MIB), ("slot",)).describe() == "mps slot (1 of 4, 25% threads)"
    # A share bounds no SMs, so it holds any SM need; a slot does not.
    assert pick(h100, offer, Need(GIB, 100), ("share", "slot")).describe() == "share 1Gi"


def test_offers_read_from_the_slices_of_a_node_policy() -> None:
    gpus = [from_catalog("H100-80GB", i) for i in range(4)] + [from_catalog("L4", 4)]
    policy = parse_node_policy({"default": {"wholeGpu": True}, "rules": [
        {"match": {"index": 0}, "mig": "dynamic", "dynamicMig": {"profiles": ["1g.10gb", "3g.40gb"]}},
        {"match": {"index": 1}, "slots": {"count": 4, "strategy": "mps"}},
        {"match": {"index": 2}, "slots": {"count": 2, "strategy": "mps", "layout": "capacity"}},
        {"match": {"index": 3}, "memoryShares": {"minimum": "2Gi", "step": "2Gi"}}]}, "test")
    plan = plan_pool(inventory(*gpus), policy, D, "node-a", ApiFeatures.for_server(37))
    offers, published = read_offers([{"spec": s} for s in plan.slices], D)
    h100 = offers["NVIDIA H100 80GB HBM3"]
    assert h100.whole and h100.mig_profiles == {"1g.10gb", "3g.40gb"}
    assert h100.mps_slots == {SlotOffer(4), SlotOffer(2, True)}
    assert h100.shares == {ShareOffer(2 * GIB, 2 * GIB, 78 * GIB, "mps")}
    assert h100.memory_bytes == 81559 * MIB and h100.multiprocessors == 132
    l4 = offers["NVIDIA L4"]
    assert l4.whole and not l4.mig_profiles and not l4.mps_slots and not l4.shares
    slot = published[("node-a", "gpu-1-slot-3")]
    assert (slot.type, slot.slot_count, slot.memory_bytes, slot.multiprocessors) == ("slot", 4, 20389 * MIB, 33)
    assert published[("node-a", "gpu-2-slots")].slot_count == 2
    # What the node offers, sized: 7 GiB → a 1g.10gb among MIG and slots; 11 GiB → one of GPU 1's 4 MPS slots (1/4;
    # no 1g.20gb is published), among MIG alone the 3g.40gb; among everything a 12Gi share (2Gi steps).
    model = CATALOG["H100-80GB"]
    assert pick(model, h100, Need(7 * GIB), ("mig", "slot")).describe() == "mig 1g.10gb"
    assert pick(model, h100, Need(11 * GIB), ("mig", "slot")).describe() == "mps slot (1 of 4, 25% threads)"
    assert pick(model, h100, Need(11 * GIB), ("mig",)).describe() == "mig 3g.40gb"
    assert pick(model, h100, Need(11 * GIB)).describe() == "share 12Gi"
