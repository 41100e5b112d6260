# Two commands do everything on a fresh machine:
#   make compare   installs into .venv and runs the main job (memconv compare)
#   make test      installs into .venv and runs the test suite
# and `make docs` builds the documentation site into docs/_build/html.
#
# PYTHON picks the interpreter (Python >= 3.10). .venv is rebuilt whenever PYTHON
# resolves to another interpreter; each target installs only the extras it needs,
# always with constraints.txt (the CPU build of torch 2.13.0).
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
PIP := $(BIN)/python -m pip install -q -c constraints.txt
RUFF_PATHS := memconv tests examples docs/conf.py
SPHINXOPTS ?= -W --keep-going -q
MIN_PYTHON := 3.10

# the interpreter PYTHON resolves to, and its version ("" if there is none): the real
# file, so that `python3` in the activated venv (a link to the interpreter that made it)
# names the same interpreter, and make run in the venv does not rebuild the venv with
# its own link
PYTHON_ID := $(shell $(PYTHON) -c 'import os, sys; print(os.path.realpath(sys.executable), sys.version.split()[0])' 2>/dev/null)

.PHONY: install compare test memcnn-wheel backpack-sdist test-slow lint format docs docs-clean clean benchmarks benchmarks-report \
	benchmarks-steps benchmarks-ops benchmarks-private benchmarks-models benchmarks-reversible \
	benchmarks-second-order benchmarks-streaming benchmarks-gpu calibrate-gpu calibrate FORCE

# Rebuilt (with the whole venv) only when the interpreter changed; FORCE makes make
# look at it every time, but its timestamp moves only on a rebuild.
$(VENV)/.python: FORCE
	@if [ -z "$(PYTHON_ID)" ]; then \
		echo "error: '$(PYTHON)' does not run. Install Python >= $(MIN_PYTHON) or pass PYTHON=/path/to/python3." >&2; \
		exit 1; \
	fi
	@$(PYTHON) -c 'import sys; sys.exit(sys.version_info < (3, 10))' || { \
		echo "error: memconv needs Python >= $(MIN_PYTHON); '$(PYTHON)' is $(lastword $(PYTHON_ID))." >&2; \
		echo "       Run e.g. 'make $(MAKECMDGOALS) PYTHON=python3.11'." >&2; \
		exit 1; }
	@if [ "$$(cat $@ 2>/dev/null)" != "$(PYTHON_ID)" ]; then \
		echo "creating $(VENV) with $(PYTHON_ID)"; \
		rm -rf $(VENV) && $(PYTHON) -m venv $(VENV) && \
		$(BIN)/python -m pip install -q --upgrade pip && \
		echo "$(PYTHON_ID)" > $@; \
	fi

# One stamp per set of extras: `make compare` installs only what `memconv compare` needs.
$(VENV)/.installed-%: $(VENV)/.python pyproject.toml constraints.txt
	$(PIP) -e ".[$(subst +,$(comma),$*)]"
	$(if $(findstring backpack,$*),$(PIP) --no-deps "backpack-for-pytorch>=1.6")
	@touch $@

comma := ,
EXTRAS_COMPARE := bench
EXTRAS_TEST := test+bench+backpack+opacus
EXTRAS_DOCS := docs+bench+backpack+opacus
EXTRAS_LINT := dev
EXTRAS_ALL := test+bench+backpack+opacus+docs+dev

install: $(VENV)/.installed-$(EXTRAS_ALL)

compare: $(VENV)/.installed-$(EXTRAS_COMPARE)
	$(BIN)/memconv compare

test: $(VENV)/.installed-$(EXTRAS_TEST) $(VENV)/.installed-laplace memcnn-wheel
	$(BIN)/python -m pytest -q

# MemCNN 1.5.2's wheel, whose own tests tests/test_memcnn_suite.py runs through
# memconv.reversible (fetched once, no dependencies; where the registry cannot be
# reached, that test skips and says why).
MEMCNN_WHEELS := .cache/memcnn
memcnn-wheel: $(VENV)/.python
	@ls $(MEMCNN_WHEELS)/memcnn-1.5.2-*.whl >/dev/null 2>&1 || \
		$(BIN)/python -m pip download -q --no-deps --retries 1 --timeout 15 memcnn==1.5.2 -d $(MEMCNN_WHEELS) || \
		echo "memcnn 1.5.2 could not be fetched: tests/test_memcnn_suite.py will skip"

