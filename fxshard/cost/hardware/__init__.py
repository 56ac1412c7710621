"""Hardware profiles as data: what a device computes and moves per second, and the links between devices.

A profile is a JSON file (the shipped ones in ``fxshard/cost/hardware/``, or one ``fxshard calibrate`` wrote)::

    {"name": "...", "peak_flops": {"bf16": 989e12, "fp32": 67e12}, "memory_bandwidth": 3.35e12,
     "memory": "80GiB", "devices_per_node": 8,
     "intra_node": {"bandwidth": 360e9, "latency": 5e-6}, "inter_node": {"bandwidth": 45e9, "latency": 10e-6},
     "efficiency": {"matmul": 0.72, "attention": 0.55, "memory": 0.8}}

``peak_flops`` per compute dtype (dense, FLOP/s); ``memory_bandwidth`` in bytes/s; a link's ``bandwidth`` is the
*bus* bandwidth a ring collective reaches per device (what nccl-tests calls busbw), its ``latency`` the time of
one step of a collective.  ``efficiency`` is the share of the peak each op class reaches (a matmul of the sizes a
training step runs, attention kernels, memory-bound ops).  Optional: ``kernel_overhead`` (seconds per kernel, a
floor for tiny ops), ``default_dtype``, ``groups`` (a link fitted per group size within a node, as ``fxshard calibrate``
measures it: on a CPU whose processes outnumber its cores a group of 4 is far slower per step than one of 2),
``collectives`` (a link fitted per collective and group size within a node, where a backend's collective departs
from the ring formula: gloo's reduce-scatter of a large buffer takes longer than its all-reduce of it),
``overlap`` (the share of a collective that runs hidden beside compute, 1.0 unless measured: calibrate times an
all-reduce in flight during matmuls against the two apart), ``contention`` (a rank's matmul rate alone over its rate
while every rank computes, 1.0 unless measured: above 1 where ranks outnumber cores), ``compute_scale`` (a model's
measured forward and backward over the time model's roofline for it, 1.0 unless ``fxshard calibrate --model``
measured it: the op mix of a real step, small products and elementwise ops, against the square product the peak
comes from), ``selective_overhead`` (seconds per op that selective recompute's policy adds, beside running the op
again: torch's selective checkpoint dispatches every op of the block through a Python mode in forward and in the
recompute; 0 unless measured), ``attention_by_seq`` (attention's efficiency by sequence length, ``{"512": 0.19,
"8192": 0.34, ...}``, interpolated in log2 of the length and held at the ends: a flash kernel's rate climbs with the
length its tiles amortize over; without it ``efficiency.attention`` at every length; either is a share of the peak
on the FLOPs the kernel executes, which for a causal attention are about half the counted ones),
``measured`` (calibrate's points, kept for reference)::

    hw = load_hardware("h100")
    hw.collective_seconds("all_reduce", 2**30, group=8, spread=1)     # 1 GiB over 8 GPUs of one node
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

from fxshard.errors import OptionError

SHIPPED = Path(__file__).resolve().parent  # the JSON files beside this module
REQUIRED = {
    "peak_flops": "peak FLOP/s per compute dtype, e.g. {\"bf16\": 989e12, \"fp32\": 67e12}",
    "memory_bandwidth": "device memory bandwidth in bytes/s, e.g. 3.35e12",
    "memory": "device memory, e.g. \"80GiB\" or a number of bytes",
    "devices_per_node": "devices in one node (one NVLink domain), e.g. 8",
    "intra_node": "the link within a node: {\"bandwidth\": bytes/s, \"latency\": seconds}",
    "inter_node": "the link across nodes: {\"bandwidth\": bytes/s, \"latency\": seconds}",
}
LINK_FIELDS = ("bandwidth", "latency")
DEFAULT_EFFICIENCY = {"matmul": 0.7, "attention": 0.5, "memory": 0.7}
PASSES = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1, "all_to_all": 1}  # over the buffer
DTYPE_PEAK = {"bf16": "bf16", "fp32": "fp32", "fp8": "bf16"}  # Layout.dtype -> the peak_flops key its matmuls run at
# (fp8: the ops beside its fp8 linears, which run at peak_flops["fp8"]: Hardware.fp8_peak)


@dataclass(frozen=True)
class Link:
    bandwidth: float  # bytes/s per device, as a ring collective's bus bandwidth
    latency: float  # seconds per step of a collective


@dataclass(frozen=True)
class Hardware:
    name: str
    peak_flops: dict[str, float]
    memory_bandwidth: float
    memory: int  # bytes
    devices_per_node: int
    intra_node: Link
    inter_node: Link
    efficiency: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_EFFICIENCY))
    kernel_overhead: float = 0.0
    groups: dict[int, Link] = field(default_factory=dict)  # within a node, by group size (measured)
    collectives: dict[str, dict[int, Link]] = field(default_factory=dict)  # within a node, by op and group size
    overlap: float = 1.0  # share of communication hidden beside compute where the runtime overlaps it
    contention: float = 1.0  # one rank's compute rate alone over each one's when all compute (ranks > cores)
    compute_scale: float = 1.0  # a model's measured forward + backward over the roofline's (calibrate --model)
    selective_overhead: float = 0.0  # seconds per op of a selectively recomputed block (its policy, twice)
    attention_by_seq: dict[int, float] = field(default_factory=dict)  # sequence length -> attention's efficiency
    default_dtype: str = "bf16"
    source: str = ""
    path: str = ""

    def peak(self, dtype: str) -> float:
        """Peak matmul FLOP/s at Layout.dtype ``dtype`` (bf16 or fp32)."""
        key = DTYPE_PEAK.get(dtype, dtype)
        if key not in self.peak_flops:
            raise OptionError(f"hardware profile {self.path or self.name}: expected peak_flops[{key!r}] for "
                              f"--dtype {dtype}; found only {sorted(self.peak_flops)}; add it (fxshard calibrate "
                              "measures every dtype) or choose --dtype " + " or ".join(
                                  d for d, k in DTYPE_PEAK.items() if k in self.peak_flops))
        return self.peak_flops[key]

    def attention_efficiency(self, seq: int) -> float:
        """Attention's share of the peak at sequence length ``seq``: the profile's curve (``attention_by_seq``),
        linear in log2 of the length between its points and held beyond them, else ``efficiency.attention``.

        >>> Hardware("x", {}, 1.0, 1, 1, Link(1, 0), Link(1, 0), attention_by_seq={1024: 0.2, 4096: 0.3}
        ...          ).attention_efficiency(2048)
        0.25
        """
        if not self.attention_by_seq:
            return self.efficiency["attention"]
        points = sorted(self.attention_by_seq.items())
        if seq <= points[0][0]:
            return points[0][1]
        for (s0, e0), (s1, e1) in zip(points, points[1:], strict=False):
            if seq <= s1:
                return e0 + (e1 - e0) * (math.log2(seq) - math.log2(s0)) / (math.log2(s1) - math.log2(s0))
        return points[-1][1]

    def fp8_peak(self) -> float:
        """Peak FLOP/s of an fp8 linear's product (``peak_flops["fp8"]``, dense); a profile without one (an A100, a
        CPU: no fp8 matrix units) runs it at bf16's, its casts then pure cost."""
        return self.peak_flops.get("fp8") or self.peak("bf16")

    def link(self, spread: int, group: int = 0, op: str = "") -> Link:
        """The link a group of ``group`` devices uses for collective ``op``: within one node when its members sit on
        ``spread`` == 1 node (the fit for that collective and group size, else for that group size, where the profile
        has one), else across."""
        if spread > 1:
            return self.inter_node
        return self.collectives.get(op, {}).get(group) or self.groups.get(group, self.intra_node)

    def exposed(self, seconds: float, beside: float) -> float:
        """What is left of ``seconds`` of communication that runs beside ``beside`` seconds of compute: the
        ``overlap`` share of the shorter one is hidden.  ``overlap`` 1 (a GPU's copy engines) hides all of it;
        on a CPU whose cores every process shares, the collective's copies and sums compete with the compute."""
        return seconds - self.overlap * min(seconds, max(beside, 0.0))

    def collective_seconds(self, op: str, nbytes: float, group: int, spread: int = 1) -> float:
        """Time of one collective over ``group`` devices on ``spread`` nodes, of a buffer of ``nbytes`` (the whole
        buffer: an all-reduce's input, an all-gather's output): ring bandwidth term + the smaller of the ring's and
        a tree's latency term (NCCL picks by size)."""
        if group <= 1 or nbytes <= 0:
            return 0.0
        link = self.link(spread, group, op)
        steps, wire = ring_terms(op, group, nbytes)
        if op == "all_to_all" and spread > 1:  # every pair exchanges directly: the node's share crosses the network
            wire = nbytes * (group - group / spread) / group
        return wire / link.bandwidth + steps * link.latency

    def p2p_seconds(self, nbytes: float, spread: int) -> float:
        """One pipeline send of ``nbytes`` between neighbouring stages (``spread`` > 1: across nodes)."""
        if nbytes <= 0:
            return 0.0
        link = self.link(spread, 2)
        return nbytes / link.bandwidth + link.latency


