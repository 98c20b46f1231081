# The course's commands. Each target creates .venv and installs the pinned dependencies on first
# use; later runs find the stamp file and skip the installs.
#
#   make serve      the site on http://127.0.0.1:8000, reloading on edits to docs/, snippets/, lessons_src/
#   make test       the whole suite: unit and multi-process tests, every code block, site build, browser
#   make test-portable  the checked outputs and numeric tests again under other CPU kernel families
#   make build      mkdocs build --strict into site/, executing every lesson (no cache)
#   make test-gpu   the CUDA/NCCL-marked tests, with the GPU machine's own python3 (GPU_PYTHON);
#                   fails when no GPU is present
#   make soak       Session C's two-node c10d demo 20 times: every agent must exit 0 (outside make test)
#   make bench      the benchmarks, written to bench.json
#   make bench-gpu  the GPU section of bench.json, with the GPU machine's own python3 (GPU_PYTHON)
#   make test-torchtitan  TorchTitan on the CPU in its own .venv-torchtitan (make torchtitan-env)
#
# On a Linux machine without a GPU, `make serve TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu`
# installs the CPU-only PyTorch wheel instead of PyPI's CUDA build.

PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
# The stamp is named after a digest of the dependency files' contents, not their mtimes: a fresh
# checkout (or a .venv restored from CI's cache) has new mtimes but needs no install when the
# contents match, and any change to the pins gives a new name, so the next target installs again.
DEPS_DIGEST := $(shell cat pyproject.toml constraints.txt | sha256sum | cut -c1-16)
STAMP  := $(VENV)/.installed-$(DEPS_DIGEST)
TORCH_INDEX_URL ?=
HOST   ?= 127.0.0.1:8000

.PHONY: serve build test test-portable test-gpu soak bench bench-gpu clean torchtitan-env test-torchtitan

export NO_MKDOCS_2_WARNING := 1

$(STAMP):
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	# torch first and pinned: an unpinned torch would pull several GB of CUDA wheels.
	$(PY) -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	# DS_BUILD_OPS=0: DeepSpeed installs without compiling its C++/CUDA ops (it would need nvcc).
	DS_BUILD_OPS=0 $(PY) -m pip install --quiet -c constraints.txt -e '.[site,test]'
	# On the CPU, DeepSpeed compiles one op (shared-memory collectives) when the first job starts,
	# about a minute on 2 cores; build it now, into build/torch_extensions, instead of in a test.
	$(PY) -m snippets.cluster.deepspeed.train_deepspeed --prebuild-ops
	rm -f $(VENV)/.installed*
	touch $(STAMP)

serve: $(STAMP)
	LESSON_CACHE=true LESSON_BACKGROUND=true $(VENV)/bin/mkdocs serve --dev-addr $(HOST)

build: $(STAMP)
	LESSON_CACHE=false $(VENV)/bin/mkdocs build --strict

# Four pytest workers on 2 cores: many tests wait on process start-up and rendezvous rather than
# compute, so extra workers keep both cores busy (measured on fresh clones of this machine: three
# workers 770 s for 1,044 tests, four 727 s for 1,220, five 774 s for 1,262, at the same CPU per
# test; and at one commit with 1,393 tests, two workers 715 s, three 702 s, four 709 s: the same
# within the 20-30 s that repeated runs differ by, since the suite is CPU-bound). Each worker, and every process it starts, uses one intra-op thread
# (OMP_NUM_THREADS=1): several processes with two spinning OpenMP threads each on 2 cores slow
# everything down. The pages' printed numbers do not depend on the thread count (the
# suite checks them with this setting). --dist loadfile keeps each file (a page's blocks build on
# each other) on one worker, in order; the built site is shared between them (tests/conftest.py).
# --no-loadscope-reorder keeps the suite's own order, longest files first (tests/schedule.py).
# TEST_WORKERS=0 runs everything in one process.
TEST_WORKERS ?= 4

