"""The import graph of the four distributions (``skymesh``, ``skymesh_controller``,
``skymesh_replica``, ``skymesh_lab``), read with ``ast``.

Module-level imports run when a module is imported; imports inside functions (lazy ones)
run when the function does; imports under ``if TYPE_CHECKING:`` never run. The rules:

1. No import cycle through module-level imports.
2. No import cycle through lazy imports either, except over the back edges listed in
   ``LAZY_BACK_EDGES``, each with its reason. An entry that no longer matches an import
   fails too, so the list only shrinks.
3. The product (data plane, control plane, emulated replica) never names the lab: no
   import of it of any kind (module level, in a function, under ``TYPE_CHECKING``, through
   ``import_module``/``__import__``), and no string that is one of its module names. This
   is what keeps ``pip install skymesh`` (no lab) able to run the product.
4. The planes stay apart: the data plane names neither the control plane nor the replica;
   the control plane takes from the data plane's package only its public kernel.
5. No cycle even counting type-only imports, but the ones in ``TYPE_ONLY_CYCLES``.
"""

from __future__ import annotations

import ast
import fnmatch
from collections.abc import Iterable, Iterator
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
# package -> the folder holding it (each distribution's own folder)
ROOTS: dict[str, Path] = {
    "skymesh": REPO, "skymesh_controller": REPO / "controller",
    "skymesh_replica": REPO / "replica", "skymesh_lab": REPO / "lab"}
GENERATED = ("skymesh/mesh/gen",)  # protoc output, not ours
_GENERATED_MODULES = tuple(g.replace("/", ".") for g in GENERATED)

# The product: what a balancer, controller or operator host runs, and the emulated
# replica a user installs to try it. The lab beside it: simulator, benchmarks,
# experiments, training of the length predictors, the fault harness and the demos.
PRODUCT = ("skymesh", "skymesh_controller", "skymesh_replica")
LAB = ("skymesh_lab",)
DATA_PLANE = ("skymesh",)
# What the control plane may take from the data plane's package: the shared kernel, and
# the policy registry it validates balancers' policy settings against.
KERNEL = ("skymesh.common", "skymesh.net", "skymesh.obs", "skymesh.util", "skymesh.version",
          "skymesh.policies")

# Lazy imports that close a cycle, (importer, imported; fnmatch pattern) -> why. Rule 2
# removes these edges and then finds no cycle.
LAZY_BACK_EDGES: dict[tuple[str, str], str] = {}

# Cycles that close only through ``if TYPE_CHECKING:`` imports (rule 5), each with why it
# is still there; an entry that no longer matches a cycle fails too, so the list shrinks.
TYPE_ONLY_CYCLES: dict[frozenset[str], str] = {}


