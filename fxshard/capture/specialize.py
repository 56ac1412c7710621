"""Capture Python control flow on tensor values by specializing it on the example batch, behind runtime guards.

A model that reads a tensor's value in Python (``if mask.any().item():``, ``if labels.max() >= vocab:``,
``for expert in hit.nonzero():``, ``f"expert_{idx}"``) cannot be traced on fake tensors: torch.export stops with
a data-dependent error.  Here capture runs the model once on the real example batch and records, per line of
the model's code, what each such read gave (:func:`recording`); export then runs again with those reads
answered from the record (:func:`replaying`).  Each answer is also a ``torch._check`` on the traced value, which
export keeps as a runtime assertion in the graph: a later batch that gives another value stops the step there,
with a message naming the model's line (:func:`guard_messages`), instead of running code the program lacks::

    with recording() as record:
        wrapper(*args, **kwargs)             # eager, real tensors
    with replaying(record):
        ep = torch.export.export(wrapper, args, kwargs, strict=False)
    guard_messages(ep.graph_module, record)  # runtime assertions say which line and which value

Values whose size alone depends on the data (``nonzero``, ``masked_select``, a boolean index) are not
specialized: they stay unbacked symbols (torch.export's own), sized by each batch.  Reads of floating-point
values are not specialized either (a float compared for equality would stop training at random).
"""

from __future__ import annotations

import contextlib
import linecache
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import free_unbacked_symbols

from fxshard.errors import CaptureError

_METHODS = ("item", "tolist", "__bool__", "__int__", "__index__", "__format__", "__iter__", "__len__")
_HERE = (str(Path(__file__).resolve()), str(Path(torch.__file__).resolve().parent))


@dataclass(eq=False)
class Site:
    """One line of the model's code that reads a tensor's value, and what it read on the example batch, in order."""

    file: str
    line: int
    values: list = field(default_factory=list)
    replayed: int = 0  # reads of the traced run so far
    answered: list = field(default_factory=list)  # the values given to it
    symbols: set[str] = field(default_factory=set)  # unbacked symbols export made for its reads

    def where(self) -> str:
        code = (linecache.getline(self.file, self.line) or "").strip()
        return f"{Path(self.file).name}:{self.line}" + (f" `{code}`" if code else "")


@dataclass
class Record:
    sites: dict[tuple[str, int], Site] = field(default_factory=dict)

    def site(self) -> Site:
        """The site of the calling user frame (the first outside this file and torch)."""
        frame = sys._getframe(2)
        while frame is not None and frame.f_code.co_filename.startswith(_HERE):
            frame = frame.f_back
        key = (frame.f_code.co_filename, frame.f_lineno) if frame is not None else ("<unknown>", 0)
        if key not in self.sites:
            self.sites[key] = Site(*key)
        return self.sites[key]

    def fresh(self) -> Record:
        """The values read, for another capture to be answered from (its own count of reads and answers)."""
        return Record({key: Site(s.file, s.line, list(s.values)) for key, s in self.sites.items()})

    def used(self) -> list[Site]:
        """The sites whose reads export answered from the record."""
        return [s for s in self.sites.values() if s.answered]


@contextlib.contextmanager
def _patched(make):
    originals = {name: torch.Tensor.__dict__.get(name) for name in _METHODS}
    bases = {name: getattr(torch.Tensor, name) for name in _METHODS}
    for name in _METHODS:
        setattr(torch.Tensor, name, make(name, bases[name]))
    try:
        yield
    finally:
        for name, original in originals.items():
            if original is None:
                delattr(torch.Tensor, name)
            else:
                setattr(torch.Tensor, name, original)


def _read(name: str, base, t: torch.Tensor, args, items: bool = False):
    """What the method ``name`` reads of ``t``'s value, as a plain Python value (the record's entry).  ``items``:
    a loop over a small integer tensor also reads its values (``(count, rows)``), which a program run on parts of
    the batch guards (:func:`record_reads`)."""
    if name == "__iter__" and items and t.dim() and _small_integers(t):
        return (t.shape[0], t.tolist())
    if name in ("__iter__", "__len__"):
        return t.shape[0] if t.dim() else None
    if name == "__format__":
        return t.item() if t.dim() == 0 else None
    if name == "tolist":
        return base(t)
    return base(t) if t.numel() == 1 else None


def _small_integers(t: torch.Tensor) -> bool:
    return not t.dtype.is_floating_point and not t.dtype.is_complex and t.dtype != torch.bool and t.numel() <= 256


