"""Capture an unmodified model as one flat ATen graph with its module provenance.

``torch.export.export(strict=False)`` traces the user's Python as it runs, so Hugging Face
models capture without rewrites (``torch.fx.symbolic_trace`` fails on every transformers-5
model).  The loss is captured in the same graph, so the whole training forward — including the
gather of vocabulary-sharded logits before the loss — is visible and shardable.

The result is a :class:`Program`: the GraphModule, and for every placeholder what it is
(parameter, buffer, constant, user input) and which FQN it came from::

    program = capture(load_model_file("samples/gpt.py"))
    program.gm.graph.print_tabular()
"""

from __future__ import annotations

import contextlib
import io
import linecache
import logging
import re
import sys
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils import _pytree as pytree

from fxshard.capture.batch_norm import check_batch_norms
from fxshard.capture.conversions import unchanged_conversions
from fxshard.capture.custom_ops import custom_op_modules
from fxshard.capture.functions import FunctionOp, wrapped_functions
from fxshard.capture.losses import traceable_losses
from fxshard.capture.modelfile import ModelFile
from fxshard.capture.rejoin import rejoined_rows
from fxshard.capture.specialize import (
    Record,
    guard_messages,
    record_reads,
    refuse_other_reads,
    replaying,
    runs_eagerly,
)
from fxshard.errors import CaptureError, ModelFileError, NeedsRealWeights
from fxshard.graph import node_fqn
from fxshard.runtime.functions import NAMESPACE as FUNCTION_NAMESPACE

WRAPPED = "model"  # attribute of the capture wrapper holding the user's model; stripped from FQNs


@dataclass(frozen=True)
class StateSpec:
    """A parameter, buffer or constant: the graph placeholder and the source tensor it stands for."""

    name: str  # placeholder name in the graph
    fqn: str  # the tensor's name in the user's model state
    kind: str  # "parameter" | "buffer" | "constant"
    persistent: bool = True
    # a parameter with requires_grad=False (a frozen embedding, a LoRA base): held, loaded, saved and split like any
    # other, but it gets no gradient, no optimizer state and no update at any layout
    trainable: bool = True


@dataclass(frozen=True)
class InputSpec:
    name: str  # placeholder name
    path: str  # pytree key path into (args, kwargs), e.g. "[1]['input_ids']"
    is_tensor: bool
    shape: tuple[int, ...] = ()
    dtype: str = ""
    counted_by: str = ""  # the boolean input whose True positions its entries follow (fxshard.capture.rows)
    whole: bool = False  # its first dimension is neither the batch nor counted: never split


@dataclass
class Program:
    """A captured training forward: ``gm(*state, *inputs) -> (loss, *model_outputs)``."""

    gm: fx.GraphModule
    state: list[StateSpec]
    inputs: list[InputSpec]
    output_paths: list[str]
    module_types: dict[str, str]  # fqn -> class name, for comments and errors
    tensors: dict[str, torch.Tensor]  # fqn -> initial value (real, or meta when captured without weights)
    tied: dict[str, str]  # fqn -> the fqn export kept for the same tensor
    model: torch.nn.Module
    notes: list[str] = field(default_factory=list)
    custom_ops: dict[str, str] = field(default_factory=dict)  # "ns::op" -> module registering it (custom_ops.py)
    functions: dict[str, FunctionOp] = field(default_factory=dict)  # fxshard_fn op -> autograd.Function (functions.py)
    record: Record | None = None  # what the model's code read of tensor values, where capture specialized on it

    def state_by_name(self) -> dict[str, StateSpec]:
        return {s.name: s for s in self.state}


class _WithLoss(torch.nn.Module):
    """Runs the user's model and its loss in one forward, so both land in one graph."""

    def __init__(self, model: torch.nn.Module, loss_fn, positional: bool, constants: dict | None = None):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.positional = positional
        self.constants = constants or {}  # keyword arguments of the model's forward traced as constants, not inputs

    def forward(self, *args, **kwargs):
        out = self.model(*args, **kwargs, **self.constants)
        inputs = args if self.positional else kwargs
        if self.loss_fn is not None:
            loss = self.loss_fn(out, inputs)
        elif isinstance(out, torch.Tensor):
            loss = out
        elif getattr(out, "loss", None) is not None:
            loss = out.loss
        else:
            raise ModelFileError(
                f"the model returned {type(out).__name__} without a loss: define loss_fn(output, inputs) in "
                "the model file, return a scalar loss, or pass labels so the output carries .loss"
            )
        return loss, out


