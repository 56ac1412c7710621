"""ZeRO 1 as Megatron-Core's distributed optimizer: flat buckets, one reduce-scatter and one all-gather each.

The parameters (in the order the caller gives them, the same on every rank of the group: the stage modules'
``named_parameters``) are packed into contiguous flat buckets of at most ``bucket_bytes`` (a parameter larger
than that gets a bucket of its own); the module's parameters become views of the bucket's parameter buffer and,
from the first step on, their ``.grad`` views of its gradient buffer, so backward accumulates into the buckets
in place.  Each bucket, padded to a multiple of the group size N, is split into N equal contiguous shards; rank
r owns shard r.  Once per step, after every accumulated backward::

    opt.reduce_gradients()   # per bucket: grads /= average_over; reduce_scatter into this rank's shard
    opt.step()               # AdamW on this rank's shards only, then per bucket: all_gather of the parameters
    opt.zero_grad()          # zero the gradient buffers (the views stay)

With :meth:`DistributedOptimizer.gather_before_use` (``fxshard run``'s default, ``--no-overlap-param-gather``
to turn it off) the step leaves each bucket's all-gather in flight (``async_op=True``), as Megatron-Core's
``overlap_param_gather`` does: a forward pre-hook on each module holding a bucket's parameters waits for that
bucket before the module runs, so the next forward's first blocks compute while later buckets still arrive.
Buckets are issued in parameter order, which is the order the generated forward first uses them in (a module's
own parameters, then its blocks in call order).  Whatever else reads parameters between a step and the next
forward (a checkpoint, the final state, the end of training) calls :func:`finish_param_sync` first.  The same
collectives move the same bytes into the same buffers: only the moment of the wait differs, so training is
bitwise the same.

2 collectives per bucket and step, moving (N−1)/N of the bucket each: the bytes of DDP's all-reduce, where
``ZeroRedundancyOptimizer`` adds one broadcast per parameter.  AdamW is elementwise, so stepping a shard (a
flat slice crossing parameter boundaries) is the same arithmetic as torch's per-tensor AdamW (``foreach=False``)
on each whole parameter: one learning rate, weight decay and step count for all (every parameter steps every
step: a parameter that gets no gradient, which torch's AdamW would skip, is refused).  With ``masters`` (fp32
copies of bf16 parameters) AdamW steps an fp32 master shard and the rounded values are gathered in bf16.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from fxshard.errors import FxshardError
from fxshard.runtime import trace
from fxshard.runtime.guard import guarded

# torch 2.13's names, which gloo runs too; older torch has only reduce_scatter_tensor and all_gather_into_tensor
# (NCCL's, same arguments; gloo refuses the first): torch 2.11 on the lent GPU machines failed every --zero 1 run
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor


def bucket_layout(numels: list[int], itemsize: int, bucket_bytes: int) -> list[list[int]]:
    """Which parameters (by index) share a bucket: in order, a new bucket when the next would overflow it.

    >>> bucket_layout([3, 3, 10, 1], itemsize=4, bucket_bytes=32)
    [[0, 1], [2], [3]]"""
    buckets: list[list[int]] = []
    held = 0
    for i, n in enumerate(numels):
        if not buckets or held + n * itemsize > bucket_bytes:
            buckets.append([])
            held = 0
        buckets[-1].append(i)
        held += n * itemsize
    return buckets


@dataclass(frozen=True)
class _Piece:
    """The part of parameter ``index`` (flat elements ``[lo, hi)``) that lies in this rank's shard at ``at``."""

    index: int
    lo: int
    hi: int
    at: int


