# SkyMesh: `make demo` and `make test` work on a fresh machine (they create .venv).
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed-test
export PIP_DISABLE_PIP_VERSION_CHECK := 1

.PHONY: install demo test lint typecheck bench system-deps clean protos

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test,forecast,predict]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -m skymesh.mesh.codegen
	$(BIN)/python -c "import skymesh, aiohttp, pytest" 
	touch $@

install: $(STAMP)

# Peering stubs (protos/ -> skymesh/mesh/gen/, gitignored). Importing skymesh.mesh's
# peering API also regenerates them when they are missing or stale.
protos: $(STAMP)
	$(BIN)/python -m skymesh.mesh.codegen --force

# System pieces the tests need: redis-server (controller state store tests) and Chromium
# (the dashboard's browser test), from Debian.
SYSTEM_PKGS := redis-server:redis-server chromium:chromium
system-deps:
	@missing=""; for pair in $(SYSTEM_PKGS); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing from Debian:$$missing"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq $$missing >/dev/null) \
	  || echo "warning: could not install$$missing; the tests that need them will fail"; fi

demo: install
	$(BIN)/python -m skymesh.demo

test: install system-deps
	$(BIN)/ruff check .
	$(BIN)/pytest -q -p no:cacheprovider

lint: install
	$(BIN)/ruff check .
	$(BIN)/mypy skymesh

typecheck: lint

bench: install
	$(BIN)/python -m skymesh.bench

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache .mypy_cache out

# Fault-injection scenarios, short form (about a minute; docs/notes/hardening.md).
faults: install system-deps
	$(BIN)/skymesh faults run --short --json out/faults.json

# The three-region mesh under steady load; SKYMESH_SOAK_MINUTES (default 30). Not in CI.
soak: install
	$(BIN)/python -m skymesh.faults.soak --json out/soak.json

.PHONY: faults soak
