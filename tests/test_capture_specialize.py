"""Data-dependent Python (``if t.item():``, ``for e in hit.nonzero():``, ``f"expert_{e}"``) captured by answering its
reads from a run on the example batch (fxshard/capture/specialize.py): the graph computes what the model does on
that batch, each answer is a runtime guard naming the model's line, and a compile without real weights, where no
run is possible, refuses naming the line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from fxshard.capture.modelfile import load_model_file
from fxshard.capture.program import capture
from fxshard.check.check import check_output
from fxshard.driver import compile as compile_model
from fxshard.errors import CaptureError
from fxshard.ir.context import Layout

MODEL = Path(__file__).resolve().parent / "models" / "read_values.py"


@pytest.fixture(scope="module")
def captured():
    mf = load_model_file(MODEL)
    model = mf.build_model(0)
    return mf, model, capture(mf, 0, model)


def _run(program, batch, **replaced):
    state = [replaced.get(s.fqn, program.tensors[s.fqn]) for s in program.state]
    return program.gm(*state, *[batch[i.path.split("'")[1]] for i in program.inputs])[0]


@pytest.mark.slow  # two exports and an eager run of the model (~5 s)
def test_the_graph_computes_what_the_model_does_on_the_example(captured):
    mf, model, program = captured
    batch = mf.build_inputs(0)
    assert torch.equal(_run(program, batch), model(**batch))
    lines = "\n".join(program.notes)
    for code in ("`if labels.max() >= VOCAB:`", "`if flags.any().item():`", "`for expert in hit:`",
                 '`out = out.index_add(0, rows, self[f"expert_{expert[0]}"](h[rows]))`'):
        assert f"{code}: data-dependent control flow specialized on the example batch" in lines


@pytest.mark.slow  # two exports and an eager run of the model (~5 s)
@pytest.mark.parametrize(("change", "line"), [
    ({"flags": torch.tensor([0, 0])}, "read_values.py:39 `if flags.any().item():`"),
    ({"labels": torch.full((2, 4), 16)}, "read_values.py:36 `if labels.max() >= VOCAB:`"),
], ids=["other-branch", "labels-out-of-range"])
def test_a_batch_taking_another_branch_stops_naming_the_line(captured, change, line):
    mf, _, program = captured
    with pytest.raises(RuntimeError, match="this batch reads another value here than the example batch") as e:
        _run(program, mf.build_inputs(0) | change)
    assert str(e.value).startswith(line)


@pytest.mark.slow  # two exports and an eager run of the model (~5 s)
def test_a_loop_over_the_experts_hit_stops_when_other_experts_are_hit(captured):
    # every token routed to expert 1: the loop of the example (experts 0 and 1) is not this batch's
    mf, _, program = captured
    with pytest.raises(RuntimeError) as e:
        _run(program, mf.build_inputs(0), **{"experts.router.bias": torch.tensor([-1e4, 1e4])})
    assert "read_values.py:2" in str(e.value) and "compiled the program on" in str(e.value)


def test_without_real_weights_the_compile_refuses_naming_the_line():
    with pytest.raises(CaptureError) as e:
        compile_model(MODEL, Layout(), meta=True)
    message = str(e.value)
    assert "read_values.py:36" in message and "`if labels.max() >= VOCAB:`" in message
    assert "compile without --meta" in message


@pytest.mark.slow  # two exports and an eager run of the model (~5 s)
def test_the_rank_files_hold_the_guards_and_pass_the_static_check(tmp_path):
    result = compile_model(MODEL, Layout(tp=2), out=tmp_path / "o")
    code = result.sources["rank_pp0_tp1.py"]
    assert "aten._assert_scalar.default(" in code and "read_values.py:39 `if flags.any().item():`" in code
    assert any("specialized on the example batch" in note for note in result.manifest.notes)
    report = check_output(tmp_path / "o")  # runs each rank file: item() and nonzero() on fake tensors
    assert report.ranks == 2


@pytest.mark.slow  # two exports and three eager runs of the model
def test_a_line_reading_another_value_on_another_dp_ranks_rows_is_refused():
    # dp rank 0's row has no flag set, rank 1's has: one program cannot hold both branches of `flags.any().item()`
    with pytest.raises(CaptureError) as e:
        compile_model(MODEL, Layout(dp=2))
    message = str(e.value)
    assert "read_values.py:39 `if flags.any().item():` reads False on the first part of the batch and True on " \
           "another (a data-parallel rank's rows or a pipeline microbatch)" in message


PER_ROW = '''import torch
import torch.nn as nn


class Pool(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x, lengths):
        h = self.proj(x)
        rows = []
        for i in range(h.shape[0]):
            n = lengths[i].item()
            rows.append(h[i, :n].mean(0) if n > 2 else h[i].mean(0))
        return torch.stack(rows).pow(2).mean()


def make_model():
    return Pool()


def make_inputs():
    return {"x": torch.randn(4, 6, 8), "lengths": torch.tensor([4, 4, 4, 4])}
'''


@pytest.mark.slow  # two exports at each of two batch sizes
def test_a_read_of_each_row_the_split_batchs_second_capture_cannot_answer_suggests_dp_1(tmp_path):
    # each row's length branches: the example's part (2 rows) answers 2 reads, the analysis' capture at 4 rows reads 4
    model = tmp_path / "per_row.py"
    model.write_text(PER_ROW)
    with pytest.raises(CaptureError, match=r"per_row\.py:15 in forward\(\).*use torch\.where / torch\.cond.*or "
                                           r"train at --dp 1 without pipeline microbatches"):
        compile_model(model, Layout(dp=2))
