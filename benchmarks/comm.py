"""Count the collectives a training step really issues, next to what is expected and what fxshard states.

Three sources for the tensor-parallel step, side by side:

- **measured**: :class:`CollectiveCounter`, a ``TorchDispatchMode`` active around one step of each
  contender, counts every collective that reaches the dispatcher: ``c10d`` ops (what
  ``torch.distributed.all_reduce`` and friends dispatch to, used by fxshard and the hand-written
  code) and functional collectives (what DTensor uses).  Forward, backward and the optimizer step
  are counted apart.  Bytes are each call's input buffer on one rank (an all-gather's local part).
- **Megatron**: :func:`megatron_expected`, the textbook count for a GPT at tensor parallelism:
  2 all-reduces of B·S·H forward and 2 backward per layer, plus one forward all-reduce for the
  vocab-parallel embedding, one backward all-reduce at the LM head's input, and the vocab-parallel
  cross entropy's 3 forward all-reduces of B·S fp32 values (max, target logit, sum of exponentials).
  fxshard's cross entropy sends the same information in one all-gather of 2 values per token per rank.
- **stated by fxshard**: the generated file's header line and ``manifest.json``'s list of each rank's
  collectives (``Manifest.ranks[i].collectives``), before anything runs (:func:`fxshard_stated`).
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.common import markdown_table
from fxshard.codegen.manifest import Manifest
from fxshard.ir.comm import KINDS

# op name -> index of the argument holding this rank's input tensor(s)
_C10D_INPUT = {
    "allreduce_": 0, "allreduce_coalesced_": 0, "broadcast_": 0, "reduce_": 0,
    "allgather_": 1, "_allgather_base_": 1, "allgather_into_tensor_coalesced_": 1, "allgather_coalesced_": 1,
    "reduce_scatter_": 1, "_reduce_scatter_base_": 1, "reduce_scatter_tensor_coalesced_": 1,
    "alltoall_": 1, "alltoall_base_": 1, "gather_": 1, "scatter_": 1,
}
_FUNCTIONAL = {"all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
               "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast"}
# one vocabulary for both families, so the contenders' counts line up
_CANONICAL = {"allreduce_": "all_reduce", "allreduce_coalesced_": "all_reduce", "all_reduce_coalesced": "all_reduce",
              "allgather_": "all_gather", "_allgather_base_": "all_gather", "all_gather_into_tensor": "all_gather",
              "allgather_into_tensor_coalesced_": "all_gather", "all_gather_into_tensor_coalesced": "all_gather",
              "allgather_coalesced_": "all_gather", "reduce_scatter_": "reduce_scatter",
              "_reduce_scatter_base_": "reduce_scatter", "reduce_scatter_tensor": "reduce_scatter",
              "reduce_scatter_tensor_coalesced": "reduce_scatter", "broadcast_": "broadcast",
              "alltoall_": "all_to_all", "alltoall_base_": "all_to_all", "all_to_all_single": "all_to_all"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(v) for v in x)
    return 0


class CollectiveCounter(TorchDispatchMode):
    """Count collectives (calls and bytes per kind) issued while active, under the current phase.

    ::

        counter = CollectiveCounter()
        with counter:
            counter.phase = "forward"; loss = model(x)
            counter.phase = "backward"; loss.backward()
        counter.counts   # {"forward": {"all_reduce": {"calls": 9, "bytes": ...}}, ...}
    """

    def __init__(self):
        super().__init__()
        self.phase = "step"
        self.counts: dict[str, dict[str, dict[str, int]]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # let DTensor run first: it lowers to collectives on plain tensors, which come back here
            return NotImplemented
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        namespace = getattr(func, "namespace", "")
        name = func._overloadpacket.__name__ if hasattr(func, "_overloadpacket") else ""
        if namespace == "c10d" and name in _C10D_INPUT:
            self._add(_CANONICAL.get(name, name), _nbytes(args[_C10D_INPUT[name]]))
        elif namespace == "_c10d_functional" and name in _FUNCTIONAL:
            self._add(_CANONICAL.get(name, name), _nbytes(args[0]))
        return out

    def _add(self, kind: str, nbytes: int) -> None:
        entry = self.counts.setdefault(self.phase, {}).setdefault(kind, {"calls": 0, "bytes": 0})
        entry["calls"] += 1
        entry["bytes"] += nbytes


def megatron_expected(batch: int, seq: int, hidden: int, vocab: int, layers: int, tp: int,
                      dtype_bytes: int = 4) -> dict:
    """The Megatron-LM count for one training step of the GPT at ``tp`` (see the module docstring)."""
    act = batch * seq * hidden * dtype_bytes
    loss = 3 * batch * seq * 4  # max, target logit, sum of exponentials: one fp32 value per token each
    return {
        "forward": {"all_reduce": {"calls": 2 * layers + 4, "bytes": (2 * layers + 1) * act + loss}},
        "backward": {"all_reduce": {"calls": 2 * layers + 1, "bytes": (2 * layers + 1) * act}},
    }


_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4}
_HEADER = re.compile(r"^# collectives per \w+: (forward .*?)(?: \(returning .*\))?$", re.M)


def fxshard_stated(out: Path, manifest: Manifest, rank: int = 0) -> dict:
    """What fxshard's output says rank ``rank`` issues per step: the header line and the manifest's list."""
    entry = manifest.ranks[rank]
    header = _HEADER.search((Path(out) / entry.file).read_text())
    counts: dict[str, dict[str, dict[str, int]]] = {}
    for c in entry.collectives:
        if c.outputs_only:  # not issued in training
            continue
        nbytes = _DTYPE_BYTES.get(c.dtype, 4)
        for s in c.shape:
            nbytes *= s
        forward = KINDS[c.op].forward  # copy_to and copy_to_linears issue nothing forward
        phases = [("forward", forward)] if forward else []
        if c.backward:
            phases.append(("backward", c.backward))
        for phase, kind in phases:
            # "shape" is the collective's input as this rank holds it; the one case where backward sends
            # less is scatter's backward all-gather, whose input is this rank's part of that tensor
            part = nbytes if kind == "all_reduce" or phase == "forward" else nbytes // getattr(manifest.layout, c.group)
            e = counts.setdefault(phase, {}).setdefault(kind, {"calls": 0, "bytes": 0})
            e["calls"] += 1
            e["bytes"] += part
    return {"header": header.group(1) if header else None, "manifest": counts}


def describe(counts: dict, phase: str) -> str:
    """``"9 all_reduce (4.5 MB), 1 all_gather (2.0 MB)"`` for one phase; ``"none"`` if it has none."""
    kinds = counts.get(phase, {})
    if not kinds:
        return "none"
    return ", ".join(f"{v['calls']} {k} ({_size(v['bytes'])})" for k, v in sorted(kinds.items()))


def _size(nbytes: int) -> str:
    return f"{nbytes / 1e6:.2f} MB" if nbytes >= 10_000 else f"{nbytes / 1e3:.2f} kB"


def markdown(tp_results: list[dict]) -> str:
    """One table: per model size, the measured counts of each contender next to Megatron and fxshard's own."""
    rows = []
    for r in tp_results:
        size = r["model"]["size"]
        c = r["collectives"]
        for name, counts in c["measured"].items():
            rows.append([size, f"{name}, measured", describe(counts, "forward"), describe(counts, "backward"),
                         describe(counts, "optimizer")])
        rows.append([size, "Megatron, expected", describe(c["megatron"], "forward"),
                     describe(c["megatron"], "backward"), "none"])
        stated = c["fxshard_stated"]
        rows.append([size, "fxshard manifest.json, stated", describe(stated["manifest"], "forward"),
                     describe(stated["manifest"], "backward"), "—"])
        fwd, _, bwd = (stated["header"] or "?; ?").partition("; ")
        rows.append([size, "fxshard rank file header, stated", fwd.removeprefix("forward "),
                     bwd.removeprefix("backward "), "—"])
    header = ["model", "source", "forward", "backward", "optimizer step"]
    return ("Collectives one rank issues per training step at tp=2 (calls, and bytes of this rank's input "
            "buffers), counted at run time by a dispatch mode around one step.\n\n" + markdown_table(header, rows))
