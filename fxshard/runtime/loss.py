"""A token-mean loss's divisor, set by the runtime for each step (see ``passes/token_mean.py``).

The generated code computes the loss of a microbatch as its sum over counted tokens; ``token_mean`` divides
it by the step's count N over D, the number of parts (microbatches · dp ranks · accumulated batches) whose
gradients and losses training averages, so every part's loss is its share of the step's single-device mean.
Called outside a training step (a test, a forward on its own), it divides by the call's own count: the
loss the unmodified model computes on that batch.
"""

from __future__ import annotations

import contextlib

import torch

_DIVISORS: list[tuple[float, ...] | None] = [None]


@contextlib.contextmanager
def step_tokens(counted, parts: int):
    """For one step's forwards and backwards: ``counted`` targets in the whole step (one count per counted mean
    of the loss: an int, or a sequence for a loss adding several), averaged over ``parts``."""
    counts = tuple(counted) if isinstance(counted, (tuple, list)) else (counted,)
    _DIVISORS[0] = tuple(c / parts for c in counts)
    try:
        yield
    finally:
        _DIVISORS[0] = None


def token_mean(loss_sum: torch.Tensor, target: torch.Tensor, ignore_index: int = -100, term: int = 0) -> torch.Tensor:
    """``loss_sum`` (summed over this microbatch's counted targets) as its share of the step's token mean; ``term``:
    which of the loss's counted means it is (each divided by its own count)."""
    divisors = _DIVISORS[0]
    if divisors is None:
        return loss_sum / (target != ignore_index).sum()
    return loss_sum / divisors[term]
