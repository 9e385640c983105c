# Two entry points for a fresh machine: `make run` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
TORCH := torch==2.13.0
# The package folders, each installed as hybridkv.<folder>.
FOLDERS := errors scheduler policies memory kernels models executor parallel serving testing

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip

$(VENV)/.demo: pyproject.toml | $(VENV)/bin/python
	$(PIP) $(TORCH)
	$(PIP) -e '.[demo]'
	touch $@

# The test extra plus demo's converters (the slow test checks the built-in model) and
# the docs extra (`make test` builds the documentation site).
$(VENV)/.test: pyproject.toml | $(VENV)/bin/python
	$(PIP) $(TORCH)
	$(PIP) -e '.[test,demo,docs]'
	touch $@

.PHONY: run test lint typecheck docs gpu-check
run: $(VENV)/.demo
	$(VENV)/bin/hybridkv demo

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy cannot follow setuptools' package-dir mapping, so it checks a link tree that
# gives the folders their installed names (hybridkv.memory, hybridkv.policies, ...).
typecheck: $(VENV)/.test
	rm -rf .typecheck && mkdir -p .typecheck/hybridkv
	for d in $(FOLDERS); do ln -s ../../$$d .typecheck/hybridkv/$$d; done
	cd .typecheck && MYPYPATH=. ../$(VENV)/bin/mypy --strict $(foreach d,$(FOLDERS),-p hybridkv.$(d))

# mkdocstrings cannot follow the package-dir mapping either: griffe reads a link tree of
# its own (build/docs-src, so that `make -j` may run docs beside typecheck), and the site
# goes to site/ (ignored by git). --strict fails on a broken link or reference.
docs: $(VENV)/.test
	rm -rf build/docs-src && mkdir -p build/docs-src/hybridkv
	for d in $(FOLDERS); do ln -s ../../../$$d build/docs-src/hybridkv/$$d; done
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

test: lint typecheck docs
	$(VENV)/bin/pytest -q

# Every committed PNG under docs/img, redrawn from benchmarks/results/*.json (each file's
# "command" field is the command that measured it; benchmarks/common/plot.py lists them).
.PHONY: figures
figures: $(VENV)/.test
	$(PY) -m benchmarks.common.plot

# One command that says whether the GPU path works and how fast it is
# (benchmarks/gpu/check.py): its JSON and summary go to OUT; DRY_RUN=1 runs the same code on
# the CPU at toy sizes (the suite runs it so). PY=python3 runs it on that interpreter as it
# is, without the venv: a GPU machine's own CUDA build of torch.
OUT ?= build/gpu-check
gpu-check: $(if $(filter command line,$(origin PY)),,$(VENV)/.test)
	$(PY) -m benchmarks.gpu.check --out $(OUT) $(if $(DRY_RUN),--dry-run)
