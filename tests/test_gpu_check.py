"""The GPU check's CPU-side parts: arguments, the bandwidth table, the Llama-3-8B-shaped config and
its weight bytes, the request mix, and the plumbing of each measurement run small on CPU (kernels
interpreted) so that the one run on a GPU machine does not fail on a typo."""

from __future__ import annotations

import json

import pytest
import torch

# Imported before the interpreter is switched on, as in a full test run (see test_kernels_triton.py).
import triton.language  # noqa: F401

from scripts import gpu_check
from tests.triton_mode import interpreted_kernels

TINY_CFG = dict(
    gpu_check.LLAMA3_8B,
    vocab_size=512,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
)


def test_parse_args_defaults_and_overrides(tmp_path):
    args = gpu_check.parse_args(["--out", str(tmp_path)])
    assert args.out == tmp_path and args.peak_bandwidth_tbps is None and args.requests == 256
    assert args.sections == list(gpu_check.SECTIONS)
    args = gpu_check.parse_args(
        [
            "--out",
            "x",
            "--peak-bandwidth-tbps",
            "4.8",
            "--sections",
            "kernels",
            "llama3_8b",
            "--requests",
            "16",
        ]
    )
    assert (
        args.peak_bandwidth_tbps == 4.8 and args.sections == ["kernels", "llama3_8b"] and args.requests == 16
    )


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--out", "x", "--requests", "0"],
        ["--out", "x", "--sections", "nope"],
        ["--out", "x", "--peak-bandwidth-tbps", "-1"],
    ],
)
def test_parse_args_rejects(argv):
    with pytest.raises(SystemExit):
        gpu_check.parse_args(argv)


@pytest.mark.parametrize(
    "name,tbps",
    [
        ("NVIDIA H200", 4.8),
        ("NVIDIA H100 80GB HBM3", 3.35),
        ("NVIDIA H100 PCIe", 2.0),
        ("NVIDIA H100 NVL", 3.9),
        ("NVIDIA GH200 480GB", 4.0),
        ("NVIDIA A100-SXM4-80GB", 2.039),
    ],
)
def test_peak_bandwidth_by_device_name(name, tbps):
    peak, source = gpu_check.peak_bandwidth(name)
    assert peak == pytest.approx(tbps * 1e12) and source.startswith("table")


def test_peak_bandwidth_override_and_unknown():
    assert gpu_check.peak_bandwidth("NVIDIA H200", 3.0) == (3.0e12, "--peak-bandwidth-tbps")
    assert gpu_check.peak_bandwidth("Some Future GPU") == (None, "unknown")


def test_llama3_8b_parameter_count_matches_transformers():
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = {
        k: v
        for k, v in gpu_check.LLAMA3_8B.items()
        if k not in ("architectures", "model_type", "torch_dtype")
    }
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model("llama", **cfg))
    assert gpu_check.parameter_count(gpu_check.LLAMA3_8B) == sum(p.numel() for p in model.parameters())
    assert gpu_check.parameter_count(gpu_check.LLAMA3_8B) == pytest.approx(8.03e9, rel=1e-3)


def test_decode_floor_on_h200():
    floor = gpu_check.decode_floor_seconds(gpu_check.LLAMA3_8B, 2, 4.8e12)
    assert floor["weight_bytes"] == 2 * gpu_check.parameter_count(gpu_check.LLAMA3_8B)
    assert floor["floor_s"] == pytest.approx(3.35e-3, rel=1e-2)
    assert floor["floor_s_without_embedding"] < floor["floor_s"]


def test_config_only_model_is_what_the_engine_reads(tmp_path):
    from engine_svc.models.spec import ModelSpec

    spec = ModelSpec.from_path(gpu_check.write_config_only_model(tmp_path / "m", gpu_check.LLAMA3_8B))
    assert (spec.hidden_size, spec.num_layers, spec.num_heads, spec.num_kv_heads, spec.head_dim) == (
        4096,
        32,
        32,
        8,
        128,
    )
    assert spec.rope_scaling["rope_type"] == "llama3" and spec.rope_theta == 500000.0
    assert spec.vocab_size == 128256 and not spec.tie_word_embeddings


def test_mixed_requests_are_deterministic_and_mixed():
    reqs = gpu_check.mixed_requests(256, 0, 128256)
    assert reqs == gpu_check.mixed_requests(256, 0, 128256) and len(reqs) == 256
    assert all(16 <= len(p) <= 1024 and 16 <= n <= 256 for p, n in reqs)
    assert len({len(p) for p, _ in reqs}) > 100 and all(0 <= t < 128256 for p, _ in reqs for t in p)


