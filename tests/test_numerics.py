"""Tier 2: every rank's generated code on real gloo groups equals the unsharded model.

Logits (the model's outputs), the loss and every parameter gradient (reassembled from the ranks'
slices through the manifest) agree with single-device autograd within 1e-5.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from harness import spawn

from fxshard.capture.inputs import flatten_batch
from fxshard.capture.modelfile import load_model_file
from fxshard.capture.program import _WithLoss
from fxshard.codegen.manifest import read_manifest
from fxshard.driver import compile as compile_model
from fxshard.ir.layout import Coords, Layout
from fxshard.ir.placement import assemble

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))  # benchmarks.comm: the collective counter
TOL = dict(rtol=1e-5, atol=1e-5)


def _rank_module(rank: int, world: int, out: str):
    """This tp rank's generated ``RankModule`` on a gloo mesh with its weights, and its example batch."""
    from torch.distributed.device_mesh import init_device_mesh

    from fxshard.codegen.manifest import import_rank_file, read_manifest
    from fxshard.runtime import load_state

    out = Path(out)
    manifest = read_manifest(out)
    mesh = init_device_mesh("cpu", (1, 1, world), mesh_dim_names=("dp", "pp", "tp"))
    entry = manifest.rank(Coords(tp=rank))
    module = import_rank_file(out / entry.file).RankModule({a: mesh.get_group(a) for a in ("dp", "pp", "tp")})
    load_state(module, out / entry.weights)
    batch = load_model_file(out / "model.py").build_inputs(manifest.seed)
    return module, flatten_batch(batch, manifest.inputs)


def _rank_forward_backward(rank: int, world: int, out: str):
    module, leaves = _rank_module(rank, world, out)
    outputs = module(*leaves)
    outputs[0].backward()
    grads = {name: p.grad.clone() for name, p in module.named_parameters()}
    return [o.detach().clone() for o in outputs], grads


def _reference(model_path: Path):
    mf = load_model_file(model_path)
    model, batch = mf.build()
    model.train()
    step = _WithLoss(model, mf.loss_fn, not isinstance(batch, dict))
    loss, out = step(**batch) if isinstance(batch, dict) else step(*batch)
    loss.backward()
    leaves = [loss] + [x for x in torch.utils._pytree.tree_leaves(out) if isinstance(x, torch.Tensor)]
    grads = {n: p.grad for n, p in model.named_parameters(remove_duplicate=False)}
    return leaves, grads


@pytest.mark.distributed
@pytest.mark.parametrize("sample, tp", [  # make test: llama (GQA, RoPE) at tp4, gpt2 (Conv1D, tied head) at tp2
    *(pytest.param(sample, tp, marks=pytest.mark.matrix) if (sample, tp) not in (("llama.py", 4), ("gpt2.py", 2))
      else (sample, tp) for tp in (2, 4) for sample in ("gpt.py", "llama.py", "gpt2.py"))])
def test_rank_code_matches_unsharded_model(tmp_path, sample, tp):
    path = ROOT / "samples" / sample
    compile_model(path, Layout(tp=tp), out=tmp_path)
    manifest = read_manifest(tmp_path)
    results = spawn(_rank_forward_backward, tp, str(tmp_path))
    ref_outputs, ref_grads = _reference(path)

    for outputs, _ in results:
        assert len(outputs) == len(ref_outputs)
        for got, want in zip(outputs, ref_outputs, strict=True):
            torch.testing.assert_close(got, want.detach(), **TOL)

    pieces: dict[str, list] = {}
    shapes = {}
    for entry, (_, grads) in zip(manifest.ranks, results, strict=True):
        for attr, t in entry.tensors.items():
            if t.kind != "parameter":
                continue
            pieces.setdefault(t.source, []).append((t.slice, grads[attr]))
            shapes[t.source] = t.global_shape
    assert set(pieces) | set(manifest.tied) == set(ref_grads), "every parameter has a gradient on some rank"
    for source, parts in pieces.items():
        full = assemble(parts, shapes[source])
        torch.testing.assert_close(full, ref_grads[source], **TOL, msg=lambda m, s=source: f"{s}: {m}")
    sharded = [t for e in manifest.ranks for t in e.tensors.values() if t.slice.parts > 1]
    assert sharded, "the plan split some weights"


def _training_forward(rank: int, world: int, out: str):
    """One training forward (``return_outputs = False``, as ``fxshard run`` sets), counting its collectives."""
    from benchmarks.comm import CollectiveCounter

    module, leaves = _rank_module(rank, world, out)
    module.return_outputs = False
    counter = CollectiveCounter()
    counter.phase = "forward"
    with counter:
        outputs = module(*leaves)
    return len(outputs), float(outputs[0]), counter.counts


@pytest.mark.distributed
def test_training_forward_skips_gathering_the_returned_logits(tmp_path):
    """samples/gpt.py returns its logits; training needs only the loss, so it issues what the manifest states
    per step: the cross entropy's small all-gather, not the logits' (which only ``return_outputs`` pays)."""
    from benchmarks.comm import fxshard_stated

    path = ROOT / "samples" / "gpt.py"
    result = compile_model(path, Layout(tp=2), out=tmp_path)
    entry = result.manifest.ranks[0]
    assert [c.op for c in entry.collectives if c.outputs_only] == ["all_gather"]
    ref_loss = _reference(path)[0][0]
    stated = fxshard_stated(tmp_path, result.manifest)["manifest"]["forward"]
    for count, loss, measured in spawn(_training_forward, 2, str(tmp_path)):
        assert count == 1
        torch.testing.assert_close(torch.tensor(loss), ref_loss.detach(), **TOL)
        assert measured["forward"] == stated
        tokens = 8 * 16  # samples/gpt.py: batch 8, sequence 16
        assert measured["forward"]["all_gather"] == {"calls": 1, "bytes": tokens * 2 * 4}