@contextlib.contextmanager
def recording(items: bool = False):
    """Record every value the model's Python code reads of its tensors (eager, on real tensors); ``items``: as
    :func:`_read` says."""
    record = Record()
    busy = [False]

    def make(name, base):
        def method(t, *args):
            if busy[0]:
                return base(t, *args)
            busy[0] = True  # a read inside another (Tensor.__format__ calls item()) is the outer one's
            try:
                record.site().values.append(_read(name, base, t, args, items))
                return base(t, *args)
            finally:
                busy[0] = False
        return method

    with _patched(make):
        yield record


def record_reads(module: torch.nn.Module, args: tuple, kwargs: dict, items: bool = False) -> Record | None:
    """Run ``module`` once eagerly on the example (``args``, ``kwargs``) and record what its code reads of tensor
    values; None when it cannot run for real (meta or fake weights or inputs: a compile without real weights) or
    reads nothing.  Buffers (batch-norm statistics) and the random number generators are left as they were.

    ``items``: for a program run on parts of the batch (dp ranks' rows, pipeline microbatches), a loop over a small
    integer tensor (``for expert_idx in expert_hit:``, the experts a batch hit) is specialized on its values too,
    not only on how many: each part then runs the example's iterations, which the batch-row analysis needs to call
    them the whole batch's (:func:`fxshard.ir.rows_picked.hit_rule`)."""
    if not runs_eagerly(module, args, kwargs):
        return None
    saved = {id(b): b.detach().clone() for b in module.buffers()}
    with torch.random.fork_rng(devices=[]), recording(items) as record:
        try:
            module(*args, **kwargs)
        except Exception:  # the traced run says what is wrong, naming the line
            return None
        finally:
            with torch.no_grad():
                for b in module.buffers():
                    b.copy_(saved[id(b)])
    return record if record.sites else None


def refuse_other_reads(record: Record, module: torch.nn.Module, example: tuple[tuple, dict], path) -> None:
    """Raise a CaptureError if the model, run on ``example`` (another part of the batch the same program runs on: a
    dp rank's rows, a pipeline microbatch), reads another value at a line the program specialized: its guard would
    stop that rank's first step.  A part the model cannot run on eagerly is not judged here."""
    other = record_reads(module, *example, items=True)
    if other is None:
        return
    for site in record.used():
        theirs = other.sites.get((site.file, site.line))
        seen = theirs.values[:len(site.answered)] if theirs is not None else []
        if seen != site.answered:
            raise CaptureError(
                f"{path}: {site.where()} reads {_shown(site.answered)} on the first part of the batch and "
                f"{_shown(seen) or 'nothing'} on another (a data-parallel rank's rows or a pipeline microbatch): "
                "data-dependent control flow, which fxshard specializes on the example batch, and the program "
                "every rank runs can hold one value there. Train it without splitting the batch (tp alone), or "
                "make the code depend on shapes or the config alone")


def runs_eagerly(module: torch.nn.Module, args: tuple, kwargs: dict) -> bool:
    """Whether ``module`` can run on the example for real: no meta or fake weight, buffer or input."""
    tensors = [*module.parameters(), *module.buffers(),
               *(t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor))]
    return not any(t.is_meta or _fake(t) for t in tensors)


@contextlib.contextmanager
def replaying(record: Record):
    """Answer the reads export cannot (values of fake tensors) from ``record``, each behind a ``torch._check``."""
    busy = [False]

    def make(name, base):
        def method(t, *args):
            if busy[0]:
                return base(t, *args)
            busy[0] = True  # as in recording: the reads counted are the outermost ones, in order per line
            try:
                site = record.site()
                value = site.values[site.replayed] if site.replayed < len(site.values) else None
                site.replayed += 1
                answered = _UNANSWERED if value is None or not _fake(t) else _answer(name, base, t, args, value, site)
                if answered is _UNANSWERED:
                    return base(t, *args)
                site.answered.append(value)
                return answered
            finally:
                busy[0] = False
        return method

    with _patched(make):
        yield


_UNANSWERED = object()


