"""Hypothesis runs the same examples on every CI run, so a red build always reproduces.

``SKYMESH_HYPOTHESIS=explore`` draws fresh random examples (and more of them) for
hunting new failures locally; whatever it finds becomes a fixed regression test.
"""

from __future__ import annotations

import os

from hypothesis import settings

settings.register_profile("ci", derandomize=True, print_blob=True)
settings.register_profile("explore", derandomize=False, print_blob=True)
settings.load_profile(os.environ.get("SKYMESH_HYPOTHESIS", "ci"))
