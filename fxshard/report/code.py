"""The rank files as the report shows them: highlighted line by line, and read back into modules and collectives.

The highlighter is Python's own ``tokenize`` mapped to a few CSS classes (no dependency, no network).  The
module list is read from the comments the code generator heads every group of lines with
(``# self_attn.q_proj  Linear  column-parallel  (modeling_llama.py:244)``) and its ``rt.<collective>`` calls,
whose trailing comment gives the local shape and dtype of what they make::

    modules = rank_modules(Path("out/l/rank_pp0_tp0.py").read_text())
    modules[0].fqn, modules[0].role, modules[0].collectives[0].op   # 'model.embed_tokens', 'vocab-parallel', ...
"""

from __future__ import annotations

import html
import io
import keyword
import math
import re
import token
import tokenize
from dataclasses import dataclass, field

from fxshard.codegen.lines import SHORT_DTYPES

_BUILTINS = {"self", "None", "True", "False", "super", "torch", "rt", "aten"}


def highlight(source: str) -> list[str]:
    """One HTML string per line of ``source``: keywords, strings, comments, numbers and definitions in spans."""
    lines = source.splitlines()
    marks: list[list[tuple[int, int, str]]] = [[] for _ in lines]  # per line: (start col, end col, css class)
    previous = None
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            css = _css(tok, previous)
            if tok.type not in (token.NL, token.NEWLINE, token.INDENT, token.DEDENT):
                previous = tok
            if css is None:
                continue
            (r0, c0), (r1, c1) = tok.start, tok.end
            for row in range(r0, r1 + 1):  # a docstring spans lines: one span per line
                if row - 1 < len(lines):
                    marks[row - 1].append((c0 if row == r0 else 0, c1 if row == r1 else len(lines[row - 1]), css))
    except (tokenize.TokenError, SyntaxError):  # not Python we can read: shown plain
        pass
    return [_line(text, marks[i]) for i, text in enumerate(lines)]


def _css(tok, previous) -> str | None:
    if tok.type == token.COMMENT:
        return "c"
    if tok.type == token.STRING or tok.type in _FSTRING:
        return "s"
    if tok.type == token.NUMBER:
        return "n"
    if tok.type == token.NAME:
        if previous is not None and previous.string in ("def", "class"):
            return "d"
        if keyword.iskeyword(tok.string):
            return "k"
        if tok.string in _BUILTINS:
            return "b"
    return None


_FSTRING = {getattr(token, n) for n in ("FSTRING_START", "FSTRING_MIDDLE", "FSTRING_END") if hasattr(token, n)}


def _line(text: str, marks: list[tuple[int, int, str]]) -> str:
    out, at = [], 0
    for start, end, css in sorted(marks):
        if start < at:
            continue
        out.append(html.escape(text[at:start]))
        out.append(f'<span class="{css}">{html.escape(text[start:end])}</span>')
        at = end
    out.append(html.escape(text[at:]))
    return "".join(out)


# ---------------------------------------------------------------- modules and collectives of a rank file

_CLASS = re.compile(r"^class (\w+)\(")
_INSTANCES = re.compile(r"as this rank runs it \(([^)]*)\)")
_HEADER = re.compile(r"^\s+# (\S+|\(the block\))  (\w+)(?:  ([a-z][\w-]*(?: [\w-]+)*))?  \(([^)]*)\)(?:  "
                     r"\(([^)]*)\))?\s*$")
_CALL = re.compile(r"^\s+(\w+) = rt\.(\w+)\(.*#\s*\[([\d, ]*)\] (\w+)")
_DTYPE_BYTES = {short: dtype.itemsize for dtype, short in SHORT_DTYPES.items()}  # as the line comments write them


@dataclass
class CallSite:
    """One ``rt.<op>`` line: what its forward and backward issue, and the bytes of the whole buffer of each."""

    line: int
    op: str
    value: str
    shape: tuple[int, ...]
    dtype: str
    forward: str | None
    backward: str | None
    forward_bytes: int
    backward_bytes: int


