"""Where a model's weights go: llama-server's placement flags as llama.cpp model parameters.

    apply(params, split_mode, tensor_split, override_tensor, n_cpu_moe, load_mode, lazy_mode,
          repack, override_kv, device, main_gpu) -> keep
    chosen(device, split_mode, main_gpu) -> the offload devices that compute

- ``split_mode`` (``-sm``): ``none``, ``layer`` or ``row`` across several GPUs;
  ``tensor_split`` (``-ts``): the proportions per GPU, "3,1".
- ``device`` (``-dev``): the GPUs to offload to, by llama.cpp's names ("CUDA0,CUDA1",
  matched without case as llama.cpp does), ``none`` for none (every layer on the CPU), ""
  for every one; ``main_gpu`` (``-mg``): with ``split_mode`` none, the one of those that
  holds the whole model (-1: none). ``chosen`` says which compute, for the ready line and the
  cache key's identity: a state is keyed on the GPUs that made it, not on every GPU present.
- ``override_tensor`` (``-ot``): "PATTERN=BUFFER,..."; a tensor whose name matches a regex
  PATTERN goes to the named buffer type ("CPU", "CUDA0", ... as `ggml_backend_buft_name` names
  them); ``n_cpu_moe`` (``--n-cpu-moe``): the MoE experts of the first N layers stay on the CPU
  (llama.cpp's own patterns, ``blk\\.I\\.ffn_(up|down|gate|gate_up)_(ch|)exps``); -1 keeps every
  layer's there (llama-server's ``-cmoe``). Together they let a 30B MoE model run on a 24 GB
  card.
- ``load_mode`` (llama-server's ``-lm``): how the weights are read, ``auto`` (map the file,
  unless a device cannot), ``none`` (read it), ``mmap``, ``mlock`` (read and lock in RAM),
  ``mmap+mlock`` or ``dio`` (direct I/O where there is). The older ``--mlock`` and ``--no-mmap``
  are spellings of it (proxy/config.py): this llama.cpp's parameters have no
  ``use_mmap``/``use_mlock`` any more, and a value set on a name the struct lacks would be
  dropped without a word. ``lazy_mode`` (``-lzm``): ``on`` reads the rows of the tensors an
  architecture marks (per-layer embeddings) from the mapped file as they are needed, ``auto``
  only for such tensors over 4 GiB, ``off`` never.
- ``repack`` (llama-server's ``--repack`` / ``-nr, --no-repack``): the CPU's extra buffer types,
  weights repacked for its kernels (AMX tiles, AVX2/AVX-512 interleaved blocks): ``on``,
  ``off``, or ``auto`` (`uses_repack`): on, except on a CPU with AMX, whose llama.cpp kernels
  crash at the first prompt batch on some machines (ggml-org/llama.cpp#20824, seen on this
  project's Intel Xeon test machines; llama.cpp has no switch for AMX alone). Repacked weights
  compute other bits, so whether they are used is in the compute identity.

``override_kv`` (``--override-kv``): the model's metadata changed by key (backend/kv_override.py).

The arrays llama.cpp reads during the load are returned (``keep``): the caller holds them until
the model is loaded. A buffer name no device has is a ValueError that lists the names there are.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pathlib
import sys
from typing import Any

import llama_cpp

from backend import kv_override

SPLIT_MODES = {"none": 0, "layer": 1, "row": 2}  # enum llama_split_mode
LOAD_MODES = {  # llama-server's --load-mode words -> enum llama_load_mode
    "auto": llama_cpp.LLAMA_LOAD_MODE_AUTO, "none": llama_cpp.LLAMA_LOAD_MODE_NONE,
    "mmap": llama_cpp.LLAMA_LOAD_MODE_MMAP, "mlock": llama_cpp.LLAMA_LOAD_MODE_MLOCK,
    "mmap+mlock": llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK,
    "dio": llama_cpp.LLAMA_LOAD_MODE_DIRECT_IO,
}
LAZY_MODES = {"off": llama_cpp.LLAMA_LAZY_MODE_OFF, "auto": llama_cpp.LLAMA_LAZY_MODE_AUTO,
              "on": llama_cpp.LLAMA_LAZY_MODE_ON}  # --lazy-mode -> enum llama_lazy_mode
FFN_EXPERTS = r"\.ffn_(up|down|gate|gate_up)_(ch|)exps"  # llama.cpp's LLM_FFN_EXPS_REGEX


class _Override(ctypes.Structure):  # struct llama_model_tensor_buft_override
    _fields_ = [("pattern", ctypes.c_char_p), ("buft", ctypes.c_void_p)]


# ggml's shared library by platform, in the order llama-cpp-python tries its own
# (llama_cpp._ctypes_extensions.load_shared_library)
GGML_NAMES = {"darwin": ("libggml.so", "libggml.dylib"), "win32": ("ggml.dll", "libggml.dll")}


def ggml_library(base: pathlib.Path | None = None, platform: str = sys.platform
                 ) -> pathlib.Path:
    """ggml's shared library, found where and as llama-cpp-python finds libllama beside it: in
    LLAMA_CPP_LIB_PATH, else llama_cpp's lib directory; libggml.so (Linux, FreeBSD),
    libggml.so or libggml.dylib (macOS), ggml.dll or libggml.dll (Windows)."""
    if base is None:
        override = os.environ.get("LLAMA_CPP_LIB_PATH")
        base = pathlib.Path(override) if override else \
            pathlib.Path(llama_cpp.__file__).parent / "lib"
    names = GGML_NAMES.get(platform, ("libggml.so",))
    for name in names:
        if (base / name).exists():
            return base / name
    raise FileNotFoundError(f"ggml's shared library ({' or '.join(names)}) is not in {base}, "
                            "where llama-cpp-python keeps its libraries: reinstall it")


@functools.cache
def _ggml() -> ctypes.CDLL:
    """ggml's device API (loaded and declared once)."""
    ggml = ctypes.CDLL(str(ggml_library()))
    ptr, size, name = ctypes.c_void_p, ctypes.POINTER(ctypes.c_size_t), ctypes.c_char_p
    for fn, restype, argtypes in (
            ("ggml_backend_dev_count", ctypes.c_size_t, []),
            ("ggml_backend_dev_get", ptr, [ctypes.c_size_t]),
            ("ggml_backend_dev_buffer_type", ptr, [ptr]),
            ("ggml_backend_buft_name", name, [ptr]),
            ("ggml_backend_dev_name", name, [ptr]),
            ("ggml_backend_dev_description", name, [ptr]),
            ("ggml_backend_dev_type", ctypes.c_int, [ptr]),
            ("ggml_backend_dev_memory", None, [ptr, size, size])):
        getattr(ggml, fn).restype, getattr(ggml, fn).argtypes = restype, argtypes
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
    if n_cpu_moe < 0:  # llama-server's -cmoe: every layer's experts, as its one pattern
        return [*pairs, (FFN_EXPERTS, "CPU")]
    pairs += [(rf"blk\.{i}{FFN_EXPERTS}", "CPU") for i in range(n_cpu_moe)]
    return pairs


