# SkyMesh: `make demo` and `make test` work on a fresh machine (they create .venv).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-test
export PIP_DISABLE_PIP_VERSION_CHECK := 1
# pipefail: a failed pip install must fail the target even though its output is filtered.
SHELL := /bin/bash
.SHELLFLAGS := -eo pipefail -c

.PHONY: install wheels demo test lint typecheck bench system-deps clean protos lock

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

LOCK   := requirements/lock.txt
# The four distributions (docs/development.md), editable, with every extra the tests use:
# the data plane (.), the control plane (controller/), the emulated replica (replica/)
# and the lab (lab/). Each resolves the others from these folders, never from an index.
DISTS  := -e '.[test,predict,tracing]' -e './controller[planning,forecast]' \
          -e './replica[tokenizer]' -e ./lab
PYPROJECTS := pyproject.toml controller/pyproject.toml replica/pyproject.toml lab/pyproject.toml

# Every install resolves from the checked-in lock, so a fresh machine gets what CI got.
$(STAMP): $(PYPROJECTS) $(LOCK) | $(BIN)/python
	$(BIN)/pip install -q -c $(LOCK) $(DISTS) 2>&1 | { grep -v "is ignored" || true; }
	$(BIN)/python -m skymesh.mesh.codegen
	$(BIN)/python -c "import skymesh, aiohttp, pytest" 
	touch $@

install: $(STAMP)

# The four distributions as wheels in dist/ (docs/development.md#the-four-distributions):
# skymesh (with its generated peering stubs), skymesh-controller, skymesh-replica and
# skymesh-lab, built offline from the installed build tools.
wheels: install
	rm -rf dist && $(BIN)/pip wheel -q --no-deps --no-build-isolation -w dist \
	  . ./controller ./replica ./lab
	@ls dist

# Peering stubs (protos/ -> skymesh/mesh/gen/, gitignored). Importing skymesh.mesh's
# peering API also regenerates them when they are missing or stale.
protos: $(STAMP)
	$(BIN)/python -m skymesh.mesh.codegen --force

# System pieces the tests need: redis-server (controller state store tests), Chromium
# (the dashboard's browser test) and promtool (the alert-rule tests; Debian ships it in
# the prometheus package, whose server the tests do not use), from Debian.
SYSTEM_PKGS := redis-server:redis-server chromium:chromium promtool:prometheus
system-deps:
	@missing=""; for pair in $(SYSTEM_PKGS); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing from Debian:$$missing"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	  || echo "warning: could not install$$missing; the tests that need them will fail"; fi

demo: install
	$(BIN)/python -m skymesh_lab.demos.demo

# checkov, for the Kubernetes manifest test, lives in its own venv outside the repository
# (about 100 packages the project does not otherwise need), from its own lock.
CHECKOV_VENV := $(HOME)/.cache/skymesh/checkov-venv
CHECKOV      := $(CHECKOV_VENV)/bin/checkov
$(CHECKOV): requirements/checkov.lock
	rm -rf $(CHECKOV_VENV) && $(PYTHON) -m venv $(CHECKOV_VENV)
	$(CHECKOV_VENV)/bin/pip install -q -r requirements/checkov.lock 2>&1 | { grep -v "is ignored" || true; }
	touch $@

# Two pytest-xdist workers, whole files each: ~11 instead of ~20 minutes of tests on the
# two-core CI machine. TEST_WORKERS=0 runs the suite in one process.
TEST_WORKERS ?= 2
# Type-checked in `make test` and `make lint`: the product's three packages and the lab.
TYPED := skymesh controller/skymesh_controller replica/skymesh_replica lab/skymesh_lab
test: install system-deps $(CHECKOV)
	$(BIN)/ruff check .
	$(BIN)/mypy $(TYPED)
	CHECKOV=$(CHECKOV) $(BIN)/pytest -q -p no:cacheprovider -n $(TEST_WORKERS) --dist loadfile \
	  --durations=30

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy $(TYPED)

typecheck: lint

# The router-overhead benchmark (docs/results/router-overhead.md) needs wrk and gcc; it
# installs sglang-router and vllm-router into venvs under /tmp and skips those that fail.
# Optional: a missing tool or router does not fail `make bench`.
BENCH_SYSTEM_PKGS := wrk:wrk gcc:gcc
bench: install
	$(BIN)/python -m skymesh_lab.bench
	-$(MAKE) -s system-deps SYSTEM_PKGS="$(BENCH_SYSTEM_PKGS)"
	-$(BIN)/skymesh bench router-overhead --json out/bench/router-overhead.json

# Refresh the lock: resolve pyproject.toml's ranges afresh in a scratch venv and freeze.
# torch stays at the contract's exact pin (2.13.0, the CPU build on this machine's disk).
lock:
	rm -rf .lock-venv && $(PYTHON) -m venv .lock-venv
	.lock-venv/bin/pip install -q $(DISTS) 2>&1 | { grep -v "is ignored" || true; }
	{ head -3 $(LOCK); .lock-venv/bin/pip freeze --all --exclude-editable \
	  | grep -iv "^skymesh\|^pip==" | sed 's/^torch==2.13.0+cpu$$/torch==2.13.0/'; } > $(LOCK).new
	mv $(LOCK).new $(LOCK) && rm -rf .lock-venv

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache out

# Fault-injection scenarios, short form (about a minute; docs/notes/hardening.md).
faults: install system-deps
	$(BIN)/skymesh faults run --short --json out/faults.json

# The three-region mesh under steady load; SKYMESH_SOAK_MINUTES (default 30). Not in CI.
soak: install
	$(BIN)/python -m skymesh_lab.faults.soak --json out/soak.json

.PHONY: faults soak

# The real-engine lane (docs/engines.md): builds once, cached outside the repository
# (SKYMESH_E2E_CACHE, default ~/.cache/skymesh-e2e), a venv with vLLM's CPU build
# (tools/e2e/requirements-vllm.lock) and a tiny model made offline, then runs tests/e2e
# against two real vLLM servers behind skymesh-lb. Not in `make test` (see the doc).
# It also builds the container image with buildah and runs it (tests/e2e/test_image.py).
E2E_SYSTEM_PKGS := buildah:buildah debootstrap:debootstrap
e2e: install
	$(MAKE) -s system-deps SYSTEM_PKGS="$(E2E_SYSTEM_PKGS)"
	$(PYTHON) tools/e2e/build_env.py
	SKYMESH_E2E_ENV="$$($(PYTHON) tools/e2e/build_env.py --where)" SKYMESH_IMAGE_TEST=1 \
	  $(BIN)/pytest -q -p no:cacheprovider -rxXs tests/e2e

.PHONY: e2e

# The container images (docs/image.md): docker when a daemon answers, else buildah (vfs,
# chroot, host network) on a local Debian base made first if missing. ROLE=balancer
# (default), controller or replica; IMAGE=TAG to name it.
image:
	ROLE=$(ROLE) tools/image/build.sh $(IMAGE)

.PHONY: image
