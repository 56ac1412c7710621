"""``fxshard plan --auto``: every layout that divides the devices, those that fit, ranked by predicted step time.

The axes, in the mesh's order: tp (within a node, sizes the model divides by), cp (once ``Layout`` has it), pp (at
most one stage per block) with its schedule and virtual stages, dp the rest, ep carved out of dp (dividing the
experts), the ZeRO stage, sp, recompute, and the microbatch size (1, 2, 4, ... 64 rows; at pp=1 the rest of a dp
rank's batch is accumulated, ``fxshard run --grad-accum``).  Less recompute is never slower, so each layout takes
the least recompute that fits (as ``--recompute auto`` does).  Every candidate's memory is checked first (the
plan's verdict); the fitting ones are ranked by a lower bound of their step (no bubble), and the pipeline of each is
simulated in that order until the bound of the next cannot beat the ones kept::

    result = search(profile, load_hardware("h100"), gpus=64, setting=Setting(4096, 512, 8))
    result.ranked[0].layout, result.ranked[0].step
"""

from __future__ import annotations

import dataclasses
import heapq
import time
from dataclasses import dataclass, field

from fxshard.cost.hardware import Hardware
from fxshard.cost.profile import ModelProfile, S, b
from fxshard.cost.timemodel import Evaluator, Prediction, Setting, lower_bound, peaks_by_mode, predict
from fxshard.errors import LayoutError, divisors
from fxshard.ir.cut import schedule_accepts
from fxshard.ir.layout import Layout
from fxshard.units import human_bytes

MAX_ROWS = 64  # microbatch sizes tried: 1, 2, 4, ... up to this (and a dp rank's whole batch)
MODES = ("none", "selective", "full")
KEEP = 12  # predictions kept while searching (the best few are printed)
HAS_CP = "cp" in {f.name for f in dataclasses.fields(Layout)}


@dataclass(frozen=True)
class Candidate:
    layout: Layout
    accumulate: int = 1  # pp=1: batches accumulated per step


@dataclass
class SearchResult:
    ranked: list[Prediction]  # fitting, best first (with .accumulate)
    setting: Setting
    gpus: int
    considered: int = 0  # layouts that divide
    fitting: int = 0
    simulated: int = 0
    seconds: float = 0.0  # wall clock
    cpu_seconds: float = 0.0  # this process's CPU time (on a shared machine the wall clock also holds the others')
    notes: list[str] = field(default_factory=list)


def search(profile: ModelProfile, hw: Hardware, gpus: int, setting: Setting, dtype: str | None = None,
           top: int = 5, evaluator: Evaluator | None = None) -> SearchResult:
    """The fitting layouts of ``gpus`` devices, best predicted step first; refusals say why none divides or fits."""
    started, cpu = time.perf_counter(), time.process_time()
    ev = evaluator or Evaluator(profile, hw, dtype)
    # an fp8 search proposes --dtype fp8 layouts: the compile command it prints is fp8's, and a layout fp8 refuses
    # (Layout says why) is not among them; under --cp its amaxes go over cp x tp (the time model prices them)
    at = "fp8" if "fp8" in (dtype, profile.dtype) else ev.dtype
    candidates = list(layouts(profile, gpus, setting, at))
    if not candidates:
        raise LayoutError(_nothing_divides(profile, gpus, setting, at))
    fitting, closest = [], None
    for base in candidates:
        fit, over = _least_recompute(ev, base, setting)
        if fit is not None:
            fitting.append(fit)
        elif closest is None or over[0] < closest[0]:
            closest = (over[0], over[1], over[2])
    if not fitting:
        raise LayoutError(_nothing_fits(ev, gpus, setting, closest))
    bounded = sorted(((lower_bound(ev, c.layout, setting, c.accumulate), i, c) for i, c in enumerate(fitting)))
    kept: list[tuple[float, int, Prediction]] = []
    simulated = 0
    for bound, i, c in bounded:
        if len(kept) >= max(KEEP, top) and bound >= -kept[0][0]:
            break
        p = predict(ev, c.layout, setting, c.accumulate)
        simulated += 1
        heapq.heappush(kept, (-p.step, i, p))
        if len(kept) > max(KEEP, top):
            heapq.heappop(kept)
    ranked = [p for _, _, p in sorted(kept, key=lambda e: (-e[0], e[1]))][:top]
    return SearchResult(ranked, setting, gpus, len(candidates), len(fitting), simulated,
                        time.perf_counter() - started, time.process_time() - cpu)


