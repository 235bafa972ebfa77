"""Imports only go down: pallas_kernels <- sparse_jax <- models <- benchmarks.

Checked on the source (every import statement, lazy ones inside functions
included), so a lazy upward import cannot hide."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LAYERS = ["pallas_kernels", "sparse_jax", "models", "benchmarks"]


def imported_packages(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name.split(".")[0] for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module.split(".")[0])
    return out


@pytest.mark.parametrize("package", LAYERS[:-1])
def test_imports_only_go_down(package):
    above = set(LAYERS[LAYERS.index(package) + 1:])
    bad = {str(p.relative_to(ROOT)): sorted(imported_packages(p) & above)
           for p in sorted((ROOT / package).rglob("*.py"))}
    bad = {p: pkgs for p, pkgs in bad.items() if pkgs}
    assert not bad, f"{package} imports packages above it: {bad}"


def test_the_check_sees_lazy_imports(tmp_path):
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from models.api import load_model\n    import benchmarks.timing\n")
    assert imported_packages(f) == {"models", "benchmarks"}


#: the rooms of models/, bottom to top: the model, the runners over it, serving, the command
#: lines (models/generate.py and models/serve.py are the CLI's entry modules: top)
MODEL_ROOMS = ["models", "models.runtime", "models.serving", "models.cli"]
ENTRY_MODULES = {"models/generate.py", "models/serve.py", "models/__init__.py"}


def _room(path: Path) -> str:
    rel = path.relative_to(ROOT)
    if str(rel) in ENTRY_MODULES:
        return "models.cli"
    parts = rel.parts
    return "models" if len(parts) == 2 else f"models.{parts[1]}"


def _imported_modules(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # from models import runtime
    return out


def test_models_rooms_only_import_down():
    bad = {}
    for p in sorted((ROOT / "models").rglob("*.py")):
        room = MODEL_ROOMS.index(_room(p))
        above = MODEL_ROOMS[room + 1:]
        up = sorted(m for m in _imported_modules(p) if any(m == r or m.startswith(r + ".") for r in above))
        if up:
            bad[str(p.relative_to(ROOT))] = up
    assert not bad, f"modules import rooms above their own: {bad}"


@pytest.mark.parametrize("package", LAYERS[:-1])
def test_no_function_level_imports_of_the_project(package):
    """Imports of the project's own modules sit at module level, where the import graph
    shows them (a function-level one hides a circle or an arrow up)."""
    bad = []
    for p in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(p.read_text(), str(p))
        for fn in ast.walk(tree):
            if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            for node in ast.walk(fn):
                names = ([a.name for a in node.names] if isinstance(node, ast.Import) else
                         [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module
                         else [])
                if any(n.split(".")[0] in LAYERS for n in names):
                    bad.append(f"{p.relative_to(ROOT)}:{node.lineno}")
    assert not bad, f"function-level imports of the project's modules: {sorted(set(bad))}"
