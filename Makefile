# The two commands the README promises; each installs what it needs first.
#   make demo   generate text (built-in synthetic model unless MODEL=path; on a GPU when there is one)
#   make test   the test suite (CPU; `make test-cuda` on a machine with a GPU)
PY ?= python3
PROMPT ?= The quick brown fox
MODEL ?=

.PHONY: install demo test test-cuda

install:
	@$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install torch
	$(PY) -m pip install -q setuptools wheel ninja
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"

demo: install
	$(PY) -m qwen38_model generate $(if $(MODEL),--model $(MODEL)) --prompt "$(PROMPT)"

test: install
	$(PY) -m pytest -q -rs

test-cuda: install
	$(PY) -m pytest -q -rs -m cuda
