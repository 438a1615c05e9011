"""partita's imports run one way: no module imports, directly or through others, a module that imports it.

The check reads the source (``ast``, nothing is imported) and counts what Python would execute:
module-level imports and imports inside functions alike (a function-level import is a cycle that
waits for its first call), but not imports under ``if TYPE_CHECKING:`` (type checkers only).
``from package import name`` depends on ``package`` and, when ``name`` is a submodule, on that
submodule too. Importing ``a.b.c`` runs ``a/__init__.py`` first, but that is the import system's
doing, not a dependency of ``c``: a package's ``__init__`` may re-export its submodules as long as
those submodules do not import the package back (import ``partita.x.errors``, not ``partita.x``).

Lazy re-exports resolved from strings (``importlib.import_module`` in a package ``__getattr__``)
are not seen, as with any static check; they are the façade of a package, not a layer's import.

When this fails, move the shared piece down into a module both sides can import (an interface,
constants, the data types), or move a function to the layer that owns its data. Hiding an import
inside a function does not help: those are counted.
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path

import pytest

import partita

# Cycles that could not be broken yet, each with the reason: none.
KNOWN_CYCLES: list[frozenset[str]] = []


def find_modules(package_dir: Path, package: str) -> dict[str, Path]:
    """Every module of the package under ``package_dir``, by dotted name (a package by its own name)."""
    modules = {package: package_dir / "__init__.py"}
    for info in pkgutil.iter_modules([str(package_dir)]):
        name = f"{package}.{info.name}"
        if info.ispkg:
            modules.update(find_modules(package_dir / info.name, name))
        else:
            modules[name] = package_dir / f"{info.name}.py"
    return modules


def _type_checking_only(tree: ast.Module) -> set[int]:
    """ids of the nodes in ``if TYPE_CHECKING:`` bodies (``typing.TYPE_CHECKING`` too); their ``else`` runs."""
    skip: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If):
            test = node.test
            name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
            if name == "TYPE_CHECKING":
                skip.update(id(inner) for statement in node.body for inner in ast.walk(statement))
    return skip


def _known(name: str, modules: dict[str, Path]) -> str | None:
    """The module ``name`` names, or its closest enclosing one (``pkg.mod.attr`` -> ``pkg.mod``)."""
    while name and name not in modules:
        name = name.rpartition(".")[0]
    return name or None


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> dict[str, list[int]]:
    """The modules of ``modules`` that ``module`` imports -> the lines that import them."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    skip = _type_checking_only(tree)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found: dict[str, list[int]] = {}
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: level 1 is this package, 2 its parent, ...
                parts = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parts + ([base] if base else []))
            targets = [base] + [f"{base}.{alias.name}" for alias in node.names]
        else:
            continue
        for target in targets:
            resolved = _known(target, modules)
            if resolved is not None and resolved != module:
                lines = found.setdefault(resolved, [])
                if node.lineno not in lines:
                    lines.append(node.lineno)
    return found


def import_graph(package_dir: Path, package: str) -> dict[str, dict[str, list[int]]]:
    modules = find_modules(package_dir, package)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, dict[str, list[int]]]) -> list[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for root in sorted(graph):
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, successors = work[-1]
            descended = False
            for successor in successors:
                if successor not in index:
                    index[successor] = low[successor] = len(index)
                    stack.append(successor)
                    on_stack.add(successor)
                    work.append((successor, iter(sorted(graph[successor]))))
                    descended = True
                    break
                if successor in on_stack:
                    low[node] = min(low[node], index[successor])
            if descended:
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(frozenset(component))
    return found


def describe(component: frozenset[str], graph: dict[str, dict[str, list[int]]]) -> str:
    edges = [f"  {source} -> {target} (line {', '.join(map(str, graph[source][target]))})"
             for source in sorted(component) for target in sorted(graph[source]) if target in component]
    return f"{len(component)} modules import each other:\n" + "\n".join(edges)


def test_partita_has_no_import_cycles() -> None:
    package_dir = Path(partita.__file__).parent
    graph = import_graph(package_dir, "partita")
    assert len(graph) > 100  # the walk found the whole package, not one directory of it
    new = [c for c in cycles(graph) if c not in KNOWN_CYCLES]
    assert not new, ("partita's imports must run one way (see tests/test_import_cycles.py for how to fix one):\n"
                     + "\n".join(describe(c, graph) for c in new))


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text, encoding="utf-8")
    return root / "pkg"


