"""The product packages hold only what the running service imports: every module under gateway/,
engine_svc/, kernels/ and tokenizer_svc/ is reachable by imports from an entry point (the
``llmserve`` script, a ``python -m`` the Makefile or the service itself runs, the offline API).
Test and benchmark helpers live under tests/ and benchmarks/; set-up scripts under scripts/."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("gateway", "engine_svc", "kernels", "tokenizer_svc")


def product_modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Modules of ours that ``name`` imports anywhere in its body (lazy imports included), and the
    modules it names as strings, which is how a process is spawned (``-m tokenizer_svc.worker``)."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            found.add(base)
            found.update(f"{base}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in modules:
            found.add(node.value)
        elif _discovers_its_modules(node) and path.name == "__init__.py":
            # a package that imports every module of its own (pkgutil.iter_modules(__path__)), as
            # engine_svc/models/arch does: each of them is imported when the package is
            found.update(m for m in modules if m.rpartition(".")[0] == name)
    return {m for m in found if m in modules}


def _discovers_its_modules(node: ast.AST) -> bool:
    return (
        isinstance(node, ast.Call)
        and ast.unparse(node.func) == "pkgutil.iter_modules"
        and len(node.args) == 1
        and ast.unparse(node.args[0]) == "__path__"
    )


def entry_points(modules: dict[str, Path]) -> set[str]:
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"].get("scripts", {})
    entries = {target.split(":")[0] for target in scripts.values()}
    made = re.findall(r"-m ([\w.]+)", (ROOT / "Makefile").read_text())
    entries |= {m for m in made if m in modules}
    # The set-up scripts make runs (make model: scripts.default_model) import what they build with;
    # the GPU check is verification tooling, like the tests, and counts for nothing.
    for script in {m for m in made if m.startswith("scripts.") and m != "scripts.gpu_check"}:
        path = ROOT / (script.replace(".", "/") + ".py")
        entries |= imports_of(script, path, modules)
    entries |= {m for m in modules if m.endswith("__main__")}
    entries |= set(PACKAGES)  # the public API: `from engine_svc import LLM`, `from gateway.client import ...`
    return entries


def reachable(modules: dict[str, Path]) -> set[str]:
    seen: set[str] = set()
    todo = list(entry_points(modules))
    while todo:
        name = todo.pop()
        if name in seen or name not in modules:
            continue
        seen.add(name)
        parents = [".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)]
        todo += parents + sorted(imports_of(name, modules[name], modules))
    return seen


def test_every_product_module_is_imported_by_the_service():
    modules = product_modules()
    unused = sorted(set(modules) - reachable(modules))
    assert not unused, (
        f"modules in the product packages that no entry point imports (move test or benchmark "
        f"helpers under tests/ or benchmarks/): {unused}"
    )


def test_the_check_finds_a_module_nothing_imports(tmp_path):
    modules = product_modules()
    modules["kernels.orphan_helper"] = tmp_path / "orphan_helper.py"
    (tmp_path / "orphan_helper.py").write_text("import torch\n")
    assert "kernels.orphan_helper" not in reachable(modules)
    assert "gateway.cli" in reachable(modules) and "engine_svc.server.main" in reachable(modules)


def test_a_package_that_imports_its_own_modules_reaches_them(tmp_path):
    """The architectures' package imports each of its modules through pkgutil: every one of them is
    reachable through it, and a module elsewhere is not made reachable by that."""
    modules = product_modules()
    arch = {m for m in modules if m.startswith("engine_svc.models.arch.")}
    assert len(arch) >= 10 and arch <= reachable(modules)
    modules["kernels.orphan_helper"] = tmp_path / "orphan_helper.py"
    (tmp_path / "orphan_helper.py").write_text("import torch\n")
    assert "kernels.orphan_helper" not in reachable(modules)