class _Bucket:
    """One flat parameter buffer and gradient buffer (the module's parameters and gradients are views of them)."""

    def __init__(self, params: list[torch.nn.Parameter], indices: list[int], world: int, rank: int):
        self.indices = indices
        first = params[indices[0]]
        self.starts = []
        numel = 0
        for i in indices:
            self.starts.append(numel)
            numel += params[i].numel()
        self.shard = math.ceil(numel / world)  # padded: N equal shards
        self.lo, self.hi = rank * self.shard, (rank + 1) * self.shard
        self.params = torch.zeros(self.shard * world, dtype=first.dtype, device=first.device)
        self.grads: torch.Tensor | None = None  # allocated at the first reduction (see reduce_gradients)
        with torch.no_grad():
            for i, start in zip(indices, self.starts, strict=True):
                p = params[i]
                view = self.params[start:start + p.numel()].view_as(p)
                view.copy_(p)
                p.data = view
        self.pieces = [_Piece(i, max(self.lo, s) - s, min(self.hi, s + params[i].numel()) - s,
                              max(self.lo, s) - self.lo)
                       for i, s in zip(indices, self.starts, strict=True)
                       if s < self.hi and s + params[i].numel() > self.lo]

    def grad_slot(self, params, k: int) -> torch.Tensor:
        i, start = self.indices[k], self.starts[k]
        return self.grads[start:start + params[i].numel()].view_as(params[i])


