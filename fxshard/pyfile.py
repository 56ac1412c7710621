"""Import a Python file by its path: a model file the user wrote, a rank file fxshard generated.

The module is registered in ``sys.modules`` under ``prefix`` and a digest of the path, so the file's classes pickle
and its dataclasses resolve their module (a dataset's workers, ``torch.export`` of its model) and importing the same
file again gives the same name; where the file's own code raises, the half-made module is removed and the error goes
to the caller, which names the file::

    module = import_file(Path("samples/gpt.py"), "fxshard_model_")    # sys.modules["fxshard_model_3f1c..."]
"""

from __future__ import annotations

import hashlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType


def import_file(path: Path, prefix: str) -> ModuleType:
    name = prefix + hashlib.sha256(str(path).encode()).hexdigest()[:12]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except Exception:
        sys.modules.pop(name, None)
        raise
    return module
