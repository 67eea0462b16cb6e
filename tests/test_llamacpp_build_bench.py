"""The llama.cpp peer: the build's instruction-set flags come from /proc/cpuinfo (AMX never on),
and benchmarks/llamacpp_bench.py reads llama-bench's JSON (the better repack setting per test).
Where `make bench-peer` has built llama-bench, the benchmark's --quick mode runs end to end on the
default model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from benchmarks.llamacpp_bench import LLAMA_BENCH, best_rates
from scripts.build_llamacpp import cpu_flags, isa_cmake_flags

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_GGUF = ROOT / "models" / "default" / "SmolLM2-135M-Instruct.Q4_1.gguf"

AVX2_EPYC = "processor\t: 0\nflags\t\t: fpu sse sse2 avx f16c fma avx2 bmi2 abm\n"
SAPPHIRE_RAPIDS = (
    "processor\t: 0\nflags\t\t: fpu avx f16c fma avx2 bmi2 avx512f avx512dq avx512cd avx512bw avx512vl "
    "avx512_vnni avx512_bf16 avx512vbmi avx_vnni amx_bf16 amx_tile amx_int8\n"
)


def options(text: str) -> dict[str, str]:
    return dict(f[2:].split("=") for f in isa_cmake_flags(cpu_flags(text)))


def test_an_avx2_only_cpu_builds_avx2_and_no_avx512():
    o = options(AVX2_EPYC)
    assert o["GGML_NATIVE"] == "OFF"
    assert [o[k] for k in ("GGML_AVX", "GGML_AVX2", "GGML_FMA", "GGML_F16C", "GGML_BMI2")] == ["ON"] * 5
    assert [o[k] for k in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX_VNNI")] == [
        "OFF"
    ] * 4


def test_an_amx_cpu_gets_its_avx512_but_never_amx():
    o = options(SAPPHIRE_RAPIDS)
    assert [o[k] for k in ("GGML_AVX512", "GGML_AVX512_VNNI", "GGML_AVX512_BF16", "GGML_AVX512_VBMI")] == [
        "ON"
    ] * 4
    assert o["GGML_AVX_VNNI"] == "ON"
    assert [o[k] for k in ("GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")] == ["OFF"] * 3


def test_avx512_needs_every_subset_ggml_compiles_with():
    no_bw = SAPPHIRE_RAPIDS.replace(" avx512bw", "")
    assert options(no_bw)["GGML_AVX512"] == "OFF"


def test_cpuinfo_without_flags_is_an_error():
    with pytest.raises(RuntimeError, match="no 'flags' line"):
        cpu_flags("processor\t: 0\n")


RECORDS = [
    {
        "n_prompt": 512,
        "n_gen": 0,
        "repack": False,
        "avg_ts": 300.5,
        "build_commit": "abc",
        "build_number": 11434,
    },
    {"n_prompt": 0, "n_gen": 128, "repack": False, "avg_ts": 40.0},
    {"n_prompt": 512, "n_gen": 0, "repack": True, "avg_ts": 410.25},
    {"n_prompt": 0, "n_gen": 128, "repack": True, "avg_ts": 38.5},
]


def test_best_rates_takes_the_better_repack_setting_per_test():
    r = best_rates(RECORDS, 512, 128)
    assert (r["pp"], r["tg"]) == (410.25, 40.0)
    assert r["repack"] == {"pp": {"false": 300.5, "true": 410.25}, "tg": {"false": 40.0, "true": 38.5}}


def test_a_missing_test_is_an_error_naming_it():
    with pytest.raises(ValueError, match="no tg128 result"):
        best_rates(RECORDS[:1] + RECORDS[2:3], 512, 128)


@pytest.mark.skipif(not LLAMA_BENCH.exists(), reason=f"{LLAMA_BENCH} absent: `make bench-peer` builds it")
@pytest.mark.skipif(not DEFAULT_GGUF.exists(), reason=f"{DEFAULT_GGUF} absent: `make model` places it")
def test_quick_mode_runs_both_systems(tmp_path):
    from benchmarks.llamacpp_bench import main

    out = tmp_path / "r.json"
    main(["--model", str(DEFAULT_GGUF), "--quick", "--out", str(out)])
    r = json.loads(out.read_text())
    for name in ("pp16", "tg8"):
        assert r[name]["ours_tok_s"][0] > 0 and r[name]["llamacpp_tok_s"][0] > 0
        assert set(r[name]["llamacpp_repack_tok_s"][0]) == {"false", "true"}
    assert "11434" in r["llamacpp_build"]
