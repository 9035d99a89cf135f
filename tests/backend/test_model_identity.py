"""The model identity on real files: every byte of the model counts (the real default model with
one byte flipped in its middle), and the whole-file hash is computed once per file version,
remembered in a sidecar under $XDG_CACHE_HOME/prefixgate that a restarted process reads."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import xxhash

from backend import keys
from backend.keys import file_digest, make_salt, model_identity
from proxy.config import default_model

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {"n_ctx": 4096, "type_k": "f16", "type_v": "f16", "flash_attn": "off",
            "lib_version": "0.3.16"}
MIB = 1 << 20


@pytest.fixture(autouse=True)
def hashes_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """An empty sidecar directory, and this process's memory of earlier digests forgotten."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    keys._hashed.clear()
    return tmp_path / "xdg" / "prefixgate"


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([byte ^ 0xFF]))


def digest_in_a_new_process(path: Path) -> str:
    """What a restarted prefixgate computes (XDG_CACHE_HOME is inherited)."""
    code = "import sys; from backend.keys import file_digest; print(file_digest(sys.argv[1]))"
    return subprocess.run([sys.executable, "-c", code, str(path)], cwd=REPO, check=True,
                          capture_output=True, text=True).stdout.strip()


def test_a_changed_middle_byte_changes_the_identity_and_the_salt(tmp_path: Path) -> None:
    model = Path(default_model())
    swapped = tmp_path / "models" / model.name  # same name, same size, one byte differs
    swapped.parent.mkdir()
    shutil.copyfile(model, swapped)
    size_bytes = swapped.stat().st_size
    flip_byte(swapped, size_bytes // 2)
    assert (swapped.name, swapped.stat().st_size) == (model.name, model.stat().st_size)
    with model.open("rb") as a, swapped.open("rb") as b:  # the old identity's inputs agree:
        assert a.read(MIB) == b.read(MIB)  # first MiB
        a.seek(-MIB, os.SEEK_END)
        b.seek(-MIB, os.SEEK_END)
        assert a.read() == b.read()  # last MiB

    assert model_identity(swapped) != model_identity(model)
    assert make_salt(str(swapped), **SETTINGS) != make_salt(str(model), **SETTINGS)
    assert model_identity(model) == {
        "size_bytes": size_bytes, "xxh3_128": xxhash.xxh3_128_hexdigest(model.read_bytes())}

    flip_byte(swapped, size_bytes // 2)  # the same bytes again: the same identity, a hit
    assert make_salt(str(swapped), **SETTINGS) == make_salt(str(model), **SETTINGS)


def test_the_default_model_is_hashed_once_and_remembered(hashes_dir: Path) -> None:
    model = Path(default_model())
    digest = file_digest(model)
    files = json.loads((hashes_dir / "model-hashes.json").read_text())["files"]
    assert [r["xxh3_128"] for r in files.values()] == [digest]
    assert [r["path"] for r in files.values()] == [str(model.resolve())]
    assert list(files) == [keys._stamp(model)]
    assert digest_in_a_new_process(model) == digest
    assert list(model.parent.glob("*.json")) == []  # nothing written next to the model


def test_a_restart_trusts_the_sidecar_only_for_the_same_file_version(
    tmp_path: Path, hashes_dir: Path
) -> None:
    model = tmp_path / "model.gguf"
    model.write_bytes(random.Random(3).randbytes(3 * MIB))
    old = model.stat()
    os.utime(model, ns=(old.st_atime_ns - 10**10, old.st_mtime_ns - 10**10))  # as if from 10 s ago
    # ctime cannot be set back, and it is recent: a file changed in the last 2 s is hashed
    # every time and never remembered (its times may not have ticked since the last write)
    assert keys._stamp(model) is None
    assert file_digest(model) == xxhash.xxh3_128_hexdigest(model.read_bytes())
    assert not (hashes_dir / "model-hashes.json").exists()

    # a digest remembered for this file version (planted, so the test can tell it was read)
    st = model.stat()
    stamp = f"{st.st_dev}:{st.st_ino}:{st.st_size}:{st.st_mtime_ns}:{st.st_ctime_ns}"
    hashes_dir.mkdir(parents=True)
    (hashes_dir / "model-hashes.json").write_text(json.dumps(
        {"version": 1, "files": {stamp: {"xxh3_128": "planted", "path": "x", "hashed_s": 1.0}}}))
    time.sleep(max(0.0, (st.st_ctime_ns + keys._SETTLED_NS - time.time_ns()) / 1e9) + 0.05)
    assert keys._stamp(model) == stamp
    assert digest_in_a_new_process(model) == "planted"

    # the middle changed, the mtime put back: the ctime moved, so the file is hashed again
    flip_byte(model, 3 * MIB // 2)
    os.utime(model, ns=(old.st_atime_ns - 10**10, old.st_mtime_ns - 10**10))
    assert digest_in_a_new_process(model) == xxhash.xxh3_128_hexdigest(model.read_bytes())


def test_an_unusable_sidecar_directory_costs_a_hash_not_a_failure(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("XDG_CACHE_HOME", str(blocker / "below"))  # mkdir fails, even for root
    model = Path(default_model())
    assert file_digest(model) == xxhash.xxh3_128_hexdigest(model.read_bytes())
    assert "cannot remember model file hashes" in caplog.text


def test_a_malformed_sidecar_is_ignored_and_rewritten(hashes_dir: Path) -> None:
    hashes_dir.mkdir(parents=True)
    sidecar = hashes_dir / "model-hashes.json"
    model = Path(default_model())
    for junk in ["{", "[]", '{"files": []}', '{"files": {"a": 1, "b": {"xxh3_128": 2}}}']:
        sidecar.write_text(junk)
        keys._hashed.clear()
        assert file_digest(model) == xxhash.xxh3_128_hexdigest(model.read_bytes())
        files = json.loads(sidecar.read_text())["files"]
        assert list(files) == [keys._stamp(model)], junk


def test_a_split_models_identity_is_every_part(tmp_path: Path) -> None:
    """A real split of the default model (as llama.cpp's gguf-split lays one out): its
    identity hashes every part, so a changed byte in the last part changes the salt (it hashed
    the first part alone), and a part gone is an error, never a key of half a model."""
    from tests.models import write_split

    parts = write_split(default_model(), tmp_path / "m" / "smol-00001-of-00003.gguf", 3)
    assert keys.model_files(parts[0]) == parts and keys.model_files(default_model()) == [
        Path(default_model())]
    identity = model_identity(parts[0])
    assert identity == {
        "size_bytes": sum(p.stat().st_size for p in parts),
        "parts": [{"size_bytes": p.stat().st_size,
                   "xxh3_128": xxhash.xxh3_128_hexdigest(p.read_bytes())} for p in parts]}
    salt = make_salt(str(parts[0]), **SETTINGS)
    flip_byte(parts[2], parts[2].stat().st_size // 2)
    assert model_identity(parts[0]) != identity
    assert make_salt(str(parts[0]), **SETTINGS) != salt
    parts[1].unlink()
    with pytest.raises(FileNotFoundError):
        model_identity(parts[0])
