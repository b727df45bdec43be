"""The layers of distckpt hold: no module imports from a layer above its own, the import graph has
no cycles, and distckpt's own modules are imported at module top (a function-level import hides a
dependency; only optional third-party packages are imported where they are used).

The layers, top to bottom (``docs/architecture.md`` draws them):

0. facade and applications: ``distckpt`` (its ``__init__``), ``checkpointer``, ``tools``, ``integrations``;
1. the save and load drivers and phases: ``save``, ``load``, and the ``options`` they take;
2. the state model, storage and integrity: ``state``, ``storage``, ``integrity``;
3. the base: ``errors``, ``_dist``, ``_compat``, ``_process``, ``_version``, ``_ints``.

A module may import from its own layer or any layer below; the whole graph (module-level and
function-level imports alike) must be acyclic.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "distckpt"

LAYERS: dict[str, int] = {
    "distckpt": 0,
    "distckpt.__main__": 0,
    "distckpt.checkpointer": 0,
    "distckpt.tools": 0,
    "distckpt.integrations": 0,
    "distckpt.options": 1,
    "distckpt.save": 1,
    "distckpt.load": 1,
    "distckpt.state": 2,
    "distckpt.storage": 2,
    "distckpt.integrity": 2,
    "distckpt.errors": 3,
    "distckpt._dist": 3,
    "distckpt._compat": 3,
    "distckpt._process": 3,
    "distckpt._version": 3,
    "distckpt._ints": 3,
    "distckpt._shown": 3,
    "distckpt._caller": 3,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        out[name] = path
    return out


def _layer(module: str) -> int:
    best = None
    for prefix, layer in LAYERS.items():
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, layer)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS (and docs/architecture.md)"
    return best[1]


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[str, int, bool]]:
    """``(imported distckpt module, line, at module top)`` for every import in ``module``."""
    tree = ast.parse(path.read_text())
    # Imports inside functions are hidden dependencies; module-level ones (``if TYPE_CHECKING:`` too) are not.
    inner = {id(n) for f in ast.walk(tree) if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)) for n in ast.walk(f)}
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rsplit(".", 1)[0] if "." in name else ""
            if name.startswith("distckpt") and name != module:
                found.append((name, node.lineno, id(node) not in inner))
    return found


def test_no_module_imports_from_a_layer_above_its_own():
    modules = _modules()
    upward = [
        f"{m} (layer {_layer(m)}) imports {t} (layer {_layer(t)}) at line {line}"
        for m, path in sorted(modules.items())
        for t, line, _ in _imports(m, path, modules)
        if _layer(t) < _layer(m) and not (m == "distckpt" or m.startswith("distckpt.") and t == "distckpt")
    ]
    assert upward == [], "\n".join(upward)


def test_the_import_graph_has_no_cycles():
    modules = _modules()
    graph = {m: sorted({t for t, _, _ in _imports(m, p, modules) if t != "distckpt"}) for m, p in modules.items()}
    cycles, index, low, stack, on = [], {}, {}, [], set()

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph.get(v, []):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert cycles == [], f"import cycles: {cycles}"


def test_distckpt_modules_are_imported_at_module_top():
    modules = _modules()
    hidden = [
        f"{m}:{line} imports {t} inside a function"
        for m, path in sorted(modules.items())
        for t, line, at_top in _imports(m, path, modules)
        if not at_top and t != "distckpt"
    ]
    assert hidden == [], "\n".join(hidden)


def test_every_module_has_a_layer():
    for module in _modules():
        _layer(module)
