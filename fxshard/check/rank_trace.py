"""Run a generated rank file on meta tensors and record every collective it would issue.

The static checks (``fxshard.check.check``) must judge the files that will actually run — a file someone
edited, or one left over from another compile — so they do not look at the compiler's graph: they
execute the rank file itself.  Its classes are built on the ``meta`` device (no memory, no data), their
``forward`` runs on meta inputs of the declared shapes, and autograd runs the backward; the module's
``rt`` (``fxshard.runtime``) is replaced by a recorder whose collectives communicate nothing and
instead note what the real one would send: the kind, the process group, the shape and dtype, and the
line of the rank file that issued it (the backward of ``rt.copy_to`` is charged to the ``copy_to`` line)::

    trace = trace_rank(source, "rank_pp0_tp1.py", manifest, manifest.ranks[1])
    str(trace.classes["RankModule"].forward[0])
    # 'all_reduce float32 [8, 16, 64] over tp (rank_pp0_tp1.py:173 rt.all_reduce -> all_reduce)'  (gpt.py, tp=2)
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import inspect
import re
import sys
import traceback
import types
from dataclasses import dataclass, field

import torch

from fxshard import runtime
from fxshard.codegen.manifest import Manifest, RankEntry
from fxshard.errors import CheckError
from fxshard.ir.comm import FUSED_NAMES, KINDS, SUM_TIED_GRADS, amax_weights, op_group
from fxshard.ir.layout import CP, CPTP, DP, EP, PP, TP

_ASSIGNED = re.compile(r"^\s*([A-Za-z_]\w*)\s*=")


@dataclass(frozen=True)
class FakeGroup:
    """Stands in for a process group: its name (``tp``, ``pp``, ``tied:<fqn>``), size and this rank's index."""

    name: str
    size: int
    rank: int


@dataclass(frozen=True)
class Collective:
    """One collective a rank file issues: what the backend would run, and the line that issues it."""

    kind: str  # what the backend runs: all_reduce, all_gather
    group: str
    shape: tuple[int, ...]
    dtype: str
    direction: str  # forward, backward, after backward
    call: str  # the rt.* function of the line (copy_to issues its all_reduce in backward)
    value: str  # the variable the line assigns ("all_reduce_3"), "" when it assigns none
    file: str
    line: int
    owner: str = ""  # the generated class whose forward issues it ("" for sync_tied_grads)

    @property
    def ident(self) -> tuple[str, str]:
        """The line's value within its class: block classes run once per block, so a value name alone repeats."""
        return self.owner, self.value

    @property
    def key(self) -> tuple:
        """What must agree between the ranks of a group for the collective to complete correctly."""
        return self.kind, self.group, self.shape, self.dtype

    def what(self) -> str:
        return f"{self.kind} {self.dtype} {list(self.shape)}"

    def where(self) -> str:
        return f"{self.file}:{self.line}"

    def __str__(self) -> str:
        via = f"rt.{self.call}" + (f" -> {self.value}" if self.value else "")
        return f"{self.what()} over {self.group} ({self.where()} {via})"


@dataclass
class ClassTrace:
    """What one generated class (``RankModule`` or ``StageN``) did in one forward and backward."""

    name: str
    forward: list[Collective] = field(default_factory=list)
    backward: list[Collective] = field(default_factory=list)
    outputs: list[tuple[tuple[int, ...], str]] = field(default_factory=list)  # (shape, dtype) returned
    tensors: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)  # parameters and buffers


@dataclass
class RankTrace:
    file: str
    module: types.ModuleType
    classes: dict[str, ClassTrace] = field(default_factory=dict)
    tied: list[Collective] = field(default_factory=list)  # sync_tied_grads, after backward


def load_rank_source(source: str, file: str) -> types.ModuleType:
    """Execute a rank file's source as a fresh module whose code objects carry ``file`` as their file name."""
    module = types.ModuleType("fxshard_checked_" + re.sub(r"\W", "_", file))
    module.__file__ = file
    try:
        code = builtins.compile(source, file, "exec")
    except SyntaxError as e:
        raise CheckError(f"{file}:{e.lineno}: the rank file is not valid Python ({e.msg})") from None
    try:
        exec(code, module.__dict__)
    except Exception as e:
        raise CheckError(f"{_line_of(e, file)}: the rank file fails to import: {type(e).__name__}: {e}") from None
    return module


