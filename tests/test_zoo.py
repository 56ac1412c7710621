"""A fast representative part of the model zoo (`make zoo` runs all of it): each case trains a transformers
architecture from zoo/models on its padded batch under one layout and must equal single-device training
(losses within 1e-5 relative, trained parameters within 1e-3 of the update, as `fxshard verify` checks)."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxshard.driver import verify
from fxshard.ir.context import Layout
from fxshard.testing import matrix

ZOO = Path(__file__).resolve().parent.parent / "zoo" / "models"
CASES = {  # what each one covers that the others do not
    "llama-dp2": ("llama", Layout(dp=2)),  # padded rows split over dp: the token-mean loss
    "gpt2-pp2": ("gpt2", Layout(pp=2)),  # a head tied to the embedding across stages
    "opt-tp2": ("opt", Layout(tp=2)),  # a vocab-parallel embedding with a padding row in the batch
    "bert-pp2": ("bert", Layout(pp=2)),  # an encoder, masked LM with a microbatch counting few tokens
    # encoder-decoder cut by pp: the decoder's inputs are the labels shifted by writes into a slice of new_zeros
    # (shift_tokens_right), which a later stage must not recompute without those writes
    "bart-pp2": ("bart", Layout(pp=2)),
    "t5-tp2": ("t5", Layout(tp=2)),  # encoder-decoder, constants made in forward
    "bloom-tp2": ("bloom", Layout(tp=2)),  # a custom autograd.Function (GeLU) kept as a pointwise custom op
    # a shipped plan naming only the embedding, completed by automatic pairing (attention, Mamba-2 mixer, MLP)
    "falcon_h1-tp2": ("falcon_h1", Layout(tp=2)),
    "whisper-tp2": ("whisper", Layout(tp=2)),  # speech: a convolutional front end, frozen sinusoidal positions
    # a contrastive loss over the whole batch (features gathered over dp) and key biases whose gradient is rounding
    # noise, judged apart (fxshard.check.verify QUIET_GRAD)
    "clip-dp2": ("clip", Layout(dp=2)),
    "olmoe-tp2-pp2": ("olmoe", Layout(tp=2, pp=2)),  # experts in every layer, split over tp, cut by pp
}


@pytest.mark.distributed
# all make test-matrix's: GPT-2 and BERT at pp2 are tests/test_training_layouts.py's gpt2-pp2-zero-bubble and
# bert-qa-pp2-2-microbatches (make test), an encoder-decoder at pp2 tests/test_capture_layouts.py's t5-pp2, and
# make zoo runs every case
@pytest.mark.parametrize("case", matrix(CASES, ()))
def test_zoo_architecture_trains_like_one_device(case):
    model, layout = CASES[case]
    result = verify(ZOO / f"{model}.py", layout, steps=3)
    assert result.ok, result.summary()
    if model == "falcon_h1":  # its Mamba A_log and dt_bias are quiet (true gradients 1e-8 of the model's RMS) but
        # train alike on both sides: they stay under the strict update share, none is judged apart
        assert any(p["quiet"] for p in result.params) and not result.apart, result.summary()


def test_resume_keeps_every_cell_of_the_page(tmp_path):
    """``python -m zoo.run --resume`` reads back what the page says (a run cut short goes on where it stopped)."""
    from zoo.run import read_page, results_page

    results = {("bart", "tp=2"): ("exact", "loss 8.791e-08, params 5.867e-06, 6 quiet 8.793e-07 within 6.010e-03"),
               ("clip", "pp=2"): ("refused", "--pp 2 with 2 microbatches: CLIPModel: aten.matmul.default pairs | rows"),
               ("clip", "tp=2"): ("FAILED", "loss 1.0e-01, params 7.0e-01"), ("opt", "dp=2"): ("refused", "x: y")}
    page = tmp_path / "RESULTS.md"
    older = ("\n## Older runs' cells\n\n| architecture | tp=2 |\n|---|---|\n"
             "| t5 | exact: loss 1e-07, params 5e-05 |\n\n1. z\n")
    page.write_text(results_page(results, 3, 12.4, ("tp=2", "pp=2", "dp=2"), 9) + older)  # a section after: not read
    assert "not run yet" in page.read_text()  # bart pp=2, dp=2 and others: left out of what resume keeps
    assert read_page(page) == (results, 12.0)


def test_only_takes_names_with_commas_and_refuses_an_unknown_one(tmp_path, capsys):
    from zoo.run import main

    with pytest.raises(SystemExit):  # llama is known: only the misspelt name is named, before any case runs
        main(["--only", "llama,lama", "t5", "--out", str(tmp_path / "RESULTS.md")])
    assert "--only lama: no such architecture" in capsys.readouterr().err
    assert not (tmp_path / "RESULTS.md").exists()