class DistributedOptimizer:
    """AdamW with its state, and the fp32 master weights of bf16 parameters, sharded over ``group`` (ZeRO 1).

    ``average_over``: the gradients are divided by it before the reduce-scatter's sum (default: the group's
    size, DDP's average; the experts of expert parallelism are summed over their edp group and divided by dp).
    ``names``: each parameter's name, for messages.  Build it after the parameters hold their values (they are
    copied into the buckets)::

        opt = DistributedOptimizer(list(module.parameters()), OptimConfig(), dp_group)
    """

    def __init__(self, params, config, group, masters=None, bucket_bytes: int | None = None,
                 average_over: int | None = None, names: list[str] | None = None, decayed: list[bool] | None = None):
        bucket_bytes = bucket_bytes or int(config.zero_bucket_mb * 2**20)  # OptimConfig: --zero-bucket-mb
        params = list(params)
        names = names or [f"parameter {i}" for i in range(len(params))]
        keep = [i for i, p in enumerate(params) if p.requires_grad]  # torch's AdamW never steps a frozen one
        self.params, self.names = [params[i] for i in keep], [names[i] for i in keep]
        decayed = [True] * len(self.params) if decayed is None else [decayed[i] for i in keep]
        masters = None if masters is None else [masters[i] for i in keep]
        self.group = group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.average_over = average_over or self.world
        self._index = {id(p): i for i, p in enumerate(self.params)}
        self.buckets: list[_Bucket] = []
        for dtype in dict.fromkeys(p.dtype for p in self.params):  # a bucket holds one dtype
            ids = [i for i, p in enumerate(self.params) if p.dtype == dtype]
            itemsize = torch.empty((), dtype=dtype).element_size()
            for part in bucket_layout([self.params[i].numel() for i in ids], itemsize, bucket_bytes):
                self.buckets.append(_Bucket(self.params, [ids[k] for k in part], self.world, self.rank))
        self.masters = None
        if masters is not None:  # fp32 master shards; the caller drops its full copies
            self.masters = [self._master_shard(b, masters) for b in self.buckets]
        self.shards = self.masters or [b.params[b.lo:b.hi] for b in self.buckets]
        # weight decay, here, on the decayed parameters' elements of each shard (a shard crosses parameters, and the
        # 1-D ones are spared): the multiply AdamW makes first, so its own runs with weight decay 0
        self.weight_decay = config.weight_decay
        self._decayed = [_runs([(c.at, c.at + c.hi - c.lo) for c in b.pieces if decayed[c.index]])
                         for b in self.buckets]
        self.optim = config.make(self.shards or [torch.zeros(1, requires_grad=True)])  # a rank with nothing to train
        for group in self.optim.param_groups:
            group["weight_decay"] = 0.0
        self._reduced = False
        self._deferred = False  # gather_before_use: step() leaves the all-gathers in flight
        self._pending: dict[int, dist.Work] = {}  # bucket index -> its all-gather, issued and not yet waited for
        self._hooks: list = []

    @staticmethod
    def _master_shard(b: _Bucket, masters: list[torch.Tensor]) -> torch.Tensor:
        shard = torch.zeros(b.shard, dtype=torch.float32, device=b.params.device)
        for c in b.pieces:
            shard[c.at:c.at + c.hi - c.lo] = masters[c.index].reshape(-1)[c.lo:c.hi]
        return shard

    @property
    def param_groups(self):
        return self.optim.param_groups

    @property
    def defaults(self):
        return self.optim.defaults

    @property
    def buffer_bytes(self) -> int:
        """Bytes of one bucket set (parameter or gradient buffers), padding included."""
        return sum(b.params.numel() * b.params.element_size() for b in self.buckets)

    def reduce_gradients(self) -> None:
        """Average the gradients over the group: one reduce-scatter per bucket into this rank's shard.  Called
        once per step after the last backward (again: a no-op until :meth:`zero_grad`)."""
        if self._reduced:
            return
        for b in self.buckets:
            self._collect(b)
            b.grads.div_(self.average_over)
            if self.world > 1:
                with guarded("reduce_scatter of a ZeRO-1 gradient bucket over dp", self.group, b.grads):
                    _reduce_scatter(b.grads[b.lo:b.hi], b.grads, group=self.group)
        self._reduced = True

    def _collect(self, b: _Bucket) -> None:
        """The bucket's gradients into its buffer: at the first step autograd made them (each moves in, freed),
        later they are views of it already."""
        if b.grads is None:
            b.grads = torch.zeros_like(b.params)
        for k, i in enumerate(b.indices):
            p = self.params[i]
            if p.grad is None:
                raise FxshardError(
                    f"{self.names[i]}: got no gradient in this step; ZeRO 1 steps every parameter of a bucket, where "
                    "torch's AdamW skips one without a gradient, so training would not be exact: make the parameter "
                    "take part in the loss (or freeze it with requires_grad=False in the model), or use --zero 0/2")
            slot = b.grad_slot(self.params, k)
            if p.grad.data_ptr() != slot.data_ptr():
                slot.copy_(p.grad)
                p.grad = slot

    def grad_pieces(self, weights: dict[int, float]) -> list[tuple[torch.Tensor, float]]:
        """Each parameter's part of this rank's reduced gradient shards, with ``weights[id(p)]``: the pairs of
        :func:`fxshard.train.optim.clip_grad_norm_` (every element is on one rank of the group: no 1/N)."""
        assert self._reduced, "grad_pieces before reduce_gradients"
        return [(b.grads[b.lo + c.at:b.lo + c.at + c.hi - c.lo], weights[id(self.params[c.index])])
                for b in self.buckets for c in b.pieces]

    def step(self, closure=None) -> None:
        """AdamW on this rank's shards; then one all-gather per bucket of the updated parameters (left in flight
        after :meth:`gather_before_use`)."""
        self.finish_param_sync()  # a step before any forward waited (e.g. two steps in a row): the last ones first
        self.reduce_gradients()
        for b, shard in zip(self.buckets, self.shards, strict=True):
            g = b.grads[b.lo:b.hi]
            shard.grad = g.float() if self.masters is not None else g
        self._decay()
        self.optim.step()
        with torch.no_grad():
            for k, (b, shard) in enumerate(zip(self.buckets, self.shards, strict=True)):
                shard.grad = None
                if self.masters is not None:
                    b.params[b.lo:b.hi].copy_(shard)  # rounded to the parameters' dtype
                if self.world > 1:
                    self._gather(k, b)

    def _decay(self) -> None:
        """AdamW's decoupled weight decay, ``p *= 1 - lr * weight_decay``, on the decayed runs of each shard: the
        same multiply torch's foreach AdamW makes on a whole parameter, so bitwise the same."""
        if not self.weight_decay or not self.shards:
            return
        lr = self.optim.param_groups[0]["lr"]  # a scheduler's current learning rate
        runs = [shard[a:b] for shard, decayed in zip(self.shards, self._decayed, strict=True) for a, b in decayed]
        if runs:
            with torch.no_grad():
                torch._foreach_mul_(runs, 1 - lr * self.weight_decay)

    def _gather(self, k: int, b: _Bucket) -> None:
        """Bucket ``k``'s all-gather: waited for here, or (deferred) left in flight with a trace event from its
        issue to its completion on the rank's dp row."""
        what = f"all_gather of ZeRO-1 parameter bucket {k} over dp"
        start = time.perf_counter_ns()
        with guarded(what + (" (issue)" if self._deferred else ""), self.group, b.params):
            work = _all_gather(b.params, b.params[b.lo:b.hi], group=self.group, async_op=self._deferred)
        if not self._deferred:
            return
        self._pending[k] = work
        if trace.enabled():
            from fxshard.runtime.dp_trace import traced_until_done

            traced_until_done(work, f"all_gather (ZeRO-1 bucket {k}, issued by the step)", start, self.group,
                              b.params, bucket=k)

    # ------------------------------------------------------------ overlapped parameter all-gathers

    def gather_before_use(self, modules, per_submodule: bool = True) -> None:
        """From now on :meth:`step` leaves each bucket's all-gather in flight; before a module of ``modules`` (with
        ``per_submodule``, each of their submodules) runs forward, it waits for the buckets of the parameters it
        holds itself.  ``per_submodule=False`` (a forward compiled as one graph, whose submodules' hooks would be
        traced into it): each module waits for all its parameters' buckets before it runs::

            opt.gather_before_use([module])   # step k's gathers overlap step k+1's forward
            ...
            finish_param_sync(opt)            # before reading the parameters anywhere else
        """
        bucket_of = {id(self.params[i]): k for k, b in enumerate(self.buckets) for i in b.indices}
        for module in modules:
            for sub in module.modules() if per_submodule else [module]:
                held = sub.parameters(recurse=not per_submodule)
                needed = sorted({bucket_of[id(p)] for p in held if id(p) in bucket_of})
                if needed:
                    self._hooks.append(sub.register_forward_pre_hook(self._waiter(needed)))
        self._deferred = self.world > 1

    def _waiter(self, needed: list[int]):
        def wait_for_buckets(module, args) -> None:
            for k in needed:
                self._wait(k)

        return wait_for_buckets

    def _wait(self, k: int) -> None:
        work = self._pending.pop(k, None)
        if work is not None:
            with guarded(f"the wait for the all_gather of ZeRO-1 parameter bucket {k} over dp", self.group,
                         self.buckets[k].params):
                work.wait()

    def finish_param_sync(self) -> None:
        """Wait for every parameter all-gather still in flight: the parameters hold the step's values after it."""
        for k in sorted(self._pending):
            self._wait(k)

    @property
    def gathers_in_flight(self) -> list[int]:
        """The buckets whose all-gather was issued and not yet waited for (empty unless deferred)."""
        return sorted(self._pending)

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Zero the gradient buffers; the parameters' ``.grad`` stay views of them (``set_to_none`` is ignored)."""
        for b in self.buckets:
            if b.grads is not None:
                b.grads.zero_()
                for k, i in enumerate(b.indices):
                    self.params[i].grad = b.grad_slot(self.params, k)
        self._reduced = False

    def state_tensors(self) -> list[torch.Tensor]:
        """What this optimizer holds beyond the parameters: Adam moments and fp32 master shards (memory report)."""
        out = list(self.masters or [])
        for st in self.optim.state.values():
            out += [v for v in st.values() if isinstance(v, torch.Tensor)]
        return out

    # ------------------------------------------------------------ checkpoints: state per parameter

    def gathered_state(self) -> dict[int, dict[str, torch.Tensor]]:
        """``{id(p): {"param"?, "exp_avg", "exp_avg_sq", "step"}}`` of every parameter, whole, on the group's rank
        0 (``{}`` elsewhere); "param" is the fp32 master under mixed precision.  Collective over the group."""
        out: dict[int, dict[str, torch.Tensor]] = {}
        for b, shard in zip(self.buckets, self.shards, strict=True):
            state = self.optim.state.get(shard, {})
            kinds = {k: state[k] for k in ("exp_avg", "exp_avg_sq") if k in state}
            if self.masters is not None:
                kinds["param"] = shard
            whole = {k: self._gather_state(v) for k, v in kinds.items()}
            if self.rank != 0:
                continue
            for k, i in enumerate(b.indices):
                p, start = self.params[i], b.starts[k]
                got = {kind: v[start:start + p.numel()].view(p.shape).clone() for kind, v in whole.items()}
                if "step" in state:
                    got["step"] = state["step"].clone()
                out[id(p)] = got
        return out

    def _gather_state(self, shard: torch.Tensor) -> torch.Tensor:
        if self.world == 1:
            return shard
        parts = [torch.empty_like(shard) for _ in range(self.world)] if self.rank == 0 else None
        with guarded("gather of ZeRO-1 optimizer state for a checkpoint", self.group, shard):
            dist.gather(shard.contiguous(), parts, group=self.group, group_dst=0)
        return torch.cat(parts) if self.rank == 0 else shard

    def load_value(self, p: torch.nn.Parameter, value: torch.Tensor) -> None:
        """Make ``value`` (fp32, shaped like ``p``) ``p``'s value: its view of the bucket (rounded to the bucket's
        dtype) and, under mixed precision, this rank's part of the fp32 master shard."""
        with torch.no_grad():
            p.copy_(value)
            i = self._index.get(id(p))
            if i is None or self.masters is None:
                return
            for b, shard in zip(self.buckets, self.masters, strict=True):
                for c in (c for c in b.pieces if c.index == i):
                    shard[c.at:c.at + c.hi - c.lo] = value.reshape(-1)[c.lo:c.hi].to(shard.device, shard.dtype)

    def load_state(self, p: torch.nn.Parameter, state: dict[str, torch.Tensor]) -> None:
        """Take this rank's part of ``p``'s whole Adam state (``exp_avg``, ``exp_avg_sq`` shaped like ``p``,
        ``step``).  Every parameter of a shard must come with the same step."""
        i = self._index.get(id(p))
        if i is None:  # a frozen parameter: no state
            return
        for b, shard in zip(self.buckets, self.shards, strict=True):
            for c in (c for c in b.pieces if c.index == i):
                st = self.optim.state.setdefault(shard, {})
                step = state["step"].float().cpu()
                if "step" in st and float(st["step"]) != float(step):
                    raise FxshardError(f"{self.names[i]}: checkpointed at Adam step {float(step):g}, other parameters "
                                       f"of its ZeRO-1 bucket at {float(st['step']):g}; the checkpoint is inconsistent")
                st["step"] = step
                for kind in ("exp_avg", "exp_avg_sq"):
                    v = st.setdefault(kind, torch.zeros_like(shard))
                    v[c.at:c.at + c.hi - c.lo] = state[kind].reshape(-1)[c.lo:c.hi].to(v.dtype)


def _runs(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent ``[start, end)`` ranges joined (the pieces of neighbouring parameters of a shard)."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def finish_param_sync(opt) -> None:
    """Wait for ``opt``'s parameter all-gathers still in flight (ZeRO 1 with overlapped gathers), before anything but
    the next forward reads the parameters; a no-op for an optimizer that leaves nothing in flight::

        finish_param_sync(run.opt)   # then save a checkpoint, or read the trained parameters
    """
    wait = getattr(opt, "finish_param_sync", None)
    if wait is not None:
        wait()
