"""The model holds one copy of each projection's weight: where a linear packed its own (quantized
blocks, bf16 or fp32 panels, oneDNN's reordered weight), the loader frees the float parameter and
the blocks it was built from (engine_svc/models/float_weights.py); ``linear_backend="dense"``
reads the parameters, so there they stay, and so does a tied embedding (the lookup reads it),
except a GGUF file's: its lookup reads the file's blocks (engine_svc/models/block_embedding.py)."""

from __future__ import annotations

import mmap

import numpy as np
import pytest
import torch

from engine_svc.models.float_weights import linear_shapes, projections
from engine_svc.models.gguf_checkpoint import GGUFCheckpoint
from engine_svc.sampling_params import SamplingParams
from tests.engine_helpers import make_engine, random_model, random_prompts, run_to_completion
from tests.gguf_files import write_gguf

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def _serves(engine):
    """The linears still serve: a greedy request runs to its end."""
    out = run_to_completion(engine, {"r": (random_prompts([7], 1000)[0], GREEDY)})
    assert len(out["r", 0]) == GREEDY.max_tokens


def _projection_bytes(model) -> int:
    """Bytes the float parameters of the projections and a non-tied LM head still hold."""
    return sum(p.numel() * p.element_size() for name, p, _ in projections(model) if name != "embed")


def _assert_freed(model, released: dict[str, str] | None = None):
    assert _projection_bytes(model) == 0, "a packed linear's float weight was kept beside it"
    if released is not None:  # the load's result names exactly the parameters left empty, with why
        empty = {name for name, p, _ in projections(model) if p.numel() == 0}
        if model.lm_head is not None and model.embed.numel() == 0:
            empty.add("embed")
        assert set(released) == empty, (sorted(released), sorted(empty))
        assert all(why.startswith("freed at load: ") for why in released.values())
    for name, param, _ in projections(model):
        assert getattr(param, "quantized", None) is None, f"{name}: the load-time blocks were kept"
        if name == "embed":  # tied: the lookup reads it, or the blocks it was dequantized from
            whole = model.spec.vocab_size * model.spec.hidden_size
            assert param.numel() == (0 if model.embed_blocks is not None else whole)
    # the geometry survives for whoever needs the shapes (benchmarks.compute_efficiency)
    shapes = linear_shapes(model)
    for name, _, linear in projections(model):
        want = shapes["lm_head" if name == "embed" else name]
        assert (linear.out_features, linear.in_features) == want
    with pytest.raises(RuntimeError, match="freed weight"):
        model.prepare_linears("native")


@pytest.fixture(scope="module")
def q4_1_file(tiny_llama, tmp_path_factory):
    return write_gguf(tiny_llama, tmp_path_factory.mktemp("freed") / "tiny-Q4_1.gguf", "Q4_1")


def test_each_layer_is_freed_before_the_next_is_packed(tiny_llama, tmp_path, monkeypatch):
    """The load's peak holds one layer's weights twice, not the model's: when a layer's linears are
    built, every earlier layer's float projections (and, last, an untied head's) are freed."""
    from engine_svc import model_setup
    from engine_svc.models import float_weights

    seen = []

    def spy(model, index, freed):
        float_weights.free_layer_weights(model, index, freed)
        held = {
            name.split(".")[1] if name.startswith("layers.") else name
            for name, p, _ in projections(model)
            if p.numel()
        }
        seen.append((index, held))

    monkeypatch.setattr(model_setup, "free_layer_weights", spy)
    untied = random_model(tmp_path / "untied", tiny_llama, seed=3, tie_word_embeddings=False)
    engine = make_engine(untied, dtype="bfloat16")
    assert [i for i, _ in seen] == [*range(len(engine.model.layers)), None]
    for i, held in seen:
        later = {str(j) for j in range(len(engine.model.layers)) if i is not None and j > i}
        assert held <= later | {"embed"} | ({"lm_head"} if i is not None else set()), (i, held)
    assert "lm_head" not in seen[-1][1]
    _assert_freed(engine.model, engine.runtime.load.released)


def _assert_blocks_path_gives_the_float_tokens(path, vocab: int) -> None:
    """The whole exact path (fp32 activations on the embedding's blocks) gives the float model's
    greedy tokens."""
    prompts = random_prompts([9, 30], vocab, seed=4)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = []
    for options in ({"quantized_activations": "none"}, {"dtype": "float32"}):
        e = make_engine(path, **options)
        assert (e.model.embed_blocks is not None) == ("dtype" not in options)
        out = run_to_completion(e, {str(i): (p, params) for i, p in enumerate(prompts)})
        runs.append([out[str(i), 0] for i in range(len(prompts))])
    assert runs[0] == runs[1]


