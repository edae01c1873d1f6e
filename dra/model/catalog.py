"""Built-in catalog of real NVIDIA GPU models, used to simulate them (dra/sim/fakenvml.py) and to fill in the few
facts NVML does not report for a whole GPU (SM and engine counts of GPUs without MIG).

Each model carries what NVML reports for it: product name exactly as ``nvmlDeviceGetName`` returns it, brand
and architecture as NVML enum values, CUDA compute capability, total framebuffer in MiB, PCI device id, and
the MIG geometry (GPU-instance profiles with NVML profile index, nvidia-smi profile id, placements, engines).

Geometry comes from two tables:

* ``slots8`` (A100, H100, H200, B200): 8 memory slices, 7 compute slices.
* ``slots4_a30`` (A30): 4 memory slices, 4 compute slices.

Placements and instance counts are the captured ``nvidia-smi mig -lgipp`` tables; for H200 and B200 no
placement capture is public, so they are inferred from identical fractions and counts. Profile memory (MiB),
SMs and engines are captured values (``nvidia-smi mig -lgip``, whose memory column is memorySizeMB / 1024 with
two decimals, so the MiB below are exact) where a public capture exists; each model names its source. MIG
memory per profile differs slightly between driver releases; the captures are of 5xx drivers. Values without
a capture are derived, and marked so:

* memory: the H100-80GB capture's fraction of total memory for the same number of memory slices, applied to
  the model's total and rounded down to 256 MiB (NVML sizes MIG memory in such steps);
* SMs: a fixed number of SMs per compute slice (as on A100: 14 per slice, 98 of 108 in 7g).

Profile names are the ones NVML reports; ``profile_name_from_memory`` recomputes them from memory the way
go-nvlib does, and the tests check every catalog name against it.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import pynvml

from api.quantity import GIB, MIB
from dra.model.gpu import MigProfile

# ---------------------------------------------------------------------------------------------------------------
# Records


@dataclass(frozen=True)
class GpuModel:
    """One GPU model."""

    name: str                              # catalog key, e.g. "H100-80GB"
    product_name: str                      # exactly as nvmlDeviceGetName reports it
    brand: int                             # NVML_BRAND_*
    architecture: int                      # NVML_DEVICE_ARCH_*
    compute_capability: tuple[int, int]
    memory_mib: int                        # total framebuffer as nvmlDeviceGetMemoryInfo reports it
    multiprocessors: int
    pci_device_id: int                     # 16-bit PCI device id, e.g. 0x2330
    copy_engines: int
    decoders: int
    encoders: int
    jpeg_engines: int
    ofa_engines: int
    mig_memory_slices: int = 0             # 0: not MIG-capable
    mig_compute_slices: int = 0
    mig_profiles: tuple[MigProfile, ...] = ()

    @property
    def mig_capable(self) -> bool:
        return bool(self.mig_profiles)

    @property
    def family(self) -> str:
        return family_of(*self.compute_capability)

    @property
    def nvml_pci_device_id(self) -> int:
        """The PCI id as NVML's nvmlPciInfo_t.pciDeviceId has it: device id << 16 | vendor id 0x10de."""
        return (self.pci_device_id << 16) | 0x10DE

    def profile(self, name: str) -> MigProfile:
        """The MIG profile with this name (e.g. "3g.40gb"); ValueError listing the model's profiles otherwise."""
        for p in self.mig_profiles:
            if p.name == name:
                return p
        if not self.mig_profiles:
            raise ValueError(f"{self.name} does not support MIG")
        known = ", ".join(p.name for p in self.mig_profiles)
        raise ValueError(f"{self.name} has no MIG profile {name!r} (known: {known})")

    def profile_by_id(self, profile_id: int) -> MigProfile | None:
        return next((p for p in self.mig_profiles if p.profile_id == profile_id), None)

    def profile_by_index(self, nvml_index: int) -> MigProfile | None:
        return next((p for p in self.mig_profiles if p.nvml_index == nvml_index), None)

    @property
    def full_mig_profile(self) -> MigProfile | None:
        """The profile that spans every memory slice (7g, or 4g on A30)."""
        return next((p for p in self.mig_profiles if p.memory_slices == self.mig_memory_slices), None)


