# The two commands the README promises; each installs what it needs first.
#   make demo   generate text (built-in synthetic model unless MODEL=path; on a GPU when there is one)
#   make test   the test suite (CPU; `make test-cuda` on a machine with a GPU)
PY ?= python3
PROMPT ?= The quick brown fox
MODEL ?=
# Where torch comes from when none is installed and there is no NVIDIA GPU: the CPU wheels. A bare
# `pip install torch` on Linux pulls a CUDA build (~5 GB), useless without a GPU.
TORCH_CPU_INDEX ?= https://download.pytorch.org/whl/cpu

.PHONY: torch install install-package ready demo test test-cuda

# An installed torch is kept (the extension is built against it); otherwise the build is chosen by
# whether `nvidia-smi` lists a GPU.
torch:
	@if $(PY) -c "import torch" 2>/dev/null; then \
		$(PY) -c "import torch; print('torch', torch.__version__, 'is installed: keeping it,', \
			f'a CUDA {torch.version.cuda} build' if torch.version.cuda else 'a CPU build')"; \
		if nvidia-smi -L >/dev/null 2>&1 && $(PY) -c "import torch, sys; sys.exit(torch.version.cuda is not None)"; then \
			echo "an NVIDIA GPU is present: for the CUDA kernels install a CUDA build of torch (README: Building for a GPU)"; \
		fi; \
	elif nvidia-smi -L >/dev/null 2>&1; then \
		echo "no torch installed, an NVIDIA GPU is present: installing PyPI's torch (a CUDA build)"; \
		$(PY) -m pip install torch; \
	else \
		echo "no torch installed, no NVIDIA GPU: installing the CPU build of torch from $(TORCH_CPU_INDEX)"; \
		$(PY) -m pip install torch --index-url $(TORCH_CPU_INDEX); \
	fi

# setuptools, wheel and ninja are pyproject.toml's build requirements: without build isolation pip
# does not install them (and an isolated build would pull another torch).
install: torch install-package

install-package:
	$(PY) -m pip install -q "setuptools>=64" wheel ninja
	$(PY) -m pip install -q --no-build-isolation -e ".[test]"
	@$(PY) -c "import qwen38_ops; print('qwen38_ops:', qwen38_ops.BUILD_SUMMARY)"

# demo and test install only when something the install depends on changed (scripts/install_is_current.py).
ready: torch
	@$(PY) scripts/install_is_current.py || $(MAKE) --no-print-directory install-package

demo: ready
	$(PY) -m qwen38_model generate $(if $(MODEL),--model "$(MODEL)") --prompt "$(PROMPT)"

test: ready
	$(PY) -m pytest -q -rs

test-cuda: ready
	$(PY) -m pytest -q -rs -m cuda
