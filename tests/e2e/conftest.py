"""The real-engine lane: two real vLLM servers (CPU build, tiny model) and skymesh-lb.

``make e2e`` builds the environment once (``tools/e2e/build_env.py``) and runs this folder
with ``SKYMESH_E2E_ENV`` naming it (``venv/`` with vLLM, ``model/``). Without that
variable every test here that needs the servers is skipped, so ``make test`` stays green
on a machine that never built the lane (``test_tools.py``, the tools' own tests, runs).

The servers are started once per session (30-50 s idle, minutes on a loaded machine),
each pinned to one core, and waited on through ``/health`` with a deadline. Their logs
are kept in ``out/e2e/`` and their tails are attached to any failing test's report.
Tests marked ``e2e_disruptive`` (they kill a server) run last.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
# The cluster code is shared with tools/e2e/burst_bench.py, which runs as a script.
sys.path.insert(0, str(REPO / "tools" / "e2e"))
from vllm_cluster import E2E_ENV_VAR, OUT_DIR, Cluster, e2e_env, start_cluster  # noqa: E402

# Server start-up alone may take minutes on a loaded machine: more than the suite's
# per-test timeout, which counts the session fixture's set-up in the first test.
E2E_TIMEOUT_S = 1200


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "e2e: real-engine lane (make e2e; needs vLLM)")
    config.addinivalue_line("markers",
                            "e2e_disruptive: kills a server of the shared cluster; runs last")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    ours = [it for it in items if HERE in Path(str(it.path)).parents]
    env = e2e_env()
    if ours and env is None and os.environ.get(E2E_ENV_VAR):
        # Named but not built: fail, so a broken build cannot pass as a skipped lane.
        raise pytest.UsageError(f"{E2E_ENV_VAR}={os.environ[E2E_ENV_VAR]} holds no built "
                                "env (venv/bin/python and model/config.json)")
    skip = pytest.mark.skip(reason=f"real-engine lane: {E2E_ENV_VAR} is not set or holds no "
                            "built env; run `make e2e`")
    for item in ours:
        # Only tests on the real servers belong to the lane; the tools' own tests run
        # everywhere.
        if "cluster" not in getattr(item, "fixturenames", ()):
            continue
        item.add_marker(pytest.mark.e2e)
        item.add_marker(pytest.mark.timeout(E2E_TIMEOUT_S))
        if env is None:
            item.add_marker(skip)
    # Stable sort: the tests that kill a server go after every other test of the lane.
    items.sort(key=lambda it: it in ours and it.get_closest_marker("e2e_disruptive") is not None)


_cluster: Cluster | None = None


@pytest.fixture(scope="session")
def cluster() -> Iterator[Cluster]:
    global _cluster
    env = e2e_env()
    assert env is not None  # the collection hook skipped us otherwise
    OUT_DIR.mkdir(parents=True, exist_ok=True)
    _cluster = start_cluster(env, OUT_DIR, deadline_s=float(
        os.environ.get("SKYMESH_E2E_START_DEADLINE_S", "600")))
    try:
        yield _cluster
    finally:
        _cluster.stop()
        _cluster = None


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    if report.failed and _cluster is not None and not hasattr(report, "wasxfail"):
        for name, tail in _cluster.log_tails().items():
            report.sections.append((f"log tail: {name}", tail))
