"""Sizes as people read them, one formatter for the rank files, the plan, the memory report and the HTML report::

    >>> human_bytes(3 * 2**30), human_bytes(1536, digits=1), human_bytes(12)
    ('3.00 GiB', '1.5 KiB', '12 B')
"""

from __future__ import annotations

_BINARY = ((2**40, "TiB"), (2**30, "GiB"), (2**20, "MiB"), (2**10, "KiB"))


def human_bytes(n: float, digits: int = 2) -> str:
    """``n`` bytes in the largest binary unit it reaches, with ``digits`` decimals (whole bytes below 1 KiB)."""
    for scale, unit in _BINARY:
        if abs(n) >= scale:
            return f"{n / scale:.{digits}f} {unit}"
    return f"{n:.0f} B"
