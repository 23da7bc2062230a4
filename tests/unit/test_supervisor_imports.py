"""skymesh-lb's supervisor (``listen.workers`` above 1) serves no request: it checks the
config, binds the port and starts the workers. What it imports it holds for the
balancer's whole life, in RSS beside every worker's (docs/notes/memory-1m.md)."""

from __future__ import annotations

import json
import subprocess
import sys

# The supervisor's path through skymesh.balancer.cli.main, up to starting the workers
# (``supervise`` replaced by a stand-in that reports what the process imported).
_SUPERVISOR = """
import json, sys
import skymesh.balancer.workers as workers
from skymesh.balancer import cli

def supervise(argv, count, *rest, **kw):
    print(json.dumps({"count": count, "modules": sorted(sys.modules)}))
    return 0

workers.supervise = supervise
sys.exit(cli.main(["--port", "0", "--replicas", "http://127.0.0.1:9,http://127.0.0.1:10",
                   "--workers", "2"] + sys.argv[1:]))
"""


def _supervisor_modules(*flags: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", _SUPERVISOR, *flags], capture_output=True,
                         text=True, timeout=120, check=True)
    doc = json.loads(out.stdout.strip().splitlines()[-1])
    assert doc["count"] == 2  # it did get as far as starting the workers
    return set(doc["modules"])


def test_the_supervisor_does_not_load_numpy_for_the_default_policy() -> None:
    """numpy is about 10 MB of a process's RSS; only the prefix keys and the PreServe
    look-ahead maps use it, and with the default policy the supervisor makes neither."""
    modules = _supervisor_modules()
    assert "skymesh.policies.preserve" in modules  # the registry's policies are there
    assert "skymesh.prefix.trie" in modules  # the config check built the policy's trie
    assert "numpy" not in modules


def test_the_supervisor_does_not_load_aiohttp() -> None:
    """aiohttp is about 9 MB of the supervisor's RSS, and it connects nowhere: the config
    check takes the URL policy (skymesh.net.urlpolicy), not its aiohttp resolver
    (skymesh.net.resolver), which imported aiohttp with it."""
    modules = _supervisor_modules()
    assert "skymesh.net.urlpolicy" in modules  # the config's URL checks ran
    assert not {m for m in modules if m == "aiohttp" or m.startswith("aiohttp.")}
    assert "yarl" not in modules  # the policy's URL joining imports it where it joins


def test_the_supervisor_does_not_load_prometheus_client() -> None:
    """It exports no metrics (the workers do): the config's connection limits
    (skymesh.net.limits) imported prometheus_client for their collector."""
    modules = _supervisor_modules()
    assert "skymesh.net.limits" in modules  # the config's connection limits are there
    assert not {m for m in modules
                if m == "prometheus_client" or m.startswith("prometheus_client.")}


def test_the_prefix_package_still_gives_the_text_keys() -> None:
    from skymesh.prefix import keys, text_prefix_keys

    assert text_prefix_keys is keys.text_prefix_keys
    assert text_prefix_keys("a" * 130) == keys.text_prefix_keys("a" * 128)