@pytest.mark.parametrize("options", [{}, {"quantized_activations": "none"}], ids=["int8act", "fp32act"])
def test_gguf_blocks_leave_no_float_copy_and_still_serve(q4_1_file, options):
    engine = make_engine(q4_1_file, **options)
    _assert_freed(engine.model, engine.runtime.load.released)
    _serves(engine)  # the linears serve without them


@pytest.mark.parametrize(
    "options",
    [{"quantization": "int8"}, {"quantization": "int4"}, {"dtype": "bfloat16"}, {"dtype": "float32"}],
    ids=lambda o: next(iter(o.values())),
)
def test_packed_linears_from_a_float_checkpoint_leave_no_float_copy(tiny_llama, options):
    engine = make_engine(tiny_llama, **options)
    if options.get("dtype") == "float32" and engine.model.layers[0].qkv_proj.kind == "dense":
        pytest.fail("the fp32 model did not get a packed linear here: nothing to free")
    _assert_freed(engine.model, engine.runtime.load.released)
    _serves(engine)


def test_dense_linears_keep_the_parameters_they_read(q4_1_file, tiny_llama):
    for engine in (
        make_engine(q4_1_file, linear_backend="dense"),
        make_engine(tiny_llama, linear_backend="dense"),
    ):
        model = engine.model
        assert all(
            p.numel() == torch.Size(s).numel()
            for (_, p, _), s in zip(projections(model), linear_shapes(model).values(), strict=True)
        )
        assert all(getattr(p, "quantized", None) is None for _, p, _ in projections(model))
        assert set(engine.runtime.load.released) <= {"embed"}  # no projection (the lookup may read blocks)
        model.prepare_linears("dense")  # still possible: nothing was freed


@pytest.fixture(scope="module")
def tied_llama(trained_tokenizer_dir, tmp_path_factory):
    return random_model(
        tmp_path_factory.mktemp("tied") / "hf",
        trained_tokenizer_dir,
        seed=9,
        tie_word_embeddings=True,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )


@pytest.mark.parametrize("fmt", ["Q8_0", "Q4_1"])
def test_a_tied_gguf_embedding_is_looked_up_in_its_blocks(tied_llama, tmp_path, fmt):
    path = write_gguf(tied_llama, tmp_path / f"tied-{fmt}.gguf", fmt)
    engine = make_engine(path)
    model = engine.model
    assert model.lm_head is None and model.embed_blocks is not None and model.embed.numel() == 0
    _assert_freed(model, engine.runtime.load.released)
    assert "embed" in engine.runtime.load.released
    # Every row, bit for bit, against the gguf package's dequantization of the file's table.
    table = next(t for t in GGUFCheckpoint(path).tensors() if t.hf_name == "model.embed_tokens.weight")
    want = table.dequantize()
    ids = torch.randperm(want.shape[0], generator=torch.Generator().manual_seed(0))
    got = model._embed(ids)
    assert torch.equal(got.view(torch.int32), want[ids].view(torch.int32))
    _assert_reads_the_files_bytes(model, path)
    shaped = model._embed(ids.view(4, -1))
    assert torch.equal(shaped.view(torch.int32), want[ids].view(4, -1, 64).view(torch.int32))
    for bad in (-1, want.shape[0]):
        with pytest.raises(IndexError, match=f"token id {bad} is outside"):
            model._embed(torch.tensor([3, bad]))
    _assert_blocks_path_gives_the_float_tokens(path, vocab=1024)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
def test_a_tied_embedding_quantized_at_load_stays_float(tied_llama, quantization):
    """Blocks made at load from float weights are not the table: the lookup keeps the float one."""
    model = make_engine(tied_llama, quantization=quantization).model
    assert model.embed_blocks is None
    _assert_freed(model)


def _dequantized_names(monkeypatch) -> list[str]:
    from engine_svc.models import gguf_checkpoint

    names, original = [], gguf_checkpoint.GGUFTensor.dequantize

    def recording(self):
        names.append(self.hf_name)
        return original(self)

    monkeypatch.setattr(gguf_checkpoint.GGUFTensor, "dequantize", recording)
    return names


