#!/usr/bin/env bash
# The browser tests (tests/report/test_report_browser.py) drive Debian's Chromium through playwright's Python
# package; playwright's own browser download does not work on these machines.  Install it only when missing.
set -euo pipefail
GIVEN=${CHROMIUM:-}
CHROMIUM=${CHROMIUM:-/usr/bin/chromium}
if [ -x "$CHROMIUM" ]; then
  exit 0
fi
if [ -z "$GIVEN" ]; then
  for name in chromium chromium-browser; do  # another distribution's Chromium on PATH does as well
    if command -v "$name" >/dev/null; then
      echo "Chromium is at $(command -v "$name"), not $CHROMIUM: run the tests with CHROMIUM=$(command -v "$name")" >&2
      exit 1
    fi
  done
fi
if ! command -v apt-get >/dev/null; then
  echo "the browser tests need Chromium at $CHROMIUM, and there is no apt-get here to install Debian's:" \
       "install Chromium and set CHROMIUM=/path/to/chromium, or run \`make test-fast\` (no browser tests)" >&2
  exit 1
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
