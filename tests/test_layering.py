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
