# herald: the two commands of a fresh machine are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed
TORCHREC_STAMP := $(VENV)/.torchrec-installed
RAY_STAMP := $(VENV)/.ray-installed

.PHONY: install torchrec ray demo test bench-ps clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	@# numba compiles herald's kernels once per installation, here: a tiny job of the default
	@# kind writes them to the package's __pycache__ (cache=True), and every later process of
	@# every job loads them instead of compiling its own (docs/job.md, "Start-up")
	$(VENV)/bin/herald train --source 'synthetic://criteo?rows=8000&seed=0' --workers 2 --batch-size 64 \
		--steps 4 --quiet --run-dir $(VENV)/kernel-warmup
	rm -rf $(VENV)/kernel-warmup
	touch $(STAMP)

install: $(STAMP)

# Optional TorchRec interop (docs/torchrec.md). torchrec 1.8.0 declares an unpinned
# fbgemm-gpu dependency whose 1.9.0 wheel overwrites fbgemm-gpu-cpu 1.8.0 and then fails
# to load, so its dependencies are installed first and torchrec itself with --no-deps.
$(TORCHREC_STAMP): $(STAMP)
	$(PY) -m pip install -q fbgemm-gpu-cpu==1.8.0 tensordict torchmetrics pyre-extensions tqdm
	$(PY) -m pip install -q --no-deps torchrec==1.8.0
	touch $(TORCHREC_STAMP)

torchrec: $(TORCHREC_STAMP)

# Optional Ray launcher (`herald train --launcher ray`: docs/cluster.md), the extra `ray`.
$(RAY_STAMP): $(STAMP)
	$(PY) -m pip install -q -e '.[ray]'
	touch $(RAY_STAMP)

ray: $(RAY_STAMP)

# The main job: train DLRM on the embedded synthetic Criteo-shaped stream with 2 workers.
demo: $(STAMP)
	$(VENV)/bin/herald train

# The checks first (docs/design.md, "Checks"), each failing fast: formatting and lint (ruff),
# the import rules (import-linter contracts in pyproject.toml: docs/design.md, "Layers"), the
# type check of the contracts, the PS and the scheduler (mypy, [tool.mypy] in pyproject.toml);
# then every test, including integration tests against real PS processes and a real Kafka
# broker, the TorchRec interop and the Ray launcher on local Ray clusters (so `make test`
# installs torchrec and ray: `make torchrec`, `make ray`).
test: $(STAMP) $(TORCHREC_STAMP) $(RAY_STAMP)
	$(VENV)/bin/ruff format --check herald tests
	$(VENV)/bin/ruff check herald tests
	$(VENV)/bin/lint-imports
	$(VENV)/bin/mypy
	$(PY) -m pytest -q --timeout=300 --durations=15 tests

# PS pull/push throughput vs memcpy and bare ZeroMQ (one shard, ~45 s).
bench-ps: $(STAMP)
	$(VENV)/bin/herald bench ps

clean:
	rm -rf $(VENV) .pytest_cache
