"""The layers of the package: every module imports only from its own package or from a lower layer, and the
project's import graph has no cycle - imports inside functions counted.

Layers, lowest first (DESIGN.md, "Layers"): ``core`` (what a call is; it imports neither JAX nor torch) <
``tracing`` (a score_mod traced with JAX) < ``reference`` and ``graphs`` (the NumPy reference; the cuDNN graph
builder) < ``persist`` (plans on disk) < ``engine`` (running prepared calls) <
``fronts`` and ``jax_bridge`` (the array-library fronts) < ``torch`` (the torch front: custom operators over
the CuPy front, and transformers' attention; optional, nothing below or in the face imports it) < the package's face (``cudnn_attn/__init__.py``) <
``tools`` (command line, demo, self-test) < ``cudnn_attn.__main__``.  The imports are read from the sources (AST), so a
function-local import counts like a module-level one.

The same sources say that no two classes of the package share a name (a name says which class it is).
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = {"cudnn_attn": "cudnn_attn", "graphs": "cudnn_attn.graphs", "jax_bridge": "cudnn_attn.jax_bridge"}
LAYERS = [("cudnn_attn.core",), ("cudnn_attn.tracing",), ("cudnn_attn.reference", "cudnn_attn.graphs"), ("cudnn_attn.persist",),
          ("cudnn_attn.engine",), ("cudnn_attn.fronts", "cudnn_attn.jax_bridge"), ("cudnn_attn.torch",), ("cudnn_attn",),
          ("cudnn_attn.tools",), ("cudnn_attn.__main__",)]


def _modules() -> dict[str, Path]:
    found = {}
    for folder, package in FOLDERS.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join([package, *parts])] = path
    return found


MODULES = _modules()


def _target(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """``(imported project module, line, inside a function)`` of every import statement of ``module``."""
    tree = ast.parse(path.read_text())
    local = {id(node) for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
             for node in ast.walk(fn)}
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package
            for _ in range(max(node.level - 1, 0)):
                base = base.rpartition(".")[0]
            source = (f"{base}.{node.module}" if node.module else base) if node.level else node.module
            names = [f"{source}.{alias.name}" for alias in node.names if f"{source}.{alias.name}" in MODULES]
            if len(names) < len(node.names):
                names.append(source)
        else:
            continue
        for name in names:
            target = _target(name)
            if target is not None and target != module:
                found.append((target, node.lineno, id(node) in local))
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _layer(module: str) -> tuple[int, str]:
    """The layer of ``module``: the most specific package of :data:`LAYERS` that holds it."""
    best = None
    for level, packages in enumerate(LAYERS):
        for package in packages:
            if module == package or module.startswith(package + "."):
                if best is None or len(package) > len(best[1]):
                    best = (level, package)
    return best


def test_every_module_belongs_to_a_layer_below_the_face():
    face = [m for m in MODULES if _layer(m)[1] == "cudnn_attn"]
    assert face == ["cudnn_attn"], face


def test_imports_point_down_or_stay_in_their_package():
    wrong = []
    for module, imports in GRAPH.items():
        level, package = _layer(module)
        for target, line, _ in imports:
            target_level, target_package = _layer(target)
            if target_level > level or (target_level == level and target_package != package):
                wrong.append(f"{MODULES[module].relative_to(ROOT)}:{line}: {module} (layer {package}) imports "
                             f"{target} (layer {target_package})")
    assert not wrong, "\n".join(wrong)


def test_no_import_cycles_counting_imports_inside_functions():
    index, low, stack, on_stack, cycles = {}, {}, [], set(), []

    def visit(node: str) -> None:          # Tarjan's strongly connected components
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for target, _, _ in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for module in GRAPH:
        if module not in index:
            visit(module)
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


# Function-local imports of project modules that stay, each for the cost it defers.  A new one needs a reason
# here; the test fails when one disappears, so that the list stays true.
DEFERRED = {
    ("cudnn_attn.engine.cache", "cudnn_attn.persist.build"): "imports the cuDNN frontend (import cudnn_attn "
                                                             "must not: cudnn_attn.engine.preload does it "
                                                             "on a thread)",
    ("cudnn_attn.engine.cache", "cudnn_attn.graphs.target"): "imports the cuDNN frontend (GraphCache.deviceless)",
    ("cudnn_attn.engine.cache", "cudnn_attn.graphs.driver_stub"): "10 ms of imports (GraphCache.deviceless)",
    ("cudnn_attn.engine.autotune", "cudnn_attn.graphs.builder"): "imports the cuDNN frontend",
    ("cudnn_attn.engine.autotune", "cudnn_attn.persist.build"): "imports the cuDNN frontend",
    ("cudnn_attn.tools.cli", "cudnn_attn.persist.build"): "imports the cuDNN frontend (info and cache work "
                                                          "without it)",
    ("cudnn_attn.tools.cli", "cudnn_attn.graphs.target"): "imports the cuDNN frontend",
    ("cudnn_attn", "cudnn_attn.reference"): "the package's lazy attribute cudnn_attn.reference (module "
                                            "__getattr__): import cudnn_attn does not import the reference",
    ("cudnn_attn.tools.demo", "cudnn_attn.jax_bridge"): "imports JAX, which the demo uses only when installed",
}


def test_function_local_imports_are_the_deferred_ones():
    found = {(module, target) for module, imports in GRAPH.items() for target, _, inside in imports if inside}
    assert found == set(DEFERRED), (f"new: {sorted(found - set(DEFERRED))}; "
                                    f"gone: {sorted(set(DEFERRED) - found)}")


@pytest.mark.parametrize("package", ["cudnn_attn.core", "cudnn_attn.tracing", "cudnn_attn.persist", "cudnn_attn.engine",
                                     "cudnn_attn.fronts", "cudnn_attn.tools"])
def test_layer_packages_import_nothing(package):
    """These layers' ``__init__`` hold a docstring only, so importing one module of a layer imports no other."""
    assert not GRAPH[package], GRAPH[package]


