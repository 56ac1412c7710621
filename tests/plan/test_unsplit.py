"""What tensor parallelism leaves whole on every rank is said, with the reason (issue 31, section 3): in the compile's
notes above 10% of the parameters, in ``fxshard plan --json`` always, and the compile table shows each rank's
parameters against the unsharded total."""

from __future__ import annotations

import json
from pathlib import Path

from cli_in_process import fxshard

from fxshard.cost.costs import plan_costs
from fxshard.ir.layout import Layout

MODELS = Path(__file__).resolve().parent.parent / "models"
UNSPLIT, MLP = MODELS / "unsplit.py", MODELS / "mlp.py"


def test_plan_json_lists_the_modules_left_whole_and_why():
    report = plan_costs(UNSPLIT, Layout(tp=2)).to_json()["unsplit"]
    assert report["total_params"] == 32 + 16 * 64 + 64 + 64 * 16 + 16 + 16 * 15 + 15
    assert report["whole_params"] == 32 + 16 + 16 * 15 + 15  # the norm, fc_out's bias, proj
    assert report["over_threshold"] and report["whole_share"] > 0.10
    rows = [(m["modules"], m["params"], m["reason"]) for m in report["modules"]]
    assert rows[0][:2] == ("proj", 240)  # largest first
    assert rows[0][2] == ("no rule: automatic pairing found no column/row pair within its module that splits without "
                          "a gather inside it")
    assert ("proj", 15, "a size (15) that tp=2 does not divide") in rows  # its bias
    assert any(m == "norm" and n == 32 and "take it whole" in r for m, n, r in rows)
    assert any(m == "mlp.fc_out" and n == 16 for m, n, r in rows)


def test_compile_says_what_stays_whole_and_the_share_of_the_unsharded_total(tmp_path):
    run = fxshard("compile", UNSPLIT, "--tp", 2, "--out", tmp_path / "out")
    assert run.returncode == 0, run.stderr
    text = " ".join(run.stdout.split())
    assert "tp=2 leaves 303 of the model's 2,415 parameters (13%) whole on every tp rank" in text
    assert "proj: 240 parameters, no rule" in text
    assert "of 2,415" in text  # the table's per-rank figure against the unsharded total
    plan = json.loads(fxshard("plan", UNSPLIT, "--tp", 2, "--json").stdout)
    assert plan["unsplit"]["whole_params"] == 303


def test_a_layout_that_splits_nearly_everything_says_nothing():
    report = plan_costs(MLP, Layout(tp=2)).to_json()
    assert not report["unsplit"]["over_threshold"]
    assert not any("whole on every tp rank" in n for n in report["notes"])
