"""Every command's layout flags come from one declaration, Layout's fields, verify's training flags from
RunOptions', plan's and compile's --seq / --batch from StepShape's and --auto's from AutoOptions' (fxshard/flags.py):
the typer commands' options are compared with the declarations, in one process."""

from __future__ import annotations

import typer
from fxshard.cli.app import app

from fxshard.cost.auto_options import AutoOptions
from fxshard.flags import Flag, flags
from fxshard.ir.layout import Layout
from fxshard.step_shape import StepShape
from fxshard.train.optim import OptimConfig
from fxshard.train.options import RunOptions

COMMANDS = typer.main.get_command(app).commands


def _options(command: str) -> dict[str, object]:
    """Parameter name -> click option of ``fxshard COMMAND``."""
    return {p.name: p for p in COMMANDS[command].params}


def _declared_as(option, flag: Flag) -> bool:
    names = option.opts + option.secondary_opts
    return (names == flag.declaration.split("/") and option.default == flag.default
            and (option.help or "") == flag.help and option.hidden == flag.hidden)


def test_compile_plan_and_verify_take_every_layout_flag_as_layout_declares_it():
    for command in ("compile", "plan", "verify"):
        options = _options(command)
        for flag in flags(Layout):
            assert flag.name in options, f"fxshard {command} has no {flag.flag}"
            assert _declared_as(options[flag.name], flag), (command, flag, options[flag.name].opts)


def test_the_layout_flags_include_the_ones_that_had_drifted():
    assert "overlap" in _options("plan") and all("split_before" in _options(c) for c in ("compile", "plan", "verify"))


def test_verify_trains_with_run_s_own_flags_for_steps_the_optimizer_timeout_and_compile():
    verify, run = _options("verify"), {f.name: f for f in RunOptions.flags()}
    for name in ("steps", "timeout", "compile", "cpu_matmul", *(f.name for f in flags(OptimConfig))):
        assert name in verify and _declared_as(verify[name], run[name]), name


def test_run_takes_every_run_option_as_declared():
    run = _options("run")
    for flag in RunOptions.flags():
        assert _declared_as(run[flag.name], flag), flag


def test_the_step_shape_and_the_auto_flags_are_declared_once_for_plan_and_compile():
    """--seq and --batch (StepShape) and --auto's own flags (AutoOptions) mean one thing on every command that takes
    them: one declaration each, no second --seq with its own help, no second name for the batch."""
    for command in ("compile", "plan"):
        options = _options(command)
        for flag in flags(StepShape) + flags(AutoOptions):
            assert flag.name in options and _declared_as(options[flag.name], flag), (command, flag)
        every = [name for option in options.values() for name in option.opts + option.secondary_opts]
        assert len(every) == len(set(every)), f"fxshard {command} declares a flag twice"


def test_plan_binds_to_one_name_on_every_command():
    for command in ("compile", "plan", "verify"):
        (found,) = [name for name, option in _options(command).items() if "--plan" in option.opts]
        assert found == "plan_file", (command, found)


def test_compile_plan_and_verify_take_a_folders_flags_and_one_seq_and_batch():
    from fxshard.capture.folder_options import FolderOptions

    for command in ("compile", "plan", "verify"):
        options = _options(command)
        for flag in flags(FolderOptions):
            assert _declared_as(options[flag.name], flag), (command, flag)
    for name in ("seq", "batch"):
        helps = {_options(c)[name].help for c in ("compile", "plan", "verify")}
        assert len(helps) == 1, (name, helps)  # one declaration, one meaning
