"""DeepSeek-V3-shaped DeepseekV3ForCausalLM (61 layers of 7168, the first 3 dense (SwiGLU 18432), then 256 routed
experts of 2048 and one shared, 8 routed per token; multi-head latent attention, 128 heads; vocabulary 129280): for
`fxshard plan` only (built on meta tensors, nothing allocated)."""
import torch
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM


def make_model():
    # on meta from the start: transformers' experts create their stacked weights with torch.empty (30 GB a layer)
    # before fxshard's meta capture could move them
    with torch.device("meta"):
        return DeepseekV3ForCausalLM(DeepseekV3Config(attn_implementation="sdpa"))


def make_inputs():
    ids = torch.randint(0, 129280, (64, 32))
    return {"input_ids": ids, "labels": ids.clone(), "use_cache": False}
