"""Say where two ranks' sequences of collectives part ways, in terms of their rank files' lines.

Comparing position by position finds where the *communication* first goes wrong, but not the line
a person changed: drop one of sixteen identical all-reduces and the sequences only differ at the
end.  The values the lines assign (``all_reduce_3 = rt.all_reduce(...)``), with the class whose code assigns
them, are the same in every rank file of one compile, so aligning on (class, value, collective) finds the
dropped, added or moved line::

    where, text = first_difference(ref, odd, "rank_pp0_tp0.py", "global rank 0", "rank_pp0_tp1.py", lines, "forward")
    # ('rank_pp0_tp1.py:265', 'forward collective #4 is missing: rank_pp0_tp0.py:265 (global rank 0) issues
    #   all_reduce float32 [8, 16, 64] (all_reduce_3 = rt.all_reduce(...)) but line 265 here
    #   (`all_reduce_3 = linear_9`) issues none; this rank issues 17 forward collectives there, the other 18')
"""

from __future__ import annotations

import re
from difflib import SequenceMatcher

from fxshard.check.rank_trace import Collective


def first_difference(ref: list[Collective], odd: list[Collective], ref_file: str, ref_ranks: str, odd_file: str,
                     odd_lines: list[str], phase: str, elsewhere: dict[str, Collective] | None = None
                     ) -> tuple[str, str]:
    """``(file:line in the odd rank's file, what differs)`` for the first place ``odd`` departs from ``ref``.

    ``elsewhere``: the odd rank's collectives over other groups, by :attr:`Collective.ident` (a line moved to
    another group).  Values are identified with their class: a block class's lines run once per block."""
    args = ref_file, ref_ranks, phase
    odd_lines = (odd_lines, elsewhere or {})
    moved = {c.ident for c in ref if c.value} & {c.ident for c in odd}
    matcher = SequenceMatcher(a=[(c.ident, c.key) for c in ref], b=[(c.ident, c.key) for c in odd], autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        pairs = list(zip(range(i1, i2), range(j1, j2), strict=False)) if tag == "replace" else []
        if pairs and all(ref[i].key == odd[j].key for i, j in pairs) and i2 - i1 == j2 - j1:
            continue  # renamed values, same collectives
        lost = [i for i in range(i1, i2) if ref[i].ident not in moved]
        added = [j for j in range(j1, j2) if odd[j].ident not in moved]
        if tag != "insert" and lost and (tag == "delete" or not added):
            return _missing(ref, odd, lost[0], j1, odd_file, odd_lines, *args)
        if tag != "delete" and added and (tag == "insert" or not lost):
            return _extra(ref, odd, added[0], *args)
        break  # a collective issued in another order, or one replaced by another
    # where communication first goes wrong: the first position whose collectives differ
    p = next((k for k in range(min(len(ref), len(odd))) if ref[k].key != odd[k].key), min(len(ref), len(odd)))
    if p < min(len(ref), len(odd)):
        return _replaced(ref, odd, p, p, *args)
    if len(ref) > len(odd):
        return _missing(ref, odd, p, p, odd_file, odd_lines, *args)
    return _extra(ref, odd, p, *args)


def _count(seq: list, phase: str) -> str:
    return f"{len(seq)} {phase} collective{'s' * (len(seq) != 1)}"


def _call(c: Collective) -> str:
    return f"{c.value} = rt.{c.call}(...)" if c.value else f"rt.{c.call}(...)"


def _replaced(ref, odd, i, j, ref_file, ref_ranks, phase) -> tuple[str, str]:
    a, b = ref[i], odd[j]
    text = (f"{phase} collective #{j + 1} is {b.what()} ({_call(b)}) but {a.where()} ({ref_ranks}) issues "
            f"{a.what()} ({_call(a)})")
    later = next((k for k, c in enumerate(ref) if b.value and c.ident == b.ident and c.key == b.key), None)
    if later is not None:
        text += f"; the order differs: {ref_file} issues {b.value} as #{later + 1}"
    return b.where(), text


def _missing(ref, odd, i, j, odd_file, odd_source, ref_file, ref_ranks, phase) -> tuple[str, str]:
    a = ref[i]
    odd_lines, elsewhere = odd_source
    assigns = re.compile(rf"^\s*{re.escape(a.value)}\s*=") if a.value else None
    start = next((k for k, line in enumerate(odd_lines) if a.owner and line.startswith(f"class {a.owner}(")), 0)
    n = next((k + 1 for k, line in enumerate(odd_lines) if k >= start and assigns and assigns.match(line)), 0)
    if n:
        other = elsewhere.get(a.ident)
        does = f"issues it over {other.group} instead" if other else "issues none"
        here = f"line {n} here (`{odd_lines[n - 1].split('#')[0].strip()[:70]}`) {does}"
        where = f"{odd_file}:{n}"
    else:
        where = odd[j - 1].where() if j else odd_file
        here = "this rank issues none" + (f" after line {odd[j - 1].line}" if j else "")
    return where, (f"{phase} collective #{i + 1} is missing: {a.where()} ({ref_ranks}) "
                   f"issues {a.what()} ({_call(a)}) but {here}; this rank issues {_count(odd, phase)} there, "
                   f"the other {len(ref)}")


def _extra(ref, odd, j, ref_file, ref_ranks, phase) -> tuple[str, str]:
    b = odd[j]
    return b.where(), (f"{phase} collective #{j + 1} {b.what()} ({_call(b)}) is not issued by {ref_file} "
                       f"({ref_ranks}); this rank issues {_count(odd, phase)} there, the other {len(ref)}")
