"""``fxshard verify``'s comparison: distributed training against one device, from the same weights and batches.

:func:`fxshard.driver.verify` runs both; here every rank's trained slices are reassembled by the manifest's slice
records into full tensors (:func:`gather_parameters`) and compared with the single-device model trained by
:func:`fxshard.train.reference.reference_losses` (:func:`compare_parameters`, :class:`Verification`)::

    rows = compare_parameters(gather_parameters(manifest, folder), single, initial, quiet)
    update_share(rows)          # ||distributed - single|| / ||single - initial||
    judged_apart(rows, 1e-3)    # the quiet parameters that share cannot hold, judged by adamw_reach instead

The batch norms' running statistics are compared alike (:func:`compare_running_stats`, from
``gather_parameters(manifest, folder, kind="buffer")``): training never reads them, so only their own comparison
finds them wrong.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import load_file

from fxshard.codegen.manifest import Manifest
from fxshard.errors import FxshardError
from fxshard.ir.context import Layout
from fxshard.runtime.slices import assemble

DEFAULT_RTOL = {"fp32": 1e-5, "bf16": 2e-2, "fp64": 1e-9, "fp8": 2e-2}  # losses, relative
# Parameters: ||distributed - single|| / ||single - initial|| over all trained parameters, the difference as
# a share of what training changed.  Measured on samples/gpt.py after 3 steps: 1e-5 at fp32 in every
# layout, 0.03-0.10 under bf16 (8 significant bits; Adam turns gradients at rounding-noise level into
# +-lr steps), while a gradient left unsynchronized on half the model gives 0.7.  The bf16 figures are twice bf16's
# own error against fp32 training, so two correct bf16 runs that round differently (ranks, GPU kernels) agree within
# them: tests/check/test_verify_tolerance.py.  A per-tensor
# ||diff|| / ||single|| is no test: a bias that starts at 0 has only its update as its norm.
# Under --fp64 (fxshard.check.fp64) rounding is 2**29 times smaller: a ResNet whose fp32 training is 7e-2 of the
# update off itself in float64 shows 1e-13 at dp2 and tp2 in float64, and a real error keeps its size.
DEFAULT_PARAM_RTOL = {"fp32": 1e-3, "bf16": 0.25, "fp64": 1e-6, "fp8": 0.25}  # fp8: bf16 with fp8 linears
# fp8 linears over an fp32 model (--fp8 at --dtype fp32): losses within 2e-4, parameters within 1e-2 of the update.
# A float8 rounding is a step (one e4m3 step is 1/8 of a value, one e5m2 step 1/4), so an fp32-rounding difference
# upstream (tp's partial sums) moves an element sitting on a boundary by a whole step, and Adam's first, sign-like
# step carries it on.  Measured on samples/llama.py, 3 steps, tensorwise, one device: weights perturbed by a relative
# 1e-7 (fp32 rounding) move the losses by up to 7.9e-5 (fp32 training: 0) and by 1e-6 up to 1.1e-4; tp2 with sp
# differs from one device by 7.9e-5, tp2 x dp2 by 4e-8, dp2 by 0.  The same recipe with its scales over half batches
# (a missed amax reduction) differs by 1.5e-4, 4.5e-4, 7.3e-4 over the 3 steps, and fp8 from fp32 training by 2.9e-4.
# Parameters, without tp (every forward one device's): within 1e-2 of the update (dp, pp: met).  Under tp, bf16's 0.25:
# tensorwise, one device's weights perturbed by a relative 1e-7 move the parameters by 0.142 of the update (a scale
# moves every element's rounding, and Adam's sign-like first step turns small flipped gradients into +-lr), and tp2
# differs by 0.142; rowwise tp2 by 0.151 (its products come out in bf16, so tp's partial sums round at bf16).  A
# missed amax reduction moves them by 0.23, within reach of that noise: under tp the losses and
# tests/runtime/test_fp8_tp.py (each rank's products against one device's, bit for bit) catch it, not this share.
# Rowwise under --cp is held as under tp: each cp rank's weight gradient over its own tokens comes out in bf16 before
# the ranks' sum (cp2 on samples/llama.py: losses 2.3e-5, parameters 3.8e-2 of the update); its amaxes over cp's
# tokens are tests/runtime/test_fp8_tp.py's split="rows", bit for bit.
FP8_RTOL, FP8_PARAM_RTOL, FP8_TP_PARAM_RTOL = 2e-4, 1e-2, 0.25


def default_tolerances(layout: Layout) -> tuple[float, float]:
    """The losses' relative tolerance and the parameters' share of the update that ``layout``'s dtype allows."""
    if layout.fp8_recipe is not None and not layout.mixed:
        partial = layout.tp > 1 or (layout.cp > 1 and layout.fp8_recipe == "rowwise")  # sums of bf16-rounded parts
        return FP8_RTOL, FP8_TP_PARAM_RTOL if partial else FP8_PARAM_RTOL
    return DEFAULT_RTOL[layout.dtype], DEFAULT_PARAM_RTOL[layout.dtype]