def test_without_a_gpu_the_check_says_so_in_its_report(tmp_path, capsys):
    assert gpu_check.main(["--out", str(tmp_path)]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert "no CUDA device" in report["error"] and report["facts"]["torch"] == torch.__version__


def test_engine_benchmark_plumbing_on_cpu(tmp_path):
    result = gpu_check.section_llama3_8b(
        "cpu",
        tmp_path,
        1e11,
        num_requests=6,
        decode_steps=4,
        seed=0,
        cfg=TINY_CFG,
        kernel_backend="torch",
        prompt_range=(4, 40),
        output_range=(2, 6),
        max_model_len=256,
        num_kv_blocks=128,
    )
    tp, b1 = result["throughput"], result["batch1_decode"]
    assert tp["output_tokens"] == tp["expected_output_tokens"] and tp["output_tokens_per_s"] > 0
    assert b1["decode_steps"] == 4 and b1["s_per_token"] > 0 and b1["ratio_to_floor"] > 0


def test_kernel_measurements_plumbing_on_cpu(tmp_path):
    from benchmarks import kernel_microbench as microbench
    from tests import kernel_conformance as conformance

    with interpreted_kernels():
        from kernels.triton.registry import TRITON_KERNELS as k

        records = conformance.check_all(k, "cpu", (torch.float32,))
        prefill = microbench.attention_vs_sdpa(
            k.paged_attention,
            batch=2,
            seq_len=32,
            q_len=32,
            hq=4,
            hk=2,
            d=64,
            block_size=16,
            dtype=torch.float32,
            device="cpu",
            iters=1,
        )
        decode = microbench.decode_bandwidth(
            k.paged_attention,
            batch=1,
            seq_len=544,
            hq=4,
            hk=1,
            d=64,
            block_size=32,
            dtype=torch.float32,
            device="cpu",
            peak_bytes_per_s=1e11,
            iters=1,
        )
    assert records and all(r["ok"] for r in records), [r for r in records if not r["ok"]]
    assert {r["kernel"] for r in records} >= {
        "rms_norm",
        "silu_and_mul",
        "apply_rotary.q",
        "write_kv",
        "paged_attention",
    }
    assert prefill["max_abs_err_vs_sdpa"] < 1e-4 and prefill["ratio_paged_over_sdpa"] > 0
    assert 0 < decode["fraction_of_peak"] and decode["bytes_moved"] > 2 * 544 * 64 * 4


def test_tiny_hf_equality_plumbing_on_cpu(tmp_path):
    # (Gemma 3 through the interpreted Triton engine: tests/test_gemma3.py; here its case is listed)
    with interpreted_kernels():
        result = gpu_check.section_tiny_hf_equality(
            "cpu", tmp_path, seed=0, prompt_lengths=(1, 20), archs=("llama", "gemma2")
        )
    assert result["all_equal"], result


def test_tiny_hf_equality_lists_gemma3_with_both_layer_kinds():
    """The GPU run's Gemma 3 case: 5:1 local/global, a rotary base per kind, q/k norms, as the
    engine reads its config."""
    import inspect

    from engine_svc.models.build import make_config
    from engine_svc.models.spec import ModelSpec

    assert "gemma3" in inspect.signature(gpu_check.section_tiny_hf_equality).parameters["archs"].default
    shape, _ = gpu_check.TINY_HF_MODELS["gemma3"]
    cfg = make_config("gemma3", vocab_size=1024, hidden_size=256, intermediate_size=512, **shape)
    spec = ModelSpec.from_dict({**cfg.to_dict(), "architectures": ["Gemma3ForCausalLM"]})
    assert [a.window for a in spec.layer_attention] == [48] * 5 + [None, 48]
    assert {a.rope_theta for a in spec.layer_attention} == {10_000.0, 1_000_000.0} and spec.qk_norm


def test_lora_section_plumbing_on_cpu(tmp_path):
    """The LoRA section end to end on CPU with the kernels interpreted (fp32), small shapes."""
    with interpreted_kernels():
        result = gpu_check.section_lora(
            "cpu",
            tmp_path,
            0,
            dtypes=(torch.float32,),
            perf_cfg=TINY_CFG,
            perf_requests=4,
            perf_lengths=(6, 2),
            prompt_lengths=(5, 20, 3, 9),
            max_tokens=3,
        )
    assert result["kernels_ok"] and {r["kernel"] for r in result["kernel_records"]} == {"lora_apply"}
    assert result["equal_to_torch_twin"]
    tp = result["throughput"]
    assert tp["adapters_vs_base"] > 0 and tp["mixed_vs_separate"] > 0
    summary = gpu_check.summary(
        dict(facts=dict(device="cpu", date="today"), sections={"lora": dict(status="ok", **result)})
    )
    assert summary["lora"]["equal_to_torch_twin"] is True
