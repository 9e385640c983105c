# Two entry points for a fresh machine: `make run` (the main job) and `make test`.
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip install -q
TORCH := torch==2.13.0

$(VENV)/bin/python:
	python3 -m venv $(VENV)
	$(PIP) --upgrade pip

$(VENV)/.demo: pyproject.toml | $(VENV)/bin/python
	$(PIP) $(TORCH)
	$(PIP) -e '.[demo]'
	touch $@

# The test extra plus demo's converters: the slow test checks the built-in model.
$(VENV)/.test: pyproject.toml | $(VENV)/bin/python
	$(PIP) $(TORCH)
	$(PIP) -e '.[test,demo]'
	touch $@

.PHONY: run test lint typecheck
run: $(VENV)/.demo
	$(VENV)/bin/hybridkv demo

lint: $(VENV)/.test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .

# mypy cannot follow setuptools' package-dir mapping, so it checks a link tree that
# gives the folders their installed names (hybridkv.memory, hybridkv.policies).
typecheck: $(VENV)/.test
	rm -rf .typecheck && mkdir -p .typecheck/hybridkv
	for d in errors scheduler policies memory kernels models executor parallel serving; do ln -s ../../$$d .typecheck/hybridkv/$$d; done
	cd .typecheck && MYPYPATH=. ../$(VENV)/bin/mypy --strict -p hybridkv.errors -p hybridkv.memory -p hybridkv.policies

test: lint typecheck
	$(VENV)/bin/pytest -q
