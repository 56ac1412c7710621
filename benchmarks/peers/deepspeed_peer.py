"""DeepSpeed as its users train a Hugging Face model: ``deepspeed.initialize`` on the unmodified
``LlamaForCausalLM`` (so the weights are the very ones fxshard compiles) with ZeRO stage 3 over the dp ranks (stage 0,
its DDP, at ``dp2-replicated``), its engine's ``backward`` and ``step``.  Only the data-parallel layouts: DeepSpeed's
own tensor parallelism (AutoTP) is for inference and its pipeline engine needs the model rewritten as a
``PipelineModule``.

The optimizer is torch's AdamW at the shared settings, handed to the engine (a client optimizer): DeepSpeed's own
``AdamW`` builds a C++ extension just in time (``ninja``), which is not the comparison here::

    peer = deepspeed_peer(layout, model, batch, torch.device("cpu"))
    loss = peer.step()
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from benchmarks.peers.common import Peer, PeerLayout, local_rows

LAYOUTS = ("dp2", "dp2-replicated")  # the layouts DeepSpeed runs here (see the module docstring)
NOT_OFFERED = ("not run: DeepSpeed's tensor parallelism (AutoTP) is for inference, and its pipeline engine needs the "
               "model rewritten as a deepspeed.pipe.PipelineModule (not the same unmodified model)")


def deepspeed_peer(layout: PeerLayout, model: torch.nn.Module, batch: dict, device: torch.device) -> Peer:
    """This rank's DeepSpeed engine (ZeRO 3 over ``layout.dp``) and training step."""
    import deepspeed

    if layout.name not in LAYOUTS:
        raise NotImplementedError(f"DeepSpeed at {layout.name}: {NOT_OFFERED}")
    os.environ.setdefault("LOCAL_RANK", str(dist.get_rank()))  # what its launcher sets; one host here
    deepspeed.init_distributed(dist_backend=dist.get_backend(), auto_mpi_discovery=False)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    config = {"train_micro_batch_size_per_gpu": batch["input_ids"].shape[0] // layout.dp,
              # a bound no norm reaches: DeepSpeed computes the global gradient norm only to clip, and every other
              # tool computes it each step (fxshard's, torchtitan's clip_grad_norm_ at inf, Megatron-Core's)
              "gradient_accumulation_steps": 1, "gradient_clipping": 1e30, "zero_allow_untested_optimizer": True,
              "zero_optimization": {"stage": 3 if layout.sharded else 0}, "steps_per_print": 10**9,
              "wall_clock_breakdown": False}
    engine, *_ = deepspeed.initialize(model=model.to(device), optimizer=optimizer, config=config)
    ids = local_rows(batch["input_ids"], dist.get_rank(), layout.dp).to(device)

    def step() -> float:
        loss = engine(input_ids=ids, labels=ids, use_cache=False).loss
        engine.backward(loss)
        engine.step()
        loss = loss.detach().clone()
        dist.all_reduce(loss)  # each rank's rows hold as many tokens: the global mean is the ranks' mean
        return float(loss) / layout.dp

    return Peer(step=step)