# A parameter whose gradient is zero in exact arithmetic (a key projection's bias: softmax ignores a shift that all
# keys share) gets rounding noise as its gradient, and AdamW divides a gradient by its own size: each run moves it by
# up to lr per step, in directions the noise picks (CLIP's key biases: gradient RMS 4e-8 of the model's; their updates
# made 1e-2 of all the updates' difference at tp2 with losses exact).  Its update is no measure, so such a "quiet"
# parameter (gradient RMS at most QUIET_GRAD of the model's RMS gradient at every single-device step) may leave the
# update share and be judged alone: it must then lie within twice the farthest AdamW can move an element
# (:func:`adamw_reach`).  Small true gradients are quiet too (Bamba's and Falcon-H1's A_log and dt_bias: 1e-8 to 2e-6
# of the model's RMS), and they train alike on both sides (differences 1e-10), so only the quiet parameters the strict
# share cannot hold leave it (:func:`judged_apart`); a quiet parameter that agrees stays under the strict check.
QUIET_GRAD = {"fp32": 1e-5, "bf16": 1e-3, "fp64": 1e-10, "fp8": 1e-3}


@dataclass(frozen=True)
class Floor:
    """How far one device in fp32 is from one device in float64 (its rounding, amplified by training), beside how
    far the distributed run is from it: losses (largest relative difference) and parameters (share of the update).
    Measured where an fp32 verification fails (:func:`fxshard.check.fp64.rounding_floor`)."""

    loss_rel: float
    param_rel: float
    distributed_loss_rel: float
    distributed_param_rel: float

    def beyond(self, rtol: float, param_rtol: float) -> bool:
        """Whether one device's own rounding exceeds the tolerance: fp32 training cannot judge the model."""
        return self.loss_rel > rtol or self.param_rel > param_rtol

    def describe(self, rtol: float, param_rtol: float) -> str:
        measured = (f"one device in fp32 is {self.loss_rel:.1e} (losses) and {self.param_rel:.1e} of the update "
                    f"(parameters) off one device in float64, the distributed run {self.distributed_loss_rel:.1e} "
                    f"and {self.distributed_param_rel:.1e}")
        if self.beyond(rtol, param_rtol):
            return (f"{measured}: training this model amplifies rounding past the tolerance, so fp32 cannot tell "
                    "an error of the distributed program from rounding; `fxshard verify --fp64` compares the same "
                    "program in float64")
        return f"{measured}: one device's rounding is within the tolerance, so the difference is the distributed run's"


