# Two commands on a fresh machine (Python 3.11+):
#   make run    set up and start the app on the embedded default at http://127.0.0.1:7860
#   make test   set up (Chromium included) and run the whole test suite
#
# TORCH_SPEC picks the PyTorch build. The default pin gives the CUDA build on Linux x86_64 from PyPI
# (and the CPU wheel where a local wheelhouse provides it); ROCm / XPU users point it at their index,
# e.g. make run TORCH_SPEC="torch==2.13.0 --index-url https://download.pytorch.org/whl/rocm6.4"
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
BIN := $(VENV)/bin
SUDO := $(shell [ "$$(id -u)" = 0 ] || echo sudo)

.PHONY: setup run test browser front lint bench clean

setup: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip
	$(BIN)/python -m pip install -q $(TORCH_SPEC)
	$(BIN)/python -m pip install -q -e ".[dev]"
	touch $@

run: setup
	$(BIN)/python app.py $(ARGS)

# Debian's Chromium drives the browser tests through the PyPI playwright package (never `playwright install`).
browser:
	@[ -x /usr/bin/chromium ] || ($(SUDO) apt-get update -q && $(SUDO) apt-get install -y -q chromium)

# Debian's nginx for the reference front's test (scripts/nginx/showcase.conf, tests/test_nginx_front.py).
front:
	@[ -x /usr/sbin/nginx ] || ($(SUDO) apt-get update -q && ($(SUDO) apt-get install -y -q nginx-light || \
		$(SUDO) apt-get install -y -q nginx))

# Two pytest-xdist workers, each module whole on one (its module fixtures built once); the modules that start
# torchrun ranks or a Ray cluster share one group. TEST_WORKERS=0: one process.
TEST_WORKERS ?= 2
test: setup browser front
	HF_HUB_OFFLINE=1 GRADIO_ANALYTICS_ENABLED=False $(BIN)/python -m pytest -n $(TEST_WORKERS) --dist loadscope \
		--no-loadscope-reorder --durations=15 $(PYTEST_ARGS)

lint: setup
	$(BIN)/ruff check engine bench training ui tests app.py

bench: setup
	$(BIN)/python -m bench bench --preset tiny-flux --device cpu --modes eager,compile,regional \
		--precisions fp32,bf16 --sizes 64x64,128x128 --steps 4 --runs 10 --out artifacts/bench

clean:
	rm -rf $(VENV) artifacts .pytest_cache
