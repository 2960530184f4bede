"""The packages' import structure, read statically with ``ast`` (nothing is imported or run).

1. No import cycle among the modules of any one package (``retopk_core``, ``retopk_server``, the client's
   two): every ``import`` and ``from ... import`` counts, at module level, inside a function (an import
   deferred into a function to dodge a cycle is still one) or under ``if TYPE_CHECKING:`` (it never runs, but
   the two modules still know each other: name what is needed in a Protocol instead, as runtime/prefill.py
   and engine/commands.py do).
   ``from package import name`` is an edge to ``package.name`` where that is a module, else to the package.
2. No file reaches into another module's private names:
   - ``from M import _name`` and ``import M._private_module`` where M is a module of this project (retopk_core,
     retopk_server, retopk_client, retopk_shared) other than the file itself, except a package's own private modules
     imported from inside that package (``methods/baselines/_common.py`` from its siblings);
   - ``expr._name`` where ``expr`` is not ``self`` / ``cls`` and ``_name`` is a private attribute or method
     that the project defines (``def _name`` or ``self._name = ...``) in some file but not in this one: a
     class reading its own private fields on another instance of itself stays allowed. What this cannot see:
     a private name that the reading file happens to define too, and private names of third-party objects.
"""

from __future__ import annotations

import ast
import sys
from collections import defaultdict
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"retopk_core": ROOT / "retopk_core", "retopk_server": ROOT / "server" / "retopk_server",
            "retopk_client": ROOT / "client" / "retopk_client", "retopk_shared": ROOT / "client" / "retopk_shared"}


def module_name(package: str, path: Path) -> str:
    parts = (package, *path.relative_to(PACKAGES[package]).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    """Every module of the project's packages, by dotted name."""
    return {module_name(package, path): path
            for package, folder in PACKAGES.items() for path in sorted(folder.rglob("*.py"))}


MODULES = modules()


def is_private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def resolve(name: str, importer: str, level: int) -> str:
    """The absolute module name of an import written ``level`` dots up from ``importer``."""
    if level == 0:
        return name
    base = importer.split(".")
    if not MODULES[importer].name == "__init__.py":
        base = base[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([name] if name else []))


def imports(module: str) -> list[tuple[int, str, str | None]]:
    """(line, imported module, imported name or None) of every import in ``module``, TYPE_CHECKING's included."""
    out = []
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name, None) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node.module or "", module, node.level)
            out += [(node.lineno, source, alias.name) for alias in node.names]
    return out


def import_graph(package: str) -> dict[str, set[str]]:
    """Module -> the modules of the same package it imports."""
    graph = defaultdict(set)
    for module in (m for m in MODULES if m.split(".")[0] == package):
        graph[module]
        for _, source, name in imports(module):
            target = f"{source}.{name}" if name and f"{source}.{name}" in MODULES else source
            if target in MODULES and target.split(".")[0] == package and target != module:
                graph[module].add(target)
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan's algorithm)."""
    index, low, stack, on_stack, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
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
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                out.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def private_definitions() -> dict[str, set[str]]:
    """Private attribute or method name -> the modules that define it (``def _x`` in a class, or
    ``self._x = ...`` / ``self._x: T = ...``)."""
    out = defaultdict(set)
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef) and is_private(item.name):
                        out[item.name].add(module)
                    elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name) \
                            and is_private(item.target.id):
                        out[item.target.id].add(module)
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                    and isinstance(node.value, ast.Name) and node.value.id == "self" and is_private(node.attr):
                out[node.attr].add(module)
    return out


def module_aliases(module: str) -> dict[str, str]:
    """Local name -> project module, for the names ``module``'s imports bind to a module of the project."""
    out = {}
    for node in ast.walk(ast.parse(MODULES[module].read_text())):
        if isinstance(node, ast.Import):
            out |= {alias.asname: alias.name for alias in node.names if alias.asname and alias.name in MODULES}
        elif isinstance(node, ast.ImportFrom):
            source = resolve(node.module or "", module, node.level)
            out |= {alias.asname or alias.name: f"{source}.{alias.name}" for alias in node.names
                    if f"{source}.{alias.name}" in MODULES}
    return out