# PYTHONDONTWRITEBYTECODE (set on some machines, this one included) would make every process
# compile the course's modules again, and each pytest worker rewrite the asserts of every test
# module again: 3 of the 6 CPU seconds that collecting the suite takes.
test: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE OMP_NUM_THREADS=1 $(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder

# The pages' checked outputs and the numeric tests again, under the CPU kernel families this machine
# can emulate (tests/portable.py): ATen, oneDNN and MKL capped together at `default` (no vector
# kernels) and at AVX2, and the native kernels on two threads. `make test` is the native family on
# one thread. A number that holds only on the kernels that wrote it fails here. One family:
# `make test-portable FAMILIES=default` (what CI runs after make test).
FAMILIES ?=
test-portable: $(STAMP)
	env -u PYTHONDONTWRITEBYTECODE TEST_WORKERS=$(TEST_WORKERS) $(PY) -m tests.portable $(FAMILIES)

# The GPU targets run with the interpreter the GPU machine has, and its CUDA build of PyTorch:
# never .venv (whose torch is the CPU pin) and never an install (GPU machines may have no
# network). `make test-gpu GPU_PYTHON=/opt/conda/bin/python` names another one.
# snippets/tools/gpu_env.py first prints the interpreter, torch, CUDA and the GPU (the record
# beside the results), and stops with one line if a test dependency is missing.
GPU_PYTHON ?= python3

test-gpu:
	PYTHONPATH=. $(GPU_PYTHON) -m snippets.tools.gpu_env
	env -u PYTHONDONTWRITEBYTECODE REQUIRE_GPU=1 PYTHONPATH=. $(GPU_PYTHON) -m pytest -m cuda -p no:cacheprovider

# Session C's two-node c10d demo 20 times over (SOAK_RUNS=N for more): every agent must exit 0.
# About 15 s of CPU a run, so not part of `make test`, which runs the demo once.
soak: $(STAMP)
	SOAK=1 OMP_NUM_THREADS=1 $(PY) -m pytest tests/test_teardown_soak.py

bench: $(STAMP)
	$(PY) -m snippets.bench --out bench.json

# Writes results["gpu"] into bench.json and keeps the CPU results (--merge). Flags for a smaller
# GPU: `make bench-gpu GPU_BENCH_FLAGS="--batch-size 8"` (python -m snippets.bench.gpu --help).
GPU_BENCH_FLAGS ?=
bench-gpu:
	@PYTHONPATH=. $(GPU_PYTHON) -m snippets.tools.gpu_env --bench
	@PYTHONPATH=. $(GPU_PYTHON) -m snippets.bench.gpu --merge --out bench.json $(GPU_BENCH_FLAGS)

# TorchTitan on the CPU (docs/course/week-2/torchtitan.md): the optional extra `torchtitan` in its
# own environment, never in .venv (about 1.5 GB, half of it torch). torch first, at the pin; then
# the extra's pins read from pyproject.toml, with constraints.txt so nothing replaces torch.
TT_VENV  := .venv-torchtitan
TT_PY    := $(TT_VENV)/bin/python
TT_STAMP := $(TT_VENV)/.installed-$(DEPS_DIGEST)

$(TT_STAMP):
	test -x $(TT_PY) || $(PYTHON) -m venv $(TT_VENV)
	$(TT_PY) -m pip install --quiet --upgrade pip
	$(TT_PY) -m pip install --quiet torch==2.13.0 $(if $(TORCH_INDEX_URL),--index-url $(TORCH_INDEX_URL))
	$(TT_PY) -m pip install --quiet -c constraints.txt $$($(TT_PY) -c "import tomllib; \
		print(' '.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['optional-dependencies']['torchtitan']))")
	rm -f $(TT_VENV)/.installed*
	touch $(TT_STAMP)

torchtitan-env: $(TT_STAMP)

# The pages' TorchTitan runs (blocks marked torchtitan in docs/), each a five-step training run
# under torchrun, in page order, and tests/torchtitan/ (the launcher's version check, the assets).
# Outside `make test`, which skips the blocks with their reason and does not collect
# tests/torchtitan/; here a missing extra or a failing run fails.
test-torchtitan: $(STAMP) $(TT_STAMP)
	REQUIRE_TORCHTITAN=1 OMP_NUM_THREADS=1 $(PY) -m pytest -m torchtitan -p no:cacheprovider tests/torchtitan docs

# Build output and caches only: runs/ and logs/ hold the learner's training runs.
clean:
	rm -rf site .cache .pytest_cache
