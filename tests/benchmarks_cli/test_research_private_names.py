"""benchmarks/research/ (probes and sweeps, out of CI) reaches the product only through public
names: no probe imports, reads, patches or getattr()s a leading-underscore name of a product
module, nor of an object it built from one, so that renaming a private name in the product never
breaks a probe unseen. Checked statically with `ast` (the probes need a GPU to run)."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
RESEARCH = ROOT / "benchmarks" / "research"


def product_packages() -> set[str]:
    """The top-level packages the project installs (pyproject's package include list)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {p.rstrip("*") for p in cfg["tool"]["setuptools"]["packages"]["find"]["include"]}


PRODUCT = product_packages()


def private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def in_product(module: str | None) -> bool:
    return module is not None and module.split(".")[0] in PRODUCT


def root_name(node: ast.AST) -> str | None:
    """The name an expression starts from: `a` in `a.b(c)[0].d`."""
    while isinstance(node, (ast.Attribute, ast.Call, ast.Subscript, ast.Await, ast.Starred)):
        node = node.func if isinstance(node, ast.Call) else node.value
    return node.id if isinstance(node, ast.Name) else None


def bound_names(target: ast.AST) -> list[str]:
    if isinstance(target, ast.Name):
        return [target.id]
    if isinstance(target, (ast.Tuple, ast.List)):
        return [n for elt in target.elts for n in bound_names(elt)]
    return []


def violations(source: str) -> list[str]:
    """Every place `source` reaches a private name of a product module, as 'line: what'.

    Product-bound names are those imported from a product package and, transitively, those
    assigned from an expression that starts from one (`graph = DecodeGraph(...)`): an attribute
    chain from such a name may not contain a private name. Scopes are not told apart, which errs
    on the side of flagging."""
    tree = ast.parse(source)
    found: list[str] = []
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if in_product(alias.name):
                    if any(private(part) for part in alias.name.split(".")):
                        found.append(f"{node.lineno}: import {alias.name}")
                    bound.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and in_product(node.module):
            if any(private(part) for part in node.module.split(".")):
                found.append(f"{node.lineno}: from {node.module}")
            for alias in node.names:
                if private(alias.name):
                    found.append(f"{node.lineno}: from {node.module} import {alias.name}")
                bound.add(alias.asname or alias.name)
    assignments: list[tuple[list[str], ast.AST]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            assignments.append(([n for t in node.targets for n in bound_names(t)], node.value))
        elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
            assignments.append((bound_names(node.target), node.value))
        elif isinstance(node, (ast.For, ast.AsyncFor, ast.comprehension)):
            assignments.append((bound_names(node.target), node.iter))
        elif isinstance(node, (ast.With, ast.AsyncWith)):
            assignments += [(bound_names(i.optional_vars), i.context_expr) for i in node.items if i.optional_vars]
    changed = True
    while changed:  # until every name assigned from a product-bound one is bound too
        changed = False
        for names, value in assignments:
            if root_name(value) in bound and not bound.issuperset(names):
                bound.update(names)
                changed = True
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and private(node.attr) and root_name(node) in bound:
            found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif (isinstance(node, ast.Call) and isinstance(node.func, ast.Name)
              and node.func.id in ("getattr", "setattr", "hasattr", "delattr") and len(node.args) >= 2
              and root_name(node.args[0]) in bound and isinstance(node.args[1], ast.Constant)
              and isinstance(node.args[1].value, str) and private(node.args[1].value)):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return sorted(set(found), key=lambda s: int(s.split(":")[0]))


RESEARCH_FILES = sorted(RESEARCH.rglob("*.py"))


def test_the_research_folder_is_where_the_probes_are():
    assert len(RESEARCH_FILES) >= 10


@pytest.mark.parametrize("path", RESEARCH_FILES, ids=lambda p: str(p.relative_to(RESEARCH)))
def test_a_research_script_reaches_no_private_product_name(path):
    assert violations(path.read_text()) == [], f"{path.relative_to(ROOT)} uses private product names"


@pytest.mark.parametrize("snippet", [
    "from model.kernels.gemm.fp8_gemm import BLOCK, _a8_tile",
    "from model.kernels.gemm import fp8_gemm\nfp8_gemm._fp8_gemm_kernel",
    "import model.kernels.moe.moe_tile_kernels as k\nk._down_kernel",
    "import model.kernels.mhc.mhc\nmodel.kernels.mhc.mhc._entry_small_kernel = None",
    "from model.cuda_graph import DecodeGraph\ngraph = DecodeGraph(1)\ngraph._load([], [])",
    "from kvtransfer import Agent\nwith Agent('a') as agent:\n    n = agent._nixl",
    "from kvtransfer import Agent\nagent = Agent('a')\nalias = agent\nalias._nixl.transfer",
    "from model import moe\ngetattr(moe, '_secret')",
    "from router._internal import x",
])
def test_private_product_names_are_found(snippet):
    assert violations(snippet)


@pytest.mark.parametrize("snippet", [
    "from benchmarks.flash_model import _tile_random",
    "from model.kernels.gemm.fp8_gemm import a8_tile\na8_tile.__name__",
    "import torch\nx = torch.empty(1)\nx._version",
    "from model.cuda_graph import DecodeGraph\nclass P:\n    def f(self):\n        self._x = DecodeGraph",
])
def test_public_product_names_and_other_modules_private_names_pass(snippet):
    assert violations(snippet) == []
