"""What each peer needs to run on a CPU with gloo, and why: every change here is a device placement or a
collective's reduce op, never the computation.  The results page lists these (:data:`CPU_SHIMS`), each with the line
of the peer's code that requires CUDA and the error it raises without the change.

Megatron-Core's changes hold only while its own code runs (:func:`megatron_on_cpu`, entered around each of its
steps), so fxshard and torchtitan in the same process never see them.
"""

from __future__ import annotations

import contextlib

import torch

# peer -> [(where its code requires CUDA or something gloo lacks, the error without the change, what we change)]
CPU_SHIMS = {
    "torchtitan": [
        ("torchtitan/tools/utils.py:55 `device_type = _get_available_device_type() or \"cuda\"`; "
         "parallel_dims.py:282 builds every mesh with it",
         "fully_shard: `AssertionError: Torch not compiled with CUDA enabled` (torch.cuda.current_device)",
         "torchtitan.distributed.parallel_dims.device_type = \"cpu\""),
        ("torchtitan/distributed/minimal_async_ep/kernels.py:10 `import triton` at import time",
         "`ModuleNotFoundError: No module named 'triton'` (the CPU torch wheel has no triton)",
         "make peers installs triton 3.8.0 (from the wheels on disk); no triton kernel runs on the CPU"),
        ("FSDP2 reduce-scatters the gradients with `ReduceOp.PREMUL_SUM` under torchtitan's FSDP settings",
         "`RuntimeError: Cannot use ReduceOp.PREMUL_SUM with Gloo`",
         "every FSDP module: set_force_sum_reduction_for_comms(True) (a SUM, then the same division)"),
    ],
    "Megatron-Core": [
        ("megatron/core/models/common/embeddings/rotary_pos_embedding.py:162 "
         "`self.inv_freq.to(device=torch.cuda.current_device())`; also tensor_parallel/mappings.py:91, "
         "tensor_parallel/layers.py:552, pipeline_parallel/p2p_communication.py (receive buffers)",
         "`AssertionError: Torch not compiled with CUDA enabled`",
         "torch.cuda.current_device() answers \"cpu\" while Megatron's code runs"),
        ("megatron/core/optimizer/optimizer.py:907 `torch.tensor([1.0], dtype=torch.float, device='cuda')` "
         "(FP32Optimizer); distributed/param_and_grad_buffer.py:768 likewise",
         "`AssertionError: Torch not compiled with CUDA enabled`",
         "while Megatron's code runs, a tensor made with device=\"cuda\" is made on the CPU (a TorchFunctionMode)"),
        ("megatron/core/pipeline_parallel/p2p_communication.py:398 `torch.cuda.synchronize()` after each "
         "send/receive", "`AssertionError: Torch not compiled with CUDA enabled`",
         "torch.cuda.synchronize() does nothing while Megatron's code runs (CPU ops return done)"),
        ("megatron/core/transformer/utils.py:35 default causal mask `torch.ones(sq, sq, device=\"cuda\")`",
         "`AssertionError: Torch not compiled with CUDA enabled`",
         "the causal mask is passed in (attention_mask), as Megatron's own data pipeline does"),
        ("megatron/core/tensor_parallel/random.py:235 `torch.cuda.get_rng_state()` (CudaRNGStatesTracker.add); "
         "transformer/dot_product_attention.py:217 forks that tracker every forward",
         "`Exception: cuda rng state model-parallel-rng is not added`",
         "the tracker's fork is a no-op: dropout is 0, so nothing draws from it"),
    ],
}


def torchtitan_on_cpu() -> None:
    """Point torchtitan's meshes at the CPU (its fallback device type is "cuda")."""
    import torchtitan.distributed.parallel_dims as parallel_dims

    parallel_dims.device_type = "cpu"


def sum_reduction_for_gloo(model: torch.nn.Module) -> None:
    """FSDP2 modules reduce with SUM then divide, instead of PREMUL_SUM, which gloo does not have."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


class _CudaToCpu(torch.overrides.TorchFunctionMode):
    """Every tensor Megatron's code makes on "cuda" (``device="cuda"`` literals, ``.cuda()``) is made on the CPU."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if str(kwargs.get("device", "")).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        return func(*args, **kwargs)


class _NoFork:
    def fork(self, *args, **kwargs):
        return contextlib.nullcontext()


@contextlib.contextmanager
def megatron_on_cpu(on_cpu: bool = True):
    """While Megatron-Core's code runs: ``torch.cuda.current_device()`` is "cpu" and its CUDA RNG tracker forks
    nothing.  ``on_cpu=False`` (a GPU): nothing changes."""
    if not on_cpu:
        yield
        return
    from megatron.core.tensor_parallel import random

    current_device, synchronize = torch.cuda.current_device, torch.cuda.synchronize
    tracker = random._CUDA_RNG_STATE_TRACKER
    torch.cuda.current_device, torch.cuda.synchronize = lambda: "cpu", lambda *args: None
    random._CUDA_RNG_STATE_TRACKER = _NoFork()
    random._CUDA_RNG_STATE_TRACKER_INITIALIZED = True
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.synchronize = current_device, synchronize
        random._CUDA_RNG_STATE_TRACKER = tracker