# -- the graph ----------------------------------------------------------------------------
def discover(roots: dict[str, Path]) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the packages in ``roots``."""
    out: dict[str, Path] = {}
    for package, home in roots.items():
        for path in sorted((home / package).rglob("*.py")):
            rel = path.relative_to(home)
            if any(rel.as_posix().startswith(g + "/") for g in GENERATED):
                continue
            parts = list(rel.with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return ast.unparse(test) in ("TYPE_CHECKING", "typing.TYPE_CHECKING")


def _import_nodes(body: list[ast.stmt], lazy: bool, typed: bool = False
                  ) -> Iterator[ast.Import | ast.ImportFrom]:
    """Imports that can run: with ``lazy`` False only those that run when the module runs
    (not in function bodies); type-only ones only with ``typed``."""
    for node in body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            if lazy:
                yield from _import_nodes(node.body, lazy, typed)
        elif isinstance(node, ast.If):
            if typed or not _is_type_checking(node.test):
                yield from _import_nodes(node.body, lazy, typed)
            yield from _import_nodes(node.orelse, lazy, typed)
        elif isinstance(node, ast.Try):
            for block in (node.body, node.orelse, node.finalbody,
                          *(h.body for h in node.handlers)):
                yield from _import_nodes(block, lazy, typed)
        elif isinstance(node, (ast.With, ast.AsyncWith, ast.ClassDef, ast.For, ast.While)):
            yield from _import_nodes(node.body, lazy, typed)


def _calls_import_module(tree: ast.Module) -> bool:
    return any(isinstance(n, ast.Call) and ast.unparse(n.func).endswith("import_module")
               for n in ast.walk(tree))


def imports_of(name: str, path: Path, known: set[str], lazy: bool = False,
               typed: bool = False) -> set[str]:
    """The modules of ``known`` that ``name`` imports (at module level unless ``lazy``)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    if lazy and _calls_import_module(tree):
        # importlib.import_module(NAME) with names from a table: every string in the module
        # that names one of ours counts (a string run as ``python -m`` elsewhere does not).
        out |= {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant)
                and isinstance(n.value, str) and n.value in known and n.value != name}
    for node in _import_nodes(tree.body, lazy, typed):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        else:
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[:len(anchor) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            # ``from pkg import sub`` imports the submodule; ``from mod import name`` mod.
            targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in known else base
                       for a in node.names]
        for target in targets:
            if any(target == g or target.startswith(g + ".") for g in _GENERATED_MODULES):
                continue  # protoc's output: it imports nothing of ours
            # ``import a.b.c`` where only ``a.b`` is ours still runs ``a.b``.
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                out.add(target)
    return out