REPACK = ("auto", "on", "off")


def cpu_features() -> list[str]:
    """The CPU features ggml picks its kernels by, as its system info says ("AVX2", "AMX_INT8")."""
    info = llama_cpp.llama_print_system_info().decode(errors="replace")
    cpu_part = info.split("CPU :", 1)[1].split(":", 1)[0] if "CPU :" in info else ""
    # "SSE3 = 1 | AVX = 1 | ... | REPACK = 1 | CUDA" -> the features that are on
    return [f.split("=")[0].strip() for f in cpu_part.split("|") if f.strip().endswith("= 1")]


def uses_repack(repack: str) -> bool:
    """Whether the CPU's extra buffer types are used (module docstring)."""
    if repack not in REPACK:
        raise ValueError(f"--repack is one of {', '.join(REPACK)}")
    return repack == "on" or (repack == "auto" and "AMX_INT8" not in cpu_features())


def apply(params: Any, split_mode: str = "layer", tensor_split: str = "",
          override_tensor: str = "", n_cpu_moe: int = 0, load_mode: str = "auto",
          lazy_mode: str = "auto", repack: str = "auto", override_kv: str = "",
          device: str = "", main_gpu: int = 0) -> list[Any]:
    keep: list[Any] = kv_override.model_params(params, kv_override.parse(override_kv))
    params.main_gpu = main_gpu
    listed = named(device)
    if listed is not None:  # llama.cpp's NULL-terminated list of the devices to offload to
        arr_d = (ctypes.c_void_p * (len(listed) + 1))(*[d["handle"] for d in listed], None)
        keep.append(arr_d)
        params.devices = ctypes.cast(arr_d, ctypes.c_void_p)
    params.use_extra_bufts = uses_repack(repack)
    if split_mode not in SPLIT_MODES:
        raise ValueError(f"--split-mode is one of {', '.join(SPLIT_MODES)}")
    params.split_mode = SPLIT_MODES[split_mode]
    if load_mode not in LOAD_MODES:
        raise ValueError(f"--load-mode is one of {', '.join(LOAD_MODES)}")
    params.load_mode = LOAD_MODES[load_mode]
    if lazy_mode not in LAZY_MODES:
        raise ValueError(f"--lazy-mode is one of {', '.join(LAZY_MODES)}")
    params.lazy_mode = LAZY_MODES[lazy_mode]
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


DEVICE_TYPES = {0: "cpu", 1: "gpu", 2: "igpu", 3: "accel"}  # enum ggml_backend_dev_type


