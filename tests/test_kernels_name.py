"""Our top-level `kernels` package shares its import name with Hugging Face's `kernels` distribution.
transformers imports names from that one whenever its metadata says it is installed (5.25 made it a
requirement, hence the pin below 5.25 in pyproject.toml); beside ours, `import transformers` then fails."""

import importlib.metadata
import subprocess
import sys


def test_transformers_loads_beside_our_kernels_package():
    try:
        foreign = importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        foreign = None
    # A fresh interpreter, so that nothing the test session imported already hides the failure.
    code = "import transformers.activations, kernels.cpu.native_build; print('ok')"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, (
        f"Hugging Face's kernels {foreign} is installed (pip uninstall kernels)\n" if foreign else ""
    ) + out.stderr[-2000:]
    assert out.stdout.strip() == "ok"