class UnknownModelError(ValueError):
    """A GPU model name the catalog does not know."""


def profile_name_from_memory(compute_slices: int, memory_mib: int, total_memory_mib: int, suffix: str = "") -> str:
    """The profile name go-nvlib derives: ``<G>g.<GB>gb``; GB = fraction of memory rounded up to eighths,
    times the total in whole GiB (rounded up), rounded half away from zero."""
    frac = math.ceil(memory_mib / total_memory_mib * 8 - 1e-9) / 8
    total_gib = math.ceil(total_memory_mib * MIB / GIB)
    gb = math.floor(frac * total_gib + 0.5)
    return f"{compute_slices}g.{gb}gb{suffix}"


# ---------------------------------------------------------------------------------------------------------------
# Families


def family_of(cc_major: int, cc_minor: int) -> str:
    """GPU family from CUDA compute capability, as GPU Feature Discovery labels it (gpu.family), except that
    CC 11 (Jetson Thor, sm_110) is "blackwell" where GFD says "undefined"."""
    if cc_major == 1:
        return "tesla"
    if cc_major == 2:
        return "fermi"
    if cc_major == 3:
        return "kepler"
    if cc_major == 5:
        return "maxwell"
    if cc_major == 6:
        return "pascal"
    if cc_major == 7:
        return "volta" if cc_minor < 5 else "turing"
    if cc_major == 8:
        return "ampere" if cc_minor < 9 else "ada-lovelace"
    if cc_major == 9:
        return "hopper"
    if cc_major in (10, 11, 12):
        return "blackwell"
    if cc_major == 13:
        return "rubin"
    return "undefined"


# ---------------------------------------------------------------------------------------------------------------
# Geometry tables: (kind, NVML profile index, nvidia-smi id, compute slices, memory slices, starts, max instances)

_P = pynvml
_GeometryRow = tuple[str, int, int, int, int, tuple[int, ...], int]

SLOTS8: tuple[_GeometryRow, ...] = (
    ("1g", _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 19, 1, 1, (0, 1, 2, 3, 4, 5, 6), 7),
    ("1g+me", _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 20, 1, 1, (0, 1, 2, 3, 4, 5, 6), 1),
    ("1g.2m", _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV2, 15, 1, 2, (0, 2, 4, 6), 4),
    ("2g", _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 14, 2, 2, (0, 2, 4), 3),
    ("3g", _P.NVML_GPU_INSTANCE_PROFILE_3_SLICE, 9, 3, 4, (0, 4), 2),
    ("4g", _P.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 5, 4, 4, (0,), 1),
    ("7g", _P.NVML_GPU_INSTANCE_PROFILE_7_SLICE, 0, 7, 8, (0,), 1),
)

SLOTS4_A30: tuple[_GeometryRow, ...] = (
    ("1g", _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE, 14, 1, 1, (0, 1, 2, 3), 4),
    ("1g+me", _P.NVML_GPU_INSTANCE_PROFILE_1_SLICE_REV1, 21, 1, 1, (0, 1, 2, 3), 1),
    ("2g", _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE, 5, 2, 2, (0, 2), 2),
    ("2g+me", _P.NVML_GPU_INSTANCE_PROFILE_2_SLICE_REV1, 6, 2, 2, (0, 2), 1),
    ("4g", _P.NVML_GPU_INSTANCE_PROFILE_4_SLICE, 0, 4, 4, (0,), 1),
)