def reach_ins() -> list[str]:
    """Every place a file reads another module's private name, as 'file:line: what'."""
    defined = private_definitions()
    found = []
    for module, path in MODULES.items():
        aliases = module_aliases(module)
        where = path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
        package = module if path.name == "__init__.py" else module.rpartition(".")[0]
        for line, source, name in imports(module):
            if source.split(".")[0] not in PACKAGES or source == module:
                continue
            private_module = next((p for p in source.split(".") if is_private(p)), None)
            if private_module and not module.startswith(source.rpartition(".")[0] + ".") \
                    and source.rpartition(".")[0] != package:
                found.append(f"{where}:{line}: imports the private module {source}")
            if name and is_private(name) and f"{source}.{name}" not in MODULES:
                found.append(f"{where}:{line}: from {source} import {name}")
            elif name and is_private(name) and source != package:
                found.append(f"{where}:{line}: imports the private module {source}.{name}")
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and is_private(node.attr)):
                continue
            owner = node.value
            if isinstance(owner, ast.Name) and aliases.get(owner.id, module) != module:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (private to {aliases[owner.id]})")
                continue
            if isinstance(owner, ast.Name) and owner.id in ("self", "cls"):
                continue
            if isinstance(owner, ast.Call) and isinstance(owner.func, ast.Name) and owner.func.id == "super":
                continue
            if defined.get(node.attr) and module not in defined[node.attr]:
                found.append(f"{where}:{node.lineno}: {ast.unparse(node)} (defined in "
                             f"{', '.join(sorted(defined[node.attr]))})")
    return found


@pytest.mark.parametrize("package", list(PACKAGES))
def test_no_import_cycle(package):
    found = cycles(import_graph(package))
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_no_file_reaches_into_another_modules_private_names():
    found = reach_ins()
    assert not found, "private names read from another module:\n" + "\n".join(found)


def test_the_checks_see_what_they_look_for(tmp_path, monkeypatch):
    """A planted package with one cycle and each kind of reach-in: the walkers find every one (so the empty
    answers above mean something), and a class reading its own private field on another instance passes."""
    assert resolve("base", "retopk_core.methods.retopk", 1) == "retopk_core.methods.base"
    pkg = tmp_path / "retopk_core"
    pkg.mkdir()
    files = {
        "__init__.py": "",
        "a.py": "from retopk_core import b\nfrom retopk_core.c import _helper\n",
        "b.py": "def f():\n    from retopk_core import a  # deferred, still a cycle\n",
        "c.py": "class Runner:\n    def __init__(self):\n        self._rows = []\n"
                "    def same(self, other):\n        return other._rows\n"
                "def _helper():\n    pass\n",
        "d.py": "from typing import TYPE_CHECKING\nfrom retopk_core import c\n"
                "if TYPE_CHECKING:\n    from retopk_core import e\n"
                "def g(runner):\n    return runner._rows, c._helper\n",
        "e.py": "from retopk_core import d\n",
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    monkeypatch.setitem(PACKAGES, "retopk_core", pkg)
    planted = {module_name("retopk_core", pkg / name): pkg / name for name in files}
    monkeypatch.setattr(sys.modules[__name__], "MODULES", planted)
    assert cycles(import_graph("retopk_core")) == [["retopk_core.a", "retopk_core.b"],
                                                   ["retopk_core.d", "retopk_core.e"]]  # d's TYPE_CHECKING counts
    found = sorted(line.split(": ", 1)[1] for line in reach_ins())
    assert found == ["c._helper (private to retopk_core.c)", "from retopk_core.c import _helper",
                     "runner._rows (defined in retopk_core.c)"], found