class _OnGrad(torch.autograd.Function):
    """Identity whose backward calls ``note(grad)``: where a collective runs on the gradient."""

    @staticmethod
    def forward(ctx, x, note):
        ctx.note = note
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.note(grad)
        return grad, None


class _NoteOnce(torch.autograd.Function):
    """Identity on several tensors whose backward calls ``note`` once, with a flat buffer of ``elements``."""

    @staticmethod
    def forward(ctx, note, elements, *tensors):
        ctx.note, ctx.elements = note, elements
        return tuple(t.view_as(t) for t in tensors)

    @staticmethod
    def backward(ctx, *grads):
        g = next(g for g in grads if g is not None)
        ctx.note(g.new_empty((ctx.elements,)))
        return None, None, *grads


def _slot_elements(tensors, layouts) -> int:
    """The elements ``rt.sum_replicas`` all-reduces: each replicated part in its slots."""
    total = 0
    for t, (dim, pieces) in zip(tensors, layouts, strict=True):
        row = t.numel() // t.shape[dim]
        total += sum(length * slots * row for _start, length, _slot, slots in pieces)
    return total


class Recorder:
    """Replaces ``fxshard.runtime`` (the ``rt`` of a rank file): collectives are recorded, not run.

    Functions without communication (``shard``, ``vocab_embedding``) are the real ones."""

    def __init__(self, file: str, lines: list[str]):
        self._file, self._lines = file, lines
        self.events: list[Collective] = []

    def __getattr__(self, name):
        return getattr(runtime, name)

    def _site(self) -> tuple[int, str, str]:
        """The rank file's line that issues a call, the value it assigns and the class whose code it is."""
        frame = sys._getframe(1)
        while frame is not None and frame.f_code.co_filename != self._file:
            frame = frame.f_back
        if frame is None:
            return 0, "", ""
        line = frame.f_lineno
        m = _ASSIGNED.match(self._lines[line - 1]) if 0 < line <= len(self._lines) else None
        qualname = frame.f_code.co_qualname
        return line, m.group(1) if m else "", qualname.split(".")[0] if "." in qualname else ""

    def _note(self, kind, group, t, direction, call, site) -> None:
        name = group.name if isinstance(group, FakeGroup) else f"<not a process group: {group!r}>"
        self.events.append(Collective(kind, name, _shape(t), str(t.dtype).removeprefix("torch."),
                                      direction, call, site[1], self._file, site[0], site[2]))

    def _collective(self, kind, x, group, **kwargs):
        """What the runtime's ``kind`` would do: note its forward operation now, its backward operation when
        autograd reaches it (charged to this line), and return the local value it makes."""
        site = self._site()
        buffer = _buffer_of(kind, x, kwargs)
        over = {amaxes: op_group((x, group), kwargs, amaxes) for amaxes in (True, False)}  # fp8 under --cp: cp_tp
        for op, amaxes in kind.ops("forward"):
            self._note(op, over[amaxes], buffer("forward") if amaxes else x, "forward", kind.name, site)
        size = group.size if isinstance(group, FakeGroup) else 1

        def note(g):
            for op, amaxes in kind.ops("backward"):
                self._note(op, over[amaxes], buffer("backward") if amaxes else g, "backward", kind.name, site)

        if kind.ops("backward") and kind.name in _SEVERAL_OUTPUTS:  # noted on its input's gradient
            return kind.fake(_OnGrad.apply(x, note), size, **kwargs)
        if kind.name == "sum_replicas":  # several tensors, one all-reduce of their replicated parts' slots
            return _NoteOnce.apply(note, _slot_elements(x, kwargs.get("layouts", ())), *x)
        y = kind.fake(x, size, **kwargs)
        if kind.ops("backward"):
            y = _OnGrad.apply(y, note)
        return y

    def recompute(self, block, *args, keep="inputs"):
        """A recomputed block's collectives are those of its forward: recorded once, where the block is called
        (the rerun in backward issues them again on every rank of the group alike)."""
        return block(*args)

    def sum_tied_grads(self, copies, group):
        if group is not None:
            self._note("all_reduce", group, copies[0], "after backward", SUM_TIED_GRADS, self._site())


# whose backward collective is noted on the input
_SEVERAL_OUTPUTS = (*FUSED_NAMES, "ring_attention_step")


def _buffer_of(kind, x, kwargs):
    """``direction -> the buffer`` of an fp8 kind's amax all-reduce (float32), else None."""
    if kind.buffer is None:
        return None
    weights = [tuple(w.shape) for w in amax_weights(kwargs)]
    return lambda direction: x.new_empty((int(kind.buffer(x.numel(), weights, kwargs, direction)),),
                                         dtype=torch.float32)


