"""Load a user's model file: ``make_model()``, ``make_inputs()``, optional ``loss_fn``.

The file is imported as it is; nothing in it is rewritten.  Randomness is seeded before ``make_model`` and
before ``make_inputs`` so compile, run and the single-device reference all see the same initial weights and the
same batch.  Its training data (``make_dataset``, ``collate``, ``make_batches``) is :mod:`fxshard.train.data`'s
to read, from ``ModelFile.module``::

    mf = load_model_file("samples/gpt.py")
    model, inputs = mf.build(seed=0)
"""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from fxshard.capture.custom_ops import MODEL_FILE_MODULE
from fxshard.capture.lora import LoraOptions, apply_lora
from fxshard.errors import ModelFileError
from fxshard.pyfile import import_file


@dataclass
class ModelFile:
    path: Path
    make_model: Callable[[], torch.nn.Module]
    make_inputs: Callable[[], Any]
    loss_fn: Callable[[Any, Any], torch.Tensor] | None
    module: Any
    lora: LoraOptions | None = None  # compile --lora: peft's adapters on what make_model() returns

    def build_model(self, seed: int = 0, meta: bool = False) -> torch.nn.Module:
        """``make_model()`` after seeding; ``meta=True``: parameters on the meta device (no memory).  With ``lora``,
        wrapped by peft's LoRA (its adapters real even on a meta base: :mod:`fxshard.capture.lora`)."""
        torch.manual_seed(seed)
        with meta_parameters() if meta else contextlib.nullcontext():
            try:
                model = self.make_model()
            except Exception as e:  # the user's code: its error, named, not a traceback through fxshard
                raise ModelFileError(f"{self.path}: make_model() raised {type(e).__name__}: {e}; fix the model "
                                     "file (run make_model() on its own to see the traceback)") from e
        if not isinstance(model, torch.nn.Module):
            raise ModelFileError(
                f"{self.path}: make_model() returned {type(model).__name__}; expected a torch.nn.Module. "
                "Return the model instance, e.g. `return GPT(config)`."
            )
        if self.lora is not None:
            model = apply_lora(model, self.lora, seed, self.path.name)
        return model

    def for_layout(self, layout) -> ModelFile:
        """This model file as ``layout`` builds it: with ``--lora``'s adapters (``layout.lora``), else as it is."""
        import dataclasses

        options = LoraOptions.from_layout(layout)
        return self if options is None or options == self.lora else dataclasses.replace(self, lora=options)

    def build_inputs(self, seed: int = 0) -> Any:
        torch.manual_seed(seed + 1)
        try:
            inputs = self.make_inputs()
        except Exception as e:  # the user's code: its error, named, as make_model()'s is
            raise ModelFileError(f"{self.path}: make_inputs() raised {type(e).__name__}: {e}; fix the model "
                                 "file (run make_inputs() on its own to see the traceback)") from e
        check_inputs(inputs, f"{self.path}: make_inputs()")
        return inputs

    def build(self, seed: int = 0) -> tuple[torch.nn.Module, Any]:
        return self.build_model(seed), self.build_inputs(seed)

    def digest(self) -> str:
        return hashlib.sha256(self.path.read_bytes()).hexdigest()[:16]

    def identity(self) -> tuple:
        """What the model and inputs it builds depend on, for a cache of its captures: the file and its digest, the
        LoRA options, and which functions build them (a plan's profile builds the file's model shortened)."""
        return (str(self.path), self.digest(), repr(self.lora), *(
            None if f is None else (f.__module__, f.__qualname__) for f in (self.make_model, self.make_inputs,
                                                                          self.loss_fn)))


