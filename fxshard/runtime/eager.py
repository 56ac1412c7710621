"""Functions that run eagerly under ``torch.compile``, marked without importing ``torch._dynamo``.

``torch.compiler.disable`` imports ``torch._dynamo`` when it decorates (torch 2.13): about 2 s of CPU, nearly half of
what importing the runtime costs, paid by every process that imports it, a rank of a run without ``--compile`` and
every ``fxshard`` command alike.  :func:`eager` marks a function instead; :func:`disable_marked`, which
:func:`fxshard.runtime.compiled.compile_module` calls before it compiles anything, replaces each marked function
wherever a runtime module holds it (``rt.all_to_all_dispatch`` in a rank file included) by
``torch.compiler.disable(fn)``, so that ``torch.compile`` sees exactly what the decorator gave it before.  A
function marked after ``torch._dynamo`` is loaded is disabled at once::

    @eager   # a graph break under --compile: the rows it moves are data
    def all_to_all_dispatch(x, group, offsets, recv_counts): ...

Compiling a rank module by other means than ``compile_module``: call :func:`disable_marked` first.
"""

from __future__ import annotations

import sys

_MARK = "__fxshard_eager__"
_marked: list = []  # the marked functions, in the order they were defined
_done = False  # disable_marked has run: a function marked later is disabled at once


def eager(fn):
    """Mark ``fn`` to run eagerly under ``torch.compile`` (a graph break at each call); see the module docstring."""
    setattr(fn, _MARK, True)
    _marked.append(fn)
    if _done or "torch._dynamo" in sys.modules:
        import torch

        return torch.compiler.disable(fn)
    return fn


def disable_marked() -> None:
    """Replace every marked function held by a loaded ``fxshard.runtime`` module by its ``torch.compiler.disable``
    wrapper (idempotent)."""
    global _done
    import torch

    wrapped = {id(fn): torch.compiler.disable(fn) for fn in _marked}
    for name, module in list(sys.modules.items()):
        if module is None or not (name == "fxshard.runtime" or name.startswith("fxshard.runtime.")):
            continue
        for attr, value in list(vars(module).items()):
            if getattr(value, _MARK, False) and id(value) in wrapped:
                setattr(module, attr, wrapped[id(value)])
    _done = True
