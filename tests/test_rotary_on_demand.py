"""The rotary tables' rows made as positions are reached (engine_svc/models/rotary_tables.py): every
row written is bit for bit the row of the whole table as it was built at start (stated here
directly: one fp32 product ``position * inv_freq`` per entry, its cos then its sin, for every
position at once), across growth boundaries, for the kinds of table the architectures declare
(plain, Gemma 3's local and global theta, llama3 scaling, Phi-3's long-rope phases, the identity of
a NoPE layer); rows not reached are not resident; a model's forward covers the rows its step reads
(greedy tokens equal to HF's with growth steps of a few positions: tests/test_gemma3.py,
tests/test_phi3.py)."""

from __future__ import annotations

import pytest
import torch

from engine_svc.models import rotary_tables
from engine_svc.models.rotary_tables import RotaryTables
from kernels.reference.rotary import rope_inv_freq

LLAMA3 = {
    "rope_type": "llama3",
    "factor": 8.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
LONG = {
    "rope_type": "longrope",
    "short_factor": [1.0 + 0.05 * i for i in range(16)],
    "long_factor": [1.5 + 0.3 * i for i in range(16)],
    "original_max_position_embeddings": 1000,
    "attention_factor": 1.19,
}


def _whole_table(head_dim: int, theta: float, scaling: dict | None, n: int) -> torch.Tensor:
    """The table as the model built it at start: every position's row in one computation."""

    def block(inv_freq, scale=1.0):
        freqs = torch.outer(torch.arange(n, dtype=torch.float32), inv_freq.float())
        return torch.cat([freqs.cos() * scale, freqs.sin() * scale], dim=-1)

    if (scaling or {}).get("rope_type") != "longrope":
        return block(rope_inv_freq(head_dim, theta, scaling))
    exponent = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    scale = float(scaling["attention_factor"])
    return torch.cat(
        [
            block(1.0 / (torch.tensor(scaling[f], dtype=torch.float32) * theta**exponent), scale)
            for f in ("short_factor", "long_factor")
        ]
    )


def _resident_bytes(t: torch.Tensor) -> int:
    """Bytes of ``t``'s own mapping that are resident (/proc/self/smaps)."""
    addr, found = t.data_ptr(), False
    with open("/proc/self/smaps") as f:
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                lo, hi = (int(x, 16) for x in head.split("-"))
                found = lo <= addr < hi
            elif found and head == "Rss:":
                return int(line.split()[1]) * 1024
    raise AssertionError("no mapping holds the table")


CASES = [
    ("gemma3 local", 256, 10_000.0, None, 1, 9000),
    ("gemma3 global", 256, 1_000_000.0, None, 1, 9000),
    ("qwen2", 64, 1_000_000.0, None, 1, 5000),
    ("llama3", 128, 500_000.0, LLAMA3, 1, 3000),
    ("odd head dim", 80, 10_000.0, None, 1, 2100),
    ("nope", 16, 10_000.0, {"rope_type": "none"}, 1, 2100),
    ("long-rope", 32, 10_000.0, LONG, 2, 3000),
    ("plain beside a switch", 32, 10_000.0, None, 2, 3000),
]


@pytest.mark.parametrize("name,head_dim,theta,scaling,phases,n", CASES, ids=[c[0] for c in CASES])
def test_rows_equal_the_whole_tables_across_growth_boundaries(name, head_dim, theta, scaling, phases, n):
    whole = _whole_table(head_dim, theta, scaling, n)
    if phases == 2 and whole.shape[0] == n:  # a table beside a switch repeats its rows per phase
        whole = torch.cat([whole, whole])
    tables = RotaryTables([(head_dim, theta, scaling)], n, phases, lazy=True)
    table = tables.tables[0]
    assert table.shape == whole.shape and tables.covered == 0
    assert not table.any()
    B = rotary_tables.BLOCK
    for reach in (1, B - 1, B, B + 1, 2 * B + 5, n - 1, n, n + 50):
        tables.cover(tables.tables, reach)
        covered = min(n, -(-reach // B) * B)
        assert tables.covered == covered
        for phase in range(whole.shape[0] // n):
            at = phase * n
            got, want = table[at : at + covered], whole[at : at + covered]
            assert torch.equal(got.view(torch.int32), want.view(torch.int32)), (name, reach, phase)
            assert not table[at + covered : at + n].any()  # not reached: never written


def test_rows_not_reached_are_not_resident():
    n, d = 32768, 256  # a Gemma 3 table: 32 MiB whole
    tables = RotaryTables([(d, 10_000.0, None)], n, 1, lazy=True)
    table = tables.tables[0]
    assert table.data_ptr() % 4096 == 0
    assert _resident_bytes(table) == 0
    tables.cover(tables.tables, 1500)
    rows = 2 * rotary_tables.BLOCK
    # the rows written, give or take a transparent huge page at each end where the kernel uses them
    assert rows * d * 4 <= _resident_bytes(table) <= rows * d * 4 + 4 * 2**20 < n * d * 4 // 4


def test_the_eager_tables_are_the_whole_tables():
    tables = RotaryTables([(64, 1e6, None), (32, 1e4, LONG)], 300, 2, lazy=False)
    assert tables.covered == 300
    assert torch.equal(tables.tables[0], torch.cat([_whole_table(64, 1e6, None, 300)] * 2))
    assert torch.equal(tables.tables[1], _whole_table(32, 1e4, LONG, 300))


def test_a_models_forward_covers_the_rows_its_step_reads():
    from engine_svc.models.decoder import DecoderForCausalLM
    from engine_svc.models.spec import ModelSpec

    spec = ModelSpec.from_dict(
        dict(
            architectures=["LlamaForCausalLM"],
            vocab_size=64,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=1,
            num_attention_heads=2,
            num_key_value_heads=1,
            head_dim=16,
            rms_norm_eps=1e-5,
            rope_theta=10_000.0,
            max_position_embeddings=4096,
            tie_word_embeddings=True,
        )
    )
    model = DecoderForCausalLM(spec, torch.float32, 4096)
    assert model.rotary.covered == 0
    model._cover_step(torch.tensor([3, 1500, 7]))
    assert model.rotary.covered == 2 * rotary_tables.BLOCK
    whole = _whole_table(16, 10_000.0, None, 4096)
    assert torch.equal(model.cos_sin[:2048], whole[:2048]) and not model.cos_sin[2048:].any()
    model.float()  # a moved or converted model holds its tables whole
    assert model.rotary.covered == 4096 and torch.equal(model.cos_sin, whole)