@pytest.mark.parametrize("back", [
    "from pkg.a import f\n",  # module level
    "def g():\n    from pkg.a import f\n",  # inside a function: still a cycle
    "from .a import f\n",  # relative
    "from . import a\n",  # the sibling, named through the package
    "import pkg.a\n",
])
def test_a_cycle_is_found_however_it_is_imported(tmp_path: Path, back: str) -> None:
    package_dir = _write(tmp_path, {"pkg/__init__.py": "", "pkg/a.py": "from pkg.b import g\ndef f(): ...\n",
                                    "pkg/b.py": back})
    graph = import_graph(package_dir, "pkg")
    assert cycles(graph) == [frozenset({"pkg.a", "pkg.b"})]
    assert describe(cycles(graph)[0], graph).splitlines()[1] == "  pkg.a -> pkg.b (line 1)"


def test_a_package_reexporting_a_submodule_that_imports_it_is_a_cycle(tmp_path: Path) -> None:
    package_dir = _write(tmp_path, {"pkg/__init__.py": "from pkg.a import f\n",
                                    "pkg/a.py": "from pkg import errors\ndef f(): ...\n", "pkg/errors.py": ""})
    assert cycles(import_graph(package_dir, "pkg")) == [frozenset({"pkg", "pkg.a"})]
    # Importing the submodule itself, not the package, is the fix.
    (package_dir / "a.py").write_text("import pkg.errors as errors\ndef f(): ...\n", encoding="utf-8")
    assert cycles(import_graph(package_dir, "pkg")) == []


def test_type_checking_imports_and_one_way_imports_are_not_cycles(tmp_path: Path) -> None:
    package_dir = _write(tmp_path, {
        "pkg/__init__.py": "",
        "pkg/low.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.high import H\n",
        "pkg/high.py": "from pkg.low import L\nfrom pkg.sub.leaf import x\n",
        "pkg/sub/__init__.py": "from pkg.sub.leaf import x\n",
        "pkg/sub/leaf.py": "import typing\nif typing.TYPE_CHECKING:\n    import pkg.sub\nelse:\n    import pkg.low\n",
    })
    graph = import_graph(package_dir, "pkg")
    assert graph["pkg.sub.leaf"] == {"pkg.low": [5]}  # the else branch runs; the TYPE_CHECKING body does not
    assert graph["pkg.high"] == {"pkg.low": [1], "pkg.sub.leaf": [2]}
    assert cycles(graph) == []


# Names moved down a layer to break a cycle, and the modules they were always imported from.
MOVED = {
    "partita.monitor.events": ("partita.monitor.monitors", ["Event", "Monitor"]),
    "partita.checkpoint.locations": ("partita.checkpoint.snapshot", ["checkpoint_state_dict", "param_names",
                                                                     "piece_files", "shard_file_of", "tensor_rank_files"]),
    "partita.tensor_parallel.styles": ("partita.tensor_parallel.apply", ["STYLES", "Style", "TensorParallelPlan"]),
    "partita.tensor_parallel.conv1d": ("partita.tensor_parallel.autotp", ["Conv1DColumnParallel", "Conv1DRowParallel",
                                                                          "is_hf_conv1d"]),
    "partita.zero.stream_eligibility": ("partita.zero.fold_choice", ["auto_streams", "check_streamed_step"]),
    "partita.estimate.phases": ("partita.estimate.result", ["ALWAYS", "BACKWARD", "CATEGORIES", "DEVICES",
                                                            "END_BACKWARD", "PHASES", "START_BACKWARD", "STEP",
                                                            "WRITE_BACK"]),
}


@pytest.mark.parametrize("new", sorted(MOVED))
def test_moved_names_keep_their_old_import_paths(new: str) -> None:
    old, names = MOVED[new]
    for name in names:
        assert getattr(importlib.import_module(old), name) is getattr(importlib.import_module(new), name), (old, name)
