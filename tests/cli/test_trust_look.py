"""Issue 32 (trust, second round), what reading a folder and writing a file may do: `report` and `show` run no code
of the folder, `check` refuses an edited file before running it, no write follows a planted link, option values
that could only fail late are refused first, and a metrics file with a string or infinite loss is drawn honestly.

Every test plants the real thing (a model.py and a rank file that write a marker when imported, a symbolic link
where fxshard writes, a hard link at the lock) and goes through the real command line where a user would.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

import pytest

from fxshard.driver import compile as compile_model
from fxshard.files import UnsafePathError, open_no_follow, write_text
from fxshard.ir.context import Layout
from fxshard.testing import cli as cli_process

ROOT = Path(__file__).resolve().parents[2]
MLP = ROOT / "tests" / "models" / "mlp.py"


def fxshard(*args):
    """The command line in a process of its own, as a user runs it."""
    return cli_process(*args, timeout=300, cwd=ROOT)


class _Result:
    def __init__(self, result):
        self.returncode, self.stdout, self.stderr = result.exit_code, result.stdout, result.stderr


def cli(*args):
    """The command line in this process (typer's runner): the same parsing and messages, without starting
    Python and torch again for each refusal."""
    from fxshard.cli.app import app
    from typer.testing import CliRunner

    return _Result(CliRunner().invoke(app, [str(a) for a in args]))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    out = tmp_path_factory.mktemp("mlp") / "o"
    compile_model(MLP, Layout(tp=2), out=out)
    return out


def _copy(compiled: Path, tmp_path: Path) -> Path:
    import shutil

    out = tmp_path / "o"
    shutil.copytree(compiled, out)
    return out


def _plant_code(out: Path, marker: Path) -> None:
    """model.py and a rank file that leave ``marker`` behind when anything imports them (as a folder received
    from someone else could)."""
    payload = f"open({str(marker)!r}, 'a').write('ran\\n')\n"
    (out / "model.py").write_text(payload + MLP.read_text())
    rank = out / "rank_pp0_tp1.py"
    rank.write_text(payload + rank.read_text())


# ---------------------------------------------------------------- item 1: a look never runs the folder's code


@pytest.mark.slow
def test_report_and_show_run_no_code_of_the_folder(compiled, tmp_path):
    out = _copy(compiled, tmp_path)
    marker = tmp_path / "ran"
    _plant_code(out, marker)
    report = fxshard("report", out)
    assert report.returncode == 0, report.stderr
    page = (out / "report.html").read_text()
    assert "the report runs no code of the folder it reads; pass --model" in page
    for args in (["show", out], ["show", out, "--rank", 1]):
        proc = fxshard(*args)
        assert proc.returncode == 0, proc.stderr
    assert not marker.exists(), "a look at the folder ran its code"
    helptext = cli("report", "--help").stdout
    assert "runs no code of OUT" in helptext and "--model" in helptext


def test_report_plan_figures_come_from_the_users_own_model_file(compiled, tmp_path):
    out = _copy(compiled, tmp_path)
    marker = tmp_path / "ran"
    _plant_code(out, marker)
    proc = cli("report", out, "--model", MLP, "--to", tmp_path / "r.html")
    assert proc.returncode == 0, proc.stderr
    assert "no plan figures" not in (tmp_path / "r.html").read_text() and not marker.exists()
    other = ROOT / "tests" / "models" / "branches.py"  # not the file the folder was compiled from: not imported
    proc = cli("report", out, "--model", other)
    assert proc.returncode == 2 and "is not the model file the folder was compiled from" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_check_refuses_an_edited_file_before_running_it(compiled, tmp_path):
    out = _copy(compiled, tmp_path)
    marker = tmp_path / "ran"
    _plant_code(out, marker)
    proc = cli("check", out)
    assert proc.returncode == 2 and "edited after compile" in proc.stderr, proc.stderr
    assert "model.py" in proc.stderr and "rank_pp0_tp1.py" in proc.stderr
    run = cli("run", out, "--steps", 1)  # run's --check path: the same order
    assert run.returncode == 2 and "edited after compile" in run.stderr and "launching" not in run.stdout
    assert not marker.exists(), "check ran an edited folder's code before refusing it"


# ---------------------------------------------------------------- item 2: no write follows a link


def test_a_link_planted_at_report_html_is_refused_and_its_target_kept(compiled, tmp_path):
    out = _copy(compiled, tmp_path)
    target = tmp_path / "precious.txt"
    target.write_text("mine")
    (out / "report.html").symlink_to(target)
    proc = cli("report", out)
    assert proc.returncode == 2 and "report.html: is a symbolic link" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr
    assert target.read_text() == "mine" and (out / "report.html").is_symlink()
    proc = cli("report", out, "--to", out / "report.html")  # --to naming the link: the same
    assert proc.returncode == 2 and target.read_text() == "mine"


def test_run_refuses_links_where_it_will_write_before_launch(compiled, tmp_path):
    out = _copy(compiled, tmp_path)
    target = tmp_path / "precious.txt"
    target.write_text("mine")
    (out / "run.json").symlink_to(target)
    proc = cli("run", out, "--steps", 1)
    assert proc.returncode == 2 and "run.json: is a symbolic link" in proc.stderr, proc.stderr
    assert "launching" not in proc.stdout
    (out / "run.json").unlink()
    trace = tmp_path / "trace"
    trace.mkdir()
    for name in ("trace.json", "rank1.json"):
        (trace / name).symlink_to(target)
        proc = cli("run", out, "--steps", 1, "--trace", trace)
        assert proc.returncode == 2 and f"{name}: is a symbolic link" in proc.stderr, proc.stderr
        (trace / name).unlink()
    (tmp_path / "m.jsonl").symlink_to(target)
    proc = cli("run", out, "--steps", 1, "--metrics", tmp_path / "m.jsonl")
    assert proc.returncode == 2 and "m.jsonl: is a symbolic link" in proc.stderr and "launching" not in proc.stdout
    (tmp_path / "final").mkdir()
    (tmp_path / "final" / "rank1.safetensors").symlink_to(target)  # verify's trained tensors, one file per rank
    proc = cli("run", out, "--steps", 1, "--final-state", tmp_path / "final")
    assert proc.returncode == 2 and "rank1.safetensors: is a symbolic link" in proc.stderr, proc.stderr
    assert target.read_text() == "mine"


def test_the_writers_themselves_never_write_through_a_link(compiled, tmp_path):
    """Planted after the checks (a run that is already training): the writers refuse, the target is intact."""
    from fxshard.runtime import trace
    from fxshard.train.options import RunOptions
    from fxshard.train.record import write_run_record

    out = _copy(compiled, tmp_path)
    target = tmp_path / "precious.txt"
    target.write_text("mine")
    (out / "run.json").symlink_to(target)
    with pytest.raises(UnsafePathError, match=r"run\.json: is a symbolic link"):
        write_run_record(out, RunOptions(steps=1), [1.0], None)
    folder = tmp_path / "trace"
    folder.mkdir()
    (folder / "rank0.json").symlink_to(target)
    trace.start(0, folder)
    with pytest.raises(UnsafePathError, match=r"rank0\.json: is a symbolic link"):
        trace.save()
    (folder / "rank0.json").unlink()
    trace.start(0, folder)
    trace.save()
    (folder / "trace.json").symlink_to(target)
    with pytest.raises(UnsafePathError, match=r"trace\.json: is a symbolic link"):
        trace.merge(folder, 1)
    assert target.read_text() == "mine"
    # no temporary file left; the list of what fxshard wrote there beside them (fxshard.files)
    assert sorted(p.name for p in folder.iterdir()) == [".fxshard-files.json", "rank0.json", "trace.json"]


@pytest.mark.parametrize("link", ["symbolic", "hard"])
def test_a_checkpoint_lock_that_is_a_link_is_refused_never_truncated(tmp_path, link):
    from fxshard.train.supervise import LOCK, check_unlocked

    folder = tmp_path / "ckpt"
    folder.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("mine, not a pid")
    if link == "symbolic":
        (folder / LOCK).symlink_to(target)
    else:
        os.link(target, folder / LOCK)
    with pytest.raises(UnsafePathError, match=r"\.lock: is a (symbolic|hard) link"):
        check_unlocked(folder)
    assert target.read_text() == "mine, not a pid"


def test_a_checkpoint_latest_that_is_a_link_is_refused_before_launch(compiled, tmp_path):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    target = tmp_path / "precious.txt"
    target.write_text("mine")
    (folder / "latest").symlink_to(target)
    proc = cli("run", compiled, "--steps", 1, "--checkpoint", folder, "--save-every", 1)
    assert proc.returncode == 2 and "latest: is a symbolic link" in proc.stderr and "launching" not in proc.stdout
    from fxshard.train.checkpoint import _write_atomic

    with pytest.raises(UnsafePathError):  # and the save's own write, were one planted mid-run
        _write_atomic(folder / "latest", "step-00000002\n")
    assert target.read_text() == "mine"


def test_the_safe_writer_replaces_a_file_whole_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "f.txt"
    write_text(path, "old")
    inode = path.stat().st_ino
    write_text(path, "new")
    assert path.read_text() == "new" and path.stat().st_ino != inode  # a new file renamed in, not a rewrite
    assert sorted(p.name for p in tmp_path.iterdir()) == [".fxshard-files.json", "f.txt"]  # and what wrote it
    fd = open_no_follow(tmp_path / "lock", os.O_RDWR | os.O_CREAT)
    os.close(fd)


# ---------------------------------------------------------------- item 10: option values refused first


@pytest.mark.parametrize("args, said", [
    (["--steps", "0"], "--steps 0: expected at least 1 training step"),
    (["--rtol", "-1"], "--rtol -1.0: expected a finite tolerance >= 0"),
    (["--param-rtol", "nan"], "--param-rtol nan: expected a finite tolerance >= 0"),
])
def test_verify_refuses_meaningless_values_before_compiling(tmp_path, args, said):
    proc = cli("verify", MLP, "--tp", 2, "--out", tmp_path / "o", *args)
    assert proc.returncode == 2 and said in proc.stderr, proc.stdout + proc.stderr
    assert "verifying" not in proc.stdout and not (tmp_path / "o").exists()


def test_run_refuses_a_timeout_torch_cannot_keep_before_launch(compiled):
    for value in ("1e300", "inf", "0"):
        proc = cli("run", compiled, "--steps", 1, "--timeout", value)
        assert proc.returncode == 2 and f"--timeout {float(value)}: expected a positive number of seconds up to" \
            in proc.stderr, proc.stderr
        assert "launching" not in proc.stdout


# ---------------------------------------------------------------- item 12, report: odd metrics drawn honestly


def test_a_string_or_infinite_loss_is_said_and_never_drawn_as_nan(compiled, tmp_path):
    from fxshard.report.data import report_data
    from fxshard.report.render import render

    metrics = tmp_path / "m.jsonl"
    rows = [{"step": 1, "loss": 5.0, "seconds": 0.1}, {"step": 2, "loss": "4.0"}, {"step": 3, "loss": 1e308},
            {"step": 4, "loss": -1e308}, {"step": 5, "loss": float("inf"), "seconds": "slow"}, ["not", "a", "row"]]
    metrics.write_text("".join(json.dumps(r) + "\n" for r in rows))
    data = report_data(compiled, metrics=metrics)
    assert [s for s, _ in data.run.losses] == [1, 3, 4, 5]
    assert any("line 2: expected a step and a loss that are numbers" in w and '"loss": "4.0"' in w
               for w in data.warnings)
    assert any("line 6" in w for w in data.warnings)
    assert any(w.startswith("step 5: loss inf") for w in data.warnings)
    page = render(data)
    assert "NaN" not in page and "nan" not in page.lower().replace("nanosecond", "")
    curve = re.search(r'<polyline points="([^"]*)"', page)[1]
    assert len(curve.split()) == 3  # steps 1, 3 and 4: the infinite loss is in the table, not on the curve
    proc = cli("report", compiled, "--metrics", metrics, "--to", tmp_path / "r.html")
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr
    assert "step 5: loss inf" in proc.stderr
