"""State files on real disk: a roundtrip, and every way a file can be untrustworthy (missing,
truncated, corrupt, another model, other tokens, a full disk) raising the right CacheFault."""

from __future__ import annotations

import ctypes
import os
import tracemalloc
from pathlib import Path

import pytest

from backend import direct_write, store
from backend.keys import CacheKey
from backend.store import (
    CacheFault,
    read_header,
    read_state_file,
    read_state_into,
    state_path,
    verify_file,
    write_state_file,
)

FP = bytes(range(16))
OTHER_FP = bytes(range(1, 17))
KEY = CacheKey(bytes.fromhex("ab" * 16))
IDS = [1, 7, 49_151, 0, 300, 2, 2, 2, 9, 10]
STATE = os.urandom(100_000)


@pytest.fixture
def written(tmp_path: Path) -> Path:
    path, _, _ = write_state_file(tmp_path, KEY, FP, IDS, STATE)
    return path


def fault(path: Path, fp: bytes = FP, prompt: list[int] = IDS) -> CacheFault:
    with pytest.raises(CacheFault) as info:
        read_state_file(path, fp, prompt)
    return info.value


def flip_byte(path: Path, offset: int) -> None:
    with path.open("r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x01]))


def test_roundtrip(tmp_path: Path) -> None:
    path, size_bytes, checksum = write_state_file(tmp_path, KEY, FP, IDS, STATE)
    assert path == state_path(tmp_path, KEY) == tmp_path / "kv" / "ab" / f"{'ab' * 16}.kv"
    assert size_bytes == path.stat().st_size
    assert read_state_file(path, FP, IDS) == (len(IDS), STATE)
    assert read_state_file(path, FP, IDS + [5, 6, 7]) == (len(IDS), STATE)  # a longer prompt
    header = read_header(path)
    assert (header.magic, header.version, header.fingerprint) == (b"PGKV", 1, FP)
    assert (header.n_tokens, header.state_len, header.checksum) == (len(IDS), len(STATE), checksum)
    assert header.state_offset + header.state_len == header.file_size_bytes == size_bytes
    verify_file(path)
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temp left behind


def test_rewrite_replaces_the_file_and_other_buffers_are_accepted(tmp_path: Path) -> None:
    write_state_file(tmp_path, KEY, FP, IDS, STATE)
    c_state = (ctypes.c_uint8 * 64).from_buffer_copy(bytes(range(64)))  # what llama.cpp hands out
    path, _, _ = write_state_file(tmp_path, KEY, FP, IDS[:3], memoryview(c_state))
    assert read_state_file(path, FP, IDS) == (3, bytes(range(64)))
    path, _, _ = write_state_file(tmp_path, KEY, FP, [], bytearray(b"empty prompt"))
    assert read_state_file(path, FP, IDS) == (0, b"empty prompt")


def test_missing(tmp_path: Path) -> None:
    assert fault(state_path(tmp_path, KEY)).reason == "missing"
    with pytest.raises(CacheFault) as info:
        verify_file(tmp_path / "nope.kv")
    assert info.value.reason == "missing"


@pytest.mark.parametrize(
    ("where", "offset"),
    [
        ("a state byte", -1),
        ("the first state byte", -len(STATE)),
        ("a token id byte", 28 + 5),  # 28-byte fixed header, then the ids
        ("the checksum", 28 + 4 * len(IDS) + 8),
        ("the magic", 0),
    ],
)
def test_corrupt_byte(written: Path, where: str, offset: int) -> None:
    flip_byte(written, offset if offset >= 0 else written.stat().st_size + offset)
    err = fault(written)
    assert err.reason == "corrupt", where
    assert str(written) in str(err)
    with pytest.raises(CacheFault) as info:
        verify_file(written)
    assert info.value.reason == "corrupt"


def test_trailing_bytes_are_corrupt(written: Path) -> None:
    with written.open("ab") as f:
        f.write(b"x")
    assert fault(written).reason == "corrupt"


@pytest.mark.parametrize("keep_bytes", [0, 3, 20, 28 + 8, 28 + 4 * len(IDS) + 10, -1, -50_000])
def test_truncated(written: Path, keep_bytes: int) -> None:
    size = written.stat().st_size
    os.truncate(written, keep_bytes if keep_bytes >= 0 else size + keep_bytes)
    err = fault(written)
    assert err.reason == "truncated", str(err)
    with pytest.raises(CacheFault) as info:
        verify_file(written)
    assert info.value.reason == "truncated"


def test_other_fingerprint(written: Path) -> None:
    err = fault(written, fp=OTHER_FP)
    assert err.reason == "fingerprint"
    assert FP.hex() in str(err) and OTHER_FP.hex() in str(err)
    verify_file(written)  # the file itself is fine, just not for this model


def test_token_ids_differ_from_the_prompt(written: Path) -> None:
    prompt = IDS.copy()
    prompt[6] = 99
    err = fault(written, prompt=prompt)
    assert err.reason == "tokens"
    assert "token 6 differs" in str(err)
    assert fault(written, prompt=IDS[:-1]).reason == "tokens"  # prompt shorter than the state
    assert fault(written, prompt=[-1] + IDS[1:]).reason == "tokens"


def test_full_disk_is_an_io_fault_and_leaves_no_temp(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A real disk cannot be filled here: the temp file is created as usual, but its bytes go
    to /dev/full, which fails every write with ENOSPC."""
    real_create_temp = store._create_temp
    temps: list[Path] = []

    def create_temp_on_full_disk(directory: Path, stem: str) -> tuple[int, Path]:
        fd, tmp = real_create_temp(directory, stem)
        os.close(fd)
        temps.append(tmp)
        return os.open("/dev/full", os.O_WRONLY), tmp

    monkeypatch.setattr(store, "_create_temp", create_temp_on_full_disk)
    with pytest.raises(CacheFault) as info:
        write_state_file(tmp_path, KEY, FP, IDS, STATE)
    assert info.value.reason == "io"
    assert "No space left on device" in str(info.value)
    assert temps and not temps[0].exists()
    assert list(state_path(tmp_path, KEY).parent.iterdir()) == []


def test_unwritable_cache_dir_is_an_io_fault(tmp_path: Path) -> None:
    blocker = tmp_path / "kv"
    blocker.write_bytes(b"a file where the kv directory should be")
    with pytest.raises(CacheFault) as info:
        write_state_file(tmp_path, KEY, FP, IDS, STATE)
    assert info.value.reason == "io"


def test_a_large_state_is_held_once_in_memory(tmp_path: Path) -> None:
    state = bytes(64 << 20)
    path, _, _ = write_state_file(tmp_path, KEY, FP, IDS, state)
    del state
    tracemalloc.start()
    try:
        n, read = read_state_into(path, FP, IDS, spare=16)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert (n, len(read)) == (len(IDS), (64 << 20) + 16)
    assert peak_bytes < (64 << 20) * 1.1, peak_bytes


def test_a_state_is_written_past_the_page_cache_in_aligned_chunks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """O_DIRECT where the file system takes it (this one does): the bytes go through the
    staging buffer a chunk at a time (a small one here, so that a state spans several and ends
    in a partial one), the file is cut to its length, and it reads back exactly."""
    monkeypatch.setattr(direct_write, "DIRECT_CHUNK_BYTES", 64 << 10)
    monkeypatch.setattr(direct_write._staging, "buf", None, raising=False)
    used: list[bool] = []
    real = direct_write.write_direct
    monkeypatch.setattr(direct_write, "write_direct",
                        lambda fd, parts: used.append(real(fd, parts)) or used[-1])
    state = os.urandom(5 * (64 << 10) + 1234)  # 5 chunks and a partial sixth, with the header
    path, size, _ = write_state_file(tmp_path, KEY, FP, IDS, state)
    assert used == [True], "this file system takes O_DIRECT writes"
    assert path.stat().st_size == size
    assert read_state_file(path, FP, IDS) == (len(IDS), state)
    verify_file(path)


def test_a_file_system_that_refuses_direct_writes_gets_a_buffered_one(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EINVAL from an O_DIRECT write (tmpfs on older kernels, some overlays): the file is
    emptied and written through the page cache instead; it reads back exactly."""
    real_write = os.write
    refused: list[int] = []

    def write(fd: int, data: bytes | memoryview) -> int:
        if not refused:
            refused.append(fd)
            raise OSError(22, "Invalid argument")
        return real_write(fd, data)

    monkeypatch.setattr(store.os, "write", write)
    path, size, _ = write_state_file(tmp_path, KEY, FP, IDS, STATE)
    assert refused
    assert path.stat().st_size == size
    assert read_state_file(path, FP, IDS) == (len(IDS), STATE)


DRAFT_FP = bytes(range(2, 18))
TWIN = os.urandom(30_000)


def test_a_draft_models_twin_goes_after_the_models_state_and_reads_back_apart(
    tmp_path: Path
) -> None:
    """A file with a twin (a draft model's state of its first 6 ids): the model's state reads
    back as from a file without one (its checksum, size in the index and header the same),
    the twin reads back alone, only for its own draft model; `model_state_end` is where the
    model's part ends (what the shared tier publishes)."""
    plain, plain_size, plain_sum = write_state_file(tmp_path / "a", KEY, FP, IDS, STATE)
    path, size, checksum = write_state_file(tmp_path, KEY, FP, IDS, STATE,
                                            store.Twin(DRAFT_FP, 6, TWIN))
    assert checksum == plain_sum and path.stat().st_size == size > plain_size
    assert read_state_file(path, FP, IDS) == (len(IDS), STATE)
    verify_file(path)
    n, buf = store.read_twin_into(path, DRAFT_FP, IDS + [5], spare=16)
    assert n == 6 and buf.tobytes()[: len(TWIN)] == TWIN and buf.nbytes == len(TWIN) + 16
    assert store.read_twin_into(path, OTHER_FP, IDS) is None  # another draft model's
    assert store.read_twin_into(plain, DRAFT_FP, IDS) is None  # none at all
    assert store.model_state_end(path.read_bytes()) == plain_size
    assert path.read_bytes()[:plain_size] == plain.read_bytes()
    with pytest.raises(ValueError):  # a twin of more tokens than the state it goes with
        write_state_file(tmp_path, KEY, FP, IDS[:3], STATE, store.Twin(DRAFT_FP, 6, TWIN))


def test_a_damaged_twin_is_refused_alone_and_a_cut_file_whole(tmp_path: Path) -> None:
    """A flipped bit in the twin's state: the model's state still reads (its checksum does not
    cover the twin), the twin is a `corrupt` fault, and so is the whole file for `verify_file`.
    Bytes past the model's state that are no twin, or a twin cut short, make the whole file
    untrustworthy (the length its headers promise is not the file's)."""
    path, size, _ = write_state_file(tmp_path, KEY, FP, IDS, STATE, store.Twin(DRAFT_FP, 6, TWIN))
    flip_byte(path, size - 100)
    assert read_state_file(path, FP, IDS) == (len(IDS), STATE)
    with pytest.raises(CacheFault) as info:
        store.read_twin_into(path, DRAFT_FP, IDS)
    assert info.value.reason == "corrupt"
    with pytest.raises(CacheFault):
        verify_file(path)
    os.truncate(path, size - 1)
    assert fault(path).reason == "truncated"
    plain, plain_size, _ = write_state_file(tmp_path / "b", KEY, FP, IDS, STATE)
    with plain.open("ab") as f:
        f.write(b"PGDX" + bytes(60))
    assert fault(plain).reason == "corrupt"
