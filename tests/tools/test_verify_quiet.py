"""``fxshard verify`` on parameters whose gradient is zero up to rounding (fxshard/tools/verify.py ``QUIET_GRAD``).

A key projection's bias gets no gradient in exact arithmetic (softmax ignores a shift every key shares), so its
gradient is rounding noise, which AdamW divides by its own size: the single-device run and a distributed one move it
by up to lr per step in directions of their own noise.  Its update measures nothing; CLIP at tp2 failed verify on its
key biases alone (parameters 9.5e-3 of the update, losses 2e-7).  Such a "quiet" parameter leaves the update share and
must lie within twice the farthest AdamW can move an element (``adamw_reach``).  Tested: the bound holds for AdamW on
any gradients, the quiet parameters of a real CLIP are exactly its key biases, and verify at tp2 judges them apart."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxshard.capture.modelfile import load_model_file
from fxshard.driver import verify
from fxshard.ir.context import Layout
from fxshard.tools.verify import QUIET_GRAD, adamw_reach, quiet_parameters, update_share
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
    quiet = {p["fqn"] for p in result.quiet}
    assert quiet == {"text_model.encoder.layers.0.self_attn.k_proj.bias",
                     "vision_model.encoder.layers.0.self_attn.k_proj.bias"}, quiet
    assert result.ok, result.summary()
    assert result.quiet_atol == pytest.approx(2 * adamw_reach(OptimConfig(), 3))
    assert "2 quiet parameters" in result.summary() and result.summary().endswith(": OK")
    # the quiet ones are what the update share would otherwise weigh: counted in, the share is larger
    with_quiet = update_share([dict(p, quiet=False) for p in result.params])
    assert with_quiet > result.param_rel, (with_quiet, result.param_rel)
