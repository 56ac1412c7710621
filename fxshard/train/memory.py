"""Bytes of model state each rank actually holds, next to the ZeRO formulas (``fxshard run --memory-report``).

Measured by walking the tensors a rank holds (unique storages, so views into DDP buckets or FSDP2
all-gather buffers count once):

- **params**: the module's parameters as held between forward and backward — the dp shard under
  ZeRO 3, the gathered parameters plus the shard under ZeRO 2 (FSDP2 keeps both), bf16 parameters
  under mixed precision at ZeRO 0/1;
- **gathered**: the most parameter bytes held at once *during* a forward (ZeRO 3 gathers them before
  use: a transient, not in the formulas);
- **grads**: gradients after backward (DDP's buckets, ZeRO 1's flat gradient buckets, FSDP2's reduce-scattered
  shards);
- **optimizer**: Adam moments and fp32 master weights after the step (only the rank's share at ZeRO ≥ 1).

The formulas (Adam, Ψ parameters on this rank before dp sharding, N dp ranks; their table is
:mod:`fxshard.cost.zero_memory`'s docstring) are what ``fxshard plan`` predicts.  FSDP2 at ZeRO 2 keeps the fp32 shard
next to the gathered parameters, and its gradient shards are fp32 under mixed precision: 4Ψ/N (fp32) or 2Ψ/N (mixed)
above the formula, reported as such.
"""

from __future__ import annotations

import contextlib
import gc
from dataclasses import dataclass, field

import torch

from fxshard.cost.zero_memory import (  # noqa: F401
    FSDP2_ZERO2_EXTRA,
    formula,
    formula_text,
    frozen_formula,
    peak_params,
)
from fxshard.runtime.recompute import watching_kept


def storage_bytes(tensors) -> int:
    """Bytes of the distinct storages behind ``tensors`` (views and aliases count once)."""
    seen, total = set(), 0
    for t in tensors:
        if t is None:
            continue
        t = t._local_tensor if hasattr(t, "_local_tensor") else t  # a DTensor's shard
        ptr = _pointer(t)
        if not ptr or ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes()
    return total


def held_parameters(module: torch.nn.Module) -> list[torch.Tensor]:
    """The registered parameters, plus FSDP2's shards while the gathered parameters are registered."""
    tensors = list(module.parameters())
    for unit in module.modules():  # the module and, under per-block ZeRO 3, each block: one FSDP2 unit each
        state = getattr(unit, "_get_fsdp_state", None)
        group = getattr(state(), "_fsdp_param_group", None) if state else None
        for fp in getattr(group, "fsdp_params", ()):
            tensors.append(fp._sharded_param_data)
            tensors.append(getattr(fp, "_unsharded_param", None))
    return tensors


def optimizer_tensors(opt) -> list[torch.Tensor]:
    if hasattr(opt, "state_tensors"):  # fxshard's MasterWeightAdamW, DistributedOptimizer, ExpertSplitOptimizer
        return opt.state_tensors()
    return [v for st in opt.state.values() for v in st.values() if isinstance(v, torch.Tensor)]


@dataclass
class MemoryProbe:
    """Samples a rank's model-state bytes at the points where each category peaks; in the step run under
    :meth:`measured_step`, also the bytes one microbatch leaves saved for backward (``saved``, summed over
    the rank's stages) and the step's peak of allocated bytes (``peak``)."""

    modules: list[torch.nn.Module]
    pipeline: bool = False  # PipelineStage keeps each microbatch's inputs and outputs until its backward
    sample: dict[str, int] = field(default_factory=lambda: {"params": 0, "gathered": 0, "grads": 0, "optimizer": 0,
                                                            "live": 0, "saved": 0, "peak": 0})
    _watch: dict = field(default_factory=dict)  # id(module) -> SavedTensors while its first forward runs

    def __post_init__(self):
        for m in self.modules:  # registered after FSDP2's hooks: pre sees the gathered, post the resharded state
            m.register_forward_pre_hook(self._before_forward)
            m.register_forward_hook(self._after_forward)
            for unit in m.modules():  # per-block ZeRO 3: each block is gathered when it runs
                if unit is not m and hasattr(unit, "_get_fsdp_state"):
                    unit.register_forward_pre_hook(lambda *_: self._note("gathered", self._params()))

    def _before_forward(self, module, args) -> None:
        self._note("gathered", self._params())
        if self._watch.get(id(module), 0) is None:  # armed by measured_step: this module's first microbatch
            state = list(held_parameters(module)) + list(module.buffers())
            self._watch[id(module)] = SavedTensors(state, args if self.pipeline else ()).__enter__()

    def _after_forward(self, module, args, output) -> None:
        self._note("params", self._params())
        watch = self._watch.get(id(module))
        if isinstance(watch, SavedTensors):
            watch.__exit__(None, None, None)
            watch.add(output if self.pipeline else ())
            self.sample["saved"] += watch.nbytes()
            self._watch[id(module)] = 0

    @contextlib.contextmanager
    def measured_step(self, device: torch.device):
        """Measure the saved bytes of each module's first forward and the peak of allocated bytes in this block.

        CUDA: ``torch.cuda.max_memory_allocated``.  CPU: the bytes of every tensor storage alive at the start
        (model state, batches) plus the most bytes allocated in the block and not yet freed, summed here from the
        allocation events of torch's profiler (``profile_memory``, :func:`_block_peak`).  Storages held outside
        Python at the start (DDP's gradient buckets) are not in the baseline; one freed during the block stays
        counted (the profiler reports such a free only when an earlier profile saw the allocation)."""
        self._watch = {id(m): None for m in self.modules}
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            yield
            torch.cuda.synchronize(device)
            self.sample["peak"] = torch.cuda.max_memory_allocated(device)
            return
        from torch.profiler import ProfilerActivity, profile

        gc.collect()
        base = storage_bytes(o for o in gc.get_objects() if isinstance(o, torch.Tensor))
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            yield
        self.sample["peak"] = base + _block_peak(prof)

    def _params(self) -> int:
        return storage_bytes(t for m in self.modules for t in held_parameters(m))

    def _note(self, key: str, value: int) -> None:
        self.sample[key] = max(self.sample[key], value)

    def after_backward(self, params) -> None:
        self._note("params", self._params())
        self._note("grads", storage_bytes(p.grad for p in params))

    def after_step(self, opt) -> None:
        self._note("optimizer", storage_bytes(optimizer_tensors(opt)))
        self._note("gathered", self.sample["params"])
        # every tensor storage alive in the process, whoever holds it: catches state kept outside the
        # module and optimizer (the categories above only look where state is supposed to be)
        gc.collect()  # what an earlier run in this process left in reference cycles is not this run's
        self._note("live", storage_bytes(o for o in gc.get_objects() if isinstance(o, torch.Tensor)))


