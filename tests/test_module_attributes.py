"""Every ``module.name`` the project reads of one of its own modules exists.

Much of the library runs only on a GPU (the CuPy front's launches, the bound calls), so a function that one
module deletes while another still calls it through its module (``prepared.descriptor(x)``) would pass the CPU
suite and fail on the GPU alone.  This test reads every source file (AST), finds the names bound to project
modules by imports (``from cudnn_attn.engine import prepared``, ``from . import runtime``, ``import x.y as z``),
and checks that each attribute read through such a name exists on the imported module.  The library's sources,
the tests (the GPU tier's among them) and the benchmarks are read.
"""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest
from test_layers import MODULES

ROOT = Path(__file__).resolve().parent.parent
SOURCES = MODULES            # the project's modules by dotted name (test_layers reads the same tree)


def _module_names(module: str, path: Path, tree: ast.AST) -> dict[str, str]:
    """Local name -> project module, for every import that binds a project module to a name."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.asname and alias.name in SOURCES:
                    names[alias.asname] = alias.name
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            source = node.module if node.level == 0 else ".".join(p for p in (base, node.module) if p)
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in SOURCES:
                    names[alias.asname or alias.name] = full
    return names


def _stored(scope: ast.AST) -> set[str]:
    """Names a function (or the module) binds itself: assignment targets, loop and ``with`` targets, parameters."""
    names = {node.id for node in ast.walk(scope) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    if isinstance(scope, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
        arguments = scope.args
        names |= {a.arg for a in arguments.posonlyargs + arguments.args + arguments.kwonlyargs}
        names |= {a.arg for a in (arguments.vararg, arguments.kwarg) if a is not None}
    return names


def _reads(module: str, path: Path) -> list[tuple[str, str, int]]:
    """``(project module, attribute, line)`` of every ``name.attribute`` read through a module name that no
    enclosing function rebinds."""
    tree = ast.parse(path.read_text())
    names = _module_names(module, path, tree)
    module_stores = {node.id for node in tree.body if isinstance(node, (ast.Assign, ast.AnnAssign))
                     for node in ast.walk(node) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store)}
    found = []

    def visit(node: ast.AST, shadowed: frozenset) -> None:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            shadowed = shadowed | _stored(node)
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names \
                and node.value.id not in shadowed:
            found.append((names[node.value.id], node.attr, node.lineno))
        for child in ast.iter_child_nodes(node):
            visit(child, shadowed)

    visit(tree, frozenset(module_stores))
    return found


def test_the_scan_finds_module_reads():
    found = {(target, attribute) for target, attribute, _ in _reads("cudnn_attn.fronts.cupy",
                                                                    SOURCES["cudnn_attn.fronts.cupy"])}
    assert ("cudnn_attn.engine.prepared", "descriptor") in found
    assert ("cudnn_attn.engine.runtime", "cupy") in found


# The tests and benchmarks read the library the same way (the GPU tier runs on the GPU machine alone).
USERS = {f"{path.parent.name}.{path.stem}": path for folder in ("tests", "benchmarks")
         for path in sorted((ROOT / folder).rglob("*.py"))}


@pytest.mark.parametrize("module", sorted(SOURCES) + sorted(USERS))
def test_every_attribute_read_through_a_project_module_exists(module):
    path = SOURCES.get(module) or USERS[module]
    missing = []
    for target, attribute, line in _reads(module, path):
        try:
            imported = importlib.import_module(target)
        except ImportError:                   # an optional dependency (torch): its reads are checked where it imports
            continue
        if not hasattr(imported, attribute):
            missing.append(f"{path.relative_to(ROOT)}:{line}: {target}.{attribute}")
    assert not missing, "reads of names the module does not define:\n" + "\n".join(missing)
