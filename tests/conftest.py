"""Hypothesis runs the same examples on every CI run, so a red build always reproduces.

``SKYMESH_HYPOTHESIS=explore`` draws fresh random examples (and more of them) for
hunting new failures locally; whatever it finds becomes a fixed regression test.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Iterator

import pytest
from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("SKYMESH_HYPOTHESIS", "ci"))


@pytest.fixture(scope="session")
def moto_url() -> Iterator[str]:
    """moto's AWS API server on loopback, one per test session (tests that need a clean
    account reset it through ``/moto-api/reset``)."""
    from moto.server import ThreadedMotoServer  # only the AWS tests pay for the import

    from skymesh.util.procs import free_port

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.stop()


@pytest.fixture
def no_cyclic_gc() -> Iterator[None]:
    """The cyclic GC off for the test (after a full collection): what only it would free
    stays in ``gc.get_objects()``, as it does between the rare full collections of a
    daemon under ``skymesh.net.serving.tune_gc``."""
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
