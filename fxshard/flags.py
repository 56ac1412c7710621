"""Command-line options declared once, as fields of a frozen dataclass: a field's default and help make its flag.

:class:`fxshard.ir.layout.Layout` (``compile``, ``plan``, ``verify``) and :class:`fxshard.train.options.RunOptions`
(``run``, and ``verify``'s training) declare their fields with :func:`option`; the command line makes one option per
:class:`Flag` of :func:`flags` (field ``name`` is ``--name-with-dashes``), and a dataclass field of a dataclass
(``RunOptions.optim``) contributes its own fields' flags::

    >>> @dataclass(frozen=True)
    ... class Example:
    ...     steps: int = option(3, "training steps")
    ...     overlap: bool = option(True, "overlap the all-reduce")
    >>> [f.declaration for f in flags(Example)], build(Example, {"steps": 5, "overlap": True})
    (['--steps', '--overlap/--no-overlap'], Example(steps=5, overlap=True))

A leaf without torch: the command line declares its options before torch loads.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field


def option(default, help: str = "", *, hidden: bool = False, launcher: bool = False):
    """A field that is a command-line option; ``launcher``: read by the launching process only, not passed on."""
    return field(default=default, metadata={"help": help, "hidden": hidden, "launcher": launcher})


@dataclass(frozen=True)
class Flag:
    """One command-line option: field ``name`` is ``--name-with-dashes``."""

    name: str
    type: object
    default: object
    help: str = ""
    hidden: bool = False
    launcher: bool = False

    @property
    def flag(self) -> str:
        return "--" + self.name.replace("_", "-")

    @property
    def declaration(self) -> str:
        """What the command line declares: ``--x``, or ``--x/--no-x`` for a switch that is on by default."""
        return f"{self.flag}/--no-{self.flag[2:]}" if self.default is True else self.flag

    def argv(self, value) -> list[str]:
        """This option set to ``value``, as arguments (none for an unset path or a switch at its default)."""
        if isinstance(value, bool):
            return [] if value == self.default else [self.flag if value else f"--no-{self.flag[2:]}"]
        return [] if value is None else [self.flag, str(value)]


def flags(cls) -> list[Flag]:
    """Every option of dataclass ``cls``, in field order, a dataclass field's own options where it is."""
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        kind = hints[f.name]
        out += flags(kind) if dataclasses.is_dataclass(kind) else [Flag(f.name, kind, f.default, **f.metadata)]
    return out


def build(cls, values: dict):
    """The ``cls`` of parsed flags, by field name as :func:`flags` lists them."""
    hints = typing.get_type_hints(cls)
    return cls(**{f.name: build(hints[f.name], values) if dataclasses.is_dataclass(hints[f.name]) else values[f.name]
                  for f in dataclasses.fields(cls)})


def values(obj) -> dict:
    """Field name -> value of every option of ``obj``, a dataclass field's own where it is."""
    out = {}
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        out |= values(value) if dataclasses.is_dataclass(value) else {f.name: value}
    return out
