"""Where a model's weights go: llama-server's placement flags as llama.cpp model parameters.

    apply(params, split_mode, tensor_split, override_tensor, n_cpu_moe, mlock, mmap) -> keep

- ``split_mode`` (``-sm``): ``none``, ``layer`` or ``row`` across several GPUs;
  ``tensor_split`` (``-ts``): the proportions per GPU, "3,1".
- ``override_tensor`` (``-ot``): "PATTERN=BUFFER,..."; a tensor whose name matches a regex
  PATTERN goes to the named buffer type ("CPU", "CUDA0", ... as `ggml_backend_buft_name` names
  them); ``n_cpu_moe`` (``--n-cpu-moe``): the MoE experts of the first N layers stay on the CPU
  (llama.cpp's own patterns, ``blk\\.I\\.ffn_(up|down|gate|gate_up)_(ch|)exps``). Together they
  let a 30B MoE model run on a 24 GB card.
- ``mlock``, ``mmap``: lock the weights in RAM; map the file instead of reading it.

The arrays llama.cpp reads during the load are returned (``keep``): the caller holds them until
the model is loaded. A buffer name no device has is a ValueError that lists the names there are.
"""

from __future__ import annotations

import ctypes
import pathlib
from typing import Any

import llama_cpp

SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}  # enum llama_split_mode
FFN_EXPERTS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # llama.cpp's LLM_FFN_EXPS_REGEX


class _Override(ctypes.Structure):  # struct llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


def _ggml() -> ctypes.CDLL:
    lib = pathlib.Path(llama_cpp.__file__).parent / "lib" / "libggml.so"
    ggml = ctypes.CDLL(str(lib) if lib.exists() else "libggml.so")
    ggml.ggml_backend_dev_count.restype = ctypes.c_size_t
    ggml.ggml_backend_dev_get.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_get.argtypes = [ctypes.c_size_t]
    ggml.ggml_backend_dev_buffer_type.restype = ctypes.c_void_p
    ggml.ggml_backend_dev_buffer_type.argtypes = [ctypes.c_void_p]
    ggml.ggml_backend_buft_name.restype = ctypes.c_char_p
    ggml.ggml_backend_buft_name.argtypes = [ctypes.c_void_p]
    return ggml


def buffer_types() -> dict[str, int]:
    """Each device's buffer type by its name ("CPU", "CUDA0", ...)."""
    ggml = _ggml()
    out: dict[str, int] = {}
    for i in range(ggml.ggml_backend_dev_count()):
        buft = ggml.ggml_backend_dev_buffer_type(ggml.ggml_backend_dev_get(i))
        if buft:
            out[ggml.ggml_backend_buft_name(buft).decode()] = buft
    return out


def overrides(override_tensor: str, n_cpu_moe: int) -> list[tuple[str, str]]:
    """(pattern, buffer name) pairs, in llama.cpp's order: -ot's, then --n-cpu-moe's."""
    pairs = []
    for item in (x.strip() for x in override_tensor.split(",") if x.strip()):
        pattern, sep, buft = item.rpartition("=")
        if not sep or not pattern or not buft:
            raise ValueError(f"--override-tensor wants PATTERN=BUFFER, got {item!r}")
        pairs.append((pattern, buft))
    if n_cpu_moe < 0:
        raise ValueError("--n-cpu-moe takes a number of layers, 0 or more")
    pairs += [(rf"blk\.{i}{FFN_EXPERTS}", "CPU") for i in range(n_cpu_moe)]
    return pairs


def apply(params: Any, split_mode: str = "layer", tensor_split: str = "",
          override_tensor: str = "", n_cpu_moe: int = 0, mlock: bool = False,
          mmap: bool = True) -> list[Any]:
    keep: list[Any] = []
    if split_mode not in SPLIT_MODES:
        raise ValueError(f"--split-mode is one of {', '.join(SPLIT_MODES)}")
    params.split_mode = SPLIT_MODES[split_mode]
    params.use_mlock, params.use_mmap = mlock, mmap
    if tensor_split.strip():
        try:
            parts = [float(x) for x in tensor_split.replace("/", ",").split(",") if x.strip()]
        except ValueError:
            raise ValueError(f"--tensor-split wants proportions like 3,1, got {tensor_split!r}"
                             ) from None
        n = int(llama_cpp.llama_max_devices())
        if len(parts) > n:
            raise ValueError(f"--tensor-split gives {len(parts)} proportions; this build "
                             f"handles {n} devices")
        arr = (ctypes.c_float * n)(*parts)
        keep.append(arr)
        params.tensor_split = arr
    pairs = overrides(override_tensor, n_cpu_moe)
    if pairs:
        names = buffer_types()
        missing = sorted({b for _, b in pairs if b not in names})
        if missing:
            raise ValueError(f"no buffer type {', '.join(missing)} on this machine (there are: "
                             f"{', '.join(names) or 'none'})")
        arr_o = (_Override * (len(pairs) + 1))(
            *[_Override(p.encode(), names[b]) for p, b in pairs], _Override(None, None))
        keep.append(arr_o)
        params.tensor_buft_overrides = ctypes.cast(arr_o, ctypes.c_void_p)
    return keep
