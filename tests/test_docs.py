"""Tier 1: the documentation says what the code does.

Every command line in README.md and docs/*.md (a fenced shell block's line that starts with ``fxshard``,
``python -m fxshard...``, ``torchrun`` (of fxshard's command line, or of a script that exists), ``make``, ``python -m
<module>`` or ``python <file>``) parses against the real command line: the command exists, each flag exists on that
command and gets a value where it takes one, the positional arguments fit, and a file or folder it names exists in the
repository (outputs excepted: a path under ``out/``, or the value of an option that writes). A line with placeholders
(``MODEL``, ``OUT``, ``$z``) is checked flag by flag; one without is parsed whole by click, values converted. The Python
examples of the README and of ``fxshard.compile``'s, the compiler's and the driver's docstrings run as written.
"""

from __future__ import annotations

import doctest
import os
import re
import shlex
import typing
from pathlib import Path

import pytest
import typer

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
SHELL = {"", "sh", "bash", "shell", "console"}
# options whose value is a file or folder the command writes, not one that must exist
WRITES = {"--out", "-o", "--metrics", "--trace", "--checkpoint", "--hf", "--final-state", "--tensorboard"}


def _blocks(text: str):
    """(first line number, info string, lines) of each fenced block."""
    lines, i = text.splitlines(), 0
    while i < len(lines):
        m = re.match(r"^(\s*)```(\S*)", lines[i])
        if not m:
            i += 1
            continue
        start, info, body = i + 1, m.group(2), []
        i += 1
        while i < len(lines) and not lines[i].strip().startswith("```"):
            body.append(lines[i])
            i += 1
        yield start + 1, info, body
        i += 1


def _commands(text: str):
    """(line number, tokens) of each command line of the page's shell blocks; a trailing backslash continues."""
    for start, info, body in _blocks(text):
        if info not in SHELL:
            continue
        joined, first = "", None
        for n, line in enumerate(body, start):
            first = n if first is None else first
            if line.rstrip().endswith("\\"):
                joined += line.rstrip()[:-1] + " "
                continue
            joined += line
            stripped = joined.strip().removeprefix("$ ")
            joined, number = "", first
            first = None
            try:
                tokens = shlex.split(stripped, comments=True)
            except ValueError:
                continue
            tokens = [t for t in tokens if t != "..."]
            while tokens and tokens[-1] in (";", "done;", "done"):
                tokens.pop()
            if tokens and (tokens[0] in ("fxshard", "make", "torchrun") or tokens[:2] == ["python", "-m"]
                           or (tokens[0] == "python" and len(tokens) > 1 and tokens[1].endswith(".py"))):
                yield number, [t.rstrip(";") for t in tokens]


def _all_commands():
    found = []
    for page in PAGES:
        for number, tokens in _commands(page.read_text()):
            found.append(pytest.param(tokens, id=f"{page.relative_to(ROOT)}:{number}"))
    return found


def _placeholder(token: str) -> bool:
    bare = token.strip("[]")
    return "$" in bare or "<" in bare or bool(re.fullmatch(r"[A-Z][A-Z0-9_]*", bare))


def _output(token: str) -> bool:
    return token == "out" or token.startswith("out/") or token.startswith("/tmp/")


def _param(command, name: str):
    for p in command.params:
        if name in p.opts or name in p.secondary_opts:
            return p
    return None


def _is_argument(param) -> bool:
    return param.param_type_name == "argument"


def _is_path(param) -> bool:
    """Whether the parameter takes a file or folder (typer vendors its own click from 0.25 on: read the type
    typer was declared with where it says, else click's)."""
    declared = getattr(param, "type_descriptor", None)
    if declared is not None:
        annotation = declared.annotation
        return annotation is Path or Path in typing.get_args(annotation)
    return type(getattr(param, "type", None)).__name__ == "Path"


def _takes_value(param) -> bool:
    return not (getattr(param, "is_flag", False) or getattr(param, "count", False))


def _check_path(token: str, where: str) -> None:
    if _placeholder(token) or _output(token) or "*" in token:
        return
    assert (ROOT / token).exists(), f"{where}: {token} does not exist in the repository"


def _check_fxshard(args: list[str], where: str) -> None:
    root = typer.main.get_command(_app())
    while args and args[0].startswith("-"):  # options of the top-level command (fxshard --version)
        assert _param(root, args[0].split("=")[0]), f"{where}: fxshard has no option {args[0]}"
        args = args[1:]
    if not args:
        return
    assert args[0] in root.commands, f"{where}: fxshard has no command {args[0]!r} (it has {sorted(root.commands)})"
    command = root.commands[args[0]]
    while hasattr(command, "commands") and len(args) > 1:  # a group (fxshard data tokenize): its subcommand
        assert args[1] in command.commands, f"{where}: `fxshard {args[0]}` has no command {args[1]!r}"
        command, args = command.commands[args[1]], [f"{args[0]} {args[1]}", *args[2:]]
    rest = [t.strip("[]") for t in args[1:] if t.strip("[]")]
    positional, i, placeholders = [], 0, False
    while i < len(rest):
        token = rest[i]
        if token.startswith("-") and not re.fullmatch(r"-\d.*", token):
            name, _, value = token.partition("=")
            param = _param(command, name)
            assert param is not None, f"{where}: `fxshard {args[0]}` has no option {name}"
            if _takes_value(param) and not value:
                assert i + 1 < len(rest), f"{where}: {name} needs a value"
                i += 1
                value = rest[i]
            placeholders |= _placeholder(value) if value else False
            if value and _is_path(param) and name not in WRITES:
                _check_path(value, where)
        else:
            placeholders |= _placeholder(token)
            positional.append(token)
        i += 1
    arguments = [p for p in command.params if _is_argument(p)]
    if not any(p.nargs == -1 for p in arguments):
        assert len(positional) <= len(arguments), f"{where}: too many arguments for `fxshard {args[0]}`: {positional}"
    for token, param in zip(positional, arguments, strict=False):
        if _is_path(param) and param.name not in ("out", "checkpoint"):
            _check_path(token, where)
    if not placeholders:
        command.make_context(args[0], list(rest))  # the whole line, values converted as the command would


