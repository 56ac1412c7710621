#!/usr/bin/env bash
# The browser tests (tests/report/test_report_browser.py) drive Debian's Chromium through playwright's Python
# package; playwright's own browser download does not work on these machines.  Install it only when missing.
set -euo pipefail
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
if [ -x "$CHROMIUM" ]; then
  exit 0
fi
SUDO=""
if [ "$(id -u)" != 0 ]; then
  if command -v sudo >/dev/null; then SUDO="sudo"; else
    echo "install Chromium (apt-get install chromium) for the browser tests: not root and no sudo" >&2; exit 1
  fi
fi
echo "installing Debian's chromium for the browser tests"
$SUDO apt-get update -qq
DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq chromium >/dev/null
"$CHROMIUM" --version