# Engines per kind: (copy, decoders, encoders, jpeg, ofa), from nvidia-smi -lgip listings.
_Engines = tuple[int, int, int, int, int]
_ENGINES_GA100: dict[str, _Engines] = {
    "1g": (1, 0, 0, 0, 0), "1g+me": (1, 1, 0, 1, 1), "1g.2m": (1, 1, 0, 0, 0),
    "2g": (2, 1, 0, 0, 0), "3g": (3, 2, 0, 0, 0), "4g": (4, 2, 0, 0, 0), "7g": (7, 5, 0, 1, 1),
}
_ENGINES_GH100: dict[str, _Engines] = {
    "1g": (1, 1, 0, 1, 0), "1g+me": (1, 1, 0, 1, 1), "1g.2m": (1, 1, 0, 1, 0),
    "2g": (2, 2, 0, 2, 0), "3g": (3, 3, 0, 3, 0), "4g": (4, 4, 0, 4, 0), "7g": (8, 7, 0, 7, 1),
}
# B200: 1g, 1g+me, 1g.2m and 2g captured (NVIDIA/mig-parted PR #187; the 2g has 4 copy engines where the MIG
# guide says 3). 3g/4g/7g: copy engines from the MIG guide (6, 8, 16), decoders/JPEG per slice as on GH100
# (derived, no capture).
_ENGINES_GB100: dict[str, _Engines] = {
    "1g": (2, 1, 0, 1, 0), "1g+me": (2, 1, 0, 1, 1), "1g.2m": (2, 1, 0, 1, 0),
    "2g": (4, 2, 0, 2, 0), "3g": (6, 3, 0, 3, 0), "4g": (8, 4, 0, 4, 0), "7g": (16, 7, 0, 7, 1),
}
_ENGINES_A30: dict[str, _Engines] = {
    "1g": (1, 0, 0, 0, 0), "1g+me": (1, 1, 0, 1, 1), "2g": (2, 2, 0, 0, 0), "2g+me": (2, 2, 0, 1, 1),
    "4g": (4, 4, 0, 1, 1),
}

_SMS_GH100 = {"1g": 16, "1g+me": 16, "1g.2m": 26, "2g": 32, "3g": 60, "4g": 64, "7g": 132}  # H100 capture

# H100-80GB capture: MiB per kind and the total it was taken against; used to derive other models' memory.
_H100_TOTAL_MIB = 81559
_H100_MIB = {"1g": 9984, "1g+me": 9984, "1g.2m": 20096, "2g": 20096, "3g": 40448, "4g": 40448, "7g": 81152}


