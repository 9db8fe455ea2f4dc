"""Layers point down (docs/design.md): each package imports only the packages below it, and the two
workers never import each other. Read from the source with `ast`, so a violation fails here
before it turns into an import cycle somewhere else."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# package → the project packages it may import (besides itself)
ALLOWED = {
    "model": set(),
    "kvtransfer": set(),  # the transport moves regions that model/ describes: it knows no model
    "worker_runtime": {"model", "kvtransfer"},
    "prefill_worker": {"model", "kvtransfer", "worker_runtime"},
    "decode_worker": {"model", "kvtransfer", "worker_runtime"},
    "router": {"model", "kvtransfer", "worker_runtime"},
    "cluster": {"model", "kvtransfer", "worker_runtime", "prefill_worker", "decode_worker", "router"},
}


def imported_packages(path: Path) -> set[str]:
    """Top-level project packages `path` imports (absolute imports, lazy ones inside functions too)."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names = [node.module]
        else:
            continue
        found |= {name.split(".")[0] for name in names} & set(ALLOWED)
    return found


@pytest.mark.parametrize("package", sorted(ALLOWED))
def test_package_imports_only_the_layers_below(package):
    wrong = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        bad = imported_packages(path) - ALLOWED[package] - {package}
        if bad:
            wrong[str(path.relative_to(ROOT))] = sorted(bad)
    assert not wrong, f"{package} may import only {sorted(ALLOWED[package])}: {wrong}"


def test_the_check_sees_an_upward_import(tmp_path):
    bad = tmp_path / "m.py"
    bad.write_text("def f():\n    from cluster.launcher import LocalCluster\n    import decode_worker.engine\n")
    assert imported_packages(bad) == {"cluster", "decode_worker"}
