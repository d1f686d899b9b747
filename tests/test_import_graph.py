"""The mn_prefect package is layered: no import cycle between its modules. Every import counts, at the top of
a module, inside a function (a deferred import hides a cycle, it does not remove one) or under `if TYPE_CHECKING:`
(a cycle of types is a cycle of concepts: one side should name what it needs as a Protocol of its own). Run as a
script it prints the cycles (strongly connected components) it finds."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PACKAGE = "mn_prefect"
ROOT = Path(__file__).resolve().parent.parent / PACKAGE


def modules(root: Path = ROOT, package: str = PACKAGE) -> dict[str, Path]:
    """Every module of the package by its dotted name (a package by its own name, for its __init__.py)."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join([package, *parts])] = path
    return found


def _imports(tree: ast.AST):
    """Every Import / ImportFrom node of the tree, at any depth, those under `if TYPE_CHECKING:` included."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that `name` is or lies in (`a.b.c` where a.b.c is a function of a.b: a.b)."""
    while name:
        if name in known:
            return name
        name = name.rpartition(".")[0]
    return None


def import_graph(known: dict[str, Path] | None = None) -> dict[str, set[str]]:
    """module -> the package's modules it imports. `from pkg import x` points at pkg.x when that is a module,
    else at pkg; relative imports are resolved against the importing module's package."""
    known = modules() if known is None else known
    graph: dict[str, set[str]] = {}
    for name, path in known.items():
        is_package = path.name == "__init__.py"
        here = name if is_package else name.rpartition(".")[0]
        edges = graph.setdefault(name, set())
        for node in _imports(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:
                    anchor = here.split(".")
                    anchor = anchor[:len(anchor) - (node.level - 1)]
                    base = ".".join(anchor + ([base] if base else []))
                targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base
                           for alias in node.names]
            for target in targets:
                resolved = _resolve(target, known)
                if resolved is not None and resolved != name:
                    edges.add(resolved)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    counter = 0
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = counter
        counter += 1
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            for child in children:
                if child not in index:
                    index[child] = low[child] = counter
                    counter += 1
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                    break
                if child in on_stack:
                    low[node] = min(low[node], index[child])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(sorted(component))
    return sorted(found)


def describe(component: list[str], graph: dict[str, set[str]]) -> str:
    members = set(component)
    lines = [f"cycle of {len(component)} modules:"]
    for name in component:
        lines.append(f"  {name} -> {', '.join(sorted(graph[name] & members))}")
    return "\n".join(lines)