# BackPACK 1.7.1's source distribution, whose second-order tests (not in its wheel)
# tests/test_backpack_suite.py runs routed through memconv (slow; skips where it
# cannot be fetched).
BACKPACK_SDIST := .cache/backpack
backpack-sdist: $(VENV)/.python
	@ls $(BACKPACK_SDIST)/backpack_for_pytorch-1.7.1.tar.gz >/dev/null 2>&1 || \
		$(BIN)/python -m pip download -q --no-deps --no-binary :all: --retries 1 --timeout 15 \
			backpack-for-pytorch==1.7.1 -d $(BACKPACK_SDIST) || \
		echo "backpack-for-pytorch 1.7.1's sdist could not be fetched: tests/test_backpack_suite.py will skip"

# laplace-torch 0.3 and what its BackPACK backends import, each with --no-deps: its
# declared dependencies include torchvision, whose registry wheel does not import beside
# the CPU torch, and an ASDL fork that is not on the package index (tests/test_backpack_laplace.py).
LAPLACE_PINS := laplace-torch==0.3 torchmetrics==1.9.0 lightning-utilities==0.15.3 \
	curvlinops-for-pytorch==3.0.1 einconv==0.1.0 linear-operator==0.6.1 jaxtyping==0.3.11 \
	wadler-lindig==0.1.8
$(VENV)/.installed-laplace: $(VENV)/.installed-$(EXTRAS_TEST)
	$(BIN)/python -m pip install -q --no-deps $(LAPLACE_PINS)
	@touch $@

# The measurements behind docs/benchmarks.md (about an hour on 2 CPU cores), each
# command writing JSON Lines under docs/bench/, then the page refilled from them.
# `memconv bench` without --cases/--engines runs the full matrix (several hours here).
BENCH := $(BIN)/memconv bench
BENCH_DIR := docs/bench
BENCH_FILES := clip.jsonl clip-more.jsonl grads.jsonl grads-more.jsonl largest-grads.jsonl \
	largest-clip.jsonl largest-container-grads.jsonl largest-container-clip.jsonl \
	sweep-batch.jsonl sweep-side.jsonl private.jsonl clip-layer.jsonl models.jsonl models-grads.jsonl \
	streaming.jsonl streaming-4096.jsonl streaming-8192.jsonl streaming-16384.jsonl \
	streaming-tiles-2048.jsonl streaming-tiles-4096.jsonl
