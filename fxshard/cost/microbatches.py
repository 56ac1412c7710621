"""The pipeline's microbatch count when ``--microbatches`` is not given and ``--device-memory`` is: the fewest that fit.

Without a device size the default is the fewest microbatches the schedule runs that divide a dp rank's batch
(:func:`fxshard.ir.cut.choose_microbatches`).  That count is the largest microbatch, which is what a pipeline keeps
alive in its warm-up: at a long sequence (the 70B shape at 128k tokens: 2 microbatches of 32 sequences) no recompute
makes it fit, while one sequence per microbatch does.  So with ``--device-memory`` the default becomes the fewest
microbatches under which every rank fits: the default count when it fits (nothing changes), else the fewest larger
count that divides the batch and the schedule accepts.  Under ``--recompute auto`` a count fits when some mode fits
at it, and the mode is then the least that fits at that count: microbatches are raised only where no recompute mode
would fit, so a plan that fits at the default count keeps it (and its recompute choice).  The choice is data on the
report (``report.microbatch_choice``), printed by ``fxshard plan`` and ``fxshard compile --device-memory``, and the
layout the compile writes; an explicit ``--microbatches`` is never changed::

    report = plan_costs("samples/llama70b.py", Layout(tp=8, cp=4, pp=2, zero=1, dtype="bf16", recompute="auto"),
                        seq=131072, device_memory=80 * 2**30)
    report.layout.microbatches, report.microbatch_choice["default"]     # 64, 2

Each count tried is a plan of its own (a compile in memory at that microbatch), so the figures printed for the
chosen count are those ``--microbatches N`` prints.  The search assumes the peak does not grow with the count (the
microbatch shrinks as 1/count while a schedule keeps at most pp of them alive, GPipe all of them of 1/count each):
it tries the count the default's figures predict first (the bytes a microbatch keeps scaled by the microbatch), then
the next fewer counts while they fit, or the next more until one fits.  Under 1F1B that scaling is a lower bound, so
a fewer count it already puts over the device is not planned: one plan more than the default's where the prediction
is right (the 70B shape: 2, then 64).
"""

from __future__ import annotations

from collections.abc import Callable

from fxshard.ir.cut import schedule_accepts


def fit_microbatches(default, at_microbatches: Callable, device_memory: int):
    """The report of the fewest microbatches that fit ``device_memory`` bytes, from ``default`` (the report at the
    default count) and ``at_microbatches(m)`` (the report at ``m``); ``default`` itself when it fits or when no count
    does.  Its ``microbatch_choice`` holds the default, the chosen count, whether it fits, and the worst rank's
    peak at every count tried."""
    layout = default.layout
    first = layout.microbatches
    batch = default.batch_per_dp or first
    counts = [m for m in range(first + 1, batch + 1) if batch % m == 0 and schedule_accepts(layout, m)]
    reports = {first: default}
    choice = {"default": first, "chosen": first, "fits": default.fits, "batch_per_dp": batch,
              "schedule": layout.schedule, "pp": layout.pp, "device_memory": device_memory,
              "tried": {first: _worst(default)}}

    def fits(i: int) -> bool:
        m = counts[i]
        if m not in reports:
            reports[m] = at_microbatches(m)
            choice["tried"][m] = _worst(reports[m])
        return reports[m].fits

    best = default
    if not default.fits and counts:
        i = _predicted(default, counts, device_memory)
        if fits(i):  # down while the next fewer fits (1F1B: not where its bound already exceeds the device)
            while i > 0 and not _beyond(default, counts[i - 1], device_memory) and fits(i - 1):
                i -= 1
        else:  # up until one fits
            i += 1
            while i < len(counts) and not fits(i):
                i += 1
        if i < len(counts):  # else no count fits: the default's figures stay, with what was tried
            best = reports[counts[i]]
            choice |= {"chosen": counts[i], "fits": True}
    best.microbatch_choice = choice
    return best


def _worst(report) -> float:
    """The worst rank's predicted peak under the report's recompute mode (auto: the least that fits, else full)."""
    return max(r["peak"].value for r in report.ranks)


def _predicted(default, counts: list[int], device_memory: int) -> int:
    """The index of the first count at which the default's figures, scaled, fit: the model state stays, the bytes a
    microbatch keeps (activations and the transient) shrink as 1/count with the microbatch (under the least
    recompute the report holds for every rank); the last count when none is predicted to."""
    first = default.layout.microbatches
    modes = [m for m in ("none", "selective", "full") if all(m in r["recompute_peaks"] for r in default.ranks)]
    if not default.recompute_auto:
        modes = [default.recompute]
    for i, m in enumerate(counts):
        for mode in modes:
            if all(_scaled(r, mode, first / m) <= device_memory for r in default.ranks):
                return i
    return len(counts) - 1


def _beyond(default, m: int, device_memory: int) -> bool:
    """Whether ``m`` microbatches certainly do not fit, from the default's figures: under 1F1B a rank keeps the same
    microbatches alive at every count of at least pp, and each byte count a microbatch keeps is ``a*b + c`` in its
    rows ``b`` (``c >= 0``), so the default's bytes scaled by default/m are a lower bound (a plan saved)."""
    if default.layout.schedule != "1f1b":
        return False
    modes = [default.recompute] if not default.recompute_auto else ("none", "selective", "full")
    factor = default.layout.microbatches / m
    return all(any(_scaled(r, mode, factor) > device_memory for r in default.ranks)
               for mode in modes if all(mode in r["recompute_peaks"] for r in default.ranks))


def _scaled(row: dict, mode: str, factor: float) -> float:
    peak = row["recompute_peaks"][mode].value
    state = row["model_state"].value  # the same under every mode
    return state + (peak - state) * factor


def describe(choice: dict) -> str:
    """One line for ``fxshard plan`` and ``fxshard compile --device-memory``: the count, why, what was tried."""
    from fxshard.units import human_bytes

    device, batch, m = human_bytes(choice["device_memory"]), choice["batch_per_dp"], choice["chosen"]
    tried = ", ".join(f"{k}: {human_bytes(p)}" for k, p in sorted(choice["tried"].items()))
    default = (f"the default {choice['default']}, the fewest {choice['schedule']} runs at pp={choice['pp']} that "
               f"divide the batch of {batch} per dp rank")
    if m != choice["default"]:
        why = (f"chosen for --device-memory {device}: {default}, does not fit every rank; {m} is the fewest that "
               "divide it and fit")
    elif choice["fits"]:
        why = f"{default}: it fits every rank in {device}"
    else:
        why = f"{default}: no count that divides the batch fits every rank in {device}"
    return (f"microbatches: {m} of {batch // m} row(s) per dp rank ({why}; worst rank's peak by count: {tried}; "
            "--microbatches N sets it)")
