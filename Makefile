# Two commands do everything on a fresh clone: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fxshard-installed

.PHONY: setup browser demo test test-fast lint bench zoo clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $(STAMP)

# Debian's chromium for the browser tests, installed only when /usr/bin/chromium is missing
browser:
	bash scripts/install_chromium.sh

demo: setup
	$(PY) scripts/demo.py

test: setup browser
	$(PY) -m pytest -q --durations=15

# The edit loop: every test that starts no process group (a test that starts one unmarked fails, naming itself).
test-fast: setup
	FXSHARD_TEST_FAST=1 $(PY) -m pytest -q -m "not distributed and not e2e and not browser"

# The model zoo: every architecture of zoo/models at tp=2, pp=2 and dp=2 against one device -> zoo/RESULTS.md
zoo: setup
	$(PY) -m zoo.run

bench: setup
	$(PY) -m pytest -q benchmarks/test_benchmarks.py
	$(PY) -m benchmarks.run

lint: setup
	$(VENV)/bin/ruff check fxshard passes cli tests samples scripts benchmarks zoo

clean:
	rm -rf out $(VENV) .pytest_cache