@dataclass
class Verification:
    layout: Layout
    reference: list[float]
    distributed: list[float]
    # per parameter: fqn, shape, max_abs, rel (||diff|| / ||update|| of the tensor), diff_sq, update_sq, quiet
    params: list[dict] = field(default_factory=list)
    rtol: float = 1e-5  # losses, relative
    param_rtol: float = 1e-3  # parameters: ||diff|| / ||update|| over all of them but those judged apart
    quiet_atol: float = 0.0  # quiet parameters judged apart (judged_apart): the largest difference, 2 * adamw_reach
    precision: str = "fp32"  # the tolerances' key: the layout's dtype, or fp64 under --fp64
    floor: Floor | None = None  # where an fp32 verification fails: one device's own rounding (Floor)
    # per batch norm running statistic (running_stats): as params; judged by their share of their own change, at
    # param_rtol.  Training never reads them, so a loss or parameter comparison cannot see them wrong
    stats: list[dict] = field(default_factory=list)

    @property
    def loss_abs(self) -> float:
        return max(abs(a - b) for a, b in zip(self.distributed, self.reference, strict=True))

    @property
    def loss_rel(self) -> float:
        return max(abs(a - b) / max(abs(b), 1e-30) for a, b in zip(self.distributed, self.reference, strict=True))

    @property
    def apart(self) -> set[str]:
        """The quiet parameters judged apart (:func:`judged_apart`): those the strict update share cannot hold."""
        return judged_apart(self.params, self.param_rtol)

    @property
    def judged(self) -> list[dict]:
        """The parameters judged by their share of the update: all but those judged apart (or all, if all are)."""
        apart = self.apart
        return [p for p in self.params if p["fqn"] not in apart] or self.params

    @property
    def quiet(self) -> list[dict]:
        """The quiet parameters judged apart, largest difference first (the other quiet ones are in the share)."""
        apart = self.apart
        return sorted((p for p in self.params if p["fqn"] in apart), key=lambda p: -p["diff_sq"])

    @property
    def quiet_abs(self) -> float:
        return max((p["max_abs"] for p in self.quiet), default=0.0)

    @property
    def param_abs(self) -> float:
        return max(p["max_abs"] for p in self.judged)

    @property
    def param_rel(self) -> float:
        """||distributed - single|| / ||single - initial|| over all parameters: the difference as a share of
        what training changed (a gradient not synchronized, or applied twice, shows as a large share), but those
        judged apart."""
        return update_share(self.params, self.apart)

    @property
    def worst(self) -> dict:
        return max(self.judged, key=lambda p: p["diff_sq"])

    @property
    def stats_rel(self) -> float:
        """The running statistics' ||distributed - single|| / ||single - initial||; 0 without batch norms."""
        return update_share(self.stats) if self.stats else 0.0

    @property
    def ok(self) -> bool:
        return (self.loss_rel <= self.rtol and self.param_rel <= self.param_rtol and self.quiet_abs <= self.quiet_atol
                and self.stats_rel <= self.param_rtol)

    def summary(self) -> str:
        quiet = self.quiet
        names = ", ".join(p["fqn"] for p in quiet[:3]) + (f" and {len(quiet) - 3} more" if len(quiet) > 3 else "")
        apart = (f", and {len(quiet)} quiet parameters (gradient zero up to rounding, judged apart: {names}) max abs "
                 f"{self.quiet_abs:.3e} within {self.quiet_atol:.3e}, twice the farthest AdamW moves an element"
                 if quiet else "")
        floor = f"; {self.floor.describe(self.rtol, self.param_rtol)}" if self.floor is not None else ""
        where = f"{self.layout.describe()}{' in float64' if self.precision == 'fp64' else ''}"
        # no colon in it: scripts/nccl_matrix.py reads the verdict after the first colon past the tolerance
        stats = (f", and the batch norms' running statistics {self.stats_rel:.3e} of their update (most "
                 f"{max(self.stats, key=lambda p: p['diff_sq'])['fqn']}) within the same" if self.stats else "")
        return (f"{where}: losses max abs {self.loss_abs:.3e} rel {self.loss_rel:.3e}; "
                f"parameters max abs {self.param_abs:.3e}, ||diff|| / ||update|| {self.param_rel:.3e} (most: "
                f"{self.worst['fqn']}); tolerance: losses {self.rtol:g} relative, parameters {self.param_rtol:g} of "
                f"the update{stats}{apart}: "
                f"{'OK' if self.ok else 'FAILED'}{floor}")


def check_verify_options(steps: int, rtol: float | None, param_rtol: float | None) -> None:
    """Refuse what would make the comparison meaningless, before anything is compiled or launched."""
    from fxshard.errors import OptionError

    if not (isinstance(steps, int) and steps >= 1):
        raise OptionError(f"--steps {steps}: expected at least 1 training step to compare, e.g. --steps 3")
    for flag, value, example in (("rtol", rtol, "1e-5"), ("param-rtol", param_rtol, "1e-3")):
        if value is not None and not (math.isfinite(value) and value >= 0):
            raise OptionError(f"--{flag} {value}: expected a finite tolerance >= 0, e.g. --{flag} {example} (leave it "
                              "out for the default of the dtype)")


