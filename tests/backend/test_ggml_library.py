"""ggml's shared library is found as llama-cpp-python finds its own (issue 42: it was opened as
`libggml.so` by name, which a Mac build does not have): in LLAMA_CPP_LIB_PATH or llama_cpp's lib
directory, under each platform's names, on this Linux install and over directories laid out as
the other platforms' builds are."""

from __future__ import annotations

import pathlib
import sys
from pathlib import Path

import llama_cpp
import pytest

from backend import placement


def test_on_this_install_it_is_the_library_beside_libllama() -> None:
    found = placement.ggml_library()
    assert found.parent == pathlib.Path(llama_cpp.__file__).parent / "lib"
    assert found.name in placement.GGML_NAMES.get(sys.platform, ("libggml.so",))
    assert any(d["type"] == "cpu" for d in placement.devices()), "it loads, and answers"


@pytest.mark.parametrize(("platform", "files", "expected"), [
    ("linux", ["libggml.so", "libllama.so"], "libggml.so"),
    ("darwin", ["libggml.dylib", "libllama.dylib"], "libggml.dylib"),  # a Mac build
    ("darwin", ["libggml.so", "libggml.dylib"], "libggml.so"),  # llama-cpp-python's order
    ("win32", ["ggml.dll", "llama.dll"], "ggml.dll"),
    ("win32", ["libggml.dll"], "libggml.dll"),
    ("freebsd14", ["libggml.so"], "libggml.so"),
])
def test_each_platforms_name(tmp_path: Path, platform: str, files: list[str],
                             expected: str) -> None:
    for name in files:
        (tmp_path / name).write_bytes(b"")
    assert placement.ggml_library(tmp_path, platform) == tmp_path / expected


def test_llama_cpp_lib_path_is_looked_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch
                                         ) -> None:
    (tmp_path / "libggml.dylib").write_bytes(b"")
    monkeypatch.setenv("LLAMA_CPP_LIB_PATH", str(tmp_path))
    assert placement.ggml_library(platform="darwin") == tmp_path / "libggml.dylib"
    with pytest.raises(FileNotFoundError, match=r"libggml.so\) is not in "):
        placement.ggml_library(platform="linux")
