"""Captures are cached per process (fxshard/capture/precision.py): a plan, a search and the row and sequence analyses
capture one model at the same sizes again on meta, and verify or a test compile one small model at several layouts.
Each caller gets its own copy; a model built another way from the same file (a plan's profile shortens it), or real
inputs of other values (which data-dependent code reads), are captured anew."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from fxshard.capture.modelfile import load_model_file
from fxshard.capture.precision import capture_at

GPT = Path(__file__).resolve().parents[2] / "samples" / "gpt.py"
READS = Path(__file__).resolve().parents[1] / "models" / "read_values.py"


def _ops(program) -> list[str]:
    return [str(n.target) for n in program.gm.graph.nodes if n.op == "call_function"]


def test_a_second_meta_capture_is_an_equal_copy_the_first_callers_edits_do_not_reach():
    mf = load_model_file(GPT)
    inputs = mf.build_inputs(0)
    first = capture_at(mf, 0, inputs, meta=True)
    expected = _ops(first)
    for node in [n for n in first.gm.graph.nodes if n.op == "call_function"][:3]:  # a pass rewriting its program
        node.target = torch.ops.aten.clone.default
    first.notes.append("edited")
    second = capture_at(load_model_file(GPT), 0, inputs, meta=True)  # the file loaded again: the same key
    assert second is not first and second.gm is not first.gm and second.model is not first.model
    assert _ops(second) == expected and "edited" not in second.notes
    assert {s.name for s in second.state} == {s.name for s in first.state}


def test_other_sizes_and_a_model_built_another_way_are_captured_anew():
    mf = load_model_file(GPT)
    inputs = mf.build_inputs(0)
    whole = capture_at(mf, 0, inputs, meta=True)
    half = capture_at(mf, 0, {k: v[:2] for k, v in inputs.items()}, meta=True)
    assert half.inputs[0].shape[0] == 2 != whole.inputs[0].shape[0]

    def make_model():  # the file's model with one block, as a plan's profile shortens it
        model = mf.make_model()
        model.blocks = model.blocks[:1]
        return model

    short = capture_at(dataclasses.replace(mf, make_model=make_model), 0, inputs, meta=True)
    assert len(short.state) < len(whole.state)


def test_a_cached_capture_leaves_the_random_state_as_a_capture_does():
    mf = load_model_file(GPT)
    inputs = mf.build_inputs(0)
    capture_at(mf, 0, inputs, meta=True)
    after = torch.rand(4)
    torch.manual_seed(123)  # anything between
    capture_at(mf, 0, inputs, meta=True)
    assert torch.equal(torch.rand(4), after)


def test_real_inputs_of_other_values_are_captured_anew_where_the_model_reads_them():
    mf = load_model_file(READS)
    inputs = mf.build_inputs(0)
    doubled = capture_at(mf, 0, inputs)  # flags.any(): the branch that doubles
    again = capture_at(mf, 0, {k: v.clone() for k, v in inputs.items()})
    assert again is not doubled and _ops(again) == _ops(doubled)
    assert all(torch.equal(again.tensors[k], t) for k, t in doubled.tensors.items())
    plain = capture_at(mf, 0, inputs | {"flags": torch.tensor([0, 0])})  # the other branch: no doubling
    def reads(program):
        return sorted(repr(site.values) for site in program.record.sites.values())
    assert reads(again) == reads(doubled) != reads(plain)
    assert _ops(plain).count("aten.mul.Tensor") < _ops(doubled).count("aten.mul.Tensor")
