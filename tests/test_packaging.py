"""Every third-party module the package imports is a declared dependency of pyproject.toml.

`pip install .` installs only [project] dependencies; an import satisfied here only because the
test extra (or something else) happens to be installed breaks the user's `mindspec serve` (httpx
in the PD router was such a case). Modules of optional backends/tools, imported only when chosen,
are allowed if an extra declares them, and importing the entry points must not pull them in.
"""
import ast
import importlib.metadata
import importlib.util
import subprocess
import sys
import tomllib
from collections import defaultdict
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_DIRS = ("mindspec", "backends", "plugins", "models")
OWN_MODULES = {"mindspec"}
# module -> (extra, distribution): imported only where that extra's feature is chosen.
OPTIONAL = {
    "triton": ("cuda", "triton"),
    "torch_npu": ("npu", "torch-npu"),
    "matplotlib": ("bench", "matplotlib"),
    "jsonschema": ("bench", "jsonschema"),  # the structured scenario's validity check (also in test)
    "llguidance": ("bench", "llguidance"),  # the structured scenario's grammar-engine comparison
}


def _project() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def _names(requirements: list[str]) -> set[str]:
    return {canonicalize_name(Requirement(r).name) for r in requirements}


def _runtime() -> set[str]:
    return _names(_project()["dependencies"])


def _extra(name: str) -> set[str]:
    return _names(_project()["optional-dependencies"][name])


def _import_module_literal(node: ast.AST):
    """``importlib.import_module("x.y")`` with a literal name (how torch_npu is loaded lazily)."""
    if not (isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant)):
        return None
    func = node.func
    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
    return node.args[0].value if called == "import_module" and isinstance(node.args[0].value, str) else None


def imported_modules(files) -> dict[str, list[str]]:
    """Top-level module name -> 'file:line' of each absolute import in ``files``."""
    found = defaultdict(list)
    for path in files:
        for node in ast.walk(ast.parse(Path(path).read_text(), filename=str(path))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module] if node.level == 0 and node.module else []
            else:
                literal = _import_module_literal(node)
                names = [literal] if literal else []
            for name in names:
                found[name.split(".")[0]].append(f"{path}:{node.lineno}")
    return dict(found)


def third_party(found: dict[str, list[str]]) -> dict[str, list[str]]:
    return {m: where for m, where in found.items() if m not in sys.stdlib_module_names and m not in OWN_MODULES}


def undeclared(found: dict[str, list[str]], declared: set[str]) -> list[str]:
    """One message per imported module that no declared distribution provides."""
    providers = importlib.metadata.packages_distributions()
    problems = []
    for module, where in sorted(found.items()):
        dists = {canonicalize_name(d) for d in providers.get(module, [])}
        if not dists:
            problems.append(f"{module} (imported at {where[0]}) is not installed, so no distribution provides it")
        elif not dists & declared:
            problems.append(f"{module} (imported at {where[0]}) comes from {sorted(dists)}, not a declared dependency")
    return problems


def _package_files():
    return [p for d in PACKAGE_DIRS for p in sorted((ROOT / d).rglob("*.py"))]


def test_every_import_is_a_declared_dependency():
    found = third_party(imported_modules(_package_files()))
    required = {m: w for m, w in found.items() if m not in OPTIONAL}
    assert "httpx" in required and "torch" in required  # the scan sees the PD router and the model
    assert undeclared(required, _runtime()) == []


@pytest.mark.parametrize("module", sorted(OPTIONAL))
def test_optional_modules_are_imported_and_declared_in_their_extra(module):
    extra, dist = OPTIONAL[module]
    # an allowlist entry for a module nothing imports any more would hide the next one
    assert module in imported_modules(_package_files()), f"{module} is allowlisted but not imported"
    assert canonicalize_name(dist) in _extra(extra), f"{dist} is missing from the [{extra}] extra"
    assert canonicalize_name(dist) not in _runtime()


def test_scan_reports_an_undeclared_import(tmp_path):
    # The checker itself: a module from an installed but undeclared distribution, one that is not
    # installed at all, and a lazy literal import_module are all reported.
    src = tmp_path / "m.py"
    src.write_text("import os\nimport pytest\nfrom no_such_module_xyz import a\n"
                   "import importlib\nimportlib.import_module('another_missing_xyz.sub')\n")
    found = third_party(imported_modules([src]))
    assert sorted(found) == ["another_missing_xyz", "no_such_module_xyz", "pytest"]
    problems = undeclared(found, _runtime())
    assert len(problems) == 3 and any("pytest" in p and "not a declared dependency" in p for p in problems)


def test_entry_points_import_without_optional_modules():
    # Blocking a module in sys.modules makes any import of it fail, as if it were not installed.
    blocked = "".join(f"sys.modules[{m!r}] = None\n" for m in OPTIONAL)
    code = ("import sys\n" + blocked + "import mindspec.cli, mindspec.llm, mindspec.service.server, "
            "mindspec.service.pd_router, mindspec.backends.cpu.backend\n")
    res = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert res.returncode == 0, res.stderr


def test_text_generation_imports_are_in_the_test_extra():
    # text-generation is installed with --no-deps (its huggingface-hub<1.0 pin would downgrade
    # transformers), so the test extra must provide everything it imports.
    spec = importlib.util.find_spec("text_generation")
    if spec is None:
        pytest.skip("text-generation is not installed (pip install --no-deps text-generation==0.7.0)")
    found = third_party(imported_modules(sorted(Path(spec.origin).parent.rglob("*.py"))))
    found.pop("text_generation")
    assert {"aiohttp", "huggingface_hub", "pydantic", "requests"} <= set(found)
    assert undeclared(found, _runtime() | _extra("test")) == []
