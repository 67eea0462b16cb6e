"""Shared fixtures: tiny random models of several architectures, built once per test run."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pytest

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# GGUF tokenizer conversions of the files tests write go to a cache of this run's own.
os.environ.setdefault("LLMSERVE_CACHE", tempfile.mkdtemp(prefix="llmserve-test-cache-"))

# Shapes small enough for 2 cores, with initializer_range 0.2 so the top-2 logits are well apart
# and greedy comparisons with HF are not decided by fp32 summation order.
TINY_ARCHS: dict[str, dict] = {
    "llama": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "qwen2": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    ),
    "qwen3": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
    ),
    "mistral": dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
    ),
}

# ../shared from the main checkout; ../../shared from a worktree under /work/wt.
SHARED_TOKENIZERS = next(
    (
        p / "shared" / "fixtures" / "tokenizers"
        for p in Path(__file__).resolve().parents[2:4]
        if (p / "shared" / "fixtures" / "tokenizers").is_dir()
    ),
    Path(__file__).resolve().parents[2] / "shared" / "fixtures" / "tokenizers",
)


@pytest.fixture(scope="session")
def trained_tokenizer_dir(tmp_path_factory) -> Path:
    """The project's own BPE tokenizer (small vocabulary), trained once per run."""
    from tokenizer_svc.train import save_tokenizer, train_tokenizer

    out = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(train_tokenizer(vocab_size=1024), out, model_max_length=1024)
    return out


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory, trained_tokenizer_dir) -> dict[str, Path]:
    """``{arch: model_dir}`` for Llama, Qwen2, Qwen3 and Mistral, each with the trained tokenizer."""
    from tests.engine_helpers import random_model

    root = tmp_path_factory.mktemp("tiny_models")
    return {
        arch: random_model(
            root / arch, trained_tokenizer_dir, arch, seed=1234, generation_eos=[2, 0], **shape
        )
        for arch, shape in TINY_ARCHS.items()
    }


@pytest.fixture(scope="session")
def tiny_llama(tiny_models) -> Path:
    return tiny_models["llama"]


@pytest.fixture(scope="session")
def default_model_dir(tmp_path_factory) -> Path:
    """The built-in default model, as `make model` builds it."""
    from engine_svc.models.build_default import build_default_model

    return build_default_model(tmp_path_factory.mktemp("default_model"))


def shared_tokenizer(name: str) -> Path:
    """A real tokenizer from ../shared/fixtures; the test is skipped where that folder is absent."""
    path = SHARED_TOKENIZERS / name
    if not (path / "tokenizer.json").exists():
        pytest.skip(f"real tokenizer fixtures not present at {path}")
    return path


# Catalogue models (engine_svc/models/catalogue.py) for the real-model tier's tests that need more
# than the default's 135M parameters. CI does not download them (a gigabyte each): a test that asks
# for one skips, naming the command that places it, where it is absent. LLMSERVE_MODELS_DIR points
# at another checkout's models/ (e.g. /work/main/models), which a worktree can share.
MODELS_DIR = Path(os.environ.get("LLMSERVE_MODELS_DIR") or Path(__file__).resolve().parents[1] / "models")


def catalogue_model_path(name: str) -> Path:
    """The GGUF file of catalogue model ``name`` in MODELS_DIR/<name>; the test skips where it is
    absent or incomplete (its size and card are checked, not its sha256: `llmserve pull` did)."""
    from engine_svc.models.catalogue import entry, is_placed

    e = entry(name)  # an unknown name is the test's bug: CatalogueError, not a skip
    dest = MODELS_DIR / name
    if not is_placed(e, dest, verify=False):
        pytest.skip(
            f"catalogue model {name} is not in {dest}: `make model MODEL={name}` places it "
            f"({e.size / 2**20:,.0f} MiB from the package registry), or set LLMSERVE_MODELS_DIR"
        )
    return dest / e.file


@pytest.fixture
def catalogue_model():
    """``catalogue_model("qwen2.5-coder-0.5b") -> Path`` of its GGUF file, or a skip with the reason."""
    return catalogue_model_path
