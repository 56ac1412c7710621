"""Let a model convert its own modules to the dtype and device they already have, while it is captured.

Switch Transformers' router runs ``self.classifier = self.classifier.to(self.dtype)`` in every forward: a
conversion that changes nothing in eager PyTorch, but that ``Module._apply`` carries out on the fake tensors
of a capture by swapping each parameter for a converted copy, which fails (``Couldn't swap Linear.weight``).
While capturing, ``Module.to`` returns the module itself when no parameter or buffer would change, as eager
PyTorch's result is then the same module with the same tensors::

    with unchanged_conversions():
        ep = torch.export.export(wrapper, args, kwargs, strict=False)

A conversion that would change something still runs, and still fails as before (the capture names it).
"""

from __future__ import annotations

import contextlib

import torch


@contextlib.contextmanager
def unchanged_conversions():
    original = torch.nn.Module.to

    def to(module, *args, **kwargs):
        try:
            device, dtype, _non_blocking, memory_format = torch._C._nn._parse_to(*args, **kwargs)
        except (TypeError, RuntimeError):
            return original(module, *args, **kwargs)
        if memory_format is None and all(_unchanged(t, device, dtype) for t in _tensors(module)):
            return module
        return original(module, *args, **kwargs)

    torch.nn.Module.to = to
    try:
        yield
    finally:
        torch.nn.Module.to = original


def _tensors(module: torch.nn.Module):
    yield from (t for t in module.parameters() if t is not None)
    yield from (t for t in module.buffers() if t is not None)


def _unchanged(t: torch.Tensor, device, dtype) -> bool:
    """What ``Module.to`` leaves alone: the device if it is the same, the dtype of a non-floating tensor."""
    if device is not None and torch.device(device) != t.device:
        return False
    return dtype is None or not (t.is_floating_point() or t.is_complex()) or t.dtype == dtype