def ring_terms(op: str, group: int, nbytes: float) -> tuple[int, float]:
    """(latency steps, wire bytes per device) of collective ``op`` over ``group`` devices on a buffer of ``nbytes``:
    the ring's bandwidth term, and the smaller of the ring's and a tree's step count (NCCL picks by size).  What
    :meth:`Hardware.collective_seconds` charges, and what ``fxshard calibrate`` fits links to."""
    passes = PASSES[op]
    return passes * min(group - 1, 2 * math.ceil(math.log2(group))), passes * (group - 1) / group * nbytes


def hardware_names() -> list[str]:
    return sorted(p.stem for p in SHIPPED.glob("*.json"))


def load_hardware(name_or_path: str | Path) -> Hardware:
    """A shipped profile by name (``h100``, ``h200``, ``b200``, ``a100``, ``cpu-gloo``) or a JSON file's path;
    every missing or malformed field is named in one message."""
    from fxshard.cost.costs import parse_size

    text = str(name_or_path)
    path = Path(text)
    if not path.is_file():
        shipped = SHIPPED / f"{text.lower()}.json"
        if not shipped.is_file():
            raise OptionError(f"--hardware {text}: expected a profile name ({', '.join(hardware_names())}) or a "
                              "JSON file; found neither; `fxshard calibrate --out FILE` writes one for this machine")
        path = shipped
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise OptionError(f"hardware profile {path}: expected JSON; {type(e).__name__}: {e}") from e
    if not isinstance(data, dict):
        raise OptionError(f"hardware profile {path}: expected a JSON object of fields; found {type(data).__name__}")
    problems = [f"{k} ({why})" for k, why in REQUIRED.items() if k not in data]
    problems += _malformed(data)
    if problems:
        raise OptionError(f"hardware profile {path}: missing or malformed field(s): {'; '.join(problems)}; "
                          "fix the file, or write a measured one with `fxshard calibrate --out FILE`")
    memory = data["memory"]
    try:
        memory = int(memory) if _positive(memory) else parse_size(memory) if isinstance(memory, str) else None
    except OptionError as e:
        raise OptionError(f"hardware profile {path}: field memory: {e}") from e
    if not (isinstance(memory, int) and memory > 0):
        raise OptionError(f"hardware profile {path}: field memory: expected a positive number of bytes or a size "
                          f"such as \"80GiB\"; found {data['memory']!r}")
    return Hardware(name=str(data.get("name", path.stem)),
                    peak_flops={k: float(v) for k, v in data["peak_flops"].items()},
                    memory_bandwidth=float(data["memory_bandwidth"]), memory=memory,
                    devices_per_node=int(data["devices_per_node"]),
                    intra_node=Link(*(float(data["intra_node"][f]) for f in LINK_FIELDS)),
                    inter_node=Link(*(float(data["inter_node"][f]) for f in LINK_FIELDS)),
                    efficiency=DEFAULT_EFFICIENCY | {k: float(v) for k, v in data.get("efficiency", {}).items()},
                    kernel_overhead=float(data.get("kernel_overhead", 0.0)),
                    groups={int(g): Link(*(float(v[f]) for f in LINK_FIELDS))
                            for g, v in data.get("groups", {}).items()},
                    collectives={op: {int(g): Link(*(float(v[f]) for f in LINK_FIELDS)) for g, v in by_group.items()}
                                 for op, by_group in data.get("collectives", {}).items()},
                    overlap=float(data.get("overlap", 1.0)), contention=float(data.get("contention", 1.0)),
                    compute_scale=float(data.get("compute_scale", 1.0)),
                    selective_overhead=float(data.get("selective_overhead", 0.0)),
                    attention_by_seq={int(k): float(v) for k, v in data.get("attention_by_seq", {}).items()},
                    default_dtype=str(data.get("default_dtype", "bf16")), source=str(data.get("source", "")),
                    path=str(path))