GRADS_ENGINES := autograd,torch.func,expanded-weights,opacus-hooks,backpack-save-memory,memconv:standard,memconv:rochette,memconv:unfold,memconv:shift,memconv:auto,memconv:budget,memconv:default,memconv-modules:auto,memconv-backpack:auto
benchmarks: $(VENV)/.installed-bench+backpack+opacus
	$(BENCH) --task clip --cases resnet18-gn,seed-112 --json $(BENCH_DIR)/clip.jsonl --plot $(BENCH_DIR)/clip.png
	$(BENCH) --task grads --cases seed-112,seed-28 --engines $(GRADS_ENGINES) --json $(BENCH_DIR)/grads.jsonl --plot $(BENCH_DIR)/grads.png
	$(BENCH) --task grads --largest-batch --engines autograd,torch.func,opacus-hooks,memconv:auto,memconv:budget --json $(BENCH_DIR)/largest-grads.jsonl
	$(BENCH) --task clip --largest-batch --cases resnet18-gn --engines non-private,opacus-ghost,memconv:auto,memconv:budget --json $(BENCH_DIR)/largest-clip.jsonl
	$(BENCH) --task grads --largest-batch --container --limit-gib 2 --cases seed-112 --engines autograd,torch.func,opacus-hooks,memconv:default --json $(BENCH_DIR)/largest-container-grads.jsonl
	$(BENCH) --task clip --largest-batch --container --limit-gib 2 --max-batch 2048 --cases resnet18-gn --engines non-private,opacus-ghost,memconv:default --json $(BENCH_DIR)/largest-container-clip.jsonl
	@# On the GroupNorm ResNets every engine, Opacus' too, differs from torch.func by a few 1e-3
	@# in float32 (torch.func's own round-off; float64 agrees to 1e-10, tests/test_bench.py):
	@# the command flags it and exits 1, and the measurements that follow still run.
	-$(BENCH) --task clip --cases wrn16-4-gn,conv1d,conv3d --json $(BENCH_DIR)/clip-more.jsonl
	-$(BENCH) --task grads --cases resnet18-gn,conv1d,conv3d --json $(BENCH_DIR)/grads-more.jsonl
	$(BENCH) --task clip-layer --cases resnet18-gn,wrn16-4-gn,vit-tiny --batch-size 64 --json $(BENCH_DIR)/clip-layer.jsonl
	$(BENCH) --sweep batch --range 8,32,128,512 --json $(BENCH_DIR)/sweep-batch.jsonl --plot $(BENCH_DIR)/sweep-batch.png
	$(BENCH) --sweep side --range 28,56,112,224 --json $(BENCH_DIR)/sweep-side.jsonl --plot $(BENCH_DIR)/sweep-side.png
	$(MAKE) benchmarks-private
	$(MAKE) benchmarks-models
	$(MAKE) benchmarks-reversible
	$(MAKE) benchmarks-report
	$(MAKE) benchmarks-steps
	$(MAKE) benchmarks-ops

# "Small models, many steps" (docs/benchmarks.md): every engine set up once, one step
# each in turn, median of 30 rounds; about ten minutes on 2 CPU cores (the tanh CNN at
# N=256 peaks at about 3 GiB with its seven engines in one process).
benchmarks-steps: $(VENV)/.installed-bench+opacus
	$(BIN)/python -m memconv.bench.steps --repeats 30 --json $(BENCH_DIR)/steps.json --markdown docs/benchmarks.md

# "Operations per call" (docs/benchmarks.md): top-level ATen operations and host syncs of
# one call, by batch size, of the non-private step, memconv's PrivateStep and Opacus'
# ghost clipping (and per-sample gradients against autograd); a few minutes on 2 CPU
# cores. Counts, not times: the same on every machine for the same routes; the routes
# are priced once by this CPU's calibration and once by the shipped CUDA one (a GPU's).
benchmarks-ops: $(VENV)/.installed-bench+opacus
	$(BIN)/python -m memconv.bench.ops --batches 4,64 --json $(BENCH_DIR)/ops.jsonl
	$(BIN)/python -m memconv.bench.ops --batches 4,64 --pricing cuda --json $(BENCH_DIR)/ops-cuda.jsonl
	$(BIN)/python -m memconv.bench.ops --report $(BENCH_DIR)/ops.jsonl $(BENCH_DIR)/ops-cuda.jsonl \
		--markdown docs/benchmarks.md

# The CPU cost models refitted on this machine (memconv/calibration/cpu.json; its
# measurements in docs/bench/calibration-cpu.jsonl): about an hour on 2 CPU cores.
calibrate: $(VENV)/.installed-bench+backpack+opacus
	$(BIN)/memconv calibrate --device cpu --repeats 3 --out memconv/calibration/cpu.json --json $(BENCH_DIR)/calibration-cpu.jsonl

# "Curvature" (docs/curvature.md and its table in docs/benchmarks.md): BackPACK's
# second-order extensions with and without memconv, and curvlinops' KFAC, on All-CNN-C,
# a CIFAR ResNet-18 in eval and a ConvNeXt-style net, one step per fresh process; about
# 20 minutes on 2 CPU cores (--quick: one configuration, half a minute). curvlinops is
# installed without its dependencies' dependencies (no torchvision).
CURVLINOPS := curvlinops-for-pytorch==3.0.1 einconv==0.1.0 linear_operator==0.6.1 \
	opt_einsum==3.4.0 jaxtyping==0.3.11 wadler_lindig==0.1.8 scipy einops
