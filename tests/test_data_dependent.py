"""Models whose Python reads tensor values, each a transformers architecture of zoo/models trained exactly at tp=2 and
dp=2 against one device (issue 43 §3): Longformer's global attention (``.any().item()`` choosing a branch,
``nonzero()`` sizes), wav2vec2's CTC head (``labels.max()`` checked in Python, ``masked_select`` targets, the CTC
loss), Switch Transformers' and DBRX's loops over the experts that received tokens, Llava's image-token count check
before ``masked_scatter``, HuBERT's pooling over each row's own length, ELECTRA's discriminator loss over
``logits[mask]``.  Capture specializes the reads on the example batch behind runtime guards
(fxshard/capture/specialize.py); the static check runs ``item()`` and ``nonzero()`` on fake tensors.  (WavLM's
x-vector pooling, ``hidden_states[i, :length]``, slices each row by a size the data decides: an unbacked symbol, no
specialization; the zoo trains it.)"""

from __future__ import annotations

from pathlib import Path

import pytest

from fxshard.check.check import check_output
from fxshard.driver import compile as compile_model
from fxshard.driver import verify
from fxshard.errors import LayoutError
from fxshard.ir.context import Layout
from fxshard.testing import matrix

ZOO = Path(__file__).resolve().parent.parent / "zoo" / "models"
FAMILIES = ("longformer", "wav2vec2", "switch_transformers", "dbrx", "llava", "hubert", "electra_discriminator")
CASES = {f"{family}-{name}": (family, layout) for family in FAMILIES
         for name, layout in (("tp2", Layout(tp=2)), ("dp2", Layout(dp=2)))}
# refused at dp2 by the batch-row analysis, naming the module, the op and the model's line (issue 43): a value over
# the whole batch whose size the data decides, which it cannot compute on the gathered batch.  Longformer's global
# attention pads every row's global tokens to the batch's largest count.  (Switch's and DBRX's eager experts loops are
# exact since fxshard/ir/rows_picked.py: each part's row numbers index its own rows, the loop specialized on the
# example's experts; Llava's image features, unbound per image and joined back, since fxshard/capture/rejoin.py.)
NOT_AT_DP = {
    "longformer": r"longformer\.encoder\.layer\.0\.attention\.self: nonzero_numpy .*modeling_longformer\.py:\d+\) is "
                  r"computed on the whole batch under --dp 2 and fails at its size.*train at --dp 1",
}
# make test's; an experts loop over the experts the batch hit (Switch, DBRX) is tests/test_rows_picked.py's 30-line
# model at dp2 and tests/test_capture_specialize.py's read_values.py; Longformer's refusal at dp2 is
# tests/ir/test_rows.py's nonzero() over the whole batch, the same message (make test-matrix runs every case)
KEEP = ("wav2vec2-dp2", "electra_discriminator-dp2")


@pytest.mark.distributed
@pytest.mark.slow
@pytest.mark.parametrize("case", matrix(CASES, KEEP))
def test_data_dependent_model_trains_like_one_device_or_is_refused_naming_the_read(case):
    family, layout = CASES[case]
    if layout.dp > 1 and family in NOT_AT_DP:  # refused at compile, before anything runs
        with pytest.raises(LayoutError, match=NOT_AT_DP[family]):
            compile_model(ZOO / f"{family}.py", layout)
        return
    result = verify(ZOO / f"{family}.py", layout, steps=3)
    assert result.ok, result.summary()


@pytest.mark.slow
@pytest.mark.parametrize(("family", "line"), [
    ("llava", "modeling_llava.py"),  # the image-token count check before masked_scatter: item() on fake tensors
    ("hubert", None),  # the features' padding mask written through a boolean index: nonzero() on fake tensors
], ids=["llava", "hubert"])
def test_the_static_check_runs_what_reads_values(tmp_path, family, line):
    result = compile_model(ZOO / f"{family}.py", Layout(tp=2), out=tmp_path / "o")
    if line:
        assert line in result.sources["rank_pp0_tp0.py"] and "aten._assert_scalar.default(" in \
            result.sources["rank_pp0_tp0.py"]
    assert check_output(tmp_path / "o").ranks == 2  # fxshard check, as `fxshard run --check` runs it