def devices() -> list[dict[str, Any]]:
    """The devices this llama.cpp build can compute on: name ("CPU", "CUDA0"), description
    ("NVIDIA H100 80GB HBM3"), type (cpu, gpu, igpu, accel), free and total bytes, and
    llama.cpp's handle (a ``ggml_backend_dev_t``, for the model's device list)."""
    ggml = _ggml()
    out = []
    for i in range(ggml.ggml_backend_dev_count()):
        dev = ggml.ggml_backend_dev_get(i)
        free, total = ctypes.c_size_t(0), ctypes.c_size_t(0)
        ggml.ggml_backend_dev_memory(dev, ctypes.byref(free), ctypes.byref(total))
        out.append({"name": (ggml.ggml_backend_dev_name(dev) or b"").decode(errors="replace"),
                    "description": (ggml.ggml_backend_dev_description(dev) or b"").decode(
                        errors="replace"),
                    "type": DEVICE_TYPES.get(ggml.ggml_backend_dev_type(dev), "other"),
                    "free": free.value, "total": total.value, "handle": dev})
    return out


def offload_devices() -> list[dict[str, Any]]:
    """The devices GPU layers can go to (a GPU, an integrated GPU or an accelerator)."""
    return [d for d in devices() if d["type"] != "cpu"]


def named(device: str) -> list[dict[str, Any]] | None:
    """The offload devices -dev names, in its order, matched without case ([] for ``none``);
    None where it names none (every device). A name no such device has is a ValueError that
    lists what there is."""
    names = [n.strip() for n in device.split(",") if n.strip()]
    if not names:
        return None
    if [n.lower() for n in names] == ["none"]:
        return []
    gpus = offload_devices()
    by_name = {d["name"].lower(): d for d in gpus}
    missing = [n for n in names if n.lower() not in by_name]
    if missing:
        raise ValueError(
            f"-dev {device}: no device {', '.join(missing)} to offload to here (there are: "
            f"{', '.join(d['name'] for d in gpus) or 'none; the CPU computes'}; "
            "`prefixgate doctor` lists them)")
    return [by_name[n.lower()] for n in names]


def chosen(device: str = "", split_mode: str = "layer", main_gpu: int = 0
           ) -> list[dict[str, Any]]:
    """The offload devices that compute, as llama.cpp picks them from -dev, -sm and -mg: the
    ones named (`named`; every one where none is), and with ``split_mode`` none only the
    `main_gpu`th of those (none where it is -1). A name no device has, or a `main_gpu` out of
    range, is a ValueError that lists what there is."""
    listed = named(device)
    gpus = offload_devices() if listed is None else listed
    if split_mode == "none" and gpus:
        if listed is None:  # llama.cpp's own list: the GPUs, or the integrated ones if none
            gpus = [d for d in gpus if d["type"] == "gpu"] or \
                [d for d in gpus if d["type"] == "igpu"] or gpus
        if main_gpu < 0:
            return []
        if main_gpu >= len(gpus):
            raise ValueError(f"-mg {main_gpu}: with -sm none the model goes to one of "
                             f"{len(gpus)} GPU{'s' if len(gpus) > 1 else ''} "
                             f"({', '.join(d['name'] for d in gpus)}): give 0 to "
                             f"{len(gpus) - 1}")
        gpus = [gpus[main_gpu]]
    return gpus


def check_gpu_layers(n_gpu_layers: int) -> None:
    """GPU layers on a build that has no device to offload to is a ValueError that says how to
    fix it: llama.cpp would run them on the CPU without a word."""
    if n_gpu_layers and not offload_devices():
        raise ValueError(
            f"-ngl {'all' if n_gpu_layers < 0 else n_gpu_layers} asks for GPU layers, but this "
            "llama-cpp-python has no GPU backend (a CPU-only build): install the CUDA build "
            "(`make serve GPU=cuda`, or deploy/Dockerfile; see the README), or give -ngl 0")


def compute_identity(gpus: list[dict[str, Any]], cpu_computes: bool, repack: bool = True
                     ) -> str:
    """What computes a state's KV, in the words a cache key is salted with (backend.keys): the
    offload devices' kind and model ("CUDA (NVIDIA H100 80GB HBM3)"), and the CPU with the
    kernel features ggml picks its kernels by where it computes layers (`cpu_computes`: not
    every layer on a GPU, or tensors placed by -ot / --n-cpu-moe).

    Another GPU model or CPU runs other kernels, so a state it made is not the bits a cold run
    here computes: with this in the salt, hosts sharing a cache (the shared tier, one volume)
    share states only among like machines, and with weights repacked alike (`repack`). The
    thread count is not in it (ggml computes each output of an op on one thread, whatever their
    number)."""
    parts = sorted({f"{d['name'].rstrip('0123456789')} ({d['description']})" for d in gpus})
    if cpu_computes or not gpus:
        cpu = next((d["description"] for d in devices() if d["type"] == "cpu"), "CPU")
        parts.insert(0, f"CPU ({cpu}; {' '.join(cpu_features())}"
                        f"{'' if repack else '; weights not repacked'})")
    return ", ".join(parts)
