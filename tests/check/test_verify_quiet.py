"""``fxshard verify`` on parameters whose gradient is zero up to rounding (fxshard/check/verify.py ``QUIET_GRAD``).

A key projection's bias gets no gradient in exact arithmetic (softmax ignores a shift every key shares), so its
gradient is rounding noise, which AdamW divides by its own size: the single-device run and a distributed one move it
by up to lr per step in directions of their own noise.  Its update measures nothing; CLIP at tp2 failed verify on its
key biases alone (parameters 9.5e-3 of the update, losses 2e-7).  Such a "quiet" parameter, where the strict update
share cannot hold it, leaves the share and must lie within twice the farthest AdamW can move an element
(``adamw_reach``); a quiet parameter that trains alike on both sides stays under the strict check (``judged_apart``).
Tested: the bound holds for AdamW on any gradients, only the quiet parameters the share cannot hold leave it, the quiet
parameters of a real CLIP are exactly its key biases, and verify at tp2 judges them apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxshard.capture.modelfile import load_model_file
from fxshard.check.verify import (
    QUIET_GRAD,
    Verification,
    adamw_reach,
    judged_apart,
    quiet_parameters,
    update_share,
)
from fxshard.driver import verify
from fxshard.ir.context import Layout
from fxshard.train.optim import OptimConfig
from fxshard.train.reference import reference_losses
from fxshard.train.schedule import lr_schedule

CLIP = Path(__file__).resolve().parents[1] / "models" / "hf_clip.py"


@pytest.mark.parametrize("optim", [OptimConfig(), OptimConfig(lr=3e-3, lr_schedule="cosine", warmup_steps=1),
                                   OptimConfig(beta1=0.5, beta2=0.9)], ids=["default", "cosine-warmup", "betas"])
def test_adamw_reach_bounds_adamw_on_any_gradients(optim):
    torch.manual_seed(0)
    steps, reach = 3, adamw_reach(optim, 3)
    worst = 0.0
    for trial in range(300):  # gradients over 12 orders of magnitude, signs and sizes at random, some constant
        p = torch.nn.Parameter(torch.zeros(64))
        opt = torch.optim.AdamW([p], lr=optim.lr, betas=(optim.beta1, optim.beta2), eps=optim.eps, weight_decay=0.0)
        scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_schedule(optim, steps))
        for _ in range(steps):
            scale = 10.0 ** torch.randint(-10, 3, (64,)).float()
            p.grad = torch.randn(64) * scale if trial % 3 else torch.full((64,), 1e-9 + trial)
            opt.step()
            scheduler.step()
        worst = max(worst, p.detach().abs().max().item())
    assert worst <= reach * (1 + 1e-6), (worst, reach)
    assert worst >= 0.9 * reach  # a constant gradient moves an element by nearly the whole reach: the bound is tight


def _row(fqn: str, diff_sq: float, update_sq: float, quiet: bool) -> dict:
    return {"fqn": fqn, "shape": [4], "max_abs": diff_sq ** 0.5, "rel": (diff_sq / update_sq) ** 0.5,
            "diff_sq": diff_sq, "update_sq": update_sq, "quiet": quiet}


def test_only_the_quiet_parameters_the_share_cannot_hold_are_judged_apart():
    weight = _row("w", 1e-12, 1.0, False)  # share 1e-6 on its own
    agrees = _row("a_log", 1e-20, 1e-16, True)  # a small true gradient, alike on both sides (Mamba's A_log)
    noise = [_row(f"k{i}.bias", d, 1e-6, True) for i, d in enumerate((4e-6, 2e-6, 1e-14))]  # rounding noise, AdamW'd
    assert judged_apart([weight, agrees], 1e-3) == set()  # quiet, but within the strict share: stays in it
    # largest difference first, only until the rest is within 1e-3: share 2.4e-3, 1.4e-3 without k0, 1e-6 without k1
    assert judged_apart([weight, agrees, *noise], 1e-3) == {"k0.bias", "k1.bias"}
    assert judged_apart([weight, agrees, *noise], 3e-3) == set()
    bad = _row("u", 1.0, 1.0, False)  # a wrong non-quiet parameter: every quiet one leaves, and the share still fails
    result = Verification(Layout(tp=2), [1.0], [1.0], [weight, agrees, bad, *noise], quiet_atol=1.0)
    assert result.apart == {"a_log", "k0.bias", "k1.bias", "k2.bias"} and not result.ok
    assert result.worst["fqn"] == "u"
    result = Verification(Layout(tp=2), [1.0], [1.0], [weight, agrees, *noise], quiet_atol=1.0)
    assert result.ok and [p["fqn"] for p in result.quiet] == ["k0.bias", "k1.bias"]
    summary = result.summary()
    assert "2 quiet parameters (gradient zero up to rounding, judged apart: k0.bias, k1.bias) max abs" in summary
    assert result.param_rel == update_share([weight, agrees, noise[2]]) <= 1e-3


def test_quiet_parameters_of_clip_are_its_key_biases():
    torch.set_num_threads(1)
    mf = load_model_file(CLIP)
    grad_sq: dict = {}
    reference_losses(mf, 3, grad_sq=grad_sq)
    numel = {n: p.numel() for n, p in mf.build_model(0).named_parameters(remove_duplicate=False)}
    quiet = quiet_parameters(grad_sq, numel)
    assert quiet == {n for n in numel if n.endswith("self_attn.k_proj.bias")}, sorted(quiet)
    assert len(quiet) == 2  # one text layer, one vision layer
    assert QUIET_GRAD["fp32"] == 1e-5


@pytest.mark.distributed
def test_verify_judges_clip_key_biases_apart_at_tp2(tmp_path):
    result = verify(CLIP, Layout(tp=2), steps=3, out=tmp_path / "v")
    quiet = {p["fqn"] for p in result.params if p["quiet"]}
    assert quiet == {"text_model.encoder.layers.0.self_attn.k_proj.bias",
                     "vision_model.encoder.layers.0.self_attn.k_proj.bias"}, quiet
    assert result.ok, result.summary()
    assert result.quiet_atol == pytest.approx(2 * adamw_reach(OptimConfig(), 3))
    # the strict share of all parameters fails on the key biases' noise, so some of them are judged apart, no other
    assert update_share(result.params) > result.param_rtol >= result.param_rel, result.summary()
    assert result.apart and result.apart <= quiet, result.apart
    assert f"{len(result.apart)} quiet parameters (gradient zero up to rounding, judged apart: " in result.summary()
    assert result.summary().endswith(": OK")