benchmarks-second-order: $(VENV)/.installed-bench+backpack
	$(PIP) --no-deps $(CURVLINOPS)
	$(BIN)/python -m memconv.bench.second_order --repeats 3 --json $(BENCH_DIR)/second-order.jsonl \
		--markdown docs/curvature.md --plot $(BENCH_DIR)/second-order.png
	$(BIN)/python -m memconv.bench.second_order --from-json $(BENCH_DIR)/second-order.jsonl \
		--markdown docs/benchmarks.md

# "Reversible networks" (docs/benchmarks.md) and the reconstruction error (docs/reversible.md):
# one training step of a RevNet-style CNN at depths 4 to 64 -- conventional,
# torch.utils.checkpoint per block, MemCNN 1.5.2, memconv.reversible, DP clipping steps --
# memory in a fresh process per step, times taking turns in one process per depth (one torch
# thread); about an hour on 2 CPU cores. MemCNN gets a virtual environment of its own
# (its core needs torch and numpy; memory_profiler and psutil measure it), with the
# CPU build of torch that constraints.txt pins.
MEMCNN_VENV ?= .venv-memcnn
$(MEMCNN_VENV)/.installed: constraints.txt
	rm -rf $(MEMCNN_VENV) && $(PYTHON) -m venv $(MEMCNN_VENV)
	$(MEMCNN_VENV)/bin/python -m pip install -q -c constraints.txt torch numpy memory_profiler psutil
	$(MEMCNN_VENV)/bin/python -m pip install -q --no-deps memcnn==1.5.2
	@touch $@

benchmarks-reversible: $(VENV)/.installed-bench $(MEMCNN_VENV)/.installed
	$(BIN)/python -m memconv.bench.reversible steps --depths 4,8,16,32,64 --memcnn-python $(MEMCNN_VENV)/bin/python --json $(BENCH_DIR)/reversible.jsonl --markdown docs/benchmarks.md
	$(BIN)/python -m memconv.bench.reversible errors --depths 4,8,16,32,64 --json $(BENCH_DIR)/reversible-errors.jsonl --markdown docs/reversible.md

# The private-training path (memconv.integrations.opacus.make_private's model) against
# Opacus' hooks and ghost modes, clip_and_accumulate and non-private training.
PRIVATE_ENGINES := non-private,opacus-hooks,opacus-ghost,memconv:default,memconv:step,memconv-private,memconv:clipping
benchmarks-private: $(VENV)/.installed-bench+backpack+opacus
	-$(BENCH) --task clip --cases resnet18-gn,vit-tiny,vit-tiny-dropout,opacus-mnist --engines $(PRIVATE_ENGINES) --repeats 5 --json $(BENCH_DIR)/private.jsonl

# "DP on the models people train": torchvision's ResNet-18-GN, timm's NF-ResNet-26 and
# ConvNeXt-atto (3x64x64) and ViT-tiny (3x32x32, patch 4), batch 64, each step in a fresh
# process: one DP clipping step of each engine against the non-private step, then
# per-sample gradients against torch.func's (--table models keeps them in their own table).
MODEL_CASES := resnet18-tv-gn,nf-resnet26,convnext-atto,vit-tiny
benchmarks-models: $(VENV)/.installed-bench+opacus
	-$(BENCH) --task clip --table models --cases $(MODEL_CASES) --engines non-private,memconv:default,memconv:step,opacus-ghost,torch.func --json $(BENCH_DIR)/models.jsonl
	-$(BENCH) --task grads --table models --cases $(MODEL_CASES) --engines torch.func,memconv:default,memconv:step --json $(BENCH_DIR)/models-grads.jsonl

