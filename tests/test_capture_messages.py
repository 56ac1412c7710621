"""What a capture failure says for constructs torch.export cannot trace: the line, and what to change in the model
file (a check of the inputs that raises, a forward that converts its own weights)."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from fxshard.driver import compile as compile_model
from fxshard.errors import FxshardError
from fxshard.ir.context import Layout

MODEL = """
import torch
import torch.nn as nn
import torch.nn.functional as F


class Head(nn.Module):
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 8))

    def forward(self, x, labels):
{body}
        return F.cross_entropy(F.linear(x, self.weight), labels)


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.head = Head()

    def forward(self, x, labels):
        return self.head(x, labels)


def make_model():
    return Model()


def make_inputs():
    return {{"x": torch.randn(2, 8), "labels": torch.tensor([1, 3])}}
"""


def _refusal(tmp_path, body: str, meta: bool = False) -> str:
    path = tmp_path / "model.py"
    path.write_text(MODEL.format(body=textwrap.indent(textwrap.dedent(body), " " * 8)))
    with pytest.raises(FxshardError) as e:
        compile_model(path, Layout(), meta=meta)
    return str(e.value)


def test_a_check_of_the_labels_that_raises_names_its_line_and_the_loss_fn_way_out(tmp_path):
    # a CTC head's `if labels.max() >= vocab_size: raise ValueError(...)`, compiled without real weights: no run of
    # the model can answer the check (with them, it is specialized on the example: tests/test_capture_specialize.py)
    message = _refusal(tmp_path, "if labels.max() >= 4:\n    raise ValueError('labels out of range')", meta=True)
    assert "data-dependent control flow" in message and "`if labels.max() >= 4:`" in message
    assert "loss_fn(output, inputs)" in message and "compile without --meta" in message


@pytest.mark.parametrize("body", ["self.float()", "self.weight.data = self.weight.data.to(torch.float32)"],
                         ids=["module-float", "data-assignment"])
def test_a_forward_converting_its_own_weights_is_told_to_convert_a_copy(tmp_path, body):
    message = _refusal(tmp_path, body)
    assert "replaces its own parameters or buffers" in message and "self.weight.float()" in message
    assert "head" in message.lower()  # the module (its line, or its FQN where torch names only the lifted constant)


def test_an_eager_experts_moe_is_captured_with_its_own_grouped_experts():
    # the eager experts loop over `expert_hit` (the experts that received tokens), a loop over data
    from fxshard.capture.modelfile import load_model_file
    from fxshard.capture.program import capture

    mf = load_model_file(Path(__file__).resolve().parent / "models" / "hf_mixtral_eager.py")
    model = mf.build_model(0)
    program = capture(mf, 0, model)
    assert any("grouped_mm" in str(n.target) for n in program.gm.graph.nodes)
    assert model.config._experts_implementation == "eager"  # as the model file made it
