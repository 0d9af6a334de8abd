# Two commands for a fresh machine: `make demo` and `make test`.
# Both create (or reuse) .venv and install rayflex with a CPU build of torch, pinned first
# so nothing pulls a multi-GB CUDA build on CPU-only machines.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_VERSION ?= 2.13.0
# torchao for tests/test_float8.py only, beside the venv: inside it, transformers imports it
# with every model (+1.4 CPU-s per process that builds an HF model, measured), which every
# HF test's Ray workers would pay.
TORCHAO_VERSION ?= 0.18.0
FLOAT8_TEST_DEPS ?= .cache/float8-test
export RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER := 0
# Every Ray worker process imports rayflex: without cached bytecode each one compiles its
# ~21k lines again (~0.3 CPU-s a process, hundreds of processes in `make test`). Some
# environments (CI images, sandboxes) set this variable; it is not wanted here.
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv emulators demo docs docs-shots test test-cpu test-slow-host test-slow test-fast bench chaos chaos-overlap compare gpu-kit clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q -e ".[test]" "torch==$(TORCH_VERSION)"
	$(PY) -m pip install -q --no-deps --target $(FLOAT8_TEST_DEPS) "torchao==$(TORCHAO_VERSION)"
	touch $@

venv: $(VENV)/.installed

# Azurite, the Azure Blob emulator the az:// tests run against (npm; git-ignored cache).
# tests/cloud_fixtures.py installs the same version itself when pytest runs without make.
AZURITE_VERSION ?= 3.35.0
AZURITE := .cache/azurite/node_modules/.bin/azurite-blob
$(AZURITE):
	npm install --prefix .cache/azurite --no-audit --no-fund --loglevel=error azurite@$(AZURITE_VERSION)

emulators: $(AZURITE)

# Train the example GPT with 4 FSDP2 workers on an embedded local Ray cluster.
demo: venv
	$(VENV)/bin/rayflex run examples/gpt_small.py --name gpt-demo-$$(date +%Y%m%d-%H%M%S)

# The documentation site (MkDocs + Material + mkdocstrings) into build/site, strictly: a broken
# link, a page missing from the navigation or a stale API name fails (tests/test_docs.py too).
# The docs tools come with the test extra (`pip install -e ".[docs]"` for them alone).
export NO_MKDOCS_2_WARNING := 1
docs: venv
	$(PY) -m mkdocs build --strict

# Screenshots of the built home page and one guide, as a reader's browser draws them
# (headless Chromium: Debian's `chromium` package), into build/site/_shots/ (not committed).
CHROMIUM ?= chromium
SHOTS := build/site/_shots
docs-shots: docs
	mkdir -p $(SHOTS)
	$(CHROMIUM) --headless --no-sandbox --disable-gpu --hide-scrollbars --log-level=3 --window-size=1280,1400 \
	  --screenshot=$(SHOTS)/home.png file://$(CURDIR)/build/site/index.html
	$(CHROMIUM) --headless --no-sandbox --disable-gpu --hide-scrollbars --log-level=3 --window-size=1280,1400 \
	  --screenshot=$(SHOTS)/guide-checkpoints.png file://$(CURDIR)/build/site/guides/checkpoints/index.html
	@ls -l $(SHOTS)

# The test suite (starts its own Ray clusters and S3 endpoint on loopback), on two workers
# run side by side (see tests/conftest.py): cluster tests mostly wait.
test: venv emulators
	$(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder --durations=15 -m "not slow" tests

# The same suite, with the CPU-seconds each test file cost (every process it started counted;
# tests/suite_cpu.py): where to cut when the suite is too slow for a slow host. Needs root.
SUITE_CPU ?= suite_cpu.json
test-cpu: venv emulators
	rm -f $(SUITE_CPU).gw*
	RAYFLEX_SUITE_CPU=$(SUITE_CPU) $(PY) -m pytest -q -n 2 --dist loadfile --no-loadscope-reorder -m "not slow" tests; \
	  status=$$?; $(PY) tests/suite_cpu.py $(SUITE_CPU); exit $$status

# The same suite as a ~3x slower host of this kind would run it: everything it starts shares
# SLOW_HOST_CPUS of one core (a cgroup CPU quota; needs root). It must pass there too: no
# test bound may depend on how fast this machine happens to be.
SLOW_HOST_CPUS ?= 0.6
test-slow-host: venv emulators
	bash .ci/slow_host.sh $(SLOW_HOST_CPUS) -- $(MAKE) --no-print-directory test

# Long or load-sensitive checks (real-worker memory measurements, long chaos seeds).
test-slow: venv emulators
	$(PY) -m pytest -q --durations=15 -m slow tests

# The inner loop (under a minute): no Ray cluster, no spawned worker processes.
test-fast: venv emulators
	$(PY) -m pytest -q -n 2 --dist loadfile --durations=5 -m "not cluster and not slow and not multiproc" tests

bench: venv
	$(PY) benchmarks/overhead.py --rounds 5 --out benchmarks/results/overhead.json

# Three long chaos runs (12 faults each, one a slow machine); the report is benchmarks/results/chaos.json.
chaos: venv
	$(PY) -m rayflex.testing.chaos --seed 1 2 3 --faults 12 --slow-node --out benchmarks/results/chaos.json

# Three chaos runs in overlap mode (16 faults each, every second one during a recovery);
# the report is benchmarks/results/chaos_overlap.json.
chaos-overlap: venv
	$(PY) -m rayflex.chaos --mode overlap --seed 1 2 3 --faults 16 --out benchmarks/results/chaos_overlap.json

# rayflex vs Ray Train vs torchrun on the same workload; the README's ratio table is then
# `python benchmarks/tables.py ratios`.
compare: venv
	$(PY) benchmarks/compare.py --rounds 5 --markdown --out benchmarks/results/compare.json

# The GPU kit's wheels (a trimmed Ray, torchtitan and its pure-Python needs, torchao) for a
# CPython 3.12 GPU machine without network, into .gpu_kit/wheels (git-ignored, < 64 MiB);
# there: `bash benchmarks/gpu_device.sh` (docs/gpu_kit.md). Also a trimmed Ray for this
# machine's Python in .gpu_kit/host, which tests/test_gpu_kit.py starts ray.init from.
gpu-kit: venv
	$(PY) benchmarks/gpu_kit_wheels.py --dest .gpu_kit/wheels --python-version 3.12
	$(PY) benchmarks/gpu_kit_wheels.py --dest .gpu_kit/host --only ray \
	  --python-version $$($(PY) -c 'import sys; print("%d.%d" % sys.version_info[:2])')

clean:
	rm -rf $(VENV) runs data .pytest_cache build/site
