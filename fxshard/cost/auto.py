"""What ``fxshard plan --auto``, ``fxshard compile --auto`` and ``fxshard plan --hardware`` ask of the time model.

The options are checked here, before the capture, so a bad device count or profile is refused in a second; then
the model is captured once (:func:`fxshard.cost.profile.model_profile`) and searched
(:func:`fxshard.cost.search.search`) or one layout predicted (:func:`fxshard.cost.timemodel.predict`)::

    found = plan_auto("samples/llama70b.py", "bf16", AutoOptions(auto=True, gpus=64, hardware="h100"), seq=4096,
                      batch=512)
    found.result.ranked[0].layout.describe(), found.result.ranked[0].step
    compile_command("samples/llama70b.py", found.result.ranked[0])
"""

from __future__ import annotations

import shlex
import time
from dataclasses import dataclass, fields, replace
from pathlib import Path

from fxshard.cost.auto_options import AutoOptions
from fxshard.cost.hardware import Hardware, load_hardware
from fxshard.errors import OptionError
from fxshard.flags import flags
from fxshard.ir.layout import Layout

# the layout flags --auto chooses itself; the others (--dtype, --overlap) it takes as given
CHOSEN = ("tp", "pp", "dp", "zero", "schedule", "microbatches", "virtual_stages", "recompute", "sp", "ep", "cp",
          "cp_mode")


@dataclass
class AutoPlan:
    result: object  # fxshard.cost.search.SearchResult
    profile: object  # fxshard.cost.profile.ModelProfile
    hardware: Hardware
    capture_seconds: float  # the one capture and the compiles of its pieces
    model: str
    dtype: str = "fp32"  # the compute dtype searched
    dtype_note: str = ""  # where it came from, when --dtype did not say


def check_auto(options: AutoOptions, layout: Layout) -> Hardware:
    """Refuse what --auto cannot search, naming the flag (the options' own checks are :class:`AutoOptions`'s); the
    hardware profile it searches for."""
    if options.gpus is None:
        raise OptionError("--auto: expected --gpus N, the devices to lay the model out on; found none")
    if options.hardware is None:
        raise OptionError("--auto: expected --hardware PROFILE (h100, h200, b200, a100, cpu-gloo, or a file "
                          "`fxshard calibrate` wrote) to predict step times on; found none")
    given = [f.flag for f in flags(Layout) if f.name in CHOSEN and getattr(layout, f.name) != f.default]
    if given:
        raise OptionError(f"--auto chooses the layout itself; found {', '.join(given)} as well: drop them, or drop "
                          "--auto to cost that layout (`fxshard plan ... --hardware PROFILE` predicts its step)")
    hw = load_hardware(options.hardware)
    per_node = options.gpus_per_node or hw.devices_per_node
    if options.gpus > per_node and options.gpus % per_node:
        raise OptionError(f"--gpus {options.gpus} over nodes of {per_node} (--gpus-per-node): expected whole nodes; "
                          f"found {options.gpus % per_node} devices left over; use --gpus "
                          f"{options.gpus - options.gpus % per_node} or "
                          f"{options.gpus - options.gpus % per_node + per_node}")
    return hw


def _positive(flag: str, value: int) -> None:
    if value < 1:
        raise OptionError(f"{flag} must be at least 1, got {value}")


def setting_for(profile, hw: Hardware, gpus_per_node: int | None, seq: int | None, batch: int | None):
    """The sequence, batch (sequences per step, over all dp ranks) and devices per node the search and the
    prediction evaluate at."""
    from fxshard.cost.profile import S
    from fxshard.cost.timemodel import Setting

    example_seq = profile.example[S]
    if seq is not None:
        _positive("--seq", seq)
    return Setting(seq or int(example_seq), batch or profile.batch, gpus_per_node or hw.devices_per_node)