def with_weights(mf, folder: Path):
    """``mf`` whose ``make_model()`` loads ``folder``'s tensors (by the model's own parameter names)."""
    import dataclasses

    from fxshard.codegen.weights import tensor_files

    def make_model() -> torch.nn.Module:
        model = mf.make_model()
        if any(p.is_meta for p in model.parameters()):
            return model  # built on meta for its shapes alone (the --pack check): nothing to load into
        state: dict[str, torch.Tensor] = {}
        for file in sorted(set(tensor_files(folder).values())):
            state |= load_file(str(file))
        missing = [n for n in model.load_state_dict(state, strict=False).missing_keys
                   if n in dict(model.named_parameters())]
        if missing:
            raise FxshardError(f"{folder}: holds no tensor named {missing[0]} (of {len(missing)} parameters "
                               "missing), so verify cannot build the single-device model from it; it loads the "
                               "folder's tensors by the model's own parameter names")
        return model

    return dataclasses.replace(mf, make_model=make_model)


def _share(diff: float, update: float) -> float:
    """``diff / update``; 0 where both are 0 (a parameter training left alone, alike on both sides)."""
    if update > 0:
        return diff / update
    return 0.0 if diff == 0 else float("inf")


def gather_parameters(manifest: Manifest, folder: Path | None = None,
                      states: dict[int, dict[str, torch.Tensor]] | None = None,
                      kind: str = "parameter") -> dict[str, torch.Tensor]:
    """Full trained parameters (``kind="buffer"``: buffers) by source FQN, from the slices the first dp rank of every
    rank entry wrote to ``folder/rank<R>.safetensors`` (or holds in ``states[R]``)."""
    layout = manifest.layout
    pieces: dict[str, dict] = {}
    shapes: dict[str, tuple[int, ...]] = {}
    seen: set[int] = set()
    for rank in range(layout.world_size):
        entry = manifest.rank(layout.coords(rank))
        if id(entry) in seen:  # dp replicas hold the same values (ZeRO 2/3 shards are gathered on save); under
            continue  # --ep each ep rank's entry holds its own experts
        seen.add(id(entry))
        state = states[rank] if states is not None else load_file(str(folder / f"rank{rank}.safetensors"))
        for key, t in entry.tensors.items():
            if t.kind != kind:
                continue
            # copies of a tied weight in several stages are identical (tested); one per slice suffices
            pieces.setdefault(t.source, {})[t.slice] = (t.slice, state[key])
            shapes[t.source] = t.global_shape
    return {fqn: assemble(list(by_slice.values()), shapes[fqn]) for fqn, by_slice in pieces.items()}


def compare_parameters(trained: dict[str, torch.Tensor], single: dict[str, torch.Tensor],
                       initial: dict[str, torch.Tensor], quiet: set[str] = frozenset()) -> list[dict]:
    """Per parameter: shape, largest absolute difference, ||diff|| / ||update|| of the tensor, the squared
    norms of the difference and of the single-device update (``Verification.param_rel`` sums these), and whether
    it is quiet (in ``quiet``, from :func:`quiet_parameters`; :func:`judged_apart` picks those that leave the
    update share)."""
    rows = []
    for fqn, got in sorted(trained.items()):
        # in float64: a float64 program's differences (1e-13) would vanish in an fp32 subtraction
        want = single[fqn].double()
        delta, update = got.double() - want, want - initial[fqn].detach().double()
        rows.append({"fqn": fqn, "shape": list(want.shape), "max_abs": delta.abs().max().item(),
                     "rel": _share(delta.norm().item(), update.norm().item()),
                     "diff_sq": delta.pow(2).sum().item(), "update_sq": update.pow(2).sum().item(),
                     "quiet": fqn in quiet})
    return rows


