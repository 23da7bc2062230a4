"""What grows inside skymesh-lb over a soak (``rss_soak --probe``; docs/notes/memory-1m.md).

RSS says that a balancer grew, not what grew. The soak with ``--probe`` starts the
balancer with a ``sitecustomize`` on its ``PYTHONPATH`` that calls :func:`install` in
every process of it (the supervisor re-executes ``skymesh-lb`` for each worker, so an
import hook is the one way in). :func:`install` starts ``tracemalloc`` (when
``SKYMESH_SOAK_TRACEMALLOC`` gives the frames to keep) and sets a ``SIGUSR1`` handler that
writes ``<pid>-<n>.json`` into the directory ``SKYMESH_SOAK_PROBE`` names:

- ``containers``: for every object of a ``skymesh`` or ``prometheus_client`` class that
  can be reached, the length of each of its dict, set, list and deque attributes, summed
  by ``module.Class.attribute`` (``instances``: how many objects, ``largest``: the
  longest one); plus the containers and ``functools`` caches held by the modules'
  globals (``module:name``). Only those holding at least ``MIN_LEN`` entries.
- ``types``: objects the collector tracks (containers, instances) by type, the most
  numerous first.
- ``tracemalloc``: with it on, the memory still allocated by file and by line, the
  largest first (``kib``, ``blocks``).

Reachable, not ``gc.get_objects()``: ``skymesh.net.serving.tune_gc`` freezes what start-up
built (the policy, its trie, the app), and frozen objects are in no generation the
collector lists. So the walk starts from what it lists and the modules, and follows
``gc.get_referents`` through every tracked object. It costs a second or more on the
balancer's loop and some memory while it runs: the soak's RSS figures come from runs
without ``--probe``.

Stdlib only: every balancer process imports this module at start.
"""

from __future__ import annotations

import functools
import gc
import json
import os
import signal
import sys
import tracemalloc
from collections import Counter, deque
from pathlib import Path
from typing import Any

ENV_DIR = "SKYMESH_SOAK_PROBE"
ENV_TRACEMALLOC = "SKYMESH_SOAK_TRACEMALLOC"
MODULES = ("skymesh", "prometheus_client")
MIN_LEN = 16  # shorter containers are left out of a dump
TOP = 40  # lines of tracemalloc and types kept
_CONTAINERS = (dict, set, frozenset, list, deque)

SITECUSTOMIZE = (
    "import os\n"
    f"if os.environ.get({ENV_DIR!r}):\n"
    "    from skymesh_lab.bench.rss_soak_probe import install\n"
    f"    install(os.environ[{ENV_DIR!r}])\n")


def _ours(t: type) -> bool:
    return t.__module__.split(".", 1)[0] in MODULES


def _attrs(obj: object) -> list[tuple[str, object]]:
    out = list(getattr(obj, "__dict__", {}).items())
    for klass in type(obj).__mro__:
        for name in getattr(klass, "__slots__", ()):
            if name != "__dict__" and hasattr(obj, name):
                out.append((name, getattr(obj, name)))
    return out


def _add(sizes: dict[str, dict[str, int]], key: str, n: int) -> None:
    s = sizes.setdefault(key, {"len": 0, "instances": 0, "largest": 0})
    s["len"] += n
    s["instances"] += 1
    s["largest"] = max(s["largest"], n)


def reachable() -> list[object]:
    """Every tracked object reachable from the collector's lists and the modules,
    frozen ones included (module docstring)."""
    seen: set[int] = set()
    out: list[object] = []
    todo: list[object] = [*gc.get_objects(), *list(sys.modules.values())]
    while todo:
        obj = todo.pop()
        if id(obj) in seen or not gc.is_tracked(obj):
            continue
        seen.add(id(obj))
        out.append(obj)
        todo.extend(gc.get_referents(obj))
    return out


def containers(objs: list[object]) -> dict[str, dict[str, int]]:
    """Lengths of the containers objects of our classes and our modules hold."""
    sizes: dict[str, dict[str, int]] = {}
    for obj in objs:
        t = type(obj)
        if not isinstance(obj, type) and _ours(t):
            for name, v in _attrs(obj):
                if isinstance(v, _CONTAINERS):
                    _add(sizes, f"{t.__module__}.{t.__qualname__}.{name}", len(v))
    for mod_name, mod in list(sys.modules.items()):
        if mod is None or mod_name.split(".", 1)[0] not in MODULES:
            continue
        for name, v in list(vars(mod).items()):
            if name.startswith("__"):  # __builtins__, __all__: not state
                continue
            if isinstance(v, _CONTAINERS):
                _add(sizes, f"{mod_name}:{name}", len(v))
            elif isinstance(v, functools._lru_cache_wrapper):
                _add(sizes, f"{mod_name}:{name}()", v.cache_info().currsize)
    return {k: v for k, v in sorted(sizes.items()) if v["len"] >= MIN_LEN}


def _traced() -> dict[str, list[dict[str, Any]]]:
    if not tracemalloc.is_tracing():
        return {}
    snap = tracemalloc.take_snapshot().filter_traces(
        [tracemalloc.Filter(False, tracemalloc.__file__)])
    out: dict[str, list[dict[str, Any]]] = {}
    for group in ("filename", "lineno"):
        out[group] = [{"where": str(s.traceback[0]), "kib": round(s.size / 1024, 1),
                       "blocks": s.count} for s in snap.statistics(group)[:TOP]]
    return out


def dump(directory: Path, n: int) -> Path:
    """One dump of this process (module docstring); returns its path."""
    traced = _traced()  # before the walk, whose own lists it would count
    objs = reachable()
    doc = {"pid": os.getpid(), "n": n, "argv": sys.argv[1:],
           "types": dict(Counter(type(o).__qualname__ for o in objs).most_common(TOP)),
           "containers": containers(objs), "tracemalloc": traced}
    del objs
    path = directory / f"{os.getpid()}-{n}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)  # the soak waits for the file: never half of it
    return path


def install(directory: str) -> None:
    """Called by the soak's sitecustomize in every balancer process."""
    frames = int(os.environ.get(ENV_TRACEMALLOC) or 0)
    if frames:
        tracemalloc.start(frames)
    count = [0]

    def on_signal(signum: int, frame: object) -> None:
        count[0] += 1
        dump(Path(directory), count[0])

    signal.signal(signal.SIGUSR1, on_signal)


def write_site(directory: Path) -> Path:
    """The ``sitecustomize.py`` that installs the probe, in ``directory``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "sitecustomize.py").write_text(SITECUSTOMIZE)
    return directory
