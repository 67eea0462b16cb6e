"""A non-editable install (``pip install .``: a wheel) carries the native kernels' sources, headers
included, and builds them on first use into the kernel cache, under the same name as a build from
the checkout (the same code and flags: the cache key hashes both), so the native paths run."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from kernels.cpu import native_build

ROOT = Path(__file__).resolve().parent.parent

FIRST_USE = """
import logging, sys
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="%(message)s")
from kernels.cpu import native_attention, native_build
installed = native_build.SOURCE_DIR.parent.parent.parent
assert str(installed) == sys.argv[1], f"imported from {installed}, not the installed wheel"
assert native_attention.library() is not None, "the native kernel did not build"
print("BUILT", native_build.build("paged_attention", native_build.chosen_isa()))
"""


@pytest.mark.slow
def test_an_installed_wheel_builds_the_native_kernels_on_first_use(tmp_path):
    if native_build.compiler() is None:
        pytest.skip("no C compiler on this machine")
    # Built from a copy: setuptools leaves build/ and *.egg-info beside the sources it builds.
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns(
        ".venv", "models", ".git", "build", "*.egg-info", "__pycache__", "node_modules"
    )
    shutil.copytree(ROOT, tree, ignore=skip, symlinks=True)
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-q",
            "-w",
            str(tmp_path),
            ".",
        ],
        cwd=tree,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    (wheel,) = tmp_path.glob("llmserve-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    for source in sorted(native_build.SOURCE_DIR.iterdir()):
        assert f"kernels/cpu/native/{source.name}" in names, f"{source.name} is not in the wheel"
    site = tmp_path / "site"
    zipfile.ZipFile(wheel).extractall(site)
    cache = tmp_path / "cache"
    r = subprocess.run(
        [sys.executable, "-c", FIRST_USE, str(site)],
        cwd=tmp_path,  # not the checkout: the installed package is the one imported
        env={
            "PATH": "/usr/bin:/bin",
            "PYTHONPATH": str(site),
            "LLMSERVE_KERNEL_CACHE": str(cache),
            "HOME": str(tmp_path),
        },
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    built = Path(r.stdout.split("BUILT ")[1].strip())
    assert built.parent == cache and built.exists()
    # The checkout's own build of the same code has the same name.
    expected = native_build.build("paged_attention", native_build.chosen_isa()).name
    assert built.name == expected
