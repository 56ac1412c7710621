"""The ZeRO paper's bytes of model state per rank, for Adam: what ``fxshard plan`` predicts and ``fxshard run
--memory-report`` measures against (:mod:`fxshard.train.memory`).  Bytes per parameter (Ψ on the rank before dp
sharding, N dp ranks)::

    zero  fp32 params/grads/optimizer       mixed (bf16 + fp32 masters)
    0     4     4     8        = 16         2     2     12       = 16
    1     4     4     8/N                   2     2     12/N
    2     4     4/N   8/N                   2     2/N   12/N
    3     4/N   4/N   8/N      = 16/N       2/N   2/N   12/N     = 16/N

    >>> formula(1, 4, False, 100)["total"], formula_text(1, 4, False)
    (1000.0, '8Ψ + 8Ψ/N')
"""

from __future__ import annotations

FORMULAS = {  # (zero, mixed) -> bytes per parameter as (replicated, divided by N) per category
    (0, False): {"params": (4, 0), "grads": (4, 0), "optimizer": (8, 0)},
    (1, False): {"params": (4, 0), "grads": (4, 0), "optimizer": (0, 8)},
    (2, False): {"params": (4, 0), "grads": (0, 4), "optimizer": (0, 8)},
    (3, False): {"params": (0, 4), "grads": (0, 4), "optimizer": (0, 8)},
    (0, True): {"params": (2, 0), "grads": (2, 0), "optimizer": (12, 0)},
    (1, True): {"params": (2, 0), "grads": (2, 0), "optimizer": (0, 12)},
    (2, True): {"params": (2, 0), "grads": (0, 2), "optimizer": (0, 12)},
    (3, True): {"params": (0, 2), "grads": (0, 2), "optimizer": (0, 12)},
}
FSDP2_ZERO2_EXTRA = {False: 4, True: 2}  # bytes per Ψ/N FSDP2 holds beyond the ZeRO-2 formula (see above)


def formula(zero: int, dp: int, mixed: bool, psi: int) -> dict[str, float]:
    """Bytes per category (and ``total``) the ZeRO paper's formula gives for ``psi`` parameters."""
    zero = zero if dp > 1 else 0
    out = {k: psi * (rep + per / dp) for k, (rep, per) in FORMULAS[(zero, mixed)].items()}
    out["total"] = sum(out.values())
    return out


def frozen_formula(zero: int, dp: int, mixed: bool, psi: int) -> dict[str, float]:
    """Bytes per category for ``psi`` frozen parameters (``requires_grad=False``): no gradient, no optimizer state
    (``fxshard.train.modules.trained_parameters``), only the parameter itself.  Outside FSDP2 it is held whole in
    the compute dtype, without an fp32 master; FSDP2 (ZeRO 2/3) shards it in fp32 as any parameter, and at ZeRO 2
    keeps it gathered in the compute dtype after forward.

    >>> frozen_formula(1, 4, True, 100)["total"], frozen_formula(3, 4, True, 100)["total"]
    (200, 100.0)
    """
    zero = zero if dp > 1 else 0
    low = 2 if mixed else 4
    held = {0: low * psi, 1: low * psi, 2: low * psi + 4 * psi / dp, 3: 4 * psi / dp}[zero]
    return {"params": held, "grads": 0, "optimizer": 0, "total": held}


def peak_params(zero: int, dp: int, mixed: bool, psi: int, blocks=()) -> float:
    """Parameter bytes a rank holds at once during forward, the transient the ZeRO formulas leave out.

    ZeRO 0/1 hold the parameters in the compute dtype; under ZeRO 2 FSDP2 gathers a stage module's parameters
    whole next to the fp32 shard; under ZeRO 3 each repeated block is a unit of its own (``blocks``: the
    parameters of each block unit this rank holds), so the rest of the module is gathered with the running
    block and the next one, prefetched."""
    low = 2 if mixed else 4
    gathered = psi
    if zero == 3 and dp > 1 and blocks:
        gathered = psi - sum(blocks) + sum(sorted(blocks)[-2:])
    return low * gathered + (4 * psi / dp if zero >= 2 and dp > 1 else 0)


def formula_text(zero: int, dp: int, mixed: bool) -> str:
    zero = zero if dp > 1 else 0
    rep = sum(r for r, _ in FORMULAS[(zero, mixed)].values())
    per = sum(p for _, p in FORMULAS[(zero, mixed)].values())
    return " + ".join(t for t in (f"{rep}Ψ" if rep else "", f"{per}Ψ/N" if per else "") if t)
