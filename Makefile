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
	$(BIN)/pip install -q -e '.[test]' 2>&1 | grep -v "is ignored" || true
	$(BIN)/python -m skymesh.mesh.codegen
	$(BIN)/python -c "import skymesh, aiohttp, pytest" 
	touch $@

install: $(STAMP)

# Peering stubs (protos/ -> skymesh/mesh/gen/, gitignored). Importing skymesh.mesh's
# peering API also regenerates them when they are missing or stale.
protos: $(STAMP)
	$(BIN)/python -m skymesh.mesh.codegen --force

# System pieces the tests need: redis-server (controller state store tests).
system-deps:
	@command -v redis-server >/dev/null 2>&1 || { \
	  echo "installing redis-server from Debian"; \
	  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq redis-server >/dev/null) \
	  || echo "warning: could not install redis-server; Redis-backed tests will fail"; }

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