def layouts(profile: ModelProfile, gpus: int, setting: Setting, dtype: str):
    """Every layout of ``gpus`` devices the model and the batch divide (recompute left at none)."""
    blocks = len(profile.kinds)
    for cp in _cp_sizes(gpus, setting):
        for tp in divisors(gpus // cp):
            if tp > setting.gpus_per_node:
                continue
            for sp in (False, True) if tp > 1 else (False,):
                if profile.valid_tp(tp, sp, {S: setting.seq // cp, b: 1}) is not None:
                    continue
                for pp in divisors(gpus // (cp * tp)):
                    if pp > 1 and pp > blocks:
                        continue
                    dp = gpus // (cp * tp * pp)
                    if setting.global_batch % dp:
                        continue
                    yield from _with_dp(profile, dict(tp=tp, pp=pp, dp=dp, sp=sp, dtype=dtype,
                                                      **({"cp": cp} if HAS_CP else {})), setting, blocks)


def _cp_sizes(gpus: int, setting: Setting) -> list[int]:
    if not HAS_CP:
        return [1]
    return [c for c in divisors(gpus) if c <= 8 and setting.seq % (2 * c) == 0]


def _with_dp(profile, axes: dict, setting: Setting, blocks: int):
    dp, pp = axes["dp"], axes["pp"]
    local = setting.global_batch // dp
    eps = [e for e in divisors(dp) if profile.experts and profile.experts % e == 0] or [1]
    zeros = (0, 1, 2, 3) if dp * axes.get("cp", 1) > 1 else (0,)
    for ep in eps:
        for zero in zeros:
            for rows in _rows(local):
                m = local // rows
                for schedule, v in _schedules(pp, blocks, zero):
                    try:
                        layout = Layout(ep=ep, zero=zero, **axes, **({"schedule": schedule, "virtual_stages": v,
                                                                      "microbatches": m} if pp > 1 else {}))
                    except LayoutError:
                        continue
                    if pp > 1 and not schedule_accepts(layout, m):
                        continue
                    yield Candidate(layout, 1 if pp > 1 else m)


def _rows(local: int) -> list[int]:
    rows = [r for r in (2**k for k in range(7)) if r <= min(local, MAX_ROWS) and local % r == 0]
    return rows + ([local] if local <= MAX_ROWS and local not in rows else [])


def _schedules(pp: int, blocks: int, zero: int):
    if pp == 1:
        yield "1f1b", None
        return
    yield "gpipe", None
    yield "1f1b", None
    for v in range(2, 9):
        if pp * v <= blocks:
            yield "interleaved-1f1b", v
    for v in (1, 2):
        if pp * v <= blocks and zero != 3:
            yield "zero-bubble", v


def _least_recompute(ev, c: Candidate, setting: Setting):
    """(the candidate with the least recompute that fits, None) or (None, (overshoot, layout, peak))."""
    best = None
    modes = MODES if ev.profile.kinds else ("none",)
    verdicts = peaks_by_mode(ev, c.layout, setting, c.accumulate, modes)
    for mode in modes:
        layout = dataclasses.replace(c.layout, recompute=mode)
        peak = verdicts[mode]
        if peak <= ev.hw.memory:
            return Candidate(layout, c.accumulate), None
        if best is None or peak < best[2]:
            best = (peak - ev.hw.memory, Candidate(layout, c.accumulate), peak)
    return None, best


def _nothing_divides(profile: ModelProfile, gpus: int, setting: Setting, dtype: str) -> str:
    near = _near_counts(profile, gpus, setting, dtype)
    tps = [t for t in range(1, setting.gpus_per_node + 1) if profile.valid_tp(t, False, {S: setting.seq, b: 1}) is None]
    return (f"--gpus {gpus}: expected a device count the layouts divide; found none: tp must divide the model's sizes "
            f"(tp in {tps}, at most --gpus-per-node {setting.gpus_per_node}), pp at most its {len(profile.kinds)} "
            f"repeated blocks, and dp the global batch of {setting.global_batch}; use --gpus in "
            f"{sorted(near) or '{}'} or a --batch that {gpus // max(1, max(tps))} or more ranks divide")


def _near_counts(profile: ModelProfile, gpus: int, setting: Setting, dtype: str, want: int = 4,
                 tries: int = 64) -> list[int]:
    """The device counts nearest ``gpus`` that some layout divides, found without a loop over counts: a layout's count
    is cp x tp x pp x dp with each factor in its own short list (tp the valid sizes within a node, pp up to the
    blocks, dp a divisor of the global batch, cp up to 8), so the candidates are those products, nearest first, each
    confirmed by :func:`layouts` (at most ``tries``: its schedules or microbatches may still refuse one)."""
    blocks = max(1, len(profile.kinds))
    counts = set()
    for cp in _cp_sizes_any(setting):
        tps = [t for t in range(1, setting.gpus_per_node + 1)
               if any(profile.valid_tp(t, sp, {S: setting.seq // cp, b: 1}) is None for sp in (False, True))]
        for tp in tps:
            for pp in range(1, blocks + 1):
                counts.update(cp * tp * pp * dp for dp in divisors(setting.global_batch))
    counts.discard(gpus)
    found = []
    for n in sorted(counts, key=lambda n: (abs(n - gpus), n))[:tries]:
        if _divides(profile, n, setting, dtype):
            found.append(n)
            if len(found) == want:
                break
    return sorted(found)


def _cp_sizes_any(setting: Setting) -> list[int]:
    return [c for c in range(1, 9) if setting.seq % (2 * c) == 0] if HAS_CP else [1]


def _divides(profile, n: int, setting: Setting, dtype: str) -> bool:
    return next(iter(layouts(profile, n, setting, dtype)), None) is not None


def _nothing_fits(ev: Evaluator, gpus: int, setting: Setting, closest) -> str:
    over, c, peak = closest
    fixes = []
    for more in (2, 4, 8):
        if _fits_any(ev, gpus * more, setting):
            fixes.append(f"{gpus * more} devices (--gpus {gpus * more})")
            break
    for shorter in (2, 4, 8):
        if (setting.seq // shorter >= 1
                and _fits_any(ev, gpus, dataclasses.replace(setting, seq=setting.seq // shorter))):
            fixes.append(f"a sequence of {setting.seq // shorter} (--seq {setting.seq // shorter})")
            break
    recompute = "" if c.layout.recompute == "full" else " (recompute cannot help: the model has no repeated blocks)"
    return (f"no layout of {gpus} devices fits {human_bytes(ev.hw.memory)} per device ({ev.hw.name}): the closest, "
            f"{c.layout.describe()}, peaks at {human_bytes(peak)} on its worst rank, {human_bytes(over)} over, even "
            f"under --recompute {c.layout.recompute}{recompute}; "
            + (f"what would fit: {' or '.join(fixes)}" if fixes else
               "neither more devices (up to 8x) nor a shorter sequence (down to 1/8) fit; use a larger device")
            + f", or a device with at least {human_bytes(peak)}")


def _fits_any(ev: Evaluator, gpus: int, setting: Setting) -> bool:
    for c in layouts(ev.profile, gpus, setting, ev.dtype):
        if _least_recompute(ev, c, setting)[0] is not None:
            return True
    return False


def explain(best: Prediction, other: Prediction) -> str:
    """Why ``other`` is slower than ``best``: the terms that grew most, in milliseconds."""
    if other is best:
        return "best"
    deltas = sorted(((other.terms.get(k, 0.0) - best.terms.get(k, 0.0), k) for k in best.terms), reverse=True)
    worse = [f"+{d * 1e3:.1f} ms {k}" for d, k in deltas if d > 1e-3 * best.step][:2]
    better = [f"-{-d * 1e3:.1f} ms {k}" for d, k in deltas[::-1] if d < -1e-3 * best.step][:1]
    return ", ".join(worse + better) or f"+{(other.step - best.step) * 1e3:.2f} ms overall"
