"""Cache keys: incremental hashing equals one-shot hashing, and the salt separates what must be
separate (model file, settings, tenant) while staying the same across calls and processes."""

from __future__ import annotations

import os
import random
import subprocess
import sys
from array import array
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from backend.keys import fingerprint, make_salt, pack_ids, prefix_keys

REPO = Path(__file__).resolve().parents[2]
SETTINGS: dict[str, Any] = {
    "n_ctx": 4096,
    "type_k": "f16",
    "type_v": "f16",
    "flash_attn": "off",
    "lib_version": "0.3.16",
}


@pytest.fixture(autouse=True)
def hashes_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Model file hashes are remembered here, not in the user's ~/.cache."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    return tmp_path / "xdg" / "prefixgate"


@pytest.fixture
def model(tmp_path: Path) -> Path:
    """A 3 MiB stand-in for a GGUF: head, middle and tail MiB are distinct random bytes."""
    path = tmp_path / "model.gguf"
    path.write_bytes(random.Random(7).randbytes(3 << 20))
    return path


def one_shot(salt: bytes, ids: list[int], n: int) -> bytes:
    return xxhash.xxh3_128_digest(salt + b"".join(i.to_bytes(4, "little") for i in ids[:n]))


def test_incremental_keys_equal_one_shot_hash_at_every_position() -> None:
    rng = random.Random(1)
    ids = [rng.randrange(49_152) for _ in range(300)]
    salt = b"s" * 16
    keys = prefix_keys(salt, ids, range(len(ids) + 1))
    assert sorted(keys) == list(range(1, len(ids) + 1))
    for n, key in keys.items():
        assert key == one_shot(salt, ids, n), n
        assert len(key) == 16


def test_positions_out_of_range_ignored_and_order_irrelevant() -> None:
    ids = list(range(100, 150))
    salt = b"x" * 16
    keys = prefix_keys(salt, ids, [50, -3, 0, 7, 51, 7, 1000, 20])
    assert sorted(keys) == [7, 20, 50]
    assert keys == prefix_keys(salt, ids, [7, 20, 50])
    assert prefix_keys(salt, ids, []) == {}
    assert prefix_keys(salt, [], [0, 1]) == {}


def test_list_array_and_numpy_ids_give_the_same_keys() -> None:
    ids = [5, 70_000, 0, 2**31 - 1, 42]
    salt = b"k" * 16
    expected = prefix_keys(salt, ids, range(6))
    assert prefix_keys(salt, array("i", ids), range(6)) == expected
    assert prefix_keys(salt, np.array(ids, dtype=np.int64), range(6)) == expected  # type: ignore[arg-type]
    assert pack_ids(ids) == b"".join(i.to_bytes(4, "little") for i in ids)


def test_a_60k_prompt_is_keyed_at_every_64th_position() -> None:
    """Exactness on an agent-sized prompt; its speed is measured by `python -m bench.micro`."""
    rng = random.Random(2)
    ids = [rng.randrange(49_152) for _ in range(60_000)]
    salt = b"w" * 16
    keys = prefix_keys(salt, ids, range(0, 60_001, 64))
    assert len(keys) == 937  # 64, 128, ..., 59_968 (position 0 has no key)
    assert min(keys) == 64 and max(keys) == 59_968
    assert keys[59_968] == xxhash.xxh3_128_digest(salt + pack_ids(ids[:59_968]))
    assert keys[64] == one_shot(salt, ids, 64)


def test_salt_is_stable_across_calls_and_processes(model: Path) -> None:
    salt = make_salt(str(model), **SETTINGS)
    assert len(salt) == 16
    assert make_salt(str(model), **SETTINGS) == salt
    code = (
        "import sys; from backend.keys import make_salt; "
        "sys.stdout.write(make_salt(sys.argv[1], 4096, 'f16', 'f16', 'off', '0.3.16').hex())"
    )
    child = subprocess.run(
        [sys.executable, "-c", code, str(model)],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    )
    assert child.stdout == salt.hex()


@pytest.mark.parametrize(
    "change",
    [
        {"n_ctx": 8192},
        {"type_k": "q8_0"},
        {"type_v": "q8_0"},
        {"flash_attn": "on"},
        {"swa_full": False},
        {"lib_version": "0.3.17"},
        {"batch": 512},
        {"compute": "CUDA (NVIDIA H100 80GB HBM3)"},
        {"tenant": "acme"},
    ],
)
def test_every_setting_and_the_tenant_change_the_salt(model: Path, change: dict[str, Any]) -> None:
    base = make_salt(str(model), **SETTINGS)
    changed = make_salt(str(model), **{**SETTINGS, **change})
    assert changed != base
    ids = list(range(32))
    assert prefix_keys(changed, ids, [32]) != prefix_keys(base, ids, [32])


def test_tenants_are_separated_and_empty_tenant_is_the_default(model: Path) -> None:
    plain = make_salt(str(model), **SETTINGS)
    assert make_salt(str(model), **SETTINGS, tenant="") == plain
    assert make_salt(str(model), **SETTINGS, tenant="a") != make_salt(
        str(model), **SETTINGS, tenant="b"
    )


def test_model_identity_is_the_content_not_the_name_or_mtime(model: Path, tmp_path: Path) -> None:
    base = make_salt(str(model), **SETTINGS)
    os.utime(model, (1_000_000, 1_000_000))  # touched, same bytes: still a hit
    assert make_salt(str(model), **SETTINGS) == base

    copy = tmp_path / "copy"
    copy.mkdir()
    (copy / model.name).write_bytes(model.read_bytes())  # same name and bytes elsewhere: a hit
    assert make_salt(str(copy / model.name), **SETTINGS) == base

    data = bytearray(model.read_bytes())
    data[-10] ^= 0xFF  # a changed tail (e.g. another quantization): a clean miss
    model.write_bytes(data)
    assert make_salt(str(model), **SETTINGS) != base

    renamed = tmp_path / "other.gguf"
    renamed.write_bytes(model.read_bytes())  # the same bytes under another name: a hit
    assert make_salt(str(renamed), **SETTINGS) == make_salt(str(model), **SETTINGS)

    grown = tmp_path / "grown.gguf"
    grown.write_bytes(model.read_bytes() + b"\0")
    assert make_salt(str(grown), **SETTINGS) != make_salt(str(model), **SETTINGS)


def test_fingerprint_is_16_stable_bytes_distinct_from_the_salt(model: Path) -> None:
    salt = make_salt(str(model), **SETTINGS)
    fp = fingerprint(salt)
    assert len(fp) == 16
    assert fp == fingerprint(salt)
    assert fp != salt
    assert fingerprint(make_salt(str(model), **{**SETTINGS, "n_ctx": 2048})) != fp
