"""The native CPU kernels (``kernels/cpu/native/*.c``): compiled once per instruction set with the
system's C compiler, cached by the source's hash, loaded with ctypes.

The instruction set is chosen at run time from what this CPU reports: ``avx512`` (x86-64-v4),
``avx2`` (x86-64-v3: AVX2 + FMA) or ``generic`` (the compiler's baseline, any architecture).
``LLMSERVE_CPU_ISA`` forces one (for tests and comparisons); one the CPU lacks is refused.
No compiler, or a failed build, is not an error: callers fall back to the torch path, and the
reason is logged once per process (one warning naming the compiler and its error; a further kernel
failing with the same compiler and instruction set only at debug level), whatever the number of
layers and calls: each library is looked up once, then remembered, failure included.

An installed (non-editable) package carries the sources (``*.c`` and ``*.h``, pyproject's
package-data): the first use builds them into the cache exactly as ``make install``'s
``python -m kernels.cpu.native_build`` does, under the same name (the key hashes source and flags).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

SOURCE_DIR = Path(__file__).parent / "native"
ISAS = ("avx512", "avx2", "generic")
_FLAGS = {
    "avx512": ["-march=x86-64-v4", "-mprefer-vector-width=512"],
    "avx2": ["-march=x86-64-v3"],
    "generic": [],
}
# The x86-64 microarchitecture levels' CPU flags (what -march=x86-64-v3 / -v4 may emit).
_NEEDS = {
    "avx2": {"avx", "avx2", "bmi1", "bmi2", "f16c", "fma", "movbe", "xsave"},
    "avx512": {"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"},
}
# -ffp-contract=fast: a * b + c as one fused multiply-add (ISO C mode would forbid it).
_COMMON = [
    "-O3",
    "-fPIC",
    "-shared",
    "-pthread",
    "-fno-math-errno",
    "-fno-trapping-math",
    "-ffp-contract=fast",
    "-std=c11",
]


def cache_dir() -> Path:
    root = os.environ.get("LLMSERVE_KERNEL_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "llmserve", "kernels"
    )
    return Path(root)


@functools.cache
def cpu_flags() -> frozenset[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return frozenset(line.split(":", 1)[1].split())
    except OSError:
        pass
    return frozenset()


def supported_isas() -> list[str]:
    """The instruction sets this CPU runs, best first (``generic`` always)."""
    out = []
    if platform.machine() in ("x86_64", "AMD64"):
        flags = cpu_flags()
        if _NEEDS["avx2"] <= flags:
            if _NEEDS["avx512"] <= flags:
                out.append("avx512")
            out.append("avx2")
    return [*out, "generic"]


def chosen_isa() -> str:
    forced = os.environ.get("LLMSERVE_CPU_ISA", "").strip().lower()
    if forced:
        if forced not in ISAS:
            raise ValueError(f"LLMSERVE_CPU_ISA must be one of {ISAS}, got {forced!r}")
        if forced not in supported_isas():
            raise ValueError(f"LLMSERVE_CPU_ISA={forced}: this CPU lacks it (it has {supported_isas()})")
        return forced
    return supported_isas()[0]


def compiler() -> str | None:
    return os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")


# Second builds of one source with a switch defined: ``"<source>:<variant>"`` names one
# (``load("paged_attention:kv_bf16", isa)``: the attention kernel reading a bf16 KV cache;
# ``kv_bf16_dot``: the same with bf16 products, VDPBF16PS's order emulated by fused multiply-adds;
# ``kv_bf16_dot_native``: the same bits from the instruction itself, AVX-512 CPUs with AVX512-BF16).
VARIANTS = {
    "paged_attention": {
        "kv_bf16": ["-DKV_BF16"],
        "kv_bf16_dot": ["-DKV_BF16", "-DBF16_DOT"],
        "kv_bf16_dot_native": ["-DKV_BF16", "-DBF16_DOT", "-mavx512bf16"],
    }
}
# A variant built only for these instruction sets and where the CPU lists this flag.
VARIANT_NEEDS = {"paged_attention:kv_bf16_dot_native": ("avx512", "avx512_bf16")}


def variant_runs_here(name: str, isa: str) -> bool:
    """Whether the build ``name`` (``"<source>:<variant>"``) is made for ``isa`` on this CPU."""
    need = VARIANT_NEEDS.get(name)
    return need is None or (isa == need[0] and need[1] in cpu_flags())


def build(name: str, isa: str) -> Path:
    """Compile ``native/<name>.c`` for ``isa`` into the cache (if not there yet); the library's path.
    ``name`` may be ``"<source>:<variant>"`` (``VARIANTS``). Raises ``RuntimeError`` with the
    compiler's message when it cannot."""
    stem, _, variant = name.partition(":")
    if variant and variant not in VARIANTS.get(stem, {}):
        raise ValueError(f"no native build variant {variant!r} of {stem} (known: {VARIANTS.get(stem, {})})")
    if not variant_runs_here(name, isa):
        raise RuntimeError(
            f"{name} is built for {VARIANT_NEEDS[name][0]} CPUs with {VARIANT_NEEDS[name][1]} only"
        )
    defines = VARIANTS[stem][variant] if variant else []
    source = SOURCE_DIR / f"{stem}.c"
    # The headers it may include are part of what is built: a change to one is a new build.
    text = source.read_bytes() + b"".join(h.read_bytes() for h in sorted(SOURCE_DIR.glob("*.h")))
    cc = compiler()
    if cc is None:
        raise RuntimeError("no C compiler (cc, gcc or clang) on PATH")
    flags = [*_COMMON, *_FLAGS[isa], *defines]
    key = hashlib.sha256(text + " ".join([cc, *flags]).encode()).hexdigest()[:16]
    out = cache_dir() / f"{stem}{'-' + variant if variant else ''}-{isa}-{key}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    # Build beside the target and rename: processes starting together never load a half-written file.
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        r = subprocess.run([cc, *flags, "-o", tmp, str(source)], capture_output=True, text=True, timeout=120)
        if r.returncode != 0:
            raise RuntimeError(f"{cc} failed on {source.name} ({isa}): {r.stderr.strip()[-2000:]}")
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log.info("native kernels: built %s", out)
    return out


