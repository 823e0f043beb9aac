# The two quick-start commands: `make quickstart` trains, `make test` tests.
# Both create .venv when missing and install the pinned dependencies into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PYVER  := $(shell $(PYTHON) -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")')
LOCK   ?= requirements/dev-$(PYVER).lock
# torch is pinned exactly, apart from the hash-locked set: its wheel differs per
# vendor index (cpu / cu130 / rocm7.2) and a bare `torch` would pull a CUDA build.
TORCH_SPEC ?= torch==2.13.0
STAMP  := $(VENV)/.installed-$(PYVER)

.PHONY: quickstart test test-slow test-all bench venv clean

venv: $(STAMP)

$(STAMP): $(LOCK) Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes -r $(LOCK)
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps "$(TORCH_SPEC)"
	# this project itself, editable: `import train` works from any directory
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	touch $@

quickstart: venv
	$(PY) entrypoint.py train configs/quickstart.yaml

# `make test`: everything but the slow end-to-end tests (about 5 minutes on 2 idle
# cores); `make test-slow`: those (multi-process resumes, FSDP, compile, torchrun
# signals, simulated nodes); CI runs both.
test: venv
	$(PY) -m pytest -q -m "not slow"

test-slow: venv
	$(PY) -m pytest -q -m slow

test-all: venv
	$(PY) -m pytest -q

bench: venv
	$(PY) bench/ddp_overhead.py

clean:
	rm -rf $(VENV) runs

# Builds the CPU image (and the CUDA/ROCm Dockerfiles on a CPU base) with docker or
# podman and runs it: doctor, training, read-only root, any UID (scripts/image-test).
.PHONY: image-test
image-test: venv
	scripts/image-test
