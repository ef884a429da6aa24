# herald: the two commands of a fresh machine are `make demo` and `make test`.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed

.PHONY: install demo test bench-ps clean

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[test]'
	touch $(STAMP)

install: $(STAMP)

# The main job: train DLRM on the embedded synthetic Criteo-shaped stream with 2 workers.
demo: $(STAMP)
	$(VENV)/bin/herald train

# Every test, including integration tests against real PS processes and a real Kafka broker.
test: $(STAMP)
	$(PY) -m pytest -q --timeout=900 tests

# PS pull/push throughput vs memcpy and bare ZeroMQ (one shard, ~45 s).
bench-ps: $(STAMP)
	$(VENV)/bin/herald bench ps

clean:
	rm -rf $(VENV) .pytest_cache
