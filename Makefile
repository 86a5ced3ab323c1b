PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# xdist on the CI machine's 2 cores (see README: measured against a serial run); a worker that
# crashes fails the run at once instead of leaving its group unscheduled (which hung).
PYTEST_ARGS ?= -n auto --dist loadgroup --max-worker-restart=0

.PHONY: test validate lint venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints-cpu.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[dev,nixl]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check kvconnect connectors harness tests scripts benchmarks
	$(PY) -m pytest $(PYTEST_ARGS)

validate: $(STAMP)
	$(VENV)/bin/kvconnect-validate --prefill 1 --decode 1

lint: $(STAMP)
	$(PY) -m ruff check kvconnect connectors harness tests scripts benchmarks

clean:
	rm -rf $(VENV) build *.egg-info
