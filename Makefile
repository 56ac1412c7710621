# Two commands do everything on a fresh clone: `make demo` and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.fxshard-installed

.PHONY: setup browser demo test test-matrix test-fast test-compat peers lint bench zoo soak clean

setup: $(STAMP)

$(STAMP): pyproject.toml scripts/setup.sh
	bash scripts/setup.sh $(VENV)
	touch $(STAMP)

# Debian's chromium for the browser tests, installed only when /usr/bin/chromium is missing
browser:
	bash scripts/install_chromium.sh

demo: setup
	$(PY) scripts/demo.py

# Two workers (pytest-xdist), a test file each at a time: spawned ranks run one thread each.  The cases of broad
# layout and model matrices are marked `matrix` and left to make test-matrix; a representative case of each stays.
test: setup browser
	$(PY) -m pytest -q -m "not matrix" -n 2 --dist loadfile --durations=25

# The cases make test leaves out: the rest of each broad matrix (marked matrix).  make test and make test-matrix
# together are the whole suite; CI (.ci/run) runs both.
test-matrix: setup
	$(PY) -m pytest -q -m matrix -n 2 --dist loadfile --durations=25

# The edit loop: every test that starts no process group (a test that starts one unmarked fails, naming itself),
# less those marked slow (over ~4 s alone: big meta models, plans over many layouts; make test runs them).
# Two workers (pytest-xdist), a test file each at a time: the machine's 2 cores.
FAST := -m "not distributed and not e2e and not browser and not slow and not matrix"
test-fast: setup
	FXSHARD_TEST_FAST=1 $(PY) -m pytest -q $(FAST) -n 2 --dist loadfile --durations=10

# Another torch in a second environment, .venv-compat (`make setup`'s .venv is not touched): the fast tier, then
# a distributed subset (tp2 through the command line, pp2, dp2 ZeRO 1 and 3, a transformers Llama at tp2 and
# pp2).  Its own target: not part of `make test` or CI.
COMPAT_VENV ?= .venv-compat
COMPAT_TORCH ?= 2.14.1
COMPAT_PY := $(COMPAT_VENV)/bin/python
COMPAT_STAMP := $(COMPAT_VENV)/.fxshard-installed
LAYOUTS := tests/test_training_layouts.py::test_pipeline_training_matches_single_device
COMPAT_DISTRIBUTED := "tests/cli/test_e2e.py::test_compile_and_run_matches_single_device_training[gpt.py]" \
	"tests/test_numerics.py::test_rank_code_matches_unsharded_model[llama.py-2]" \
	"$(LAYOUTS)[gpt-pp2-1f1b]" "$(LAYOUTS)[llama-pp2-1f1b]" "$(LAYOUTS)[gpt-dp2-zero1]" "$(LAYOUTS)[gpt-dp2-zero3]"

$(COMPAT_STAMP): pyproject.toml scripts/setup_compat.sh
	TORCH=$(COMPAT_TORCH) bash scripts/setup_compat.sh $(COMPAT_VENV)
	touch $(COMPAT_STAMP)

test-compat: $(COMPAT_STAMP)
	FXSHARD_TEST_FAST=1 $(COMPAT_PY) -m pytest -q $(FAST) -n 2 --dist loadfile -p no:cacheprovider
	$(COMPAT_PY) -m pytest -q -p no:cacheprovider $(COMPAT_DISTRIBUTED)

# The real peers in a third environment, .venv-peers (`make setup`'s .venv is not touched): torchtitan, Megatron-Core
# and DeepSpeed (where it installs) beside fxshard, for `python -m benchmarks.run --only peers`.  Not part of
# `make test` or CI; benchmarks/peers/test_peers.py runs only where it exists.
PEERS_VENV ?= .venv-peers
PEERS_STAMP := $(PEERS_VENV)/.fxshard-installed

$(PEERS_STAMP): pyproject.toml scripts/setup_peers.sh
	bash scripts/setup_peers.sh $(PEERS_VENV)
	touch $(PEERS_STAMP)

peers: $(PEERS_STAMP)

# The model zoo: every architecture of zoo/models at tp=2, pp=2 and dp=2 against one device -> zoo/RESULTS.md
zoo: setup
	$(PY) -m zoo.run

# The soak test (docs/trust.md#soak): 2,000 steps of samples/gpt.py at tp2·dp2, a rank killed with kill -9 ten
# times and resumed; bit-identical to an uninterrupted run, no orphan, no stray file, no memory growth.  Its own
# target, not part of `make test` (about half an hour on 2 cores); the short version is tests/scripts/test_soak.py.
soak: setup
	nice -n 10 $(PY) scripts/soak.py --steps 2000 --kills 10 --save-every 50 --seed 0 --results benchmarks/results/soak-cpu.md

bench: setup
	$(PY) -m pytest -q benchmarks/test_benchmarks.py
	$(PY) -m benchmarks.run

# ruff over every Python file of the repository (pyproject's [tool.ruff]): lines within 120 columns (E501 enforced),
# the golden rank files under tests/fixtures/generated excepted (fxshard's own output, compared byte for byte)
lint: setup
	$(PY) -m ruff check .

clean:
	rm -rf out $(VENV) $(COMPAT_VENV) $(PEERS_VENV) .pytest_cache