def test_graph_resolves_relative_and_from_package_imports(tmp_path):
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from .sub import b\nfrom pkg.sub.b import thing\n")
    (pkg / "sub" / "__init__.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                             "    from pkg import a\n")
    (pkg / "sub" / "b.py").write_text("def f():\n    from .. import a\n    import pkg.sub\n")
    graph = import_graph(modules(pkg, "pkg"))
    assert graph == {"pkg": set(), "pkg.a": {"pkg.sub.b"}, "pkg.sub": {"pkg.a"}, "pkg.sub.b": {"pkg.a", "pkg.sub"}}
    assert cycles(graph) == [["pkg.a", "pkg.sub", "pkg.sub.b"]]  # the TYPE_CHECKING import closes one more


def test_no_import_cycle_in_the_package():
    graph = import_graph()
    found = cycles(graph)
    assert not found, "\n".join(describe(c, graph) for c in found)


def _within(name: str, packages: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(p + ".") for p in packages)


# What each layer may import besides itself (docs/architecture.md, "Layers"); what is not listed is above it or
# beside it. The cli, the mn_api, the flows' entry points and the worker's Prefect glue sit on top and are not
# listed. Shared helpers every layer may use: settings, events, notify, credentials, preemption (a run's notice and
# checkpoint files).
_HELPERS = ("mn_prefect.settings", "mn_prefect.events", "mn_prefect.notify", "mn_prefect.credentials",
            "mn_prefect.preemption")
_PURE = ("mn_prefect.scheduler", "mn_prefect.model")
BELOW = {
    "mn_prefect.store": ("mn_prefect.scheduler", "mn_prefect.model", "mn_prefect.settings"),
    "mn_prefect.placement": ("mn_prefect.store", *_PURE, "mn_prefect.settings", "mn_prefect.events",
                             "mn_prefect.notify"),
    "mn_prefect.lifecycle": ("mn_prefect.placement", "mn_prefect.store", *_PURE, *_HELPERS),
    "mn_prefect.workflow": ("mn_prefect.model",),
    "mn_prefect.ops": ("mn_prefect.lifecycle", "mn_prefect.placement", "mn_prefect.store", *_PURE, *_HELPERS),
    "mn_prefect.jobs": ("mn_prefect.lifecycle", "mn_prefect.placement", "mn_prefect.store", *_PURE, *_HELPERS),
    "mn_prefect.bundles": ("mn_prefect.jobs", "mn_prefect.workflow", "mn_prefect.drivers", "mn_prefect.lifecycle",
                           "mn_prefect.placement", "mn_prefect.store", *_PURE, *_HELPERS),
}


def test_each_layer_imports_only_the_layers_below_it():
    """The store keeps durable state and applies a booking atomically; it publishes nothing (no Prefect event,
    no notification): the layer that decided announces. Placement sits on the store and under everything that
    places; lifecycle (node states, health checks, drains) on placement; ops (metrics, usage, reports) reads
    what those keep; jobs and bundles run work through them. None of these imports the worker, the gRPC API or
    the command line."""
    graph = import_graph()
    wrong = [f"{name} -> {target}" for layer, allowed in BELOW.items() for name in sorted(graph)
             if _within(name, (layer,)) for target in sorted(graph[name]) if not _within(target, (layer, *allowed))]
    assert not wrong, "\n".join(wrong)


# -- every release goes through its owner's rule ------------------------------------------------------------------

# The one module that calls a store's own ``release`` (after checking the owner's rule), and the store backends,
# which implement it.
RELEASE_GATE = "mn_prefect.store.releasing"
RELEASE_EXEMPT = ("mn_prefect.store.releasing", "mn_prefect.store.sql", "mn_prefect.store.sql_dialects",
                  "mn_prefect.store.redis_store")
# Receivers of a ``.release(`` that are no store: the gate itself (mn_prefect.placement.bookings), the placer and
# the reservations module and the worker's Releaser (which release through it), locks and leases, a backend's
# dialect or connection pool; a deallocation decision (its ``release`` says whether to).
NOT_A_STORE = {"bookings", "placer", "self._place", "self._placer", "reservations", "lock", "leadership", "self",
               "self._announcer", "self._pool", "self.dialect", "self._releaser", "releaser", "decision",
               "self._slots", "budget"}  # http_serving, mn_api.server: semaphores of connections and streams


def release_calls(known: dict[str, Path] | None = None) -> list[str]:
    """``module:line receiver.release(`` for every ``.release`` whose receiver may be a store, called or handed on
    (``in_store(store.release, ...)``), outside the gate, the backends and the exempt packages."""
    known = modules() if known is None else known
    found: list[tuple[str, int, str]] = []
    for name, path in known.items():
        if _within(name, RELEASE_EXEMPT):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "release":
                receiver = ast.unparse(node.value)
                if receiver not in NOT_A_STORE:
                    found.append((name, node.lineno, f"{name}:{node.lineno} {receiver}.release("))
    return [line for *_, line in sorted(found)]


def test_release_calls_are_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("def f(store, lock):\n    store.release('x')\n    lock.release()\n"
                              "    self._cluster.release('y', node='n')\n    open_store().release('z')\n")
    assert release_calls(modules(pkg, "pkg")) == ["pkg.a:2 store.release(", "pkg.a:4 self._cluster.release(",
                                                   "pkg.a:5 open_store().release("]


def test_every_release_goes_through_the_owners_rule():
    """Nothing releases a booking without its owner's rule saying so: only mn_prefect.store.releasing calls a
    store's ``release`` (mn_prefect.placement.bookings.release is it), besides the backends and the worker."""
    wrong = release_calls()
    assert not wrong, "call mn_prefect.placement.bookings.release(store, owner, why) instead:\n" + "\n".join(wrong)



# -- one name, one class ---------------------------------------------------------------------------------------


def shared_class_names(known: dict[str, Path] | None = None) -> dict[str, list[str]]:
    """Every class name defined more than once in the package (nested classes included), with where each
    definition is (``module:line``)."""
    known = modules() if known is None else known
    where: dict[str, list[str]] = {}
    for name, path in known.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{name}:{node.lineno}")
    return {cls: sorted(places) for cls, places in sorted(where.items()) if len(places) > 1}


def test_shared_class_names_are_found(tmp_path):
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("class Only:\n    pass\n")
    (pkg / "a.py").write_text("class Wait:\n    pass\n\n\nclass Outer:\n    class Wait:\n        pass\n")
    (pkg / "b.py").write_text("def f():\n    class Outer:\n        pass\n    return Outer\n")
    assert shared_class_names(modules(pkg, "pkg")) == {"Outer": ["pkg.a:5", "pkg.b:2"], "Wait": ["pkg.a:1", "pkg.a:6"]}


def test_no_two_classes_share_a_name():
    """A class name says which class is meant: no two classes of the package, nested ones included, share one
    (a name defined twice is renamed after what the narrower one is; no alias keeps the old name)."""
    shared = shared_class_names()
    assert not shared, "class names defined more than once:\n" + "\n".join(
        f"  {cls}: {', '.join(places)}" for cls, places in shared.items())

if __name__ == "__main__":
    g = import_graph()
    for c in cycles(g):
        print(describe(c, g))
    sys.exit(1 if cycles(g) else 0)
