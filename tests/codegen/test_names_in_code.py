"""Issue 32 item 8: no name, string or docstring a model carries becomes code in its rank files.

Real models with the real bad names: a module added under a name holding a newline and a statement, a block class
made with ``type()`` whose name holds a newline and a statement, a model file whose own file name does.  Each
statement would leave a marker file if it ever ran; the compile and ``fxshard check`` (which imports and runs every
rank file) must leave none.
"""

from __future__ import annotations

import ast
import io
import tokenize
from pathlib import Path

import pytest

from fxshard.check.check import check_output
from fxshard.driver import compile as compile_model
from fxshard.errors import ModelFileError
from fxshard.ir.context import Layout

MODEL = '''
import torch
import torch.nn as nn

PAYLOAD = "\\nopen({marker!r}, 'w').write('ran')\\n#"
OPEN = "\\nopen({marker!r}, 'w')\\n#"  # a module name cannot hold a dot: the statement without one


def block_init(self):
    nn.Module.__init__(self)
    self.fc = nn.Linear(16, 16)


def block_forward(self, x):
    return torch.relu(self.fc(x)) + x


# a block class whose name is a newline and a statement
Block = type("Blk" + PAYLOAD, (nn.Module,), {{"__init__": block_init, "forward": block_forward}})


class Model(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(16, 16)
        {extra}

    def forward(self, x):
        for b in self.blocks:
            x = b(x)
        return self.head(x).pow(2).mean()


def make_model():
    return Model()


def make_inputs():
    return (torch.randn(4, 16),)
'''


def _write(path: Path, marker: Path, extra: str = "") -> Path:
    path.write_text(MODEL.format(marker=str(marker), extra=extra))
    return path


def _comments_and_code(source: str) -> tuple[str, str]:
    comments = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in (tokenize.COMMENT, tokenize.STRING):
            comments.append(tok.string)
    return "\n".join(comments), source


def test_a_module_name_with_a_newline_is_refused_in_one_line(tmp_path):
    marker = tmp_path / "ran"
    assert "." not in str(marker)
    model = _write(tmp_path / "m.py", marker, extra='self.add_module("evil" + OPEN, nn.Linear(16, 16))')
    with pytest.raises(ModelFileError,
                       match=r"m\.py: module [\"']evil\\nopen\(.*[\"'] has '\\n' in its name; fxshard writes "
                                             r"every module, parameter and buffer name into the generated code"):
        compile_model(model, Layout(tp=2), out=tmp_path / "o")
    assert not marker.exists() and not (tmp_path / "o").exists()


@pytest.mark.parametrize("extra, what", [('self.register_buffer("b\\"x", torch.zeros(1))', "buffer"),
                                         ('self.register_parameter("p\\\\", nn.Parameter(torch.zeros(1)))',
                                          "parameter")])
def test_a_quote_or_backslash_in_a_name_is_refused(tmp_path, extra, what):
    model = _write(tmp_path / "m.py", tmp_path / "ran", extra=extra)
    with pytest.raises(ModelFileError, match=f"{what} .* in its name"):
        compile_model(model, Layout(), out=tmp_path / "o")


def test_class_and_file_names_with_newlines_stay_text_in_the_rank_files(tmp_path):
    marker = tmp_path / "ran"
    folder = tmp_path / "models"
    folder.mkdir()
    model = _write(folder / "m\nopen('x', 'w')\n#.py", marker)  # the model file's own name holds a statement
    out = tmp_path / "o"
    compile_model(model, Layout(tp=2), out=out)
    report = check_output(out)  # imports and runs every rank file on meta tensors
    assert report.traced and not marker.exists() and not Path("x").exists()
    for rank in sorted(out.glob("rank_*.py")):
        source = rank.read_text()
        tree = ast.parse(source)
        # the only module-level statements are the template's: imports, assignments, classes, functions
        assert all(isinstance(s, (ast.Import, ast.ImportFrom, ast.Assign, ast.ClassDef, ast.FunctionDef, ast.Expr))
                   for s in tree.body), rank
        assert not any(isinstance(s, ast.Expr) and isinstance(s.value, ast.Call) for s in tree.body), rank
        text, _ = _comments_and_code(source)
        assert "Blk\\nopen(" in text and "m\\nopen(" in text  # written, escaped, in comments and docstrings
        assert "class Block(torch.nn.Module):" in source  # a class name that is no identifier: the generic one