def _app():
    from fxshard.cli.app import app

    return app


def _make_targets() -> set[str]:
    text = (ROOT / "Makefile").read_text()
    return set(re.findall(r"^([A-Za-z][\w-]*):", text, flags=re.M))


@pytest.mark.parametrize("tokens", _all_commands())
def test_documented_command_lines_parse(tokens, request):
    where = request.node.callspec.id
    if tokens[0] == "fxshard":
        _check_fxshard(tokens[1:], where)
    elif tokens[0] == "make":
        for target in tokens[1:]:
            if "=" not in target:
                assert target in _make_targets(), f"{where}: the Makefile has no target {target!r}"
    elif tokens[0] == "torchrun" and "-m" not in tokens:  # a script of its own: the file exists
        script = next((t for t in tokens[1:] if t.endswith(".py")), None)
        assert script is not None, f"{where}: torchrun without -m MODULE or a script"
        _check_path(script, where)
    elif tokens[0] == "torchrun":
        module = tokens[tokens.index("-m") + 1]
        assert module == "fxshard.cli.app", f"{where}: torchrun runs {module}, not fxshard's command line"
        _check_fxshard(tokens[tokens.index("-m") + 2:], where)
    elif tokens[1] == "-m":
        module = tokens[2]
        if module.startswith("fxshard"):
            _check_fxshard(tokens[3:], where)
        else:
            path = ROOT / module.replace(".", "/")
            assert path.with_suffix(".py").exists() or (path / "__main__.py").exists(), f"{where}: no module {module}"
    else:
        _check_path(tokens[1], where)


def test_the_checker_sees_the_pages_commands():
    """The parametrized test above is only as good as the extraction: it finds the README's worked example."""
    found = [tokens for _, tokens in _commands((ROOT / "README.md").read_text())]
    assert ["fxshard", "compile", "samples/gpt.py", "--tp", "2", "--out", "out/gpt"] in found
    assert ["make", "demo"] in found


def test_the_checker_refuses_a_flag_the_command_lacks():
    with pytest.raises(AssertionError, match="has no option --pp"):
        _check_fxshard(["run", "out/gpt", "--pp", "2"], "example")
    with pytest.raises(AssertionError, match="does not exist"):
        _check_fxshard(["compile", "samples/no_such_model.py", "--tp", "2"], "example")
    with pytest.raises(Exception) as bad:  # click's, or the click typer vendors
        _check_fxshard(["compile", "samples/gpt.py", "--tp", "two"], "example")
    assert type(bad.value).__name__ == "BadParameter"


@pytest.fixture
def in_scratch(tmp_path):
    """A working directory holding `samples/` (as the repository's root does), whose out/ is scratch."""
    (tmp_path / "samples").symlink_to(ROOT / "samples")
    cwd = os.getcwd()
    os.chdir(tmp_path)
    yield tmp_path
    os.chdir(cwd)


def _python_blocks(path: Path) -> list[str]:
    return ["\n".join(body) for _, info, body in _blocks(path.read_text()) if info == "python"]


def test_the_readme_python_example_runs(in_scratch, capsys):
    example = next(code for code in _python_blocks(ROOT / "README.md") if "fxshard.compile(" in code)
    exec(compile(example, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == str(["rank_pp0_tp0.py", "rank_pp0_tp1.py"])
    assert (in_scratch / "out" / "gpt-tp2" / "manifest.json").exists()


@pytest.mark.parametrize("target", ["fxshard.compile", "fxshard.compiler", "fxshard.driver", "fxshard.passes"])
def test_docstring_examples_run(in_scratch, target):
    import importlib

    import fxshard

    obj = fxshard.compile if target == "fxshard.compile" else importlib.import_module(target)
    finder, runner = doctest.DocTestFinder(), doctest.DocTestRunner(optionflags=doctest.ELLIPSIS)
    tests = [t for t in finder.find(obj, target, globs={"fxshard": fxshard}) if t.name == target and t.examples]
    assert tests, f"{target}'s docstring has no example"
    result = runner.run(tests[0])
    assert result.failed == 0 and result.attempted > 0


def _anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation dropped (hyphens and underscores kept), spaces to
    hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    text = re.sub(r"^```.*?^```", "", path.read_text(), flags=re.M | re.S)
    return {_anchor(m.group(1)) for m in re.finditer(r"^#+ (.*)$", text, flags=re.M)}


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_links_lead_somewhere(page):
    """Every relative link of a page names a file of the repository, and a heading of it where it names one."""
    text = re.sub(r"^```.*?^```", "", page.read_text(), flags=re.M | re.S)
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+://", target):
            continue
        file, _, anchor = target.partition("#")
        path = (page.parent / file).resolve() if file else page
        assert path.exists(), f"{page.relative_to(ROOT)}: the link {target} names no file"
        if anchor and path.suffix == ".md":
            assert anchor in _anchors(path), f"{page.relative_to(ROOT)}: {target}: no heading with that anchor"