def _recording(kind):
    params = list(inspect.signature(kind.function).parameters)[2:]  # after (x, group)

    def call(self, x, group, *args, **kwargs):
        return self._collective(kind, x, group, **dict(zip(params, args, strict=False)), **kwargs)

    call.__name__ = kind.name
    return call


for _kind in KINDS.values():
    if _kind.communicates:
        setattr(Recorder, _kind.name, _recording(_kind))


def _line_of(e: BaseException, file: str) -> str:
    """``file:line`` of the innermost frame of ``e``'s traceback inside the rank file."""
    lines = [f.lineno for f in traceback.extract_tb(e.__traceback__) if f.filename == file]
    return f"{file}:{lines[-1]}" if lines else file


def _meta(shape, dtype, requires_grad: bool) -> torch.Tensor:
    dtype = getattr(torch, dtype) if isinstance(dtype, str) else dtype
    return torch.empty(tuple(shape), dtype=dtype, device="meta").requires_grad_(requires_grad)


def _leaves(value) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _leaves(v)]
    return []


def trace_class(trace: RankTrace, recorder: Recorder, cls_name: str, groups: dict, inputs: list,
                backward: str, keywords: dict | None = None) -> ClassTrace:
    """Build ``cls_name`` on meta, run forward on ``inputs`` (and ``keywords``: the user inputs a later pipeline
    stage takes from its microbatch) and backward, recording collectives.

    ``backward``: ``"first"`` (``RankModule``: the loss is output 0), ``"outputs"`` (a pipeline stage:
    every output that carries a gradient gets one, as the next stage would send)."""
    file = trace.file
    cls = getattr(trace.module, cls_name, None)
    if not isinstance(cls, type):
        raise CheckError(f"{file}: defines no class {cls_name}, which the manifest lists for it; "
                         "the rank file and manifest.json come from different compiles")
    result = ClassTrace(cls_name)
    try:
        module = cls(groups, "meta")
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            result.tensors[name] = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        mark = len(recorder.events)
        try:
            _run_class(result, recorder, module, inputs, keywords, backward)
        except CheckError:
            raise
        except Exception as on_meta:
            # meta tensors hold no values: a value the code reads (item(), a nonzero() size, a boolean index)
            # fails there. Fake tensors with a shape environment give it a symbol instead; the first error stands
            # if they fail too
            del recorder.events[mark:]
            try:
                with fake_values():
                    _run_class(result, recorder, module, inputs, keywords, backward)
            except Exception:
                raise on_meta from None
    except CheckError:
        raise
    except Exception as e:
        raise CheckError(f"{_line_of(e, file)}: {cls_name} fails when run on meta tensors of the declared "
                         f"shapes: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
                         ) from None
    trace.classes[cls_name] = result
    return result


def _run_class(result: ClassTrace, recorder: Recorder, module, inputs: list, keywords: dict | None,
               backward: str) -> None:
    start = len(recorder.events)
    out = module(*inputs, **(keywords or {}))
    result.forward = recorder.events[start:]
    leaves = _leaves(out)
    result.outputs = [(_shape(t), str(t.dtype).removeprefix("torch.")) for t in leaves]
    roots = leaves[:1] if backward == "first" else leaves
    roots = [t for t in roots if t.requires_grad]
    start = len(recorder.events)
    if roots:
        torch.autograd.backward(roots, [torch.ones_like(t) for t in roots])
    result.backward = recorder.events[start:]


@contextlib.contextmanager
def fake_values():
    """Run meta tensors as fake ones with a shape environment: a value read from a tensor (``item()``) or a size
    that depends on the data (``nonzero``, ``masked_select``) is an unbacked symbol, as in torch.export."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    with FakeTensorMode(shape_env=ShapeEnv(), allow_non_fake_inputs=True):
        yield


def _shape(t: torch.Tensor) -> tuple:
    """``t``'s shape, a size that depends on the data written as its symbol (``u3``)."""
    return tuple(d if isinstance(d, int) else str(d) for d in t.shape)