def _malformed(data: dict) -> list[str]:
    """Every field's problem, one entry each: types, finiteness (a NaN or an infinity would rank layouts by
    ``nan s``), signs and ranges."""
    out = [f"{key} (expected text, found {data[key]!r})" for key in ("name", "source", "device")
           if key in data and not isinstance(data[key], str)]
    if "default_dtype" in data and data["default_dtype"] not in DTYPE_PEAK:
        out.append(f"default_dtype (expected one of {', '.join(DTYPE_PEAK)}, found {data['default_dtype']!r})")
    kernel = data.get("kernel_overhead", 0.0)
    if not (_number(kernel) and 0 <= kernel < 1):
        out.append(f"kernel_overhead (expected seconds per kernel in [0, 1), found {kernel!r})")
    if "devices_per_node" in data and not (isinstance(data["devices_per_node"], int) and
                                           not isinstance(data["devices_per_node"], bool)):
        out.append(f"devices_per_node (expected a whole number of devices, found {data['devices_per_node']!r})")
    memory = data.get("memory")
    if memory is not None and not (_positive(memory) or isinstance(memory, str)):
        out.append(f"memory (expected a positive number of bytes or a size such as \"80GiB\", found {memory!r})")
    if "measured" in data and not isinstance(data["measured"], dict):
        out.append(f"measured (expected an object, found {type(data['measured']).__name__})")
    flops = data.get("peak_flops")
    if flops is not None and (not isinstance(flops, dict) or not flops
                              or not all(_positive(v) for v in flops.values())):
        out.append("peak_flops (expected a non-empty object of dtype -> positive FLOP/s)")
    for key in ("memory_bandwidth", "devices_per_node"):
        if key in data and not _positive(data[key]):
            out.append(f"{key} (expected a positive number, found {data[key]!r})")
    for key in ("intra_node", "inter_node"):
        link = data.get(key)
        if link is None:
            continue
        if not isinstance(link, dict):
            out.append(f"{key} (expected {{\"bandwidth\": bytes/s, \"latency\": seconds}}, found {link!r})")
            continue
        out += [f"{key}.{f} (expected a positive number, found {link.get(f)!r})" for f in LINK_FIELDS
                if not (_positive(link.get(f)) or (f == "latency" and link.get(f) == 0))]
    groups = data.get("groups", {})
    if not isinstance(groups, dict) or not all(_link_ok(g, v) for g, v in groups.items()):
        out.append("groups (expected an object of group size -> {\"bandwidth\": bytes/s, \"latency\": seconds})")
    collectives = data.get("collectives", {})
    if not isinstance(collectives, dict) or not all(
            op in PASSES and isinstance(by_group, dict) and all(_link_ok(g, v) for g, v in by_group.items())
            for op, by_group in collectives.items()):
        out.append("collectives (expected an object of collective (" + ", ".join(PASSES) + ") -> group size -> "
                   "{\"bandwidth\": bytes/s, \"latency\": seconds})")
    overlap = data.get("overlap", 1.0)
    if not (_number(overlap) and 0 <= overlap <= 1):
        out.append(f"overlap (expected a share in [0, 1], found {overlap!r})")
    contention = data.get("contention", 1.0)
    if not (_number(contention) and contention >= 1):
        out.append(f"contention (expected a number >= 1, found {contention!r})")
    scale = data.get("compute_scale", 1.0)
    if not _positive(scale):
        out.append(f"compute_scale (expected a positive number, found {scale!r})")
    selective = data.get("selective_overhead", 0.0)
    if not (_number(selective) and 0 <= selective < 1):
        out.append(f"selective_overhead (expected seconds per op in [0, 1), found {selective!r})")
    curve = data.get("attention_by_seq", {})
    if not isinstance(curve, dict) or not all(str(k).isdigit() and int(k) > 0 and _positive(v) and v <= 1
                                              for k, v in curve.items()):
        out.append("attention_by_seq (expected an object of sequence length -> share of the peak in (0, 1])")
    eff = data.get("efficiency", {})
    if not isinstance(eff, dict) or not all(_positive(v) and v <= 1 for v in eff.values()):
        out.append("efficiency (expected an object of op class -> share of the peak in (0, 1])")
    return out


def _link_ok(group, link) -> bool:
    return str(group).isdigit() and int(group) > 0 and isinstance(link, dict) and _positive(link.get("bandwidth")) \
        and _number(link.get("latency")) and link["latency"] >= 0


def _number(v) -> bool:
    """A finite number (not a bool: JSON's true is not a quantity)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _positive(v) -> bool:
    return _number(v) and v > 0
