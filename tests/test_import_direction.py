"""The gateway is the engine's client, never the other way round: no module under engine_svc/, kernels/
or tokenizer_svc/ imports gateway, statically (any ``import``/``from`` anywhere in a file, functions
included) or by name (``importlib.import_module("gateway...")``, ``__import__``)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BELOW_THE_GATEWAY = ("engine_svc", "kernels", "tokenizer_svc")
FORBIDDEN = "gateway"


def _is_forbidden(module: str | None) -> bool:
    return module is not None and (module == FORBIDDEN or module.startswith(FORBIDDEN + "."))


def gateway_imports(source: str, filename: str = "<source>") -> list[str]:
    """Every place in ``source`` that imports the gateway, as 'line N: what'."""
    found = []
    for node in ast.walk(ast.parse(source, filename)):
        if isinstance(node, ast.Import):
            found += [f"line {node.lineno}: import {a.name}" for a in node.names if _is_forbidden(a.name)]
        elif isinstance(node, ast.ImportFrom):
            # Relative imports stay inside their own top-level package, which is not the gateway.
            if node.level == 0 and _is_forbidden(node.module):
                found.append(f"line {node.lineno}: from {node.module} import ...")
        elif isinstance(node, ast.Call) and node.args:
            func = node.func
            name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
            first = node.args[0]
            if (
                name in ("import_module", "__import__")
                and isinstance(first, ast.Constant)
                and isinstance(first.value, str)
                and _is_forbidden(first.value)
            ):
                found.append(f"line {node.lineno}: {name}({first.value!r})")
    return found


def python_files() -> list[Path]:
    files = [p for pkg in BELOW_THE_GATEWAY for p in sorted((ROOT / pkg).rglob("*.py"))]
    assert len(files) > 30, "the packages were not found where this test looks"
    return files


def test_no_module_below_the_gateway_imports_it():
    offenders = {
        str(p.relative_to(ROOT)): hits
        for p in python_files()
        if (hits := gateway_imports(p.read_text(encoding="utf-8"), str(p)))
    }
    assert not offenders, f"these import the gateway (move what they use to engine_svc/rpc/): {offenders}"


@pytest.mark.parametrize(
    "source",
    [
        "import gateway",
        "import os, gateway.tls as t",
        "from gateway import defaults",
        "from gateway.defaults import ENGINE_TCP_PORT",
        "def f():\n    from gateway.log_setup import setup_logging\n",
        "import importlib\nimportlib.import_module('gateway.tls')",
        "__import__('gateway')",
    ],
)
def test_the_check_sees_each_way_of_importing_the_gateway(source):
    assert gateway_imports(source)


@pytest.mark.parametrize(
    "source",
    [
        "import gateways",
        "from gateway_tools import x",
        "from .gateway import x",  # a sibling module of that name, not the top-level package
        "name = 'gateway'",
        "from engine_svc.rpc.tls import ClientTLS",
    ],
)
def test_the_check_leaves_other_imports_alone(source):
    assert not gateway_imports(source)


def test_the_engine_server_loads_without_the_gateway():
    """What the engine process imports at start, transitively, holds no gateway module."""
    code = (
        "import sys\n"
        "import engine_svc.server.main, engine_svc.server.health\n"
        "print(sorted(m for m in sys.modules if m == 'gateway' or m.startswith('gateway.')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


def test_the_gateway_uses_only_the_shared_engine_modules():
    """What both ends of engine.v1 use lives in engine_svc/rpc/; engine_svc/server/ is the engine
    process's own. The one exception is the ``llmserve engine`` command, which runs that process."""
    offenders = {}
    for p in sorted((ROOT / "gateway").rglob("*.py")):
        for node in ast.walk(ast.parse(p.read_text(encoding="utf-8"), str(p))):
            names = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            bad = [n for n in names if n == "engine_svc.server" or n.startswith("engine_svc.server.")]
            if bad and not (p.name == "cli.py" and bad == ["engine_svc.server.main"]):
                offenders.setdefault(str(p.relative_to(ROOT)), []).append(f"line {node.lineno}: {bad}")
    assert not offenders, f"the gateway imports the engine process's modules: {offenders}"