def trace_tied(trace: RankTrace, recorder: Recorder, stage_classes: dict[int, str], groups: dict) -> None:
    """Record ``sync_tied_grads`` (the gradient sums of weights held by several stages)."""
    fn = getattr(trace.module, "sync_tied_grads", None)
    if fn is None:
        raise CheckError(f"{trace.file}: defines no sync_tied_grads(), which every pipeline rank file has")
    stages = {s: getattr(trace.module, c)(groups, "meta") for s, c in stage_classes.items()}
    start = len(recorder.events)
    try:
        fn(stages, groups)
    except Exception as e:
        raise CheckError(f"{_line_of(e, trace.file)}: sync_tied_grads fails: {type(e).__name__}: {e}") from None
    trace.tied = recorder.events[start:]


def trace_rank(source: str, file: str, manifest: Manifest, entry: RankEntry, run: bool = True) -> RankTrace:
    """Load one rank file and record the collectives of every class it holds (and of ``sync_tied_grads``).

    ``run=True`` executes forward and backward on meta tensors (shapes as computed, the backward as
    autograd orders it).  ``run=False`` is the cheap scan the compiler uses on files it just wrote: the
    ``rt.*`` calls in the order of the source, shapes from the manifest, backward in reverse order."""
    module = load_rank_source(source, file)
    trace = RankTrace(file, module)
    recorder = Recorder(file, source.splitlines())
    module.rt = recorder  # this module object only: other importers of the rank file are untouched
    scan = None if run else _Scan(source, file, entry)
    lay, coords = manifest.layout, entry.coords
    groups = {axis: FakeGroup(axis, lay.size(axis), coords[axis]) for axis in (TP, PP, DP)}
    groups[EP] = FakeGroup(EP, lay.ep, coords.ep or 0)
    groups[CP] = FakeGroup(CP, lay.cp, coords.cp or 0)
    groups[CPTP] = FakeGroup(CPTP, lay.size(CPTP), (coords.cp or 0) * lay.tp + coords.tp)
    pipe = manifest.pipeline
    if pipe is None:
        inputs = [_meta(i.microbatch_shape, i.dtype, False) if i.is_tensor else None for i in manifest.inputs]
        if scan:
            scan.trace_class(trace, "RankModule", groups)
        else:
            trace_class(trace, recorder, "RankModule", groups, inputs, "first")
        return trace
    for tie in pipe.tied:
        groups[tie.name] = FakeGroup(tie.name, len(tie.stages), 0)
    for st in entry.stages:
        cls = getattr(module, st.class_name, None)
        declared = getattr(cls, "INPUTS", None)
        if declared is None:
            raise CheckError(f"{file}: class {st.class_name} (pipeline stage {st.index}) is missing or has no "
                             "INPUTS; the rank file and manifest.json come from different compiles")
        if scan:
            scan.trace_class(trace, st.class_name, groups)
            continue
        inputs = [_meta(shape, dtype, rg) for _, shape, dtype, rg in declared]
        batch = {i.name: i for i in manifest.inputs if i.is_tensor}
        taken = {}
        for name in getattr(cls, "BATCH", ()):
            if name not in batch:
                raise CheckError(f"{file}: {st.class_name}.BATCH names the user input {name!r}, which manifest.json "
                                 "does not list; the rank file and manifest.json come from different compiles")
            taken[name] = _meta(batch[name].microbatch_shape, batch[name].dtype, False)
        last = st.index == pipe.stages - 1
        trace_class(trace, recorder, st.class_name, groups, inputs, "first" if last else "outputs", taken)
    if scan:
        trace.tied = scan.calls(scan.function("sync_tied_grads"), "after backward")
    else:
        trace_tied(trace, recorder, {st.index: st.class_name for st in entry.stages}, groups)
    return trace


# rt.<call> -> [(backend operation, direction), ...] of every call that communicates, as the source reads
_COMMUNICATES = {k.name: [(op, d, amaxes) for d in ("forward", "backward") for op, amaxes in k.ops(d)]
                 for k in KINDS.values() if k.communicates} | {SUM_TIED_GRADS: [("all_reduce", "after backward", False)]}