def test_no_two_classes_share_a_name():
    """Every class statement of the package's modules (``cudnn_attn/``, ``graphs/``, ``jax_bridge/``; nested and
    function-local classes too) has a name no other one has, so a name in a message, a docstring or a
    stored key says which class it is."""
    where: dict[str, list[str]] = {}
    for module, path in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                where.setdefault(node.name, []).append(f"{module} ({path.relative_to(ROOT)}:{node.lineno})")
    shared = {name: places for name, places in where.items() if len(places) > 1}
    assert not shared, "classes sharing a name:\n" + "\n".join(
        f"{name}: {', '.join(places)}" for name, places in sorted(shared.items()))


def _third_party_imports(path: Path) -> list[tuple[str, int]]:
    """``(top-level module, line)`` of every absolute import statement in ``path``, inside functions too, and of
    every ``importlib.import_module("...")`` / ``__import__("...")`` with a literal name."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found += [(alias.name.partition(".")[0], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.append((node.module.partition(".")[0], node.lineno))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant) and \
                isinstance(node.args[0].value, str) and getattr(node.func, "attr", getattr(node.func, "id", "")) in \
                ("import_module", "__import__"):
            found.append((node.args[0].value.partition(".")[0], node.lineno))
    return found


def test_core_imports_neither_jax_nor_torch():
    """``core`` says what a call is for every front: no module of it imports JAX or torch, not even inside a
    function (tracing a score_mod is :mod:`cudnn_attn.tracing`'s; JAX arrays are asked for their namespace)."""
    wrong = [f"{path.relative_to(ROOT)}:{line}: imports {name}" for module, path in MODULES.items()
             if _layer(module)[1] == "cudnn_attn.core"
             for name, line in _third_party_imports(path) if name in ("jax", "jaxlib", "torch", "flax")]
    assert not wrong, "\n".join(wrong)


def test_front_signatures_are_written_out_and_match_the_parameter_table():
    """Every public front function has its signature in its source (no function made at run time), and
    ``parameters.front`` checked it against the one table when the module was imported."""
    import inspect

    import cudnn_attn
    from cudnn_attn import jax_bridge, reference
    from cudnn_attn.core import parameters

    fronts = [cudnn_attn.attention, cudnn_attn.dot_product_attention, cudnn_attn.paged_attention,
              cudnn_attn.dot_product_attention_bwd, jax_bridge.attention, jax_bridge.dot_product_attention,
              jax_bridge.paged_attention, reference.attention, reference.dot_product_attention,
              reference.paged_attention, reference.dot_product_attention_bwd]
    for function in fronts:
        source = inspect.getsource(function)
        assert f"def {function.__name__}(" in source and function.__code__.co_filename.endswith(".py"), function
        names = list(inspect.signature(function).parameters)
        body = ast.parse(textwrap.dedent(source)).body[0].body
        call = next(node.value for node in body if isinstance(node, ast.Assign)
                    and isinstance(node.value, ast.Call) and getattr(node.value.func, "attr", "") == "arguments")
        assert [a.id for a in call.args] == names, f"{function.__qualname__} binds its parameters out of order"
        form = function.arguments.form
        assert [p.name for p in inspect.signature(function).parameters.values()][:len(form.positional)] == \
            list(form.positional)

    def drifted(query, key, value, *, mask=None):     # the table's native form has more parameters
        return None

    with pytest.raises(TypeError, match="differs from the parameter table"):
        parameters.front(parameters.NATIVE)(drifted)