def running_stats(buffers: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The batch norms' running means and variances of a model's ``named_buffers()``: what training in train mode
    updates and never reads, so only a comparison of their own finds them wrong (a running variance made unbiased
    over a dp rank's part instead of the whole batch: the losses and parameters agree)."""
    return {n: b for n, b in buffers.items() if n.endswith((".running_mean", ".running_var")) and b.is_floating_point()}


def compare_running_stats(trained: dict[str, torch.Tensor], single: dict[str, torch.Tensor],
                          model: torch.nn.Module) -> list[dict]:
    """:func:`compare_parameters` for the batch norms' running statistics (:func:`running_stats`) both sides hold,
    against ``model``'s initial buffers: the rows of :attr:`Verification.stats`."""
    initial = running_stats(dict(model.named_buffers()))
    names = set(running_stats(single)) & set(trained) & set(initial)
    return compare_parameters({n: trained[n] for n in names}, single, initial)


def quiet_parameters(grad_sq: dict[str, list[float | None]], numel: dict[str, int], dtype: str = "fp32") -> set[str]:
    """The parameters whose single-device gradient is zero up to rounding: at every step its RMS is at most
    ``QUIET_GRAD[dtype]`` of the RMS of all gradients that step.  ``grad_sq``: squared gradient norms per step by FQN
    (``reference_losses(..., grad_sq=...)``; None where a parameter got no gradient, which makes it not quiet)::

        quiet_parameters({"k.bias": [1e-18], "k.weight": [4.0]}, {"k.bias": 4, "k.weight": 16})   # {"k.bias"}
    """
    steps = max((len(v) for v in grad_sq.values()), default=0)
    model_rms = []
    for t in range(steps):
        got = [(v[t], numel[n]) for n, v in grad_sq.items() if len(v) > t and v[t] is not None]
        model_rms.append((sum(g for g, _ in got) / max(sum(k for _, k in got), 1)) ** 0.5)
    return {n for n, v in grad_sq.items() if len(v) == steps > 0 and all(
        g is not None and (g / numel[n]) ** 0.5 <= QUIET_GRAD[dtype] * rms
        for g, rms in zip(v, model_rms, strict=True))}


def adamw_reach(optim, steps: int) -> float:
    """The farthest ``steps`` AdamW steps can move one element, whatever its gradients: the sum over steps of the
    step's learning rate times the largest |m_hat| / sqrt(v_hat), which Cauchy-Schwarz bounds by sqrt(sum a_k^2 / b_k)
    (a_k, b_k: the bias-corrected weights of gradient k in m_hat and v_hat; 1 at the first step, 1.0014 at the third
    with torch's betas).  Weight decay only pulls two runs' values together.  ``adamw_reach(OptimConfig(), 3)``:
    about 3.0e-3."""
    from fxshard.train.schedule import lr_schedule

    factor, b1, b2, reach = lr_schedule(optim, steps), optim.beta1, optim.beta2, 0.0
    for t in range(1, steps + 1):
        a = [(1 - b1) * b1 ** (t - k) / (1 - b1 ** t) for k in range(1, t + 1)]
        b = [(1 - b2) * b2 ** (t - k) / (1 - b2 ** t) for k in range(1, t + 1)]
        reach += optim.lr * factor(t - 1) * sum(x * x / y for x, y in zip(a, b, strict=True)) ** 0.5
    return reach


def judged_apart(rows: list[dict], param_rtol: float) -> set[str]:
    """The quiet parameters of ``rows`` that leave the update share: none if the share of all of them is within
    ``param_rtol``; otherwise the quiet ones in order of their difference, largest first, only until the share of the
    rest is within it (all of them if it never is).  A quiet parameter that trains alike on both sides (a small true
    gradient, as Mamba's A_log) so stays under the strict check::

        judged_apart([{"fqn": "w", "diff_sq": 1e-12, "update_sq": 1.0, "quiet": False},
                      {"fqn": "k.bias", "diff_sq": 1e-4, "update_sq": 1e-4, "quiet": True}], 1e-3)   # {"k.bias"}
    """
    apart: set[str] = set()
    for p in sorted((p for p in rows if p.get("quiet")), key=lambda p: -p["diff_sq"]):
        if update_share(rows, apart) <= param_rtol:
            break
        apart.add(p["fqn"])
    return apart


def update_share(rows: list[dict], apart: set[str] = frozenset()) -> float:
    """||distributed - single|| / ||single - initial|| over the parameters of ``rows`` but those in ``apart``."""
    rows = [p for p in rows if p["fqn"] not in apart]
    update = sum(p["update_sq"] for p in rows) ** 0.5
    return (sum(p["diff_sq"] for p in rows) ** 0.5) / max(update, 1e-30)
