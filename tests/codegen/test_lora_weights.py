"""``compile --weights DIR --lora R``: each rank reads its slices of the base from the Hugging Face folder by the base
model's own names (``model.layers.0.self_attn.q_proj.weight`` for peft's ``...q_proj.base_layer.weight``), and the
adapters, which the folder does not hold, are drawn at compile time and written with the rank shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from fxshard.capture.modelfile import load_model_file
from fxshard.driver import compile as compile_model
from fxshard.ir.layout import Layout

LLAMA = Path(__file__).resolve().parents[1] / "models" / "lora_llama.py"


@pytest.mark.slow  # a compile with its rank files generated and checked
def test_the_base_is_read_from_the_folder_and_the_adapters_written(tmp_path):
    load_model_file(LLAMA).build_model(5).save_pretrained(tmp_path / "hf")
    result = compile_model(LLAMA, Layout(tp=2, lora=4, lora_targets="q_proj,down_proj"), out=tmp_path / "out",
                           weights=tmp_path / "hf")
    tensors = {t.source: t for e in result.manifest.ranks for t in e.tensors.values() if t.kind == "parameter"}
    base = tensors["base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight"]
    assert not base.in_shard and base.checkpoint.name == "model.layers.0.self_attn.q_proj.weight"
    adapters = [t for fqn, t in tensors.items() if ".lora_" in fqn]
    assert len(adapters) == 8 and all(t.in_shard and t.checkpoint is None for t in adapters)
