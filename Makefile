# megatrain_hf: two commands on a fresh machine -- `make demo` and `make test`.
PY ?= python3
PIP := $(PY) -m pip
# torch 2.13.0 first: on a CPU machine it is the local CPU build; an unpinned torch would pull CUDA.
TORCH ?= torch==2.13.0

.PHONY: install demo test test-fast test-gpu lower-bounds test-integrations docs clean

install:
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[test]"

demo: install
	$(PY) examples/demo.py

# pytest-xdist workers: the suite's tiny-model tests are single-threaded Python, so two workers on 2 cores
# take 0.6x the time of one (docs/log.md); JOBS=0 runs in this process (a debugger, -x stops at once)
JOBS ?= 2

# the CPU suite (what CI runs; ~17 min on 2 cores): every test but the GPU ones; -rs lists each
# skipped test with its reason (a missing optional package, no GPU, ...)
test: install
	$(PY) -m pytest -m "not gpu" -q -rs -n $(JOBS)

# a quick check while editing (~4 min on 2 cores): without the tests marked `slow` (> ~5 s each on a
# 2-core CPU, or training runs in subprocesses), and one case of each parametrized test (--fast,
# tests/conftest.py: its first parameter set, e.g. llama of the family sweeps)
test-fast: install
	$(PY) -m pytest -m "not gpu and not slow" --fast -q -rs -n $(JOBS)

# the lowest versions pyproject.toml accepts (transformers, accelerate, peft, trl) in a clean venv,
# on a fast subset of the tests (.ci/lower_bounds.sh says which)
lower-bounds:
	PY=$(PY) TORCH="$(TORCH)" bash .ci/lower_bounds.sh

# axolotl, LLaMA-Factory and trl's CLI in their own venvs, plain vs megatrain through each tool's own command
# (.ci/integrations.sh; docs/integrations.md). WORK=DIR keeps the venvs for the next run.
test-integrations:
	PY=$(PY) TORCH="$(TORCH)" bash .ci/integrations.sh

# the documentation site (mkdocs.yml): strict, so a broken link or a page missing from the nav fails
docs:
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH)"
	$(PIP) install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(PY) -m mkdocs build --strict -d site

test-gpu:
	$(PY) -m pytest -m gpu -q -rs

clean:
	rm -rf demo_output bench_output site .pytest_cache build *.egg-info