def test_the_load_never_dequantizes_what_blocks_serve(tied_llama, tmp_path, monkeypatch):
    """Peak memory: the projections' float tensors are not read at all (only the norms and the
    tied embedding, which the lookup's check compares), unless a dense linear reads them."""
    path = write_gguf(tied_llama, tmp_path / "tied-Q4_1.gguf", "Q4_1")
    names = _dequantized_names(monkeypatch)
    model = make_engine(path).model
    assert names and all("norm" in n or n == "model.embed_tokens.weight" for n in names), names
    _assert_freed(model)
    _serves(make_engine(path))
    names.clear()
    make_engine(path, linear_backend="dense")
    assert any("q_proj" in n for n in names)  # dense reads the float weights: they are loaded


@pytest.mark.parametrize("tied", [True, False])
def test_a_parameter_left_unread_must_be_freed(tied_llama, tiny_llama, tmp_path, monkeypatch, tied):
    """The guard: were an unread (garbage) parameter kept for something to read, the load fails
    (untied: the embedding's table, left unread for the lookup's blocks)."""
    from engine_svc import model_setup

    path = write_gguf(tied_llama if tied else tiny_llama, tmp_path / f"{tied}-Q8_0.gguf", "Q8_0")
    monkeypatch.setattr(model_setup, "free_packed_float_weights", lambda model, *args: ("nothing freed", {}))
    with pytest.raises(RuntimeError, match="left unread for its blocks, yet is still kept"):
        make_engine(path)


@pytest.mark.parametrize("fmt", ["Q5_0", "Q5_1"])
def test_an_untied_gguf_embedding_is_looked_up_in_its_blocks(tiny_llama, tmp_path, fmt):
    """An untied embedding is read by the lookup alone: where the file has it in blocks, the lookup
    reads them and the fp32 table goes (Qwen2.5 Q4_K_M: 138 MiB of Q5_0 quants, a byte each,
    against 519 MiB). Its rows are the gguf package's dequantization bit for bit, and the exact
    path (fp32 activations on the file's 5-bit blocks) gives the float model's greedy tokens."""
    path = write_gguf(tiny_llama, tmp_path / f"untied-{fmt}.gguf", fmt)
    model = make_engine(path).model
    assert model.lm_head is not None and model.embed_blocks is not None and model.embed.numel() == 0
    assert getattr(model.embed, "quantized", None) is None
    _assert_freed(model)
    table = next(t for t in GGUFCheckpoint(path).tensors() if t.hf_name == "model.embed_tokens.weight")
    want = table.dequantize()
    ids = torch.randperm(want.shape[0], generator=torch.Generator().manual_seed(0))
    assert torch.equal(model._embed(ids).view(torch.int32), want[ids].view(torch.int32))
    _assert_reads_the_files_bytes(model, path)
    _assert_blocks_path_gives_the_float_tokens(path, vocab=1000)


def _assert_reads_the_files_bytes(model, path) -> None:
    """The lookup holds no copy: its blocks are the file's bytes, a view of its mapping."""
    lookup = model.embed_blocks
    table = next(t for t in GGUFCheckpoint(path).tensors() if t.hf_name == "model.embed_tokens.weight")
    assert lookup.reads_the_file and lookup.nbytes == table._reader_tensor.data.nbytes
    base = lookup._raw
    while isinstance(base, np.ndarray):
        base = base.base
    assert isinstance(base, mmap.mmap)  # a view of the file's mapping, not a copy
    assert np.array_equal(lookup._raw.reshape(-1), table._reader_tensor.data.reshape(-1))


def _mapped_rss(path) -> int:
    """This process's resident bytes of the mappings of ``path`` (/proc/self/smaps)."""
    total, inside = 0, False
    for line in open("/proc/self/smaps"):
        head = line.split()
        if head and "-" in head[0] and len(head) >= 5:  # a mapping's first line
            inside = len(head) >= 6 and head[5] == str(path)
        elif inside and line.startswith("Rss:"):
            total += int(head[1]) * 1024
    return total


def test_the_loaded_file_is_not_kept_resident(tiny_llama, tmp_path):
    """Once its blocks are packed, the file's mapping is dropped from this process's resident pages
    (RSS counts the packed copy, not the file twice); a later read of it (the embedding lookup's
    rows) pages back in what it reads, the same bytes."""
    path = write_gguf(tiny_llama, tmp_path / "resident-Q8_0.gguf", "Q8_0")
    ckpt = GGUFCheckpoint(path)
    assert int(ckpt.reader.data.sum(dtype=np.int64)) >= 0  # every page read: resident
    assert _mapped_rss(path) >= path.stat().st_size // 2
    engine = make_engine(path)
    assert _mapped_rss(path) < path.stat().st_size // 4
    ids = torch.arange(16)
    want = next(t for t in ckpt.tensors() if t.hf_name == "model.embed_tokens.weight").dequantize()
    assert torch.equal(engine.model._embed(ids), want[ids])
