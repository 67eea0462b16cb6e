"""Architectures are declared in one place (engine_svc/models/arch/): every module there is found
and registered without a list of them; the random tiny test models, and the GGUF files tests write,
come from the declaration; and no registry of architecture names outside the package lists them
again (a dict keyed by most of them, or a branch on a tuple of their names): adding an architecture
of a known kind is its module and its test file (docs/architecture.md, "Adding an architecture")."""

from __future__ import annotations

import ast
import math
import re
import sys
from pathlib import Path

import pytest

from engine_svc.models import arch as archs

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "engine_svc" / "models" / "arch"
SKIPPED = {"llmserve_proto", "__pycache__", "node_modules"}  # (and the top-level models/)


def spellings() -> set[str]:
    """Every name an architecture goes by: HF's class, GGUF's, transformers' model_type, the
    tiny model's short name."""
    out = set()
    for a in archs.all_archs():
        out |= {a.name, a.gguf, a.gguf_converted, a.model_type, a.short_name} - {None}
    return out


def registries(source: str, names: set[str], threshold: int) -> list[str]:
    """Where ``source`` lists architectures: a dict, set, list or tuple literal naming at least
    ``threshold`` of ``names`` (keys or elements), a string naming as many (a list written out, as
    an expected error message), or a membership test against a literal of two or more
    (``arch in ("qwen3", "gemma3")``: a branch on names)."""

    def named(elements) -> set[str]:
        return {e.value for e in elements if isinstance(e, ast.Constant) and e.value in names}

    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Dict):
            hits = named(node.keys)
        elif isinstance(node, ast.Tuple | ast.List | ast.Set):
            hits = named(node.elts)
        else:
            hits = set()
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            hits = set(re.findall(r"[A-Za-z0-9_]+", node.value)) & names  # a list written out
        if len(hits) >= threshold:
            found.append(f"line {node.lineno}: a {type(node).__name__.lower()} of {sorted(hits)}")
        if isinstance(node, ast.Compare):
            for op, right in zip(node.ops, node.comparators, strict=True):
                if isinstance(op, ast.In | ast.NotIn) and isinstance(right, ast.Tuple | ast.List | ast.Set):
                    hits = named(right.elts)
                    if len(hits) >= 2:
                        found.append(f"line {node.lineno}: a branch on {sorted(hits)}")
    return found


def python_files() -> list[Path]:
    out = []
    for path in ROOT.rglob("*.py"):
        rel = path.relative_to(ROOT)
        if rel.parts[0] == "models" or any(p.startswith(".") or p in SKIPPED for p in rel.parts[:-1]):
            continue
        if PACKAGE in path.parents:
            continue
        out.append(path)
    return out


def threshold() -> int:
    return max(3, math.ceil(len(archs.names()) / 2))


def test_no_registry_of_architectures_outside_the_package():
    names = spellings()
    files = python_files()
    assert ROOT / "engine_svc" / "models" / "build.py" in files and ROOT / "tests" / "gguf_files.py" in files
    found = {}
    for path in files:
        if hits := registries(path.read_text(), names, threshold()):
            found[str(path.relative_to(ROOT))] = hits
    assert not found, (
        "architectures listed outside engine_svc/models/arch/ (declare it there instead): " + repr(found)
    )


def test_the_scan_finds_a_registry_and_a_branch_on_names():
    """The check above can fail: a dict keyed by every tiny model's name, and a branch on two."""
    names = spellings()
    keys = ", ".join(f"{n!r}: {{}}" for n in archs.build_names())
    listed = ", ".join(archs.gguf_names())
    source = (
        f"DEFAULTS = {{{keys}}}\nif arch in ('qwen3', 'gemma2'):\n    pass\nGGUF = ['llama', 'x']\n"
        f"MESSAGE = 'supported: {listed}'\n"
    )
    found = sorted(registries(source, names, threshold()))
    assert len(found) == 3, found
    assert found[0].startswith("line 1: a dict") and found[1].startswith("line 2: a branch"), found
    assert found[2].startswith("line 5: a constant"), found


def test_every_module_is_found_and_names_its_transformers_model_type():
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    modules = {p.stem for p in PACKAGE.glob("*.py") if not p.stem.startswith("_")}
    assert set(archs.build_names()) == modules  # (by convention a tiny model is named as its module)
    for a in archs.all_archs():
        assert a.model_type and MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[a.model_type] == a.name, a.name
        assert archs.by_build_name(a.build_name) is a
        assert a.gguf_written and archs.by_gguf(a.gguf) is not None


def test_a_new_module_is_found_without_a_list(tmp_path, monkeypatch):
    """One more module on the package's path registers its declaration: nothing else names it."""
    (tmp_path / "zz_tiny_test_arch.py").write_text(
        "from engine_svc.models.arch import Architecture, register\n"
        "register(Architecture(name='ZzTestForCausalLM', gguf='zztest', model_type='llama', "
        "short_name='zz_test'))\n"
    )
    monkeypatch.setattr(archs, "__path__", [*archs.__path__, str(tmp_path)])
    monkeypatch.setattr(archs, "_REGISTRY", dict(archs._REGISTRY))
    monkeypatch.setattr(archs, "_LOADED", False)
    try:
        assert archs.by_name("ZzTestForCausalLM").gguf == "zztest"
        assert archs.by_gguf("zztest").name == "ZzTestForCausalLM"
        assert "zz_test" in archs.build_names()
    finally:
        sys.modules.pop(f"{archs.__name__}.zz_tiny_test_arch", None)


@pytest.mark.parametrize("name", ["gemma2", "gemma3", "qwen3_moe"])
def test_the_tiny_model_is_the_declarations(name):
    from engine_svc.models.build import make_config

    decl = archs.by_build_name(name)
    cfg = make_config(name, hidden_size=96, num_attention_heads=6)
    assert cfg.model_type == decl.model_type
    assert cfg.head_dim == 16  # head_dim None in tiny_config: hidden // heads
    for key, value in decl.tiny_config.items():
        if key != "head_dim":
            assert getattr(cfg, key) == value, key
    with pytest.raises(ValueError, match="unknown architecture 'nope'"):
        make_config("nope")
