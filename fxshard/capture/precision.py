"""Capture at a compute dtype, on real or meta tensors: what ``fxshard compile`` and ``fxshard plan`` capture.

::

    program = capture_at(load_model_file("samples/gpt.py"), 0, inputs, torch.bfloat16, meta=True)
"""

from __future__ import annotations

import copy
import hashlib
from collections import OrderedDict

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree

from fxshard.capture.modelfile import ModelFile, buffers_to_meta, meta_as_cpu, to_meta
from fxshard.capture.program import Program, capture


def capture_at(mf: ModelFile, seed: int, inputs, dtype: torch.dtype | None = None, meta: bool = False,
               peers: list | None = None, reads=None) -> Program:
    """Capture at the compute ``dtype`` (None: as the model is), on meta tensors with ``meta``.  Under a lower dtype
    (``--dtype bf16``) the parameters (not the buffers: rotary tables, masks keep their dtype) and floating inputs are
    cast before capture, so every dtype conversion in the graph is the one the model makes in bf16; the program's
    tensors are the fp32 initial values, the master weights the optimizer starts from."""
    key = _key(mf, seed, inputs, dtype, meta, peers, reads)
    if key not in _CAPTURES:
        program = _capture_at(mf, seed, inputs, dtype, meta, peers, reads)
        if not meta and sum(t.numel() * t.element_size() for t in program.tensors.values()) > SMALL:
            return program  # a real model of size: held once, by its caller
        _CAPTURES[key] = program, torch.get_rng_state()
        while len(_CAPTURES) > 8:
            _CAPTURES.popitem(last=False)
    _CAPTURES.move_to_end(key)
    program, rng = _CAPTURES[key]
    torch.set_rng_state(rng)  # as the capture (which seeds and builds the model) leaves it
    return copy.deepcopy(program)  # the passes rewrite the program they are given: each caller its own copy


# The last captures, by what they depend on: the model file's identity (fxshard.capture.modelfile), seed, compute
# dtype, replayed reads, and the inputs: on meta tensors their shapes, dtypes and non-tensor values (a capture reads
# no value there but the replayed reads); on real ones their values too, and the other parts' (peers) the
# specialized reads are checked on.  A plan or a search captures one model at the same sizes again on meta; a
# process that compiles one small model at several layouts (verify, the tests) captures it once.  Real captures are
# kept only of models of at most SMALL bytes.
SMALL = 64 * 2**20
_CAPTURES: OrderedDict[tuple, tuple[Program, torch.Tensor]] = OrderedDict()


def _key(mf: ModelFile, seed: int, inputs, dtype, meta: bool, peers, reads) -> tuple:
    def leaf(v):
        if not isinstance(v, torch.Tensor):
            return repr(v)
        shape = (tuple(v.shape), str(v.dtype), v.requires_grad)
        if meta or v.is_meta:
            return shape
        data = v.detach().contiguous().cpu().reshape(-1).view(torch.uint8).numpy()
        return *shape, hashlib.sha1(data.tobytes()).hexdigest()

    def flat(tree):
        leaves, spec = pytree.tree_flatten(tree)
        return str(spec), tuple(leaf(v) for v in leaves)

    return (*mf.identity(), seed, meta, str(dtype), flat(inputs), None if meta else tuple(flat(p) for p in peers or ()),
            repr(reads and sorted((k, repr(s.values)) for k, s in reads.sites.items())))


def _capture_at(mf: ModelFile, seed: int, inputs, dtype, meta: bool, peers, reads) -> Program:
    model = mf.build_model(seed, meta=meta)
    # on meta, buffers and inputs join the parameters there (a plain model mixes them: logits and targets);
    # the buffers' real values are what the program keeps
    real = buffers_to_meta(model) if meta else {}
    inputs = to_meta(inputs) if meta else inputs
    masters = {}
    if dtype is not None:
        masters = {name: p.detach().clone() for name, p in model.named_parameters(remove_duplicate=False)}
        cast_parameters(model, dtype)
        inputs = cast_inputs(inputs, dtype)
        peers = [cast_inputs(p, dtype) for p in peers or ()]
    if meta:  # traced as the CPU program a real capture makes (a model may branch on its device)
        with meta_as_cpu(model, inputs) as fake_inputs:
            program = capture(mf, seed, model=model, inputs=fake_inputs, reads=reads)
        held = dict(model.state_dict(keep_vars=True)) | dict(model.named_buffers())  # the meta tensors, put back
        program.tensors = {fqn: (held[fqn] if fqn in held else torch.empty(t.shape, dtype=t.dtype, device="meta"))
                           if isinstance(t, FakeTensor) else t for fqn, t in program.tensors.items()}
    else:
        program = capture(mf, seed, model=model, inputs=inputs, peers=peers)
    for fqn in program.tensors:
        if fqn in masters or fqn in real:
            program.tensors[fqn] = masters[fqn] if fqn in masters else real[fqn]
    return program


def cast_parameters(model: torch.nn.Module, dtype: torch.dtype) -> None:
    """Cast floating parameters (not buffers) in place, keeping the Parameter objects and ties."""
    with torch.no_grad():
        for p in model.parameters():
            if p.is_floating_point():
                p.data = p.data.to(dtype)


def cast_inputs(inputs, dtype: torch.dtype):
    return pytree.tree_map(lambda v: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v,
                           inputs)
