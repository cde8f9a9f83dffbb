"""Device models: what a GPU and its links can do, built in or read from a JSON file.

A :class:`Device` is the small typed record the roofline estimator
(:mod:`orgel.profile.roofline`) turns a captured graph into block costs with:
dense peak TFLOP/s per math mode, memory bandwidth and capacity, the fraction
of the roofline each op class reaches (``efficiency``), the host's cost to
issue one kernel, and two interconnects (inside a node, between nodes) with
the GPUs per node. Built-in devices are in :data:`DEVICES`; any other is a
JSON file with the same fields (:func:`load_device`)::

    {"name": "my-gpu", "peak_tflops": {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
     "memory_gbs": 1555, "memory_gib": 39.4, "launch_us": 10,
     "efficiency": {"matmul": 0.8, "attention": 0.6, "elementwise": 0.8, "normalization": 0.6},
     "intra_node": {"name": "NVSwitch", "gbs": 300, "latency_us": 10},
     "inter_node": {"name": "IB HDR", "gbs": 25, "latency_us": 20},
     "gpus_per_node": 8}

Bandwidths are GB/s (10^9 bytes) in one direction per GPU, as datasheets give
them halved (NVLink's "600 GB/s" is 300 each way).
A ``"fp8"`` peak (optional; h100-80gb lists it) prices the linears that run in
Float8 (:func:`orgel.profile.roofline.estimate_costs` with ``float8=True``).

Calibration (``efficiency``, the same for every built-in device, set once and
not per benchmark row): large GEMMs in cuBLAS reach about 80% of the dense
tensor-core peak on A100/H100-class parts and ~90% of the FP32 (non-tensor)
peak; attention (flash/memory-efficient SDPA) about 60% of the tensor peak;
streaming elementwise kernels about 80% of the DRAM bandwidth (STREAM-like
copy), normalisations and softmax (reductions, two passes) about 60%. These
are the usual published figures for these parts, not fits to the papers'
runs; ``launch_us`` (10 µs) is PyTorch eager's host cost per kernel, which
bounds a block of small kernels from below.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from orgel.schedule.costs import Link

#: The op classes a device calibrates (:func:`orgel.profile.roofline.op_class`).
OP_CLASSES = ("matmul", "attention", "elementwise", "normalization")
#: Math modes a device lists peaks for; fp32 storage runs as "tf32" only if asked, and
#: "fp8" (e4m3/e5m2 tensor cores) only for the linears a roofline is told run in Float8.
MATH_MODES = ("fp32", "tf32", "bf16", "fp16", "fp8")

DEFAULT_EFFICIENCY = {"matmul": 0.8, "attention": 0.6, "elementwise": 0.8,
                      "normalization": 0.6}
#: Non-tensor FP32 GEMMs (SGEMM) get closer to their lower peak.
FP32_MATMUL_EFFICIENCY = 0.9


class DeviceError(ValueError):
    """A device name or file is wrong; the message names the field and what to write."""


@dataclass(frozen=True)
class Interconnect:
    """A link between two GPUs: bandwidth one way (GB/s) and latency (µs)."""

    name: str
    gbs: float
    latency_us: float

    def link(self) -> Link:
        """As the simulator takes it: ms latency, ms per MiB."""
        return Link(latency=self.latency_us / 1000, per_mib=(1 << 20) / (self.gbs * 1e9) * 1000)


@dataclass(frozen=True)
class Device:
    """One GPU model and the cluster around it (see the module docstring)."""

    name: str
    peak_tflops: dict[str, float]
    memory_gbs: float
    memory_gib: float
    intra_node: Interconnect
    inter_node: Interconnect
    gpus_per_node: int = 8
    launch_us: float = 10.0
    efficiency: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    source: str = ""

    @property
    def memory_bytes(self) -> int:
        return int(self.memory_gib * (1 << 30))

    def peak(self, mode: str) -> float:
        """Dense FLOP/s (not TFLOP/s) of ``mode``; fp32 stands in for a missing tf32."""
        if mode in self.peak_tflops:
            return self.peak_tflops[mode] * 1e12
        if mode == "tf32":
            return self.peak("fp32")
        raise DeviceError(f"device {self.name} lists no peak for {mode!r} math: add "
                          f"\"{mode}\" to peak_tflops")

    def to_dict(self) -> dict[str, Any]:
        link = {k: {"name": v.name, "gbs": v.gbs, "latency_us": v.latency_us}
                for k, v in (("intra_node", self.intra_node), ("inter_node", self.inter_node))}
        return {"name": self.name, "peak_tflops": dict(self.peak_tflops),
                "memory_gbs": self.memory_gbs, "memory_gib": self.memory_gib, **link,
                "gpus_per_node": self.gpus_per_node, "launch_us": self.launch_us,
                "efficiency": dict(self.efficiency), "source": self.source}


def _ic(name: str, gbs: float, latency_us: float) -> Interconnect:
    return Interconnect(name, gbs, latency_us)


_IB_HDR = _ic("InfiniBand HDR 200 Gb/s per GPU", 25.0, 5.0)
_IB_NDR = _ic("InfiniBand NDR 400 Gb/s per GPU", 50.0, 5.0)
_IB_EDR = _ic("InfiniBand EDR 100 Gb/s per GPU", 12.5, 5.0)

#: Built-in devices. Peaks are NVIDIA's dense (no sparsity) datasheet figures.
DEVICES: dict[str, Device] = {
    "a100-40gb": Device(
        "a100-40gb", {"fp32": 19.5, "tf32": 156, "bf16": 312, "fp16": 312},
        memory_gbs=1555, memory_gib=39.4,
        intra_node=_ic("NVLink 3 via NVSwitch (600 GB/s both ways)", 300.0, 10.0),
        inter_node=_IB_HDR,
        source="NVIDIA A100 datasheet (SXM4 40GB): 19.5 FP32, 156 TF32, 312 BF16/FP16 "
               "TFLOP/s dense, 1,555 GB/s HBM2, 600 GB/s NVLink; DGX A100: 8 GPUs, "
               "one 200 Gb/s HDR port per GPU; 39.4 GiB is what torch reports usable"),
    "h100-80gb": Device(
        "h100-80gb", {"fp32": 67, "tf32": 494.5, "bf16": 989.5, "fp16": 989.5,
                      "fp8": 1979},
        memory_gbs=3350, memory_gib=79.1,
        intra_node=_ic("NVLink 4 via NVSwitch (900 GB/s both ways)", 450.0, 10.0),
        inter_node=_IB_NDR,
        source="NVIDIA H100 datasheet (SXM5): 67 FP32, 494.5 TF32, 989.5 BF16/FP16, "
               "1,979 FP8 TFLOP/s dense, 3.35 TB/s HBM3, 900 GB/s NVLink; DGX H100: 8 GPUs, one "
               "400 Gb/s NDR port per GPU"),
    "v100-16gb": Device(
        "v100-16gb", {"fp32": 15.7, "fp16": 125},
        memory_gbs=900, memory_gib=15.8,
        intra_node=_ic("NVLink 2 hybrid cube mesh (300 GB/s both ways)", 150.0, 10.0),
        inter_node=_IB_EDR,
        source="NVIDIA V100 datasheet (SXM2 16GB): 15.7 FP32, 125 FP16 tensor TFLOP/s, "
               "900 GB/s HBM2, 300 GB/s NVLink; DGX-1: 8 GPUs, 4x 100 Gb/s EDR per node "
               "(taken as one per GPU pair, 12.5 GB/s per GPU, optimistic); no bf16, "
               "no tf32 (fp32 stands in)"),
    "rtx3090-24gb": Device(
        "rtx3090-24gb", {"fp32": 35.6, "tf32": 35.6, "bf16": 71, "fp16": 71},
        memory_gbs=936, memory_gib=23.7,
        intra_node=_ic("PCIe 4.0 x16 (NVLink bridges join pairs only)", 25.0, 10.0),
        inter_node=_ic("100 Gb/s Ethernet", 12.5, 20.0),
        source="NVIDIA GeForce RTX 3090 specifications / Ampere GA102 whitepaper: 35.6 "
               "FP32 TFLOP/s, 71 FP16/BF16 tensor TFLOP/s with FP16 accumulate (35.6 with "
               "FP32 accumulate, what autocast gets: 71 here is optimistic), 936 GB/s "
               "GDDR6X, PCIe 4.0 x16 (32 GB/s, ~25 achieved)"),
}
DEVICES["a100-80gb"] = dataclasses.replace(
    DEVICES["a100-40gb"], name="a100-80gb", memory_gbs=2039, memory_gib=79.1,
    source="NVIDIA A100 datasheet (SXM4 80GB): as a100-40gb with 2,039 GB/s HBM2e")


def load_device(spec: str | Path) -> Device:
    """A built-in device by name, or a JSON file (``*.json``) with :class:`Device`'s fields."""
    text = str(spec)
    if text in DEVICES:
        return DEVICES[text]
    if not text.endswith(".json"):
        raise DeviceError(f"unknown device {text!r}: choose one of {', '.join(DEVICES)} or "
                          "give a JSON file (see orgel.costs.devices)")
    try:
        data = json.loads(Path(text).read_text())
    except OSError as exc:
        raise DeviceError(f"cannot read device file {text}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise DeviceError(f"device file {text} is not valid JSON: {exc}") from None
    try:
        return device_from_dict(data)
    except DeviceError as exc:
        raise DeviceError(f"device file {text}: {exc}") from None


_FIELDS = ("name", "peak_tflops", "memory_gbs", "memory_gib", "intra_node", "inter_node",
           "gpus_per_node", "launch_us", "efficiency", "source")


def device_from_dict(data: Any) -> Device:
    """Check and build a :class:`Device`; a :class:`DeviceError` names the bad field."""
    if not isinstance(data, dict):
        raise DeviceError("a device is a JSON object with fields " + ", ".join(_FIELDS))
    unknown = sorted(set(data) - set(_FIELDS))
    if unknown:
        raise DeviceError(f"unknown field(s) {unknown}: the fields are {', '.join(_FIELDS)}")
    for key in ("name", "peak_tflops", "memory_gbs", "memory_gib", "intra_node", "inter_node"):
        if key not in data:
            raise DeviceError(f"missing field {key!r}")
    if not isinstance(data["name"], str) or not data["name"]:
        raise DeviceError(f"name must be a non-empty string, got {data['name']!r}")
    peaks = _table(data["peak_tflops"], "peak_tflops", MATH_MODES, "TFLOP/s")
    if "fp32" not in peaks:
        raise DeviceError("peak_tflops needs at least \"fp32\" (TFLOP/s)")
    efficiency = dict(DEFAULT_EFFICIENCY)
    efficiency.update(_table(data.get("efficiency", {}), "efficiency", OP_CLASSES, "fraction"))
    for k, v in efficiency.items():
        if v > 1:
            raise DeviceError(f"efficiency.{k} is a fraction of the roofline (0 < x <= 1), "
                              f"got {v}")
    gpus = data.get("gpus_per_node", 8)
    if isinstance(gpus, bool) or not isinstance(gpus, int) or gpus < 1:
        raise DeviceError(f"gpus_per_node must be a positive integer, got {gpus!r}")
    return Device(
        name=data["name"], peak_tflops=peaks,
        memory_gbs=_positive(data["memory_gbs"], "memory_gbs"),
        memory_gib=_positive(data["memory_gib"], "memory_gib"),
        intra_node=_interconnect(data["intra_node"], "intra_node"),
        inter_node=_interconnect(data["inter_node"], "inter_node"),
        gpus_per_node=gpus, launch_us=_positive(data.get("launch_us", 10.0), "launch_us",
                                                zero=True),
        efficiency=efficiency, source=str(data.get("source", "")))


def _positive(value: Any, where: str, *, zero: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise DeviceError(f"{where} must be a number, got {value!r}")
    if value < 0 or (value == 0 and not zero):
        raise DeviceError(f"{where} must be {'>= 0' if zero else '> 0'}, got {value!r}")
    return float(value)


def _table(value: Any, where: str, keys: tuple[str, ...], unit: str) -> dict[str, float]:
    if not isinstance(value, dict):
        raise DeviceError(f"{where} must be an object like {{\"{keys[0]}\": ...}} ({unit})")
    bad = sorted(set(value) - set(keys))
    if bad:
        raise DeviceError(f"{where} has unknown key(s) {bad}: use {', '.join(keys)}")
    return {k: _positive(v, f"{where}.{k}") for k, v in value.items()}


def _interconnect(value: Any, where: str) -> Interconnect:
    if not isinstance(value, dict) or set(value) - {"name", "gbs", "latency_us"}:
        raise DeviceError(f"{where} must be an object {{\"name\": ..., \"gbs\": GB/s one way, "
                          f"\"latency_us\": µs}}, got {value!r}")
    if "gbs" not in value:
        raise DeviceError(f"{where}.gbs is missing (GB/s one way per GPU)")
    return Interconnect(str(value.get("name", where)), _positive(value["gbs"], f"{where}.gbs"),
                        _positive(value.get("latency_us", 0.0), f"{where}.latency_us",
                                  zero=True))