@contextlib.contextmanager
def meta_parameters():
    """Every parameter registered inside is moved to the meta device as it is registered.

    Buffers stay real: they are small and often not in a checkpoint (rotary ``inv_freq`` is computed
    in ``__init__``), so the compiled program keeps their values.  Initializers then run on meta
    tensors and cost nothing, so a 70B-shaped model builds in milliseconds::

        with meta_parameters():
            model = LlamaForCausalLM(config)    # parameters on meta, rotary tables real
    """
    register = torch.nn.Module.register_parameter

    def to_meta(module, name, param):
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        register(module, name, param)

    torch.nn.Module.register_parameter = to_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def buffers_to_meta(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Move every buffer to the meta device in place; return the real ones by FQN (every alias)."""
    real = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta:
                real[f"{prefix}.{name}" if prefix else name] = buf
                module._buffers[name] = buf.to("meta")
    return real


def to_meta(inputs: Any) -> Any:
    """A batch with its tensors on the meta device (same shapes and dtypes)."""
    from torch.utils import _pytree as pytree

    return pytree.tree_map(lambda v: v.to("meta") if isinstance(v, torch.Tensor) else v, inputs)


@contextlib.contextmanager
def meta_as_cpu(model: torch.nn.Module, inputs: Any):
    """While export traces, the model's meta parameters and buffers, and the meta ``inputs``, are fake CPU
    tensors (shapes and dtypes, no storage); yields the fake inputs.  The model is put back on exit.

    A model may branch on its tensors' device: transformers' grouped-matmul experts histogram the expert ids
    as floats on ``cpu`` and as int32 elsewhere, which CPU kernels refuse.  Traced on ``meta`` it takes the
    accelerator branch, and the compiled program then fails on the CPU (and disagrees with a compile of
    the real model, traced on CPU).  On fake CPU tensors it takes the branch a real capture takes::

        with meta_as_cpu(model, inputs) as fake_inputs:
            program = capture(mf, model=model, inputs=fake_inputs)
    """
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv
    from torch.utils import _pytree as pytree

    # the shape environment export expects of a mode it is handed (tracked_fakes)
    mode = FakeTensorMode(shape_env=ShapeEnv(tracked_fakes=[]), allow_non_fake_inputs=True, export=True)
    fakes: dict[int, torch.Tensor] = {}  # one fake per tensor object, so tied weights stay tied

    def fake(t):
        if not isinstance(t, torch.Tensor) or not t.is_meta:
            return t
        if id(t) not in fakes:
            with mode:
                f = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device="cpu")
            fakes[id(t)] = torch.nn.Parameter(f, requires_grad=t.requires_grad) \
                if isinstance(t, torch.nn.Parameter) else f
        return fakes[id(t)]

    swapped = []
    for module in model.modules():
        for table in (module._parameters, module._buffers):
            for name, t in table.items():
                if t is not None and t.is_meta:
                    swapped.append((table, name, t))
                    table[name] = fake(t)
    try:
        yield pytree.tree_map(fake, inputs)
    finally:
        for table, name, t in swapped:
            table[name] = t


def check_inputs(inputs: Any, where: str) -> None:
    if not isinstance(inputs, (dict, tuple, list)):
        raise ModelFileError(
            f"{where} returned {type(inputs).__name__}; expected a dict of keyword arguments or a tuple of "
            "positional arguments for the model's forward, e.g. `return {'input_ids': ids, 'labels': ids}`."
        )


def load_model_file(path: str | Path, lora: LoraOptions | None = None) -> ModelFile:
    """Import ``path`` and check it follows the model-file convention; ``lora``: build it with those adapters."""
    path = Path(path).resolve()
    if not path.is_file():
        raise ModelFileError(f"{path}: no such model file; expected a Python file defining make_model().")
    try:
        module = import_file(path, MODEL_FILE_MODULE)
    except Exception as e:  # the user's import error, reported with its origin
        raise ModelFileError(f"{path}: importing the model file failed: {type(e).__name__}: {e}") from e
    missing = [f for f in ("make_model", "make_inputs") if not callable(getattr(module, f, None))]
    if missing:
        raise ModelFileError(
            f"{path}: the model file defines no {' and no '.join(m + '()' for m in missing)}. "
            "A model file defines make_model() returning the unmodified nn.Module and make_inputs() "
            "returning one example batch (a dict of keyword arguments or a tuple); optionally "
            "loss_fn(output, inputs) and make_dataset(split) (see docs/data.md)."
        )
    return ModelFile(
        path=path,
        make_model=module.make_model,
        make_inputs=module.make_inputs,
        loss_fn=getattr(module, "loss_fn", None),
        module=module,
        lora=lora,
    )
