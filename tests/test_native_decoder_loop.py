"""The native layer loop (``kernels/cpu/native/decoder_loop.c``, ``kernels/cpu/native_decoder.py``):
the hidden states and the KV caches it leaves are the Python loop's bit for bit
(``LLMSERVE_NATIVE_DECODER_LOOP=0`` runs that loop on the same model) on every weight path (fp32
and bf16 packed panels, quantized blocks with fp32 activations, quantized blocks with int8
activations, and a mix of them), for a first token, decodes, a chunked prefill and a mixed step, at
one and two threads; the loop runs where it should (a counter), falls back where it must (wrapped
projections, q/k norms, reference kernels) with the same results, and refuses bad metadata."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from engine_svc.lora.layers import wrap_lora_layers
from engine_svc.models.decoder import AttentionInputs, DecoderForCausalLM
from engine_svc.models.loader import init_dummy_weights
from engine_svc.models.spec import ModelSpec
from kernels.backend import REFERENCE_KERNELS, TORCH_KERNELS
from kernels.cpu import native_build, native_decoder, native_elementwise, quant_int8act
from kernels.cpu.isa_choice import chosen_isa_in
from kernels.cpu.quant_gemm import BLOCK_K, QuantizedWeight, concat_rows, quantize_rows

BLOCK_SIZE, NUM_BLOCKS = 8, 24
HIDDEN, INTER, HEADS, KV_HEADS, HEAD_DIM = 128, 192, 4, 2, 32
PROJECTIONS = ("qkv_weight", "o_weight", "gate_up_weight", "down_weight")

pytestmark = pytest.mark.skipif(
    not chosen_isa_in(native_elementwise.NATIVE_SILU),
    reason="the Python loop runs torch's SiLU on the generic build, so the native loop stays off there",
)


def _spec(arch="LlamaForCausalLM", layers=3, **extra) -> ModelSpec:
    cfg = dict(
        architectures=[arch],
        vocab_size=200,
        hidden_size=HIDDEN,
        intermediate_size=INTER,
        num_hidden_layers=layers,
        num_attention_heads=HEADS,
        num_key_value_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        rms_norm_eps=1e-5,
        max_position_embeddings=256,
        tie_word_embeddings=False,
        initializer_range=0.2,
        **extra,
    )
    return ModelSpec.from_dict(cfg)


def _random_blocks(shape, fmt: str, g: torch.Generator, half: bool) -> QuantizedWeight:
    """Blocks of ``fmt`` with random quants and scales (``half``: scales that are fp16 values);
    ``A+B``: a fused projection whose first rows are A, the last quarter B (``MixedRows``)."""
    n, k = shape
    if "+" in fmt:
        first, second = fmt.split("+")
        tail = n // 4
        head_rows = _random_blocks((n - tail, k), first, g, half)
        return concat_rows([head_rows, _random_blocks((tail, k), second, g, half)])
    hi = {"Q8_0": 256, "Q4_0": 16, "Q4_1": 16, "Q5_0": 32, "Q5_1": 32, "Q5_K": 32, "Q6_K": 64}[fmt]
    q = torch.randint(0, hi, (n, k), generator=g, dtype=torch.int32)
    if fmt in ("Q6_K", "Q5_0"):  # int8 bits of -32..31, -16..15
        q = q - hi // 2
    q = q.to(torch.int8 if fmt in ("Q8_0", "Q6_K", "Q5_0") else torch.uint8).view(torch.uint8)
    nb = k // BLOCK_K[fmt]
    d = torch.rand(n, nb, generator=g) * 0.02 + 0.002
    m = -torch.rand(n, nb, generator=g) * 0.1 if fmt in ("Q4_1", "Q5_1", "Q5_K") else None
    if half:
        d, m = d.half().float(), None if m is None else m.half().float()
    return QuantizedWeight(fmt, q.contiguous(), d, m)


def _model(path: str, *, spec=None, o_bias=False, seed=0) -> DecoderForCausalLM:
    """A random model on one weight path, with norms and biases random too (a loop that skipped
    one would change the result)."""
    spec = spec or _spec()
    if o_bias:
        spec = dataclasses.replace(spec, o_bias=True)
    model = DecoderForCausalLM(spec, torch.float32, 256)
    init_dummy_weights(model, seed)
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.copy_(1 + 0.3 * torch.randn(p.shape, generator=g))
        elif name.endswith("bias"):
            p.data.copy_(0.2 * torch.randn(p.shape, generator=g))
    backend = "native"
    blocks = {}  # the load's QuantizedBlocks: linear_weights key -> blocks
    formats = {
        "gguf_fp32act": ("Q8_0", "Q4_0", "Q4_1", "Q6_K", "Q5_K", "Q5_0", "Q5_1", "Q5_0+Q8_0"),
        "gguf_int8act": ("Q4_1", "Q8_0", "Q4_0", "Q5_K", "Q5_0", "Q5_1", "Q5_0+Q8_0"),
        "mixed": ("Q4_1", None, "Q6_K", "Q8_0"),  # int8 act, a float projection, Q6_K on fp32 act
    }.get(path)
    if path == "bf16":
        backend = "native_bf16"
    elif path in ("int8", "int4"):
        for i, layer in enumerate(model.layers):
            for name in PROJECTIONS:
                fmt = "Q8_0" if path == "int8" else "Q4_1"
                qw = blocks[f"layers.{i}.{name}"] = quantize_rows(getattr(layer, name).data, fmt)
                qw.activations = "int8"
    elif formats:
        for i, layer in enumerate(model.layers):
            for j, name in enumerate(PROJECTIONS):
                # the gguf paths: every format once in the 12 projections; "mixed": as it was
                fmt = formats[((i + j) if path == "mixed" else (4 * i + j)) % len(formats)]
                if fmt is None:
                    continue
                w = getattr(layer, name)
                qw = _random_blocks(tuple(w.shape), fmt, g, half=(i + j) % 2 == 0)
                blocks[f"layers.{i}.{name}"] = qw
                if path != "gguf_fp32act" and quant_int8act.supports(fmt):
                    qw.activations = "int8"
    else:
        assert path == "fp32"
    model.prepare_linears(backend, blocks)
    return model


def _caches(model) -> list[torch.Tensor]:
    shape = (2, NUM_BLOCKS, BLOCK_SIZE, KV_HEADS, HEAD_DIM)
    return [torch.zeros(shape) for _ in model.layers]


class Sequences:
    """Block tables and context lengths of a few sequences, and the step inputs of any mix of their
    next tokens (what the scheduler would make)."""

    def __init__(self, lengths_cap: list[int], seed=0):
        g = torch.Generator().manual_seed(seed)
        order = torch.randperm(NUM_BLOCKS, generator=g).tolist()
        self.tables, self.ctx = [], [0] * len(lengths_cap)
        for cap in lengths_cap:
            n = -(-cap // BLOCK_SIZE)
            self.tables.append(order[:n])
            order = order[n:]
        self.ids = torch.Generator().manual_seed(seed + 7)

    def step(self, new: dict[int, int]):
        """Inputs for ``new[seq]`` tokens of each named sequence, in order; advances them."""
        positions, slots, lens, starts = [], [], [], [0]
        seqs = sorted(new)
        for s in seqs:
            for p in range(self.ctx[s], self.ctx[s] + new[s]):
                positions.append(p)
                slots.append(self.tables[s][p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE)
            self.ctx[s] += new[s]
            lens.append(self.ctx[s])
            starts.append(starts[-1] + new[s])
        width = max(len(self.tables[s]) for s in seqs)
        tables = torch.zeros(len(seqs), width, dtype=torch.int32)
        for r, s in enumerate(seqs):
            tables[r, : len(self.tables[s])] = torch.tensor(self.tables[s], dtype=torch.int32)
        t = len(positions)
        attn = AttentionInputs(
            slot_mapping=torch.tensor(slots, dtype=torch.int64),
            block_tables=tables,
            seq_lens=torch.tensor(lens, dtype=torch.int32),
            query_start_loc=torch.tensor(starts, dtype=torch.int32),
            max_query_len=max(new.values()),
            max_seq_len=max(lens),
        )
        ids = torch.randint(3, 200, (t,), generator=self.ids)
        return ids, torch.tensor(positions, dtype=torch.int64), attn


# A first token, a chunked prefill (two chunks), decodes of three sequences, a mixed step (decodes
# with a prefill chunk), then more decodes.
SCHEDULE = [
    {0: 1},
    {1: 13},
    {1: 9, 0: 1},
    {0: 1, 1: 1},
    {2: 20, 0: 1, 1: 1},
    {0: 1, 1: 1, 2: 1},
    {0: 1, 1: 1, 2: 1},
    {2: 1},
]


def _run_both(model, monkeypatch, schedule=SCHEDULE, kernels=TORCH_KERNELS):
    """(native outputs, Python outputs, native caches, Python caches, loop forwards) over the
    schedule, the two loops on their own caches, step by step."""
    native_caches, python_caches = _caches(model), _caches(model)
    seqs = Sequences([40, 40, 40])
    got, want = [], []
    before = native_decoder.forwards
    for new in schedule:
        ids, positions, attn = seqs.step(new)
        monkeypatch.setenv("LLMSERVE_NATIVE_DECODER_LOOP", "1")
        got.append(model(kernels, ids, positions, native_caches, attn))
        monkeypatch.setenv("LLMSERVE_NATIVE_DECODER_LOOP", "0")
        forwards = native_decoder.forwards
        want.append(model(kernels, ids, positions, python_caches, attn))
        assert native_decoder.forwards == forwards, "LLMSERVE_NATIVE_DECODER_LOOP=0 still ran the loop"
    return got, want, native_caches, python_caches, native_decoder.forwards - before


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


WEIGHT_PATHS = ["fp32", "bf16", "gguf_fp32act", "gguf_int8act", "int8", "int4", "mixed"]


# Every build whose kernels the loop can call (AVX2 too: where one of its kernels was not native, the
# loop stayed off on AVX2-only CPUs without a word in the tests).
LOOP_ISAS = [isa for isa in native_build.supported_isas() if isa in ("avx512", "avx2")]


@pytest.mark.parametrize("isa", LOOP_ISAS)
@pytest.mark.parametrize("path", WEIGHT_PATHS)
def test_the_loop_equals_the_python_loop_bit_for_bit(path, threads, isa, monkeypatch):
    monkeypatch.setenv("LLMSERVE_CPU_ISA", isa)
    model = _model(path, o_bias=path in ("fp32", "gguf_int8act"))
    got, want, native_caches, python_caches, forwards = _run_both(model, monkeypatch)
    assert model.native_loop_reason is None
    assert forwards == len(SCHEDULE), "the native loop did not run every step"
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert a.shape == b.shape == (sum(SCHEDULE[i].values()), HIDDEN)
        assert torch.equal(a, b), f"step {i}: max |diff| {(a - b).abs().max()}"
    for a, b in zip(native_caches, python_caches, strict=True):
        assert torch.equal(a, b)
    assert bool(got[-1].abs().sum() > 0)


@pytest.mark.parametrize("mlp_rows", ["1", "9", "off"], ids=["mlp", "mlp-from-9-rows", "down-only"])
@pytest.mark.parametrize("isa", LOOP_ISAS)
@pytest.mark.parametrize("path", ["gguf_int8act", "int4", "mixed", "gemma3"])
def test_int8_mlps_make_the_activation_in_the_quantization(path, isa, mlp_rows, monkeypatch):
    """Where a layer's down projection is an int8-activation linear of the loop's instruction set,
    the loop calls its entry fused with SiLU (Gemma: GELU-tanh), whose activation quantization makes
    the products itself (``Layer.down_glu``); where gate/up is one too (one format, the width a
    multiple of 64), the whole MLP runs as one call from ``LLMSERVE_FUSED_MLP_MIN_ROWS`` rows
    (``Layer.mlp``: the gate/up outputs never stored; "9": the schedule's steps on either side);
    other downs keep the kernel apart. The hidden states and caches are the Python loop's bit for
    bit, and the same with the fusions off (``LLMSERVE_FUSED_GLU=0``, ``LLMSERVE_FUSED_MLP=0``)."""
    monkeypatch.setenv("LLMSERVE_CPU_ISA", isa)
    if mlp_rows == "off":
        monkeypatch.setenv("LLMSERVE_FUSED_MLP", "0")
    else:
        monkeypatch.setenv("LLMSERVE_FUSED_MLP_MIN_ROWS", mlp_rows)
    spec = _spec("Gemma3ForCausalLM", **GEMMA3) if path == "gemma3" else None
    model = _model("gguf_int8act" if path == "gemma3" else path, spec=spec)
    got, want, native_caches, python_caches, forwards = _run_both(model, monkeypatch)
    assert forwards == len(SCHEDULE) and model.native_loop_reason is None
    descs = model._native_loop._descs
    fused = [bool(d.down_glu) for d in descs]
    assert fused == [type(layer.down_proj) is quant_int8act.Int8ActLinear for layer in model.layers]
    assert any(fused)
    whole = [bool(d.mlp) for d in descs]
    assert whole == [
        mlp_rows != "off" and quant_int8act.fused_mlp_fn(layer.gate_up_proj, layer.down_proj) is not None
        for layer in model.layers
    ]
    assert any(whole) == (mlp_rows != "off")
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {i}: max |diff| {(a - b).abs().max()}"
    for a, b in zip(native_caches, python_caches, strict=True):
        assert torch.equal(a, b)
    monkeypatch.setenv("LLMSERVE_FUSED_GLU", "0")
    monkeypatch.setenv("LLMSERVE_FUSED_MLP", "0")
    model.invalidate()
    apart, *_ = _run_both(model, monkeypatch)
    assert not any(d.down_glu or d.mlp for d in model._native_loop._descs)
    for a, b in zip(got, apart, strict=True):
        assert torch.equal(a, b)


def test_qkv_bias_models_take_the_loop_too(monkeypatch):
    model = _model("fp32", spec=_spec("Qwen2ForCausalLM"))
    assert model.layers[0].qkv_bias is not None
    got, want, *_, forwards = _run_both(model, monkeypatch, SCHEDULE[:3])
    assert forwards == 3 and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_wrapped_projections_run_the_python_loop_with_the_same_results(monkeypatch):
    model = _model("gguf_int8act")
    plain, *_ = _run_both(model, monkeypatch, SCHEDULE[:4])
    step = wrap_lora_layers(model)  # no adapter in the step: the wrappers only call through
    assert step.batch is None
    wrapped, python, *_, forwards = _run_both(model, monkeypatch, SCHEDULE[:4])
    assert forwards == 0, "the loop ran over wrapped projections"
    assert "projection is not a native linear" in model.native_loop_reason
    for a, b, c in zip(plain, wrapped, python, strict=True):
        assert torch.equal(a, b) and torch.equal(b, c)


def test_q_k_norm_models_take_the_loop_too(monkeypatch):
    model = _model("fp32", spec=_spec("Qwen3ForCausalLM"))
    got, want, *_, forwards = _run_both(model, monkeypatch, SCHEDULE[:3])
    assert forwards == 3 and model.native_loop_reason is None
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


GEMMA3 = dict(  # a local layer (window 5), a global one, a local one: windows the contexts pass
    layer_types=["sliding_attention", "full_attention", "sliding_attention"],
    sliding_window=5,
    query_pre_attn_scalar=24,
    rope_local_base_freq=10000.0,
    rope_theta=1_000_000.0,
)


@pytest.mark.parametrize("path", ["fp32", "gguf_int8act"])
def test_gemma3_layers_take_the_loop_bit_for_bit(path, monkeypatch):
    """Gemma 3's parts in the loop: q/k norms, sandwich norms, GELU-tanh, a rotary table per kind,
    sliding windows; the caches too."""
    model = _model(path, spec=_spec("Gemma3ForCausalLM", **GEMMA3))
    assert len(model.rope_tables()) == 2 and model.layers[0].window == 5
    got, want, native_caches, python_caches, forwards = _run_both(model, monkeypatch)
    assert forwards == len(SCHEDULE) and model.native_loop_reason is None
    for i, (a, b) in enumerate(zip(got, want, strict=True)):
        assert torch.equal(a, b), f"step {i}: max |diff| {(a - b).abs().max()}"
    for a, b in zip(native_caches, python_caches, strict=True):
        assert torch.equal(a, b)


def test_other_kernels_run_the_python_loop(monkeypatch):
    model = _model("fp32")
    native, *_ = _run_both(model, monkeypatch, SCHEDULE[:3])
    reference, *_, forwards = _run_both(model, monkeypatch, SCHEDULE[:3], kernels=REFERENCE_KERNELS)
    assert forwards == 0
    for a, b in zip(native, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)


def test_replaced_projections_rebuild_the_loop(monkeypatch):
    """The descriptors hold raw pointers: new linears (weights changed, then prepared again) are
    seen at the next forward."""
    model = _model("fp32")
    first, *_ = _run_both(model, monkeypatch, SCHEDULE[:2])
    for layer in model.layers:
        layer.down_weight.data.mul_(0.5)
    model.prepare_linears("native")
    second, python, *_, forwards = _run_both(model, monkeypatch, SCHEDULE[:2])
    assert forwards == 2
    assert not torch.equal(first[1], second[1])
    assert all(torch.equal(a, b) for a, b in zip(second, python, strict=True))


def _one_step(model, caches, **change):
    seqs = Sequences([40, 40, 40])
    ids, positions, attn = seqs.step({0: 3, 1: 1})
    attn.__dict__.update(change)
    return model(TORCH_KERNELS, ids, positions, caches, attn)


@pytest.mark.parametrize(
    "change,error",
    [
        (dict(slot_mapping=torch.tensor([0, 1, 2, NUM_BLOCKS * BLOCK_SIZE])), IndexError),
        (dict(block_tables=torch.tensor([[NUM_BLOCKS], [0]], dtype=torch.int32)), IndexError),
        (dict(seq_lens=torch.tensor([3, 41], dtype=torch.int32)), IndexError),  # overruns its table
        (dict(query_start_loc=torch.tensor([-1, 3, 4], dtype=torch.int32)), ValueError),
        (dict(query_start_loc=torch.tensor([0, 3, 5], dtype=torch.int32)), ValueError),
    ],
)
def test_bad_metadata_is_an_error_before_the_loop_runs(change, error, monkeypatch):
    model = _model("fp32")
    caches = _caches(model)
    before = native_decoder.forwards
    with pytest.raises(error):
        _one_step(model, caches, **change)
    assert native_decoder.forwards == before
    assert all(not c.any() for c in caches), "the loop wrote the cache before refusing"
    monkeypatch.setenv("LLMSERVE_NATIVE_DECODER_LOOP", "0")  # the Python loop's wrappers agree
    with pytest.raises(error):
        _one_step(model, _caches(model), **change)


@pytest.mark.parametrize("bad", [256, -1])
def test_bad_positions_are_an_error(bad):
    model = _model("fp32")
    seqs = Sequences([40])
    ids, positions, attn = seqs.step({0: 2})
    before = native_decoder.forwards
    with pytest.raises(IndexError, match="rotary position"):
        model(TORCH_KERNELS, ids, torch.tensor([0, bad]), _caches(model), attn)
    assert native_decoder.forwards == before


def test_steps_past_the_kept_scratch_take_their_own(monkeypatch):
    """Steps longer than the kept scratch run on rows of their own, and the next short step goes
    back to the kept rows (the schedule's token counts go 1, 13, 10, 2, 22, 3, ...)."""
    monkeypatch.setattr(native_decoder, "KEEP_SCRATCH_TOKENS", 4)
    model = _model("int4")
    got, want, native_caches, python_caches, forwards = _run_both(model, monkeypatch)
    assert forwards == len(SCHEDULE)
    assert model._native_loop._scratch_tokens == 3  # grown to the longest step of at most 4
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert all(torch.equal(a, b) for a, b in zip(native_caches, python_caches, strict=True))


def test_both_loops_count_each_layer_for_the_watchdog(monkeypatch):
    """``layer_progress`` (what the engine's watchdog reads to tell a slow step from a hung one)
    moves by the model's layers on each forward pass, in the native loop as in the Python loop."""
    from engine_svc.models import layer_progress

    model = _model("gguf_int8act")
    caches = _caches(model)
    seqs = Sequences([40, 40, 40])
    for native in ("1", "0"):
        monkeypatch.setenv("LLMSERVE_NATIVE_DECODER_LOOP", native)
        ids, positions, attn = seqs.step({0: 5})
        before, forwards = layer_progress.value(), native_decoder.forwards
        model(TORCH_KERNELS, ids, positions, caches, attn)
        assert native_decoder.forwards - forwards == (native == "1")
        assert layer_progress.value() - before == len(model.layers)


def _mirror(name: str, fields) -> type:
    return type(name, (native_decoder.ctypes.Structure,), {"_fields_": fields})


def _fields(struct: str) -> list:
    return list(native_decoder.MIRRORS[struct]._fields_)


def test_the_ctypes_mirrors_match_the_c_layout():
    c = native_decoder.c_layout(native_decoder.library())
    assert set(c) == set(native_decoder.MIRRORS)
    assert native_decoder.layout_mismatch(c, native_decoder.MIRRORS) is None


def _swapped(fields, a: str, b: str) -> list:
    i, j = (next(k for k, f in enumerate(fields) if f[0] == n) for n in (a, b))
    fields[i], fields[j] = fields[j], fields[i]
    return fields


@pytest.mark.parametrize(
    "struct,fields,named",
    [
        # a float field mirrored as a double: its size (and the struct's) differs
        (
            "Layer",
            lambda f: [(n, native_decoder.ctypes.c_double if n == "softcap" else t) for n, t in f],
            "Layer.softcap",
        ),
        # two fields in the wrong order: offsets differ, sizes agree
        ("Step", lambda f: _swapped(f, "num_groups", "slot_group_stride"), "Step.slot_group_stride"),
        # an int32 mirrored as int64: the next field moves
        (
            "Linear",
            lambda f: [(n, native_decoder.ctypes.c_int64 if n == "code" else t) for n, t in f],
            "Linear.code",
        ),
        # a field the C struct has and the mirror lacks (its last: no other field moves)
        ("Model", lambda f: [x for x in f if x[0] != "mlp_min_rows"], "Model.mlp_min_rows"),
        # a field the mirror has and C does not
        ("Model", lambda f: [*f, ("experts", native_decoder.ctypes.c_void_p)], "Model.experts"),
    ],
    ids=["size", "order", "width", "missing", "extra"],
)
def test_a_wrong_ctypes_mirror_is_refused_naming_its_field(struct, fields, named, monkeypatch):
    c = native_decoder.c_layout(native_decoder.library())
    wrong = {**native_decoder.MIRRORS, struct: _mirror(f"Wrong{struct}", fields(_fields(struct)))}
    assert named in native_decoder.layout_mismatch(c, wrong)
    # built with it, the model runs the Python loop and says why
    monkeypatch.setattr(native_decoder, "MIRRORS", wrong)
    model = _model("fp32")
    got, want, *_, forwards = _run_both(model, monkeypatch, SCHEDULE[:2])
    assert forwards == 0 and named in model.native_loop_reason
    assert all(torch.equal(a, b) for a, b in zip(got, want, strict=True))


def test_a_swapped_storage_is_seen_by_the_next_step_after_invalidate(monkeypatch):
    """``param.data = t`` (what ``float_weights`` does to free a parameter) keeps no pointer: the
    descriptors still point at the old storage until ``invalidate``. The old tensors are kept alive
    here, so a loop that was not invalidated reads the old norms (not freed memory) and differs."""
    model = _model("fp32")
    first, *_ = _run_both(model, monkeypatch, SCHEDULE[:2])
    old = []
    for layer in model.layers:
        old.append(layer.input_norm.data)
        layer.input_norm.data = layer.input_norm.data * 1.5  # new storage
    model.invalidate()
    second, python, *_, forwards = _run_both(model, monkeypatch, SCHEDULE[:2])
    assert forwards == 2 and model.native_loop_reason is None
    assert not torch.equal(first[1], second[1])
    assert all(torch.equal(a, b) for a, b in zip(second, python, strict=True))


def test_every_path_that_changes_weights_invalidates_the_loop(monkeypatch):
    """What changes a layer's linears or tensors drops the descriptors: preparing the linears,
    wrapping them for LoRA, freeing packed float weights, a dtype or device move."""
    from engine_svc.models.float_weights import free_packed_float_weights

    changes = {
        "prepare_linears": lambda m: m.prepare_linears("native"),
        "wrap_lora_layers": wrap_lora_layers,
        "free_packed_float_weights": free_packed_float_weights,
        "float": lambda m: m.float(),
        "to": lambda m: m.to(torch.device("cpu")),
    }
    for name, change in changes.items():
        model = _model("fp32")
        model.finalize()
        assert model._finalized and model.native_loop_reason is None
        change(model)
        assert not model._finalized, f"{name} left the native loop's descriptors in place"
        assert model._native_loop is None
