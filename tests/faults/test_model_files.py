"""A damaged model file ends the start in one line (issue 46, section 4).

Every file here is generated in tmp_path from a small, valid GGUF written with gguf-py (two F32
tensors behind a few hundred tokens of vocabulary): cut short at every kind of place, garbage
after the magic, an array that claims more entries than the file can hold, a FIFO and a
directory where the model should be. `prefixgate serve` (and `prefixgate worker`) run as
subprocesses: each must exit non-zero with exactly one line on stderr that names the file and
what is wrong, never a traceback, never a hang (the subprocess timeout), never an allocation the
file cannot back (`check_file`'s peak allocation is measured with tracemalloc). `-hf` with the
hub unreachable is one line too.
"""

from __future__ import annotations

import os
import random
import struct
import subprocess
import sys
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from proxy.gguf import GGML_TYPE_SIZES, GGUFError, _map, _read, check_file
from tests.conftest import ROOT, free_port


def valid_gguf(path: Path) -> Path:
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("damaged-file-test")
    w.add_context_length(512)
    w.add_tokenizer_model("gpt2")
    w.add_token_list([f"token-{i}" for i in range(300)])
    w.add_token_types([1] * 300)
    w.add_tensor("token_embd.weight", np.arange(4096, dtype=np.float32).reshape(64, 64))
    w.add_tensor("output.weight", np.ones((64, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def metadata_end(path: Path) -> int:
    buf = _map(str(path))
    try:
        return _read(buf, str(path))[1].off
    finally:
        buf.close()


def cut(at: Callable[[Path], int]) -> Callable[[Path], bytes]:
    def make(good: Path) -> bytes:
        return good.read_bytes()[:at(good)]
    return make


def garbage(after: bytes) -> Callable[[Path], bytes]:
    return lambda good: after + random.Random(46).randbytes(4096)


def huge_string_array(good: Path) -> bytes:
    key = b"tokenizer.ggml.tokens"
    return (b"GGUF" + struct.pack("<IQQ", 3, 0, 1) + struct.pack("<Q", len(key)) + key
            + struct.pack("<IIQ", 9, 8, 1 << 26) + b"\x05\x00\x00\x00\x00\x00\x00\x00abcde" * 4)


DAMAGED: list[tuple[str, Callable[[Path], bytes], str]] = [
    # (case, the file's bytes from the valid one, what the line must say)
    ("magic then garbage", garbage(b"GGUF"), "unsupported GGUF version"),
    ("magic, version 3, then garbage", garbage(b"GGUF\x03\x00\x00\x00"), "claimed"),
    ("cut at 16 B", cut(lambda g: 16), "truncated"),
    ("cut at 1 KiB", cut(lambda g: 1024), "can hold"),
    ("cut inside the metadata", cut(lambda g: metadata_end(g) * 2 // 3), "truncated"),
    ("cut just after the metadata", cut(metadata_end), "truncated"),
    ("cut at half", cut(lambda g: g.stat().st_size // 2), "truncated: tensor"),
    ("one byte short", cut(lambda g: g.stat().st_size - 1), "truncated: tensor"),
    ("a string array claiming 2^26 entries", huge_string_array, "67108864 array items"),
    ("empty", lambda good: b"", "is not a GGUF model file"),
    ("not a GGUF at all", lambda good: b"<html>404</html>" * 10, "bad magic"),
]


def serve(tmp: Path, *args: str, env: dict[str, str] | None = None,
          command: str = "serve") -> subprocess.CompletedProcess[str]:
    where = ["--port", "0"] if command == "serve" else ["--listen", f"127.0.0.1:{free_port()}"]
    return subprocess.run([sys.executable, "-m", "proxy.cli", command, *where,
                           "--cache-dir", str(tmp / "cache"), *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60,
                          env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def one_line(out: subprocess.CompletedProcess[str], *words: str) -> str:
    assert out.returncode != 0, out.stderr[-3000:]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1, out.stderr[-3000:]
    for w in words:
        assert w in lines[0], lines[0]
    return lines[0]


@pytest.mark.parametrize(("case", "make", "says"), DAMAGED, ids=[d[0] for d in DAMAGED])
def test_a_damaged_model_file_is_one_line(tmp_path: Path, case: str,
                                          make: Callable[[Path], bytes], says: str) -> None:
    good = valid_gguf(tmp_path / "good.gguf")
    check_file(str(good))  # the file they are made from is whole
    bad = tmp_path / "damaged.gguf"
    bad.write_bytes(make(good))
    with pytest.raises(GGUFError, match=says):
        check_file(str(bad))
    one_line(serve(tmp_path, "--model", str(bad)), str(bad), says)


def test_a_damaged_model_file_stops_a_worker_too(tmp_path: Path) -> None:
    good = valid_gguf(tmp_path / "good.gguf")
    bad = tmp_path / "damaged.gguf"
    bad.write_bytes(good.read_bytes()[:-1])
    one_line(serve(tmp_path, "--model", str(bad), command="worker"), str(bad), "truncated")


def test_a_huge_array_is_refused_before_it_is_allocated(tmp_path: Path) -> None:
    bad = tmp_path / "huge.gguf"
    bad.write_bytes(huge_string_array(bad))
    tracemalloc.start()
    try:
        with pytest.raises(GGUFError):
            check_file(str(bad))
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1 << 20, peak  # 2^26 list slots would be 512 MiB


@pytest.mark.parametrize("kind", ["fifo", "directory"])
def test_a_model_that_is_not_a_regular_file_is_refused_at_once(tmp_path: Path,
                                                                kind: str) -> None:
    model = tmp_path / "model.gguf"
    os.mkfifo(model) if kind == "fifo" else model.mkdir()
    line = one_line(serve(tmp_path, "--model", str(model)), str(model), "not a regular file")
    assert ("a FIFO" if kind == "fifo" else "a directory") in line


def test_dash_hf_with_the_hub_unreachable_is_one_line(tmp_path: Path) -> None:
    port = free_port()  # nothing listens there
    out = serve(tmp_path, "-hf", "pg-test/not-cached-GGUF:Q4_0",
                env={"HF_ENDPOINT": f"http://127.0.0.1:{port}", "HF_HOME": str(tmp_path / "hf"),
                     "HF_HUB_OFFLINE": "0"})
    one_line(out, "-hf pg-test/not-cached-GGUF", "unreachable", "not in the Hugging Face cache")


def test_the_type_sizes_are_gguf_pys() -> None:
    from gguf.constants import GGML_QUANT_SIZES

    assert {int(t): size for t, size in GGML_QUANT_SIZES.items()} == GGML_TYPE_SIZES
