# `make demo` runs the main job on the embedded default; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed

.PHONY: demo test bench venv clean

$(STAMP): pyproject.toml scripts/install_torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	bash scripts/install_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

venv: $(STAMP)

demo: $(STAMP)
	$(VENV)/bin/zocheck-ray demo

test: $(STAMP)
	$(PY) -m pytest -q tests

bench: $(STAMP)
	$(VENV)/bin/zocheck-ray bench replay --json benchmarks/results/replay.json

clean:
	rm -rf $(VENV) build *.egg-info
