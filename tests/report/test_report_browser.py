"""The report as a person sees it, in a real browser: samples/llama.py compiled at tp=2 pp=2 dp=2, run for two
traced steps, reported, and opened in headless Chromium (Debian's, driven by playwright; ``make test`` installs
it).  A screenshot of the page is saved in the test's tmp folder."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from fxshard.testing import cli

ROOT = Path(__file__).resolve().parents[2]
CHROMIUM = os.environ.get("CHROMIUM", "/usr/bin/chromium")
FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def fxshard(*args):
    proc = cli(*args, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, f"fxshard {' '.join(map(str, args))}:\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("report")
    out = tmp / "l"
    fxshard("compile", ROOT / "samples" / "llama.py", "--tp", 2, "--pp", 2, "--dp", 2, "--out", out)
    run = fxshard("run", out, "--steps", 2, "--trace", out / "trace", "--metrics", out / "m.jsonl", "--memory-report")
    assert "step 2/2" in run.stdout and "tokens/s" in run.stdout  # piped: plain lines, as before
    fxshard("report", out, "--model", ROOT / "samples" / "llama.py")  # the memory bars: the plan of the model file
    events = json.loads((out / "trace" / "trace.json").read_text())["traceEvents"]
    p2p = [e for e in events if e.get("cat") == "p2p"]
    assert {e["name"] for e in p2p} >= {"fwd_send", "fwd_recv", "bwd_send", "bwd_recv", "wait fwd_recv"}
    assert all(e["args"]["bytes"] > 0 and e["args"]["peers"] for e in p2p)
    # DDP's dp all-reduces (a comm hook while traced): every rank, on the row beside its own work
    ddp = [e for e in events if e.get("cat") == "dp"]
    assert {e["pid"] for e in ddp} == set(range(8)) and all(e["tid"] == 1 and e["args"]["bytes"] > 0 for e in ddp)
    return out / "report.html"


@pytest.mark.e2e
@pytest.mark.browser
def test_the_report_shows_the_mesh_schedule_and_run_without_script_errors(report, tmp_path):
    assert Path(CHROMIUM).exists(), f"{CHROMIUM} is missing: `make browser` (scripts/install_chromium.sh) installs it"
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS)  # playwright gives it a fresh profile
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors = []
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        requests = []
        page.on("request", lambda r: requests.append(r.url) if not r.url.startswith("file:") else None)
        page.goto(report.as_uri())

        cells = page.locator("[data-testid=mesh] .cell")
        assert cells.count() == 8  # dp 2 x pp 2 x tp 2
        assert cells.nth(5).inner_text().startswith("rank 5\ndp=1 pp=0 tp=1")
        assert page.locator("#schedule-plan .row").count() == 2  # one row per pp rank
        slots = page.locator("#schedule-plan .row[data-pp='1'] .slot text").all_text_contents()
        assert slots == ["F0", "B0", "F1", "B1"]
        assert page.locator("#schedule-measured .mrow").count() == 8  # traced: one row per rank
        assert page.locator("#schedule-measured rect").count() > 8 * 4
        # every rank waits on a send or receive between stages at least once per step: torch's p2p, traced
        assert page.locator("#schedule-measured .p2p-wait").count() >= 8
        assert page.locator("#schedule-measured .dp-coll").count() >= 8  # DDP's all-reduces, one row per rank
        assert "Bubble: 33.3%" in page.locator("#schedule").inner_text()
        assert page.locator("#loss-curve circle").count() == 2 and page.locator("#steps tr").count() == 3
        assert page.locator("#memory tr").count() == 9
        assert page.locator("#loss-curve").is_visible() and page.locator("#schedule-measured").is_visible()

        # a module's line link opens its rank file at those lines
        link = page.locator("table.modules[data-file='rank_pp0_tp0.py'] a.lines").first
        first = link.inner_text().split("–")[0]
        assert not page.locator("#file-rank_pp0_tp0\\.py").evaluate("d => d.open")
        link.click()
        line = page.locator(f"[id='rank_pp0_tp0.py-L{first}']")
        assert line.is_visible() and "hl" in line.get_attribute("class")

        page.goto(report.as_uri())
        page.screenshot(path=str(tmp_path / "report.png"), full_page=True)
        browser.close()
    assert errors == [] and requests == []
    assert (tmp_path / "report.png").stat().st_size > 10_000
    print(f"screenshot: {tmp_path / 'report.png'}")
