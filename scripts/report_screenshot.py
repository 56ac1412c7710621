"""A PNG of a report page as Debian's Chromium renders it (the README's docs/report.png)::

    python scripts/report_screenshot.py out/l/report.html docs/report.png
"""

import sys
from pathlib import Path

from playwright.sync_api import sync_playwright

FLAGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync"]


def main(page_file: str, png: str, width: int = 1400) -> None:
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path="/usr/bin/chromium", args=FLAGS)
        page = browser.new_page(viewport={"width": width, "height": 900})
        page.goto(Path(page_file).resolve().as_uri())
        page.screenshot(path=png, full_page=True)
        browser.close()


if __name__ == "__main__":
    main(*sys.argv[1:3])