def _answer(name: str, base, t: torch.Tensor, args, value, site: Site):
    """The recorded ``value`` as the method's result, the traced value checked against it; or _UNANSWERED."""
    if name in ("__iter__", "__len__"):
        size = t.shape[0]
        if not isinstance(size, torch.SymInt) or not free_unbacked_symbols(size):
            return _UNANSWERED  # a size export knows: nothing to specialize
        count, items = value if isinstance(value, tuple) else (value, None)
        _check_equal(size, count, site)
        if name == "__len__":
            return count
        rows = t.unbind(0)
        for row, item in zip(rows, items or (), strict=False):  # each iteration's values, as the example's
            for j, v in enumerate(_flatten(item)):
                _check_equal(torch.Tensor.item(row.reshape(-1)[j] if row.dim() != 1 else row[j]), v, site)
        return iter(rows)
    if name == "tolist":
        traced = t.tolist()
        flat, expected = _flatten(traced), _flatten(value)
        if len(flat) != len(expected) or any(isinstance(v, float) for v in expected):
            return _UNANSWERED
        for s, v in zip(flat, expected, strict=True):
            _check_equal(s, v, site)
        return value
    if isinstance(value, float) or t.numel() != 1:
        return _UNANSWERED  # floats are not specialized: an equality guard on them would fail at random
    traced = torch.Tensor.item(t) if name != "item" else base(t)
    _check_equal(traced, value, site)
    if name == "__format__":
        return format(value, *args)
    if name == "__index__" or name == "__int__":
        return int(value)
    if name == "__bool__":
        return bool(value)
    return value


def _check_equal(traced, value, site: Site) -> None:
    if isinstance(traced, (torch.SymBool, torch.SymInt)):
        site.symbols |= {str(s) for s in free_unbacked_symbols(traced)}
        cond = traced if value is True else torch.sym_not(traced) if value is False else traced == value
        torch._check(cond, lambda: f"{site.where()}: the example batch gave {value!r} here")
    elif traced != value:  # a value export computed as a constant: the record is out of step
        raise _OutOfStep(f"{site.where()}: export read {traced!r} where the example batch gave {value!r}")


class _OutOfStep(RuntimeError):
    """The traced run read another value than the recorded one: the two runs took different paths."""


def _flatten(v) -> list:
    if isinstance(v, (list, tuple)):
        return [x for item in v for x in _flatten(item)]
    return [v]


def _fake(t) -> bool:
    return isinstance(t, torch._subclasses.fake_tensor.FakeTensor) or type(t).__name__ == "FunctionalTensor"


_SYMBOL = re.compile(r"\bu\d+\b")


def guard_messages(gm: fx.GraphModule, record: Record | None) -> list[str]:
    """Rewrite every runtime assertion of ``gm`` (``aten._assert_scalar``) to say which line of the model it
    guards and what happens; returns the notes for the compile (one per specialized line).

    torch.export words them ``Runtime assertion failed for expression Eq(u0, 1) on node 'eq_2'``; a specialized
    read becomes ``modeling_x.py:549 `if is_global_attn:`: this batch reads another value here than the example
    batch fxshard compiled the program on (...)``."""
    by_symbol = {s: site for site in (record.used() if record else []) for s in site.symbols}
    for node in gm.graph.nodes:
        if node.op != "call_function" or node.target is not torch.ops.aten._assert_scalar.default:
            continue
        text = node.args[1] if len(node.args) > 1 and isinstance(node.args[1], str) else ""
        sites = {by_symbol[s] for s in _SYMBOL.findall(text) if s in by_symbol}
        if sites:
            lines = "; ".join(sorted(s.where() for s in sites))
            message = (f"{lines}: this batch reads another value here than the example batch fxshard compiled "
                       "the program on, and the program holds only the code that value led to (data-dependent "
                       "control flow, specialized at compile time). Compile with an example batch that takes "
                       "this path, or make the condition depend on shapes or the config alone")
        else:
            origin = _origin(node)
            message = (f"{origin + ': ' if origin else ''}a check of the model's own failed on this batch "
                       f"({text.removeprefix('Runtime assertion failed for expression ')})")
        node.args = (node.args[0], message, *node.args[2:])
    gm.recompile()
    return [f"{s.where()}: data-dependent control flow specialized on the example batch (read "
            f"{_shown(s.answered)}); a batch that reads another value stops with this line named"
            for s in (record.used() if record else [])]


def _shown(values: list) -> str:
    text = ", ".join(repr(v) for v in values[:4]) + (", ..." if len(values) > 4 else "")
    return text if len(text) < 80 else text[:77] + "..."


def _origin(node: fx.Node) -> str:
    """``file:line `code``` of the model line a node's stack trace ends in, or ''."""
    trace = node.meta.get("stack_trace") or ""
    found = re.findall(r'File "([^"]+)", line (\d+)', trace)
    if not found:
        return ""
    file, line = found[-1]
    code = (linecache.getline(file, int(line)) or "").strip()
    return f"{Path(file).name}:{line}" + (f" `{code}`" if code else "")