@dataclass
class ModuleLines:
    """Consecutive lines of a rank file generated from one module of the model."""

    cls: str  # the generated class holding them
    fqn: str
    type: str
    role: str  # column-parallel, row-parallel, vocab-parallel, ... or replicated
    source: str  # the model's file:line
    first: int
    last: int
    instances: int = 1  # a repeated block's class runs once per block
    collectives: list[CallSite] = field(default_factory=list)


def rank_modules(source: str, group_size: int = 1) -> list[ModuleLines]:
    """The modules of a rank file in the file's order, each with its collective calls (``group_size``: the size
    of the tp group, for the gathered buffers)."""
    from fxshard.ir.comm import KINDS, REGATHERED

    modules: list[ModuleLines] = []
    cls, prefix, instances = "", "", 1
    for number, text in enumerate(source.splitlines(), start=1):
        m = _CLASS.match(text)
        if m:
            cls, prefix, instances = m.group(1), "", 1
            continue
        m = _INSTANCES.search(text)
        if m and cls:
            names = [n.strip() for n in m.group(1).split(",")]
            prefix, instances = _common(names), len(names)
            continue
        m = _HEADER.match(text)
        if m:
            fqn = m.group(1)
            fqn = (prefix if fqn == "(the block)" else f"{prefix}.{fqn}") if prefix else fqn
            role = m.group(3) or "replicated"
            if m.group(5):  # "(recomputed here, not received)"
                role += f" ({m.group(5)})"
            last = modules[-1] if modules else None
            if last and (last.cls, last.fqn, last.role) == (cls, fqn, role):
                last.last = number
            else:
                modules.append(ModuleLines(cls, fqn, m.group(2), role, m.group(4), number, number, instances))
            continue
        if modules and text.strip() and modules[-1].cls == cls and text.startswith("        "):
            modules[-1].last = number
        m = _CALL.match(text)
        if m and m.group(2) in KINDS and KINDS[m.group(2)].communicates and modules:
            kind = KINDS[m.group(2)]
            shape = tuple(int(d) for d in m.group(3).split(",") if d.strip())
            out_bytes = math.prod(shape) * _DTYPE_BYTES[m.group(4)]
            modules[-1].collectives.append(CallSite(
                number, kind.name, m.group(1), shape, m.group(4), _said(kind, "forward"), _said(kind, "backward"),
                _buffer(kind.forward, "forward", out_bytes, group_size),
                _buffer(kind.backward, "backward", out_bytes, group_size, kind.function in REGATHERED)))
    return modules


def _said(kind, direction: str) -> str | None:
    """What a call issues in ``direction``, as the report says it: ``all_reduce (amaxes) + all_gather``; the
    bytes beside it are the data operation's (an fp8 call's amaxes are a few float32 values)."""
    return " + ".join(f"{op} (amaxes)" if amaxes else op for op, amaxes in kind.ops(direction)) or None


def _buffer(op: str | None, direction: str, out_bytes: int, n: int, regathered: bool = False) -> int:
    """Bytes of the whole buffer of an operation, from the call's local output: a backward gather collects the
    gradient of a split output (n parts), a forward reduce-scatter reduces n parts' worth; otherwise the output
    is the buffer (a gather's output is whole, a reduction's output is its input's shape).  ``regathered``: the
    fused linears that gather their sp shard again in backward, whose line states the gathered input, already
    whole."""
    if op is None:
        return 0
    grows = ((op == "all_gather" and direction == "backward" and not regathered)
             or (op == "reduce_scatter" and direction == "forward"))
    return out_bytes * n if grows else out_bytes


def _common(names: list[str]) -> str:
    """``model.layers.{0,1}`` for the instances of a block, or the one name."""
    if len(names) == 1:
        return names[0]
    heads = {n.rsplit(".", 1)[0] for n in names}
    if len(heads) == 1:
        tails = [n.rsplit(".", 1)[-1] for n in names]
        if all(t.isdigit() for t in tails):
            nums = sorted(map(int, tails))
            if nums == list(range(nums[0], nums[-1] + 1)):
                return f"{heads.pop()}.{{{nums[0]}-{nums[-1]}}}"
        return f"{heads.pop()}.{{{','.join(tails)}}}"
    return "{" + ",".join(names) + "}"
