"""The token-mean pass: a cross entropy averaged over counted targets becomes a sum divided by the step's count,
with the count emitted as ``count_tokens``; any other loss keeps the averaging and says so."""

from __future__ import annotations

from pathlib import Path

from fxshard.capture.modelfile import load_model_file
from fxshard.driver import compile as compile_model
from fxshard.ir.context import Layout

MODELS = Path(__file__).resolve().parents[1] / "models"


def _module(source: str, name: str):
    scope: dict = {}
    exec(compile(source, name, "exec"), scope)
    return scope


def test_a_padded_causal_lm_counts_its_targets_in_the_rank_file():
    result = compile_model(MODELS / "llama_padded.py", Layout(dp=2))
    code = result.sources["rank_pp0_tp0.py"]
    assert "aten.cross_entropy_loss.default(" in code and "None, 2, -100)" in code  # the cross entropy sums
    assert "token_mean = rt.token_mean(cross_entropy_loss, " in code and "ignore_index=-100)" in code
    batch = load_model_file(MODELS / "llama_padded.py").build_inputs(0)
    count = _module(code, "rank_pp0_tp0.py")["count_tokens"]
    rows = batch["input_ids"][:2], batch["attention_mask"][:2], batch["labels"][:2], False  # dp rank 0's rows
    assert int(count(*rows)) == (16 - 1) + (3 - 1)  # causal LM: the labels shifted by one, pads not counted
    assert any("a token mean" in note for note in result.ctx.notes)


def test_a_loss_that_is_not_a_token_mean_keeps_averaging_and_says_so():
    result = compile_model(MODELS / "mlp.py", Layout(dp=2))
    assert "count_tokens" not in result.sources["rank_pp0_tp0.py"]
    assert any("not a token mean" in note for note in result.ctx.notes)


def test_class_weights_are_not_a_token_mean(tmp_path):
    model = tmp_path / "weighted.py"
    model.write_text((MODELS / "padded_embedding.py").read_text().replace(
        "F.cross_entropy(self.head(torch.tanh(h)).flatten(0, 1), target.flatten())",
        "F.cross_entropy(self.head(torch.tanh(h)).flatten(0, 1), target.flatten(), weight=torch.arange(1.0, 9.0))"))
    result = compile_model(model, Layout(dp=2))
    assert "count_tokens" not in result.sources["rank_pp0_tp0.py"]


def test_the_returned_loss_is_the_mean_too():
    # the model's own output (HF .loss) is the same node as the loss training uses
    code = compile_model(MODELS / "llama_padded.py", Layout()).sources["rank_pp0_tp0.py"]
    assert "return (token_mean, token_mean" in code


def test_extractive_qa_is_two_means_each_counting_positions_other_than_the_sequence_length():
    result = compile_model(MODELS / "hf_bert_qa.py", Layout(dp=2))
    code = result.sources["rank_pp0_tp0.py"]
    assert code.count("rt.token_mean(") == 2
    assert "ignore_index=16, term=0)" in code and "ignore_index=16, term=1)" in code
    batch = load_model_file(MODELS / "hf_bert_qa.py").build_inputs(0)
    count = _module(code, "rank_pp0_tp0.py")["count_tokens"]
    rows = [batch[k][:2] for k in ("input_ids", "attention_mask", "start_positions", "end_positions")]
    assert count(*rows).tolist() == [1, 1]  # starts 3, 16 and ends 5, 16 of dp rank 0: 16 is not counted
    assert any("2 means over counted targets" in note for note in result.ctx.notes)


def test_masked_lm_plus_sentence_order_is_two_means():
    result = compile_model(MODELS / "hf_albert_pretraining.py", Layout(dp=2))
    code = result.sources["rank_pp0_tp0.py"]
    assert "term=0)" in code and "term=1)" in code
    batch = load_model_file(MODELS / "hf_albert_pretraining.py").build_inputs(0)
    count = _module(code, "rank_pp0_tp0.py")["count_tokens"]
    names = [i.name for i in result.manifest.inputs]
    rows = [batch[n][:2] for n in names]
    assert count(*rows).tolist() == [5 + 1, 2]  # masked tokens of rows 0 and 1; their two sentence-order labels


def test_a_constant_over_a_token_mean_is_not_a_mean(tmp_path):
    model = tmp_path / "reciprocal.py"
    source = (MODELS / "padded_embedding.py").read_text()
    loss = "F.cross_entropy(self.head(torch.tanh(h)).flatten(0, 1), target.flatten())"
    assert loss in source
    model.write_text(source.replace(loss, f"1.0 / {loss}"))
    assert "count_tokens" not in compile_model(model, Layout(dp=2)).sources["rank_pp0_tp0.py"]


def test_a_loss_over_boolean_indexed_tokens_is_counted_and_checked_with_a_symbolic_size():
    # logits[mask]: the rows depend on the data (aten.nonzero); the per-rank shape check carries them as a symbol
    result = compile_model(MODELS / "bool_index_loss.py", Layout(tp=2))
    code = result.sources["rank_pp0_tp0.py"]
    assert "# [u0, 32] f32" in code and "sym_size_int >= 0" in code  # export's check of the size, as Python
    batch = load_model_file(MODELS / "bool_index_loss.py").build_inputs(0)
    count = _module(code, "rank_pp0_tp0.py")["count_tokens"]
    assert int(count(batch["idx"], batch["labels"])) == 5 + 8 + 8 + 2


def test_a_mean_over_the_tokens_a_mask_keeps_is_counted_by_the_mask():
    # ELECTRA's discriminator loss: BCE over logits[mask]; dp rank 0 holds rows keeping 16 and 3 tokens, rank 1 9 and 5
    result = compile_model(MODELS / "masked_bce_loss.py", Layout(dp=2))
    code = result.sources["rank_pp0_tp0.py"]
    assert "aten.binary_cross_entropy_with_logits.default(" in code and ", None, None, 2)" in code  # summed
    assert "rt.token_mean(binary_cross_entropy_with_logits, " in code and "ignore_index=0)" in code
    batch = load_model_file(MODELS / "masked_bce_loss.py").build_inputs(0)
    count = _module(code, "rank_pp0_tp0.py")["count_tokens"]
    assert int(count(*[batch[k][:2] for k in ("idx", "attention_mask", "labels")])) == 16 + 3
    assert any("the values a mask of the batch selects counted" in note for note in result.ctx.notes)


def test_a_sum_over_its_count_beside_a_token_mean_keeps_the_token_mean(tmp_path):
    # Switch Transformers' router z-loss, torch.sum(z) / (groups * tokens), beside its cross entropy: a mean over a
    # fixed count, so the cross entropy is still counted (it was averaged over dp ranks: 6.6e-3 off at dp2)
    model = tmp_path / "z_loss.py"
    source = (MODELS / "padded_embedding.py").read_text()
    loss = "F.cross_entropy(self.head(torch.tanh(h)).flatten(0, 1), target.flatten())"
    assert loss in source
    model.write_text(source.replace(loss, f"{loss} + 0.1 * (h.pow(2).sum() / h.numel())"))
    code = compile_model(model, Layout(dp=2)).sources["rank_pp0_tp0.py"]
    assert "token_mean = rt.token_mean(" in code and "count_tokens" in code
    model.write_text(source.replace(loss, f"{loss} + 0.1 * (h.pow(2).sum() / 3)"))  # a sum over another number
    assert "count_tokens" not in compile_model(model, Layout(dp=2)).sources["rank_pp0_tp0.py"]
