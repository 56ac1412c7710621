# Two commands do everything on a fresh clone: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fxshard-installed

.PHONY: setup demo test lint bench clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $(STAMP)

demo: setup
	$(PY) scripts/demo.py

test: setup
	$(PY) -m pytest -q

bench: setup
	$(PY) -m benchmarks.run

lint: setup
	$(VENV)/bin/ruff check fxshard passes cli tests samples scripts benchmarks

clean:
	rm -rf out $(VENV) .pytest_cache