def capture(mf: ModelFile, seed: int = 0, model: torch.nn.Module | None = None, inputs: Any = None,
            peers: list | None = None, reads: Record | None = None) -> Program:
    """Capture ``make_model()`` and its loss on ``make_inputs()`` as a :class:`Program`.  ``peers``: the other parts
    of the batch the same program runs on (dp ranks' rows, pipeline microbatches), where ``inputs`` is the first:
    data-dependent code specialized on ``inputs`` must read the same values on each of them.  ``reads``: another
    capture's record, whose values answer this one's reads (the batch-row analysis' capture at twice the rows, on
    meta tensors, specialized as the program is)."""
    model = model if model is not None else mf.build_model(seed)
    check_names(model, mf.path)
    check_batch_norms(model, mf.path)
    inputs = inputs if inputs is not None else mf.build_inputs(seed)
    model.train()
    positional = not isinstance(inputs, dict)
    args, kwargs = (tuple(inputs), {}) if positional else ((), dict(inputs))
    wrapper = _WithLoss(model, mf.loss_fn, positional, cache_off(model, args, kwargs))
    ep, functions, record = _export(wrapper, args, kwargs, mf.path, reads.fresh() if reads is not None else None,
                                    items=bool(peers), twice=reads is not None)
    if record is not None and reads is None:
        for peer in peers or ():
            refuse_other_reads(record, wrapper, (tuple(peer), {}) if positional else ((), dict(peer)), mf.path)
    notes = guard_messages(ep.graph_module, record)
    rejoined_rows(ep.graph_module)  # a batch cut into its rows and joined back: one program at every size
    program = _to_program(ep, model, args, kwargs)
    program.notes += notes
    program.record = record
    used = {n.target._schema.name.split("::")[1] for n in program.gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == FUNCTION_NAMESPACE}
    program.functions = {name: functions[name] for name in sorted(used)}
    return program


def _export(wrapper: _WithLoss, args: tuple, kwargs: dict, path: Path, record: Record | None = None,
            items: bool = False, twice: bool = False):
    """``(exported program, wrapped Functions, record)``: torch.export of the wrapper; where the model's Python
    reads a tensor's value (data-dependent control flow), a second export answers those reads from an eager run
    on the example batch (:mod:`fxshard.capture.specialize`; ``record`` is None when none was needed, given: the
    reads answered from it from the start; ``items``: loops over small integer tensors specialized on their values,
    for a program run on parts of the batch; ``twice``: the batch-row analysis' capture at more rows, whose refusal
    says so)."""
    while True:
        try:
            with wrapped_functions(wrapper.model) as (functions, refusals), grouped_experts(wrapper.model), \
                    unchanged_conversions(), traceable_losses(), \
                    replaying(record) if record else contextlib.nullcontext(), _partial_graph_unprinted():
                ep = torch.export.export(wrapper, args, kwargs, strict=False)
        except ModelFileError:
            raise
        except Exception as e:
            if record is None and _data_dependent(e) and (record := record_reads(wrapper, args, kwargs, items)):
                continue  # again, the reads answered
            if refusals:  # a Function refused runs unwrapped, and may be what export failed on: it says more
                raise refusals[0] from e
            why = "specialized" if record is not None else "meta" if not runs_eagerly(wrapper, args, kwargs) else ""
            error = NeedsRealWeights if why == "meta" and _data_dependent(e) else CaptureError
            raise error(_explain_export_failure(e, path, why, twice)) from e
        if refusals:
            raise refusals[0]
        return ep, functions, record


@contextlib.contextmanager
def _partial_graph_unprinted():
    """torch.export prints the graph traced so far to stderr when it fails (``e.partial_fx_graph``): a capture that
    goes on (the retry with reads answered) or refuses with its own message keeps it out of the user's terminal.
    What else is written to stderr meanwhile is written there once export returns."""
    buffer = io.StringIO()
    shapes = logging.getLogger("torch.fx.experimental.symbolic_shapes")  # its advice on the failure, said better
    level = shapes.level
    shapes.setLevel(logging.ERROR)
    try:
        with contextlib.redirect_stderr(buffer):
            yield
    finally:
        shapes.setLevel(level)
    sys.stderr.write(buffer.getvalue())


def _data_dependent(e: Exception) -> bool:
    return "data-dependent" in str(e) or "DataDependent" in type(e).__name__