def _derived_mib(total_mib: int) -> dict[str, int]:
    """MIG memory for a model without a capture: the H100 fraction per kind, rounded down to 256 MiB."""
    return {k: (total_mib * v // _H100_TOTAL_MIB) // 256 * 256 for k, v in _H100_MIB.items()}


def _per_slice_sms(sms_per_slice: int, rows: Sequence[_GeometryRow]) -> dict[str, int]:
    """Derived SMs: a fixed count per compute slice."""
    return {kind: c * sms_per_slice for kind, _, _, c, _, _, _ in rows}


def _profiles(
    rows: Sequence[_GeometryRow],
    names: dict[str, str],
    mib: dict[str, int],
    sms: dict[str, int],
    engines: dict[str, _Engines],
) -> tuple[MigProfile, ...]:
    """Build profile records from a geometry table. ``names`` maps the base kinds to names; ``+me`` kinds are
    named after their base kind."""
    out = []
    for kind, index, pid, c, size, starts, max_n in rows:
        base, plus, attr = kind.partition("+")
        name = names[base] + (f"+{attr}" if plus else "")
        ce, dec, enc, jpg, ofa = engines[kind]
        out.append(MigProfile(
            nvml_index=index, profile_id=pid, name=name, compute_slices=c, memory_slices=size, starts=starts,
            max_instances=max_n, memory_mib=mib[kind], multiprocessors=sms[kind],
            copy_engines=ce, decoders=dec, encoders=enc, jpeg_engines=jpg, ofa_engines=ofa,
        ))
    return tuple(out)


def _slots8_model(name: str, product: str, cc: tuple[int, int], total_mib: int, sms: int, pci: int,
                  arch: int, names: dict[str, str], mib: dict[str, int], prof_sms: dict[str, int],
                  engines: dict[str, _Engines]) -> GpuModel:
    profiles = _profiles(SLOTS8, names, mib, prof_sms, engines)
    ce, dec, enc, jpg, ofa = engines["7g"]
    return GpuModel(name=name, product_name=product, brand=_P.NVML_BRAND_NVIDIA, architecture=arch,
                    compute_capability=cc, memory_mib=total_mib, multiprocessors=sms, pci_device_id=pci,
                    copy_engines=ce, decoders=dec, encoders=enc, jpeg_engines=jpg, ofa_engines=ofa,
                    mig_memory_slices=8, mig_compute_slices=7, mig_profiles=profiles)


def _plain_model(name: str, product: str, brand: int, arch: int, cc: tuple[int, int], total_mib: int,
                 sms: int, pci: int, engines: _Engines) -> GpuModel:
    ce, dec, enc, jpg, ofa = engines
    return GpuModel(name=name, product_name=product, brand=brand, architecture=arch, compute_capability=cc,
                    memory_mib=total_mib, multiprocessors=sms, pci_device_id=pci, copy_engines=ce, decoders=dec,
                    encoders=enc, jpeg_engines=jpg, ofa_engines=ofa)


def _names8(one: str, two: str, four: str, seven: str) -> dict[str, str]:
    return {"1g": f"1g.{one}gb", "1g.2m": f"1g.{two}gb", "2g": f"2g.{two}gb", "3g": f"3g.{four}gb",
            "4g": f"4g.{four}gb", "7g": f"7g.{seven}gb"}


_A, _H, _B = _P.NVML_DEVICE_ARCH_AMPERE, _P.NVML_DEVICE_ARCH_HOPPER, _P.NVML_DEVICE_ARCH_BLACKWELL
_GA100_SMS = _per_slice_sms(14, SLOTS8)

# Whole-GPU engine counts of the models without MIG are datasheet values (copy, NVDEC, NVENC, NVJPG, OFA): NVML
# reports engine counts only for MIG devices, so no capture of them exists (CUDA's deviceQuery agrees on the
# copy engines and SMs of T4, L4, L40S and A10).
_MODELS: tuple[GpuModel, ...] = (
    _plain_model("T4", "Tesla T4", _P.NVML_BRAND_TESLA, _P.NVML_DEVICE_ARCH_TURING, (7, 5), 15360, 40, 0x1EB8,
                 (3, 2, 1, 0, 1)),
    _plain_model("L4", "NVIDIA L4", _P.NVML_BRAND_NVIDIA, _P.NVML_DEVICE_ARCH_ADA, (8, 9), 23034, 58, 0x27B8,
                 (2, 4, 2, 4, 1)),
    _plain_model("L40S", "NVIDIA L40S", _P.NVML_BRAND_NVIDIA, _P.NVML_DEVICE_ARCH_ADA, (8, 9), 46068, 142, 0x26B9,
                 (2, 3, 3, 4, 1)),
    _plain_model("A10", "NVIDIA A10", _P.NVML_BRAND_NVIDIA, _A, (8, 6), 23028, 72, 0x2236, (2, 2, 1, 0, 1)),
    GpuModel(
        name="A30", product_name="NVIDIA A30", brand=_P.NVML_BRAND_NVIDIA, architecture=_A,
        compute_capability=(8, 0), memory_mib=24258, multiprocessors=56, pci_device_id=0x20B7,
        copy_engines=4, decoders=4, encoders=0, jpeg_engines=1, ofa_engines=1,
        mig_memory_slices=4, mig_compute_slices=4,
        # captured: 5.81 / 11.69 / 23.44 GiB, 14 SMs per slice
        mig_profiles=_profiles(
            SLOTS4_A30, {"1g": "1g.6gb", "2g": "2g.12gb", "4g": "4g.24gb"},
            {"1g": 5952, "1g+me": 5952, "2g": 11968, "2g+me": 11968, "4g": 24000},
            _per_slice_sms(14, SLOTS4_A30), _ENGINES_A30),
    ),
    # captured: 1g 4864, 1g.2m 9984, 7g 40320 (real A100 ResourceSlice); 2g 9.75 GiB, 3g/4g 19.62 GiB (-lgip)
    _slots8_model("A100-40GB", "NVIDIA A100-SXM4-40GB", (8, 0), 40960, 108, 0x20B0, _A, _names8("5", "10", "20", "40"),
                  {"1g": 4864, "1g+me": 4864, "1g.2m": 9984, "2g": 9984, "3g": 20096, "4g": 20096, "7g": 40320},
                  _GA100_SMS, _ENGINES_GA100),
    # captured (-lgip, driver 515.86.01, A100 80GB PCIe; 570.148.08 agrees on 1g/2g/3g): 9.50 / 19.50 / 39.25 /
    # 79.00 GiB; 1g.20gb is not listed there: no capture, given the 2g's memory (same two memory slices).
    # SMs as on A100-40GB (same GA100 die, agrees with the capture's 14/28/42/56/98).
    _slots8_model("A100-80GB", "NVIDIA A100-SXM4-80GB", (8, 0), 81920, 108, 0x20B2, _A, _names8("10", "20", "40", "80"),
                  {"1g": 9728, "1g+me": 9728, "1g.2m": 19968, "2g": 19968, "3g": 40192, "4g": 40192, "7g": 80896},
                  _GA100_SMS, _ENGINES_GA100),
    # captured: 9.75 / 19.62 / 19.62 / 39.50 / 39.50 / 79.25 GiB; 16/26/32/60/64/132 SMs
    _slots8_model("H100-80GB", "NVIDIA H100 80GB HBM3", (9, 0), _H100_TOTAL_MIB, 132, 0x2330, _H,
                  _names8("10", "20", "40", "80"), dict(_H100_MIB), _SMS_GH100, _ENGINES_GH100),
    # captured: 10.75 / 21.62 / 21.62 / 46.38 / 46.38 / 93.12 GiB; SMs as on H100-80GB (16/60/132 captured)
    _slots8_model("H100-NVL", "NVIDIA H100 NVL", (9, 0), 95830, 132, 0x2321, _H, _names8("12", "24", "47", "94"),
                  {"1g": 11008, "1g+me": 11008, "1g.2m": 22144, "2g": 22144, "3g": 47488, "4g": 47488, "7g": 95360},
                  _SMS_GH100, _ENGINES_GH100),
    # measured on an H200 SXM (driver 580.159.04, NVML profile queries with MIG mode off): memory per profile,
    # SMs 16/16/26/32/60/64/132, engines and placements as below; total 143771 MiB, 132 SMs. An older -lgip
    # capture (NVIDIA/mig-parted issue #120) said 256 MiB less for the five profiles of two or more slices.
    _slots8_model("H200-141GB", "NVIDIA H200", (9, 0), 143771, 132, 0x2335, _H, _names8("18", "35", "71", "141"),
                  {"1g": 16384, "1g+me": 16384, "1g.2m": 33280, "2g": 33280, "3g": 71424, "4g": 71424, "7g": 143360},
                  _SMS_GH100, _ENGINES_GH100),
    # B200: total 183359 MiB and 148 SMs as nvidia-smi reports them. 1g, 1g+me, 1g.45gb and 2g captured (-lgip in
    # NVIDIA/mig-parted PR #187, March 2025 driver: 20.50 / 44.25 / 44.25 GiB, 18/18/30/36 SMs, engines below;
    # the January 2025 driver of PR #166 said 22.00 GiB for 1g). No public capture of 3g, 4g, 7g: memory
    # derived (H100 fractions), SMs derived (4g = 4 x 18 like 2g = 2 x 18; 3g scaled from H100's 60 by 148/132;
    # 7g = the whole GPU).
    _slots8_model("B200", "NVIDIA B200", (10, 0), 183359, 148, 0x2901, _B, _names8("23", "45", "90", "180"),
                  {**_derived_mib(183359), "1g": 20992, "1g+me": 20992, "1g.2m": 45312, "2g": 45312},
                  {"1g": 18, "1g+me": 18, "1g.2m": 30, "2g": 36, "3g": 67, "4g": 72, "7g": 148}, _ENGINES_GB100),
)

CATALOG: dict[str, GpuModel] = {m.name: m for m in _MODELS}


def get_model(name: str) -> GpuModel:
    """A model by catalog name (case-insensitive, e.g. "h100-80gb") or by its exact NVML product name."""
    for m in _MODELS:
        if name.lower() == m.name.lower() or name == m.product_name:
            return m
    raise UnknownModelError(f"unknown GPU model {name!r} (known: {', '.join(CATALOG)})")


def model_for_product_name(product_name: str) -> GpuModel | None:
    """The catalog model NVML reports under this product name, if the catalog knows it."""
    return next((m for m in _MODELS if m.product_name == product_name), None)
