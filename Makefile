PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# xdist on the CI machine's 2 cores (see README: measured against a serial run); a worker that
# crashes fails the run at once instead of leaving its group unscheduled (which hung).
PYTEST_ARGS ?= -n auto --dist loadgroup --max-worker-restart=0

.PHONY: test test-vllm validate lint venv clean

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

# vLLM 0.33 on CPU (docs/conformance.md): CPU torch from constraints-cpu.txt, vLLM without its
# dependency pins (it pins torch 2.14, whose CPU build is not published), and the modules it
# imports at run time. Re-check the list when the vLLM pin moves.
VLLM_VENV := .venv-vllm
VLLM_PY := $(VLLM_VENV)/bin/python
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_NODEPS := vllm==0.33.0 xgrammar==0.2.8 nixl-cu13==1.5.1
VLLM_RUNTIME := packaging psutil pyzmq regex numpy "transformers>=5.16.1,<5.21" cbor2 aiohttp \
	requests oss-harmony openai "pillow>=13" pybase64 cachetools msgspec cloudpickle uvloop \
	py-cpuinfo prometheus_client "fastapi>=0.133,<0.137" partial-json-parser \
	"llguidance>=1.7,<1.8" einops "pydantic>=2.12" apache-tvm-ffi==0.1.11 rich

$(VLLM_PY):
	$(PYTHON) -m venv $(VLLM_VENV)

$(VLLM_STAMP): $(VLLM_PY) pyproject.toml constraints-cpu.txt
	$(VLLM_PY) -m pip install -q --upgrade pip
	$(VLLM_PY) -m pip install -q -c constraints-cpu.txt torch
	$(VLLM_PY) -m pip install -q --no-deps $(VLLM_NODEPS)
	$(VLLM_PY) -m pip install -q -c constraints-cpu.txt $(VLLM_RUNTIME) \
		"pytest>=8" "pytest-xdist>=3" "pytest-timeout>=2.3" "hypothesis>=6.100"
	$(VLLM_PY) -m pip install -q --no-deps -e .
	touch $(VLLM_STAMP)

test-vllm: $(VLLM_STAMP)
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(VLLM_PY) -m pytest -m vllm -p no:cacheprovider

clean:
	rm -rf $(VENV) $(VLLM_VENV) build *.egg-info