@contextlib.contextmanager
def grouped_experts(model: torch.nn.Module):
    """Capture a transformers MoE whose config asks for ``experts_implementation="eager"`` with the model's own
    grouped-matmul experts (``"grouped_mm"``, transformers' default) for the duration of the capture: the eager
    experts loop in Python over the experts that received tokens (``for expert in expert_hit``), which torch.export
    cannot trace (a loop over data).  Both compute the same experts; the model is left as it was."""
    configs = {id(c): c for m in model.modules() if (c := getattr(m, "config", None)) is not None
               and getattr(c, "_experts_implementation", None) == "eager"}
    can = getattr(model, "_can_set_experts_implementation", None)
    if not configs or can is None or not can():
        yield
        return
    for config in configs.values():
        config._experts_implementation = "grouped_mm"
    try:
        yield
    finally:
        for config in configs.values():
            config._experts_implementation = "eager"


def cache_off(model: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """``{"use_cache": False}`` for a forward that takes ``use_cache`` and was not given it: a transformers causal
    LM defaults to returning its key/value cache (a ``DynamicCache``, which export cannot return and training never
    reads), so the training forward is captured with the cache off, as samples/llama.py asks for it.  Passed by the
    capture wrapper as a constant of the trace, not as an input: the batches stay what make_inputs() returns."""
    import inspect

    try:
        params = list(inspect.signature(model.forward).parameters)
    except (TypeError, ValueError):
        return {}
    if "use_cache" not in params or "use_cache" in kwargs or params.index("use_cache") < len(args):
        return {}
    return {"use_cache": False}


def _to_program(ep, model, args, kwargs) -> Program:
    gm = ep.graph_module
    prefix = WRAPPED + "."
    state, inputs = [], []
    non_persistent = set()
    for mod_fqn, mod in model.named_modules():
        for b in getattr(mod, "_non_persistent_buffers_set", ()):
            non_persistent.add(f"{mod_fqn}.{b}" if mod_fqn else b)
    leaves = pytree.tree_flatten_with_path((args, kwargs))[0]
    user_inputs = iter(leaves)
    kinds = {"PARAMETER": "parameter", "BUFFER": "buffer", "CONSTANT_TENSOR": "constant"}
    frozen = {name for name, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad}
    for spec in ep.graph_signature.input_specs:
        kind = spec.kind.name
        if kind in kinds:
            fqn = spec.target[len(prefix):] if spec.target.startswith(prefix) else spec.target
            state.append(StateSpec(spec.arg.name, fqn, kinds[kind], fqn not in non_persistent,
                                   trainable=kinds[kind] != "parameter" or fqn not in frozen))
        elif kind == "USER_INPUT":
            path, leaf = next(user_inputs)
            is_tensor = isinstance(leaf, torch.Tensor)
            inputs.append(
                InputSpec(
                    spec.arg.name,
                    pytree.keystr(path),
                    is_tensor,
                    tuple(leaf.shape) if is_tensor else (),
                    str(leaf.dtype).removeprefix("torch.") if is_tensor else "",
                )
            )
        else:
            raise CaptureError(f"unsupported export input kind {kind} for {spec.arg.name}")
    out_leaves = pytree.tree_flatten_with_path(
        pytree.tree_unflatten([None] * ep.call_spec.out_spec.num_leaves, ep.call_spec.out_spec)
    )[0]
    output_paths = ["loss" if i == 0 else "out" + pytree.keystr(p[1:]) for i, (p, _) in enumerate(out_leaves)]

    tensors = dict(model.state_dict(keep_vars=True))
    for name, buf in model.named_buffers():
        tensors.setdefault(name, buf)
    # a tensor made inside forward (an index list, torch.tensor(...)) is lifted as a constant; export
    # keys ep.constants by the wrapper's names ("model.blocks.0.lifted_tensor_1"), the state by the model's
    constants = {(k[len(prefix):] if k.startswith(prefix) else k): v for k, v in ep.constants.items()}
    for spec in state:
        if spec.kind == "constant":
            tensors[spec.fqn] = constants[spec.fqn].detach()
    module_types = {fqn: printable(type(m).__name__) for fqn, m in model.named_modules()}

    _strip_prefix(gm, WRAPPED)
    _inline_wrappers(gm)
    _drop_noise(gm)
    state, tied = _merge_tied(gm, state, model)
    return Program(gm, state, inputs, output_paths, module_types, tensors, tied, model,
                   custom_ops=custom_op_modules(gm))


_ESCAPES = {'"': '\\"', "'": "\\'", "\\": "\\\\"}


def printable(text: str) -> str:
    """``text`` (a class name) as generated code's comments and docstrings may hold it: quotes, backslashes and
    characters that are not printable written as their escapes (``Evil\\nimport os``)."""
    return "".join(_ESCAPES.get(c) or (c if c.isprintable() else c.encode("unicode_escape").decode("ascii"))
                   for c in text)


def check_names(model: torch.nn.Module, path: Path) -> None:
    """Refuse a module, parameter or buffer name the generated code could not hold as written: every one is
    written into the rank files (comments, strings, docstrings), where a newline or a quote would end the comment
    or string and make the rest a line of code."""
    for kind, named in (("module", model.named_modules(remove_duplicate=False)),
                        ("parameter", model.named_parameters(remove_duplicate=False)),
                        ("buffer", model.named_buffers(remove_duplicate=False))):
        for name, _ in named:
            bad = next((c for c in name if not c.isprintable() or c in _ESCAPES), None)
            if bad is not None:
                raise ModelFileError(f"{path}: {kind} {name!r} has {bad!r} in its name; fxshard writes every module, "
                                     "parameter and buffer name into the generated code, where it must stay one "
                                     "line of text. Rename it (the key of its ModuleDict, or the name given to "
                                     "add_module / register_parameter / register_buffer)")


def _merge_tied(gm: fx.GraphModule, state: list[StateSpec], model: torch.nn.Module):
    """One placeholder per shared parameter: drop the unused names, map each to the kept one."""
    names_of: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        names_of.setdefault(id(p), []).append(name)
    placeholders = {n.name: n for n in gm.graph.nodes if n.op == "placeholder"}
    used = {s.fqn for s in state if placeholders[s.name].users}
    tied: dict[str, str] = {}
    drop = set()
    for names in names_of.values():
        if len(names) < 2:
            continue
        kept = next((n for n in names if n in used), names[0])
        for n in names:
            if n != kept:
                tied[n] = kept
                drop.add(n)
    keep = []
    for s in state:
        if s.fqn in drop and not placeholders[s.name].users:
            gm.graph.erase_node(placeholders[s.name])
        else:
            keep.append(s)
    gm.recompile()
    return keep, dict(sorted(tied.items()))


def _strip_prefix(gm: fx.GraphModule, wrapped: str) -> None:
    for node in gm.graph.nodes:
        stack = node.meta.get("nn_module_stack")
        if not stack:
            continue
        new = {}
        for key, (path, cls) in stack.items():
            if path == "" or path == "L__self__":
                continue  # the capture wrapper itself
            if path == wrapped:
                path = ""
            elif path.startswith(wrapped + "."):
                path = path[len(wrapped) + 1:]
            new[key] = (path, cls)
        node.meta["nn_module_stack"] = new


def _inline_wrappers(gm: fx.GraphModule) -> None:
    """Inline ``wrap_with_set_grad_enabled`` / ``wrap_with_autocast`` bodies into the flat graph.

    Hugging Face rotary embeddings run under ``torch.no_grad()`` and ``autocast(enabled=False)``;
    export keeps those as sub-graphs.  A flat graph is what the passes and the generated code want.
    Inputs of a no-grad region are detached so gradients stop there exactly as before.
    """
    hops = {torch.ops.higher_order.wrap_with_set_grad_enabled, torch.ops.higher_order.wrap_with_autocast}
    for node in list(gm.graph.nodes):
        if node.op != "call_function" or node.target not in hops:
            continue
        if node.target is torch.ops.higher_order.wrap_with_set_grad_enabled:
            enable_grad, body_node, *operands = node.args
        else:
            device_type, dtype, enabled, _cache, body_node, *operands = node.args
            if enabled:
                raise CaptureError(
                    f"{node_fqn(node) or 'model'}: torch.autocast regions inside the model are not supported; "
                    "remove the autocast context (fxshard applies mixed precision itself)"
                )
            enable_grad = True
        body = getattr(gm, body_node.target)
        env: dict[fx.Node, Any] = {}
        placeholders = [n for n in body.graph.nodes if n.op == "placeholder"]
        with gm.graph.inserting_before(node):
            for ph, arg in zip(placeholders, operands, strict=True):
                if not enable_grad and isinstance(arg, fx.Node) and _is_float(arg):
                    detached = gm.graph.call_function(torch.ops.aten.detach.default, (arg,))
                    detached.meta = dict(arg.meta)
                    arg = detached
                env[ph] = arg
            result = None
            for inner in body.graph.nodes:
                if inner.op == "placeholder":
                    continue
                if inner.op == "output":
                    result = pytree.tree_map(lambda a: env[a] if isinstance(a, fx.Node) else a, inner.args[0])
                    continue
                new = gm.graph.node_copy(inner, lambda a: env[a])
                new.meta = dict(inner.meta)
                if "nn_module_stack" not in new.meta:
                    new.meta["nn_module_stack"] = node.meta.get("nn_module_stack", {})
                env[inner] = new
        for user in list(node.users):
            assert user.target is __import__("operator").getitem, user
            user.replace_all_uses_with(result[user.args[1]])
            gm.graph.erase_node(user)
        gm.graph.erase_node(node)
        if not any(n.op == "get_attr" and n.target == body_node.target for n in gm.graph.nodes if n is not body_node):
            gm.graph.erase_node(body_node)
            delattr(gm, body_node.target)
    gm.graph.lint()
    gm.recompile()


def _is_float(node: fx.Node) -> bool:
    val = node.meta.get("val")
    return isinstance(val, torch.Tensor) and val.is_floating_point()


def _drop_noise(gm: fx.GraphModule) -> None:
    """Remove nodes that compute nothing: metadata asserts and aliases."""
    for node in list(gm.graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is torch.ops.aten._assert_tensor_metadata.default:
            gm.graph.erase_node(node)
        elif node.target is torch.ops.aten.alias.default:
            node.replace_all_uses_with(node.args[0])
            gm.graph.erase_node(node)
    gm.graph.eliminate_dead_code()
    gm.graph.lint()
    gm.recompile()


_NOT_MODEL = (str(Path(torch.__file__).resolve().parent), str(Path(__file__).resolve().parent.parent))


def _raises_after(frame) -> bool:
    """Whether the statement after ``frame``'s line (an ``if``) raises: a check of the inputs."""
    for k in range(1, 4):
        line = (linecache.getline(frame.filename, frame.lineno + k) or "").strip()
        if line:
            return line.startswith("raise ")
    return False


def _explain_export_failure(e: Exception, model_path: Path, specialized: str = "", twice: bool = False) -> str:
    """Say which construct failed and where in the model's source (transformers' code included).  ``specialized``:
    "specialized" when data-dependent code failed even with its reads answered from the example batch, "meta"
    when it could not be (no real weights or batch to run); ``twice``: the capture at more rows that a split batch
    needs (:mod:`fxshard.ir.rows`), where a read of each row (``lengths.tolist()``) has more values than the
    example batch answered."""
    frames = traceback.extract_tb(e.__traceback__)
    user = [f for f in frames if not f.filename.startswith(_NOT_MODEL) and not f.filename.startswith("<")]
    where = ""
    if user:
        f = user[-1]
        line = (linecache.getline(f.filename, f.lineno) or "").strip()
        where = f" at {f.filename}:{f.lineno} in {f.name}(): `{line}`"
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    kind = type(e).__name__
    lifted = re.search(r"model\.([\w.]+)\.lifted_tensor_\d+", str(e))
    if "data-dependent" in str(e) or "GuardOnDataDependent" in kind or "DataDependent" in kind:
        hint = (
            "Python control flow that depends on tensor values cannot be captured"
            + {"specialized": " even specialized on the example batch (fxshard answers the model's reads of tensor "
                              "values from a run on it; this read torch makes itself, where fxshard cannot answer)",
               "meta": " without real weights and batch (fxshard specializes it on the example batch, behind a "
                       "runtime guard, from a run of the model: compile without --meta / --weights)"}.get(specialized,
                                                                                                      "")
            + "; use torch.where / torch.cond, or make the condition depend only on shapes or config"
        )
        if twice:
            hint += ("; or train at --dp 1 without pipeline microbatches: this capture, at more rows than the "
                     "example batch's part, only checks a split batch, and a read of each row (such as "
                     "lengths.tolist()) has more values there than the example batch answered")
        if user and _raises_after(user[-1]):  # a check of the inputs (a CTC head's labels.max() >= vocab_size)
            hint += ("; this one only checks the inputs and raises: compute the loss in the model file's "
                     "loss_fn(output, inputs) and call the model without the inputs it checks (its labels)")
        construct = "data-dependent control flow"
    elif "Couldn't swap" in str(e) or lifted:
        construct = f"{kind}: {text}"
        module = f"{lifted.group(1)}: its" if lifted else "the"
        hint = (f"{module} forward replaces its own parameters or buffers (self.float(), self.to(...), "
                "weight.data = ...), which capture on fake tensors cannot do; compute with a converted copy instead "
                "(F.linear(x.float(), self.weight.float())), or convert the model once in make_model()")
    else:
        hint = "make the forward traceable by torch.export (non-strict), or report the failing construct"
        construct = f"{kind}: {text}"
    return f"{model_path}: torch.export could not capture the model: {construct}{where}. {hint}."