# "Streaming the models people stream": ResNet-18, ResNet-50 and ConvNeXt-tiny trunks as
# torchvision writes them (memconv.bench.trunks) with a global-pool + Linear head, one
# float32 training step on a mosaic of scikit-image's astronaut, each in a fresh process:
# conventional (autograd), memconv streaming (the tile chosen for the case's memory budget)
# and Lightstream 1.0.7 in a virtual environment of its own (lightstream and lightning,
# without torchvision, whose import fails here). A conventional step that would not fit
# (ResNet-50 and ConvNeXt-tiny from 4096 on, every trunk from 8192 on) is not run: the page
# scales it from 2048 by the area. --abort-gib stops a measurement past 12 GiB. Several
# hours on 2 CPU cores (the 8192 and 16384 steps take tens of minutes each); each command
# writes a file of its own (--json overwrites) and the page is refilled at the end.
LIGHTSTREAM_VENV ?= .venv-lightstream
STREAM_BENCH := $(BENCH) --task grads --table streaming --once --abort-gib 12
$(LIGHTSTREAM_VENV)/.installed: constraints.txt
	rm -rf $(LIGHTSTREAM_VENV) && $(PYTHON) -m venv $(LIGHTSTREAM_VENV)
	$(LIGHTSTREAM_VENV)/bin/python -m pip install -q -c constraints.txt torch numpy memory_profiler psutil tqdm scikit-image
	$(LIGHTSTREAM_VENV)/bin/python -m pip install -q -c constraints.txt lightstream==1.0.7 lightning
	@touch $@

# the tile-size sweep (512, 768, 1024 input pixels; "auto" is the rows above) of each trunk
comma := ,
STREAM_SWEEP = $(subst $(eval) ,$(comma),$(foreach t,resnet18 resnet50 convnext-tiny,$(foreach s,512 768 1024,stream-$(t)-$(1)-t$(s))))
STREAM_SWEEP_2048 := $(call STREAM_SWEEP,2048)
STREAM_SWEEP_4096 := $(call STREAM_SWEEP,4096)
benchmarks-streaming: $(VENV)/.installed-bench $(LIGHTSTREAM_VENV)/.installed
	-$(STREAM_BENCH) --cases stream-resnet18-2048,stream-resnet50-2048,stream-convnext-tiny-2048,stream-resnet18-4096 --engines autograd,memconv-streaming,lightstream --lightstream-python $(LIGHTSTREAM_VENV)/bin/python --json $(BENCH_DIR)/streaming.jsonl
	-$(STREAM_BENCH) --cases stream-resnet50-4096,stream-convnext-tiny-4096 --engines memconv-streaming,lightstream --lightstream-python $(LIGHTSTREAM_VENV)/bin/python --json $(BENCH_DIR)/streaming-4096.jsonl
	-$(STREAM_BENCH) --cases stream-resnet50-8192,stream-resnet18-8192,stream-convnext-tiny-8192 --engines memconv-streaming --json $(BENCH_DIR)/streaming-8192.jsonl
	-$(STREAM_BENCH) --cases stream-resnet18-16384 --engines memconv-streaming --json $(BENCH_DIR)/streaming-16384.jsonl
	-$(STREAM_BENCH) --cases $(STREAM_SWEEP_2048) --engines memconv-streaming --json $(BENCH_DIR)/streaming-tiles-2048.jsonl
	-$(STREAM_BENCH) --cases $(STREAM_SWEEP_4096) --engines memconv-streaming --json $(BENCH_DIR)/streaming-tiles-4096.jsonl
	-$(BIN)/python -m memconv.bench.ops --streaming --json $(BENCH_DIR)/ops-streaming.jsonl --markdown docs/benchmarks.md
	$(MAKE) benchmarks-report

# Refill docs/benchmarks.md from the JSON Lines files there are (seconds; no measurement).
benchmarks-report: $(VENV)/.installed-bench
	$(BENCH) --report $(wildcard $(addprefix $(BENCH_DIR)/,$(BENCH_FILES))) --markdown docs/benchmarks.md