POOL = "thread_pool"  # the kernels' threads (native/parallel.h): one per process, whatever the ISAs


@functools.cache
def load(name: str, isa: str) -> ctypes.CDLL:
    if name == POOL:
        return ctypes.CDLL(str(build(name, isa)), mode=ctypes.RTLD_GLOBAL)
    # The pool is loaded first and globally, so that every kernel library's reference to it binds
    # to this one pool; without it (a failed build) their loops run on the calling thread alone.
    pool = _pool()
    lib = ctypes.CDLL(str(build(name, isa)))
    if pool is None and not _pool_missing_told:
        _tell_pool_missing()
    return lib


_pool_missing_told = False
_pool_error: list[str] = []


@functools.cache
def _pool() -> ctypes.CDLL | None:
    try:
        return load(POOL, "generic")
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        # Not reported here: a compiler that cannot build the pool cannot build the kernels either,
        # and their failure is reported once (below). Reported only if a kernel builds without it.
        _pool_error.append(str(e))
        log.debug("native thread pool not built: %s", e)
        return None


def _tell_pool_missing() -> None:
    global _pool_missing_told
    _pool_missing_told = True
    why = "; ".join(_pool_error[-1:])
    log.warning("native thread pool not built, the kernels run on one thread: %s", why)


def load_or_none(name: str, isa: str | None = None) -> ctypes.CDLL | None:
    """The library for ``isa`` (default: the chosen one), or None with the reason logged once."""
    return _load_or_none(name, isa or chosen_isa())


def load_with_signatures(name: str, isa: str, signatures: dict) -> ctypes.CDLL | None:
    """``load_or_none`` with each function's ctypes signature set: ``signatures`` maps a function's
    name to ``(argtypes, restype)``."""
    lib = load_or_none(name, isa)
    if lib is not None:
        for fn_name, (argtypes, restype) in signatures.items():
            fn = getattr(lib, fn_name)
            fn.argtypes, fn.restype = argtypes, restype
    return lib


# (compiler, isa) whose failure was already reported as a warning.
_reported: set[tuple[str, str]] = set()


@functools.cache
def _load_or_none(name: str, isa: str) -> ctypes.CDLL | None:
    try:
        lib = load(name, isa)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as e:
        cc = compiler() or "none found"
        if (cc, isa) in _reported:
            log.debug("native kernel %s (%s) not built either, torch path: %s", name, isa, e)
        else:
            _reported.add((cc, isa))
            log.warning(
                "native kernels (%s) not built with compiler %s: %s; the torch path runs instead "
                "(further kernels failing with this compiler are logged at debug level)",
                isa,
                cc,
                e,
            )
        return None
    log.info("native kernel %s: %s", name, isa)
    return lib


def forget_loads() -> None:
    """Look every library up again (tests that change the compiler or the cache)."""
    global _pool_missing_told
    _load_or_none.cache_clear()
    load.cache_clear()
    _pool.cache_clear()
    _pool_missing_told = False
    _pool_error.clear()
    _reported.clear()


if __name__ == "__main__":  # make install: build for every instruction set this CPU runs
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for _isa in supported_isas():
        try:
            for _src in sorted(SOURCE_DIR.glob("*.c")):
                for _variant in ["", *VARIANTS.get(_src.stem, {})]:
                    _name = f"{_src.stem}:{_variant}" if _variant else _src.stem
                    if variant_runs_here(_name, _isa):
                        print(f"native kernels ({_isa}): {build(_name, _isa)}")
        except (RuntimeError, OSError, subprocess.TimeoutExpired) as _e:  # the torch path still runs
            print(f"native kernels ({_isa}) not built, the torch path will run: {_e}")