def plan_auto(model: str | Path, dtype: str | None, options: AutoOptions, seq: int | None = None,
              layout: Layout | None = None, plan: dict | None = None, seed: int = 0,
              batch: int | None = None) -> AutoPlan:
    """Capture ``model`` once and search every layout of ``options.gpus`` devices on ``options.hardware``, in compute
    dtype ``dtype`` (None: the one the profile trains in, its ``default_dtype``: bf16 on the shipped GPUs), at ``seq``
    and ``batch`` (sequences per step over all dp ranks; None: the example batch's)."""
    from fxshard.cost.profile import model_profile
    from fxshard.cost.search import search

    hw = check_auto(options, layout or Layout(dtype=dtype or "fp32"))
    dtype, note = search_dtype(dtype, hw)
    started = time.perf_counter()
    profile = model_profile(model, dtype=dtype, seed=seed, plan=plan)
    captured = time.perf_counter() - started
    setting = setting_for(profile, hw, options.gpus_per_node, seq, batch)
    result = search(profile, hw, options.gpus, setting, dtype, top=options.top)
    return AutoPlan(result, profile, hw, captured, str(model), dtype, note)


def search_dtype(dtype: str | None, hw: Hardware) -> tuple[str, str]:
    """The compute dtype the search runs in, and a note when the user gave none: the profile's ``default_dtype``
    (the dtype its devices train in: a search of an H100 in fp32 would rank layouts no one runs)."""
    if dtype is not None:
        return dtype, ""
    chosen = hw.default_dtype if hw.default_dtype in ("fp32", "bf16") else "fp32"
    return chosen, (f"searched in {chosen}, the dtype the hardware profile trains in (its default_dtype); "
                    f"--dtype {'fp32' if chosen == 'bf16' else 'bf16'} searches that instead")


def predict_layout(model: str | Path, layout: Layout, hardware: str, batch: int, seq: int,
                   gpus_per_node: int | None = None, plan: dict | None = None, seed: int = 0):
    """The time model's prediction for one layout (``fxshard plan --hardware``): step, compute, exposed
    communication, bubble, tokens/s per device, MFU; memory as the search judges it: (prediction, hardware,
    setting)."""
    from fxshard.cost.profile import model_profile
    from fxshard.cost.timemodel import Evaluator, predict

    hw = load_hardware(hardware)
    # --fp8 at any --dtype: modelled as --dtype fp8 (bf16 beside tensorwise fp8 linears; docs/fp8.md)
    profile = model_profile(model, dtype="fp8" if layout.fp8_recipe else layout.dtype, seed=seed, plan=plan)
    setting = setting_for(profile, hw, gpus_per_node, seq, batch)
    if setting.global_batch % layout.dp:
        raise OptionError(f"--batch {setting.global_batch}: expected a multiple of --dp {layout.dp}")
    mode = layout.recompute if layout.recompute in ("none", "selective", "full") else "none"
    return predict(Evaluator(profile, hw, layout.dtype), replace(layout, recompute=mode), setting), hw, setting


def compile_command(model: str | Path | list[str], pred, out: str = "out/auto") -> str:
    """The command line that compiles the layout of ``pred`` (and, at pp=1, how ``fxshard run`` accumulates);
    ``model``: the model file, or the arguments that name the model (a Hugging Face folder with its --seq ...)."""
    layout = pred.layout
    args = ["fxshard", "compile", *([str(model)] if isinstance(model, str | Path) else model)]
    for f in flags(Layout):
        if f.name == "microbatches" and layout.pp == 1:
            continue
        value = getattr(layout, f.name)
        if value != f.default:
            args += f.argv(value)
    line = shlex.join(args + ["--out", out])
    if layout.pp == 1 and pred.accumulate > 1:
        line += f"  &&  fxshard run {shlex.quote(out)} --grad-accum {pred.accumulate}"
    return line


def auto_fields() -> list[str]:
    return [f.name for f in fields(AutoOptions)]