# The same on a machine with a CUDA GPU, one command: the cost models fitted on the GPU
# (memconv/calibration/cuda.json, read for CUDA tensors) and checked against its allocator,
# then every table a GPU changes (memconv suite: JSON Lines under docs/bench/cuda/, each
# record written as its measurement completes, the page docs/benchmarks-cuda.md refilled
# after each step), within GPU_TIME_BUDGET seconds (what will not fit is skipped, and the
# log says so; about 8 minutes on one H100 or H200, a fresh process costing ~10 s there).
# The check and the suite exit 1 on a memory model past 25 % or a flagged float32
# deviation; what follows still runs.
#
# PYTHON_ENV=system runs it where GPUs are: a machine whose $(PYTHON) already holds a
# CUDA build of torch and that reaches no package registry. No venv is built; memconv
# runs from this source tree (on PYTHONPATH) and its peers' pure-Python wheels are
# installed from WHEELS into DEPS with
#   $(PYTHON) -m pip install --no-index --no-deps --target $(DEPS) $(WHEELS)/*.whl
# (torch, numpy, scipy, opt_einsum, einops, psutil, scikit-image and tabulate must be
# there already). Fetch the wheels on a machine with a registry, then copy wheels/:
#   pip download --no-deps --only-binary=:all: --python-version 3.12 opacus backpack-for-pytorch unfoldNd memory_profiler -d wheels/
# e.g. make benchmarks-gpu PYTHON_ENV=system PYTHON=python3 WHEELS=wheels
PYTHON_ENV ?= venv
WHEELS ?= wheels
DEPS ?= .deps
GPU_TIME_BUDGET ?= 480
ifeq ($(PYTHON_ENV),system)
GPU_PYTHON := PYTHONPATH=$(CURDIR):$(CURDIR)/$(DEPS)$${PYTHONPATH:+:$$PYTHONPATH} $(PYTHON)
GPU_READY := $(DEPS)/.installed
else
GPU_PYTHON := $(BIN)/python
GPU_READY := $(VENV)/.installed-bench+backpack+opacus
endif
MEMCONV_GPU := $(GPU_PYTHON) -m memconv

$(DEPS)/.installed: $(wildcard $(WHEELS)/*.whl)
	@ls $(WHEELS)/*.whl >/dev/null 2>&1 || { \
		echo "error: no wheels in $(WHEELS)/; fetch them where a registry is (see the Makefile's benchmarks-gpu)" >&2; \
		exit 1; }
	$(PYTHON) -m pip install -q --no-index --no-deps --target $(DEPS) $(WHEELS)/*.whl
	@touch $@

benchmarks-gpu: calibrate-gpu
	-$(MEMCONV_GPU) suite --device cuda --time-budget $(GPU_TIME_BUDGET) --out $(BENCH_DIR)/cuda --markdown docs/benchmarks-cuda.md

calibrate-gpu: $(GPU_READY)
	$(MEMCONV_GPU) calibrate --device cuda --out memconv/calibration/cuda.json --json $(BENCH_DIR)/cuda/calibration.jsonl
	-$(MEMCONV_GPU) calibrate --device cuda --check --json $(BENCH_DIR)/cuda/calibration-check.jsonl

test-slow: $(VENV)/.installed-$(EXTRAS_TEST) $(VENV)/.installed-laplace memcnn-wheel backpack-sdist
	$(BIN)/python -m pytest -q -m slow

lint: $(VENV)/.installed-$(EXTRAS_LINT)
	$(BIN)/ruff check $(RUFF_PATHS)
	$(BIN)/ruff format --check $(RUFF_PATHS)

format: $(VENV)/.installed-$(EXTRAS_LINT)
	$(BIN)/ruff format $(RUFF_PATHS)
	$(BIN)/ruff check --fix $(RUFF_PATHS)

# The site, with the gallery's examples executed at small sizes (MEMCONV_FULL=1 for the
# full ones); warnings are errors. Open docs/_build/html/index.html.
docs: $(VENV)/.installed-$(EXTRAS_DOCS)
	$(BIN)/sphinx-build -b html $(SPHINXOPTS) docs docs/_build/html
	@echo "built docs/_build/html/index.html"

docs-clean:
	rm -rf docs/_build docs/auto_examples docs/api/generated docs/sg_execution_times.rst

clean: docs-clean
	rm -rf $(VENV) $(MEMCNN_VENV) $(DEPS) build dist *.egg-info .pytest_cache .ruff_cache .hypothesis results
	find memconv tests examples docs -name __pycache__ -type d -prune -exec rm -rf {} +