def _pointer(t: torch.Tensor) -> int | None:
    """The address of ``t``'s storage, or None for a storage FSDP2 freed (a block's gathered parameters)."""
    try:
        return t.untyped_storage().data_ptr()
    except RuntimeError:
        return None


class SavedTensors:
    """While entered, notes every tensor autograd saves for backward (``saved_tensors_hooks``) and every output a
    selective recompute keeps (torch's checkpoint caches those where the hooks do not see them,
    :func:`fxshard.runtime.recompute.watching_kept`); ``nbytes`` is the bytes of their distinct storages (a view
    counts its base once), leaving out ``state`` (parameters, buffers).  A fully recomputed block shows here as
    its inputs, which checkpoint saves through the hooks."""

    def __init__(self, state, extra=()):
        self.state = {_pointer(s) for s in state if s is not None} - {None}
        self.tensors: list[torch.Tensor] = []  # kept until counted: a freed storage's address could be reused
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)
        self._kept = watching_kept(self._pack)
        self.add(extra)

    def _pack(self, t):
        self.tensors.append(t)
        return t

    def add(self, values) -> None:
        values = values if isinstance(values, (tuple, list)) else (values,)
        self.tensors += [v for v in values if isinstance(v, torch.Tensor)]

    def __enter__(self):
        self._hooks.__enter__()
        self._kept.__enter__()
        return self

    def __exit__(self, *exc):
        self._kept.__exit__(*exc)
        self._hooks.__exit__(*exc)

    def nbytes(self) -> int:
        seen, total = set(self.state), 0
        for t in self.tensors:
            ptr = _pointer(t)
            if ptr and ptr not in seen:
                seen.add(ptr)
                total += t.untyped_storage().nbytes()
        self.tensors = []
        return total


def _block_peak(prof) -> int:
    """The most bytes allocated during profiling and not yet freed, at any allocation event.

    Summed from each CPU event's own size in time order, counting a free only of a block allocated in this
    profile: the allocator's own running total (``total_allocated``) is process-wide and carries what earlier
    profiles allocated and the process freed while no profile ran, so in a process that measured other runs
    before (one spawn, several cases) it read up to 1.6 times the plan where a fresh process read 1.1."""
    from torch._C._profiler import _EventType

    events, stack = [], list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        e = stack.pop()
        stack.extend(e.children)
        if e.tag == _EventType.Allocation and e.extra_fields.device.type == "cpu":
            events.append((e.start_time_ns, e.extra_fields.alloc_size, e.extra_fields.ptr))
    live: dict[int, int] = {}
    total = peak = 0
    for _, size, ptr in sorted(events, key=lambda ev: ev[0]):
        if size > 0:
            live[ptr] = size
            total += size
            peak = max(peak, total)
        elif ptr in live:
            total -= live.pop(ptr)
    return peak


def report_rows(samples: list[dict], layout, plan: dict | str | None = None) -> list[dict]:
    """One row per rank: measured bytes next to the formula for the layout's ZeRO stage and precision, and
    the saved bytes per microbatch and the step's peak next to ``plan`` (:func:`fxshard.cost.costs.planned_memory`:
    per pp rank, or a string saying why there is none)."""
    rows = []
    zero = layout.zero if layout.dp > 1 else 0
    for rank, m in enumerate(samples):
        frozen = m.get("frozen", 0)  # requires_grad=False: the parameter alone, no gradient or optimizer state
        trained = formula(zero, layout.dp, layout.mixed, m["psi"] - frozen)
        still = frozen_formula(zero, layout.dp, layout.mixed, frozen)
        want = {key: trained[key] + still[key] for key in trained}
        total = m["params"] + m["grads"] + m["optimizer"]
        note = ""
        if zero == 2:
            extra = FSDP2_ZERO2_EXTRA[layout.mixed] * (m["psi"] - frozen) / layout.dp
            note = (f"FSDP2 keeps {FSDP2_ZERO2_EXTRA[layout.mixed]}Ψ/N more ({extra / 2**20:.2f} MiB): see "
                    "fxshard.train.memory")
        rows.append({"rank": rank, "coords": layout.coords(rank).to_json(), "psi": m["psi"], "frozen": frozen,
                     "params": m["params"],
                     "grads": m["grads"], "optimizer": m["optimizer"], "total": total, "gathered": m["gathered"],
                     "live": m["live"],
                     "formula": want, "formula_text": formula_text(zero, layout.dp, layout.mixed),
                     "ratio": total / want["total"], "note": note, "saved": m.get("saved", 0),
                     "peak": m.get("peak", 0), "plan": plan.get(layout.coords(rank).pp) if isinstance(plan, dict)
                     else None, "plan_note": plan if isinstance(plan, str) else ""})
    return rows