def build_graph(roots: dict[str, Path] | None = None, lazy: bool = False,
                typed: bool = False) -> dict[str, set[str]]:
    modules = discover(ROOTS if roots is None else roots)
    known = set(modules)
    return {name: imports_of(name, path, known, lazy, typed)
            for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components with more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []

    def visit(v: str) -> None:
        # Recursion depth is bounded by the module count (a few hundred).
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(frozenset(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def _parents(name: str) -> Iterator[str]:
    while "." in name:
        name = name.rpartition(".")[0]
        yield name


def import_chain(graph: dict[str, set[str]], start: str, bad: tuple[str, ...]
                 ) -> list[str] | None:
    """The shortest chain of module-level imports from ``start`` to a module under one of
    ``bad``; importing a module also runs its parent packages' ``__init__``."""
    prev: dict[str, str | None] = {start: None}
    todo = [start]
    while todo:
        nxt: list[str] = []
        for v in todo:
            if _under(v, bad):
                chain = [v]
                while (p := prev[chain[-1]]) is not None:
                    chain.append(p)
                return chain[::-1]
            for w in sorted(graph.get(v, set()) | {p for p in _parents(v) if p in graph}):
                if w not in prev:
                    prev[w] = v
                    nxt.append(w)
        todo = nxt
    return None


def _under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


# -- the analyser on a tree made for it ---------------------------------------------------
def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, set[str]]:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return build_graph({"pkg": tmp_path})


def test_the_analyser_counts_module_level_imports_only(tmp_path: Path) -> None:
    graph = _tree(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/a.py": "from typing import TYPE_CHECKING\nfrom pkg import b\n"
                    "if TYPE_CHECKING:\n    from pkg import c\n"
                    "def f():\n    import pkg.d\n",
        "pkg/b.py": "try:\n    from .c import thing\nexcept ImportError:\n    pass\n",
        "pkg/c.py": "import pkg.d.e\n",
        "pkg/d/__init__.py": "from ..a import x\n",
        "pkg/d/e.py": "",
    })
    assert graph["pkg.a"] == {"pkg.b"}
    assert graph["pkg.b"] == {"pkg.c"}
    assert graph["pkg.c"] == {"pkg.d.e"}
    assert graph["pkg.d"] == {"pkg.a"}
    # c -> d.e runs d/__init__, which imports a: the chain goes through the parent.
    assert import_chain(graph, "pkg.b", ("pkg.a",)) == ["pkg.b", "pkg.c", "pkg.d.e", "pkg.d",
                                                        "pkg.a"]
    assert cycles(graph) == []  # the parent edge runs first in Python: not a cycle


def test_the_analyser_finds_a_cycle(tmp_path: Path) -> None:
    graph = _tree(tmp_path, {
        "pkg/__init__.py": "", "pkg/a.py": "from pkg.b import y\n",
        "pkg/b.py": "from pkg import c\n", "pkg/c.py": "import pkg.a\n", "pkg/d.py": "",
    })
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b", "pkg.c"})]


def test_lazy_imports_close_cycles_unless_allowed(tmp_path: Path) -> None:
    _tree(tmp_path, {
        "pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n",
        "pkg/b.py": "def f():\n    from pkg import a\n",
        "pkg/c.py": "import importlib\nMODS = ['pkg.d']\nimportlib.import_module(MODS[0])\n",
        "pkg/d.py": "import pkg.c\nRUN = 'pkg.a'  # e.g. python -m pkg.a: not an import\n",
    })
    assert cycles(build_graph({"pkg": tmp_path})) == []
    lazy = build_graph({"pkg": tmp_path}, lazy=True)
    assert sorted(cycles(lazy), key=sorted) == [frozenset({"pkg.a", "pkg.b"}),
                                                frozenset({"pkg.c", "pkg.d"})]
    pruned, stale = without_back_edges(lazy, {("pkg.b", "pkg.*"), ("pkg.c", "pkg.d"),
                                              ("pkg.a", "pkg.zzz")})
    assert cycles(pruned) == [] and stale == {("pkg.a", "pkg.zzz")}


# -- the rules on the real tree -----------------------------------------------------------
@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return build_graph()


def test_the_lists_name_real_modules(graph: dict[str, set[str]]) -> None:
    missing = [p for p in (*PRODUCT, *LAB) if not any(_under(m, (p,)) for m in graph)]
    assert not missing, f"PRODUCT/LAB name modules that do not exist: {missing}"


def test_no_import_cycle_at_module_level(graph: dict[str, set[str]]) -> None:
    assert not [sorted(c) for c in cycles(graph)]


def without_back_edges(graph: dict[str, set[str]], allowed: Iterable[tuple[str, str]]
                       ) -> tuple[dict[str, set[str]], set[tuple[str, str]]]:
    """``graph`` less the edges matching ``allowed``, and the entries that matched none."""
    allowed = set(allowed)
    used: set[tuple[str, str]] = set()
    out: dict[str, set[str]] = {}
    for v, targets in graph.items():
        out[v] = set()
        for w in targets:
            hit = {(a, b) for a, b in allowed if a == v and fnmatch.fnmatchcase(w, b)}
            used |= hit
            if not hit:
                out[v].add(w)
    return out, allowed - used


def test_no_import_cycle_through_lazy_imports_but_the_known_ones() -> None:
    graph, stale = without_back_edges(build_graph(lazy=True), LAZY_BACK_EDGES)
    found = [sorted(c) for c in cycles(graph)]
    assert not found, f"import cycles through lazy imports: {found}"
    assert not stale, f"LAZY_BACK_EDGES entries that match no import any more: {stale}"


def test_the_product_does_not_import_the_lab_at_module_level(graph: dict[str, set[str]]) -> None:
    product = sorted(m for m in graph if _under(m, PRODUCT) and not _under(m, LAB))
    assert len(product) > 50  # the lists still match the tree
    chains = [" -> ".join(chain) for m in product
              if (chain := import_chain(graph, m, LAB)) is not None]
    assert not chains, "product modules importing the lab at module level:\n" + "\n".join(
        chains)


# -- every kind of reference, not just the imports that run -------------------------------
def references(path: Path) -> Iterator[tuple[int, str]]:
    """Every module a file names, of any kind: each import statement wherever it stands (in
    a function, under ``TYPE_CHECKING``), and each string constant (``import_module``'s and
    ``__import__``'s arguments, ``python -m`` argv, docstrings), as (line, text)."""
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level:
            yield node.lineno, node.module or ""
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def _names(text: str, packages: tuple[str, ...]) -> bool:
    return any(text == p or f"{p}." in text or f"{p}/" in text or f"{p}:" in text
               for p in packages)


def offending(modules: dict[str, Path], sources: tuple[str, ...], targets: tuple[str, ...],
              imports_only: bool = False) -> list[str]:
    out = []
    for name, path in sorted(modules.items()):
        if not _under(name, sources):
            continue
        tree_imports = {(n.lineno) for n in ast.walk(ast.parse(path.read_text()))
                        if isinstance(n, (ast.Import, ast.ImportFrom))}
        for line, text in references(path):
            if imports_only and line not in tree_imports and not any(
                    text == t or text.startswith(t + ".") for t in targets):
                continue
            if _names(text, targets) or text in targets:
                out.append(f"{path.relative_to(REPO)}:{line}: {text[:80]!r}")
    return out


def test_references_of_every_kind_are_found(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "__init__.py").write_text("")
    (tmp_path / "pkg" / "a.py").write_text(
        "from typing import TYPE_CHECKING\nimport importlib\n"
        "if TYPE_CHECKING:\n    import lab.x\n"
        "def f():\n    from lab import y\n    importlib.import_module('lab.z')\n"
        "    __import__('lab')\n"
        "ARGV = ['python', '-m', 'lab.w']\nOK = 'labrador.x'\n")
    found = [line for line, text in references(tmp_path / "pkg" / "a.py")
             if _names(text, ("lab",)) or text == "lab"]
    assert sorted(found) == [4, 6, 7, 8, 9]


def test_the_product_never_names_the_lab() -> None:
    bad = offending(discover(ROOTS), PRODUCT, LAB)
    assert not bad, "the product names the lab:\n" + "\n".join(bad)


def test_the_data_plane_never_imports_the_other_planes() -> None:
    bad = offending(discover(ROOTS), DATA_PLANE, ("skymesh_controller", "skymesh_replica"),
                    imports_only=True)
    assert not bad, "the data plane imports the control plane or the replica:\n" + "\n".join(
        bad)


def test_the_control_plane_takes_only_the_kernel_from_the_data_plane() -> None:
    graph = build_graph(lazy=True)
    bad = sorted(f"{a} -> {b}" for a, targets in graph.items()
                 if _under(a, ("skymesh_controller",))
                 for b in targets if _under(b, DATA_PLANE) and not _under(b, KERNEL))
    assert not bad, "the control plane reaches into the data plane:\n" + "\n".join(bad)


def test_no_cycle_even_through_type_only_imports_but_the_known_ones() -> None:
    graph, _ = without_back_edges(build_graph(lazy=True, typed=True), LAZY_BACK_EDGES)
    found = {c for c in cycles(graph) if not any(_under(m, LAB) for m in c)}
    new = [sorted(c) for c in found - set(TYPE_ONLY_CYCLES)]
    assert not new, f"import cycles (type-only imports counted): {new}"
    gone = [sorted(c) for c in set(TYPE_ONLY_CYCLES) - found]
    assert not gone, f"TYPE_ONLY_CYCLES entries that are no longer cycles: {gone}"


def test_type_only_imports_count_when_asked(tmp_path: Path) -> None:
    (tmp_path / "pkg").mkdir()
    for rel, text in {"pkg/__init__.py": "", "pkg/a.py": "import pkg.b\n",
                      "pkg/b.py": "from typing import TYPE_CHECKING\n"
                                  "if TYPE_CHECKING:\n    from pkg import a\n"}.items():
        (tmp_path / rel).write_text(text)
    assert cycles(build_graph({"pkg": tmp_path})) == []
    assert cycles(build_graph({"pkg": tmp_path}, typed=True)) == [frozenset({"pkg.a", "pkg.b"})]