class _Scan:
    """The ``rt.*`` calls of a rank file read from its syntax tree, without running anything."""

    def __init__(self, source: str, file: str, entry: RankEntry):
        self.file, self.lines, self.tree = file, source.splitlines(), ast.parse(source, file)
        self.shapes = {c.value: (c.shape, c.dtype) for c in entry.collectives}
        self.tensors = {k: (t.shape, t.dtype) for k, t in entry.tensors.items()}

    def function(self, name: str, cls: str | None = None) -> ast.FunctionDef | None:
        body = self.tree.body
        if cls is not None:
            body = next((n.body for n in body if isinstance(n, ast.ClassDef) and n.name == cls), [])
        return next((n for n in body if isinstance(n, ast.FunctionDef) and n.name == name), None)

    def trace_class(self, trace: RankTrace, cls_name: str, groups: dict) -> None:
        result = ClassTrace(cls_name)
        try:
            module = getattr(trace.module, cls_name)(groups, "meta")
        except Exception as e:
            raise CheckError(f"{_line_of(e, self.file)}: {cls_name}(...) fails to build: {type(e).__name__}: {e}"
                             ) from None
        for name, t in list(module.named_parameters()) + list(module.named_buffers()):
            result.tensors[name] = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
        per_call = self.per_call(self.function("forward", cls_name), "forward", cls_name)
        result.forward = [c for ops in per_call for c in ops if c.direction == "forward"]
        # backward reaches the calls in reverse; one call's own operations keep their order (an fp8 call's amaxes
        # before its gather)
        result.backward = [c for ops in reversed(per_call) for c in ops if c.direction == "backward"]
        trace.classes[cls_name] = result

    def calls(self, fn: ast.FunctionDef | None, scope: str, cls: str | None = None) -> list[Collective]:
        """The collectives ``fn`` issues, in source order; a call of a block submodule (``self.model_layers_2(...)``,
        built in ``cls``'s ``__init__``) issues its class's, there."""
        return [c for ops in self.per_call(fn, scope, cls) for c in ops]

    def per_call(self, fn: ast.FunctionDef | None, scope: str, cls: str | None = None) -> list[list[Collective]]:
        """:meth:`calls`, the operations of each ``rt.*`` call in a list of their own."""
        if fn is None:
            raise CheckError(f"{self.file}: has no function {'forward' if scope == 'forward' else 'sync_tied_grads'}")
        subs = self._submodules(cls) if cls is not None else {}
        found = [n for n in ast.walk(fn) if isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute)
                 and isinstance(n.func.value, ast.Name)
                 and ((n.func.value.id == "rt" and n.func.attr in _COMMUNICATES)
                      or (n.func.value.id == "self" and n.func.attr in subs))]
        out = []
        for call in sorted(found, key=lambda n: (n.lineno, n.col_offset)):
            if call.func.value.id == "self":
                sub = subs[call.func.attr]
                out += self.per_call(self.function("forward", sub), scope, sub)
                continue
            keywords = {k.arg: k.value for k in call.keywords}
            m = _ASSIGNED.match(self.lines[call.lineno - 1])
            value = m.group(1) if m else ""
            shape, dtype = self._shape(call, value)
            out.append([Collective(kind, _group_name(op_group(call.args, keywords, amaxes)), shape, dtype, direction,
                                   call.func.attr, value, self.file, call.lineno, cls or "")
                        for kind, direction, amaxes in _COMMUNICATES[call.func.attr]])
        return out

    def _submodules(self, cls: str) -> dict[str, str]:
        """``self.<attr> = <Class>(...)`` in ``cls.__init__``, for the classes this file defines: attr -> class."""
        classes = {n.name for n in self.tree.body if isinstance(n, ast.ClassDef)}
        init = self.function("__init__", cls)
        subs = {}
        for n in ast.walk(init) if init is not None else ():
            if (isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Attribute)
                    and isinstance(n.targets[0].value, ast.Name) and n.targets[0].value.id == "self"
                    and isinstance(n.value, ast.Call) and isinstance(n.value.func, ast.Name)
                    and n.value.func.id in classes):
                subs[n.targets[0].attr] = n.value.func.id
        return subs

    def _shape(self, call: ast.Call, value: str) -> tuple[tuple[int, ...], str]:
        if call.func.attr != "sum_tied_grads":
            return self.shapes.get(value, ((), "?"))
        first = call.args[0].elts[0] if call.args and isinstance(call.args[0], ast.List) and call.args[0].elts else None
        try:  # stages[3].lm_head_weight -> the tensor "Stage3.lm_head_weight"
            key = f"Stage{first.value.slice.value}.{first.attr}"
        except AttributeError:
            return (), "?"
        return self.tensors.get(key, ((), "?"))


def _group_name(node) -> str:
    """``self.tp`` -> ``tp``; ``groups["tied:w"]`` -> ``tied:w``; anything else, as written."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
        return str(node.slice.value)
    return f"<not a process group: {ast.unparse(node) if node is not None else 'missing'}>"
