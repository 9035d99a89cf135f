"""Loading a model and making its context with prefixgate's settings: the parameters
llama.cpp gets (KV types, flash attention, batch, threads, slots as non-unified KV streams,
where the weights go, RoPE scaling, NUMA), what the model's memory allows (`Memory`), and where
it all went (the placement the ready line reports). `backend.engine.Engine` runs on what `load`
returns.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import llama_cpp

from backend import kv_override
from backend.cpus import allowed_cpus, usable_cpus
from backend.placement import apply as placement_params
from backend.placement import check_gpu_layers, chosen, compute_identity, offload_devices
from policies.prefix import default_batch

log = logging.getLogger("prefixgate.engine")

CACHE_TYPES: dict[str, int] = {  # llama.cpp's -ctk/-ctv names -> ggml types
    "f32": 0, "f16": 1, "bf16": 30, "q8_0": 8, "q4_0": 2, "q4_1": 3, "iq4_nl": 20,
    "q5_0": 6, "q5_1": 7,
}
FLASH_ATTN = ("on", "off", "auto")
# llama-server's --rope-scaling words -> llama_rope_scaling_type
ROPE_SCALING = {"none": 0, "linear": 1, "yarn": 2}
# the context parameters of llama-server's --rope-freq-base, --rope-freq-scale and --yarn-*
ROPE_PARAMS = ("rope_freq_base", "rope_freq_scale", "yarn_orig_ctx", "yarn_ext_factor",
               "yarn_attn_factor", "yarn_beta_slow", "yarn_beta_fast")
# llama-server's --numa words -> ggml_numa_strategy
NUMA = {"distribute": 1, "isolate": 2, "numactl": 3}

MemoryKind = Literal["plain", "window", "recurrent"]
# how decode steps of several slots run (module rules)
DecodeShape = Literal["apart", "batched", "fixed"]


@dataclass(frozen=True, slots=True)
class Memory:
    """What the model's memory lets the live state do.

    - ``plain``: attention KV for every position; cut back to any position.
    - ``window``: sliding-window attention (``n_swa`` tokens): the window layers may hold only
      the cells of the last window, so the state can be cut back only while the cells of the new
      position's window are still there (``llama_memory_seq_pos_min``). With a real window
      (``full`` false) they drop what falls behind it as the prompt grows; with a full-size
      cache they keep everything they computed, but a restored snapshot holds only its last
      window (llama.cpp does not write cells the window masks).
    - ``recurrent``: a recurrent or hybrid model (Mamba, gated delta net, short conv beside
      attention): the recurrent state exists only at its last position; never cut back, except
      with ``rollback`` (llama.cpp's ``n_rs_seq``, where the architecture has it: Qwen3.5,
      Nemotron-H, LFM2, ...): after a llama_decode the states after each of its last
      ``rollback`` tokens are kept, so a verify's rejected drafts can be cut off once.
    """

    kind: MemoryKind
    n_swa: int = 0
    full: bool = False  # window: a full-size cache for the window layers (--swa-full)
    rollback: int = 0  # recurrent: tokens a llama_decode's end may be cut back by, once

    def to_wire(self) -> dict[str, Any]:
        return {"kind": self.kind, "n_swa": self.n_swa, "swa_full": self.full,
                "rollback": self.rollback}




@dataclass(frozen=True, slots=True)
class Loaded:
    """A model and its context, as `load` made them (the handles are llama.cpp's)."""

    model: Any
    ctx: Any
    memory: Memory
    flash_attn: str  # as llama.cpp got it (`resolve_flash_attn`)
    n_batch: int
    n_threads: int  # as resolved: what the kernels run with
    n_threads_batch: int
    placement: dict[str, Any]  # where weights and KV went (the ready line)
    compute: str  # what computes the KV (the cache identity)


def load(model_path: str, n_ctx: int, n_threads: int | None, n_gpu_layers: int, *,
         n_batch: int = 0, flash_attn: str = "off", type_k: str = "f16", type_v: str = "f16",
         swa_full: bool = True, n_threads_batch: int | None = None,
         placement: Mapping[str, Any] | None = None, n_seq: int = 1,
         progress: Callable[[float], None] | None = None, deterministic: str = "auto",
         outputs: int = 0, rollback: int = 0, rope: Mapping[str, Any] | None = None,
         numa: str = "") -> Loaded:
    """The model loaded and its context made; a ValueError that says what to change where
    llama.cpp refuses either. `outputs`: the most rows with logits one llama_decode asks for
    (0: the whole batch; `policies.prefix.outputs_max`). `rollback`: a recurrent state's
    (`Memory.rollback`, for a verify's drafts; none where the architecture has none). `rope`:
    llama-server's RoPE settings that were given, `rope_scaling` (a ROPE_SCALING word) and
    ROPE_PARAMS by name (the rest are the model's own). `numa`: a NUMA word, for the process."""
    if flash_attn not in FLASH_ATTN:
        raise ValueError(f"flash attention is one of {', '.join(FLASH_ATTN)}")
    for t in (type_k, type_v):
        if t not in CACHE_TYPES:
            raise ValueError(f"unknown KV cache type {t!r} (one of {', '.join(CACHE_TYPES)})")
    backend_init(numa)
    pl = dict(placement or {})
    # the GPUs that compute (-dev, -sm none with -mg): the ready line and the cache identity
    check_gpu_layers(n_gpu_layers)
    gpus = chosen(str(pl.get("device", "")), str(pl.get("split_mode", "layer")),
                  int(pl.get("main_gpu", 0) or 0))
    mp = llama_cpp.llama_model_default_params()
    # -1: every layer (llama.cpp takes a count; -1 itself is not "all" there)
    mp.n_gpu_layers = 0x7FFFFFFF if n_gpu_layers < 0 else n_gpu_layers
    kv_offload = bool(pl.pop("kv_offload", True))  # a context's parameter, not the model's
    keep: list[Any] = placement_params(mp, **pl)  # held while loading
    if progress is not None:  # llama.cpp's loading progress, 0..1
        def report(p: float, _: Any) -> bool:
            progress(p)
            return True
        keep.append(llama_cpp.llama_progress_callback(report))
        mp.progress_callback = keep[-1]
    free0 = [d["free"] for d in offload_devices()]
    rss0 = resident_bytes()
    model = llama_cpp.llama_model_load_from_file(model_path.encode(), mp)
    del keep
    # what to do when the GPU is full (llama-server's --fit finds the layers that fit
    # by itself; here they are given)
    full = ("; if the GPU ran out of memory (llama.cpp's log above says so), offload fewer "
            "layers (-ngl N), keep MoE experts on the CPU (--n-cpu-moe N) or give a smaller "
            "-c") if gpus and n_gpu_layers else ""
    if not model:
        raise ValueError(f"llama.cpp could not load the model {model_path}{full}")
    free1 = [d["free"] for d in offload_devices()]
    rss1 = resident_bytes()
    memory = memory_of(model, swa_full)
    # what flash attention is, as llama.cpp gets it (`resolve_flash_attn`)
    fa = resolve_flash_attn(flash_attn, cpu_only=not gpus or n_gpu_layers == 0,
                            n_seq=n_seq, type_v=type_v, memory=memory,
                            deterministic=deterministic)
    cp = llama_cpp.llama_context_default_params()
    n_batch = n_batch or default_batch(n_gpu_layers)
    # n_ctx is shared among the slots, as llama-server's -c with -np; one KV stream each
    cp.n_ctx, cp.n_batch, cp.n_ubatch, cp.n_seq_max = n_ctx, n_batch, n_batch, n_seq
    cp.kv_unified = False
    # its compute buffer holds logits for this many rows (llama.cpp's default: the batch, which
    # at 512 rows of a 152K vocabulary is 297 MiB of a GPU's memory; llama-server asks the
    # slots' rows of a verify, as here)
    cp.n_outputs_max = outputs
    cp.n_threads = n_threads or default_threads()
    cp.n_threads_batch = n_threads_batch or n_threads or usable_cpus()
    # as resolved: what the kernels run with (a self-check verdict is keyed on these)
    threads = int(cp.n_threads), int(cp.n_threads_batch)
    cp.flash_attn_type = {"on": llama_cpp.LLAMA_FLASH_ATTN_TYPE_ENABLED,
                          "off": llama_cpp.LLAMA_FLASH_ATTN_TYPE_DISABLED,
                          "auto": llama_cpp.LLAMA_FLASH_ATTN_TYPE_AUTO}[fa]
    cp.type_k, cp.type_v = CACHE_TYPES[type_k], CACHE_TYPES[type_v]
    cp.swa_full = swa_full
    cp.offload_kqv = kv_offload
    cp.n_rs_seq = rollback if memory.kind == "recurrent" else 0
    cp.no_perf = True
    rope = dict(rope or {})
    for name, value in rope.items():
        if name == "rope_scaling":
            cp.rope_scaling_type = ROPE_SCALING[value]
        elif name in ROPE_PARAMS:
            setattr(cp, name, value)
        else:
            raise ValueError(f"unknown RoPE setting {name!r}")
    ctx = llama_cpp.llama_init_from_model(model, cp)
    if not ctx:
        llama_cpp.llama_model_free(model)
        raise ValueError(
            f"llama.cpp could not create a context (n_ctx {n_ctx}, K {type_k}, V {type_v}, "
            f"flash attention {fa}; a quantized V cache needs flash attention)"
            f"{full}")
    if cp.n_rs_seq:  # 0 where the architecture cannot roll back
        memory = replace(memory, rollback=int(llama_cpp.llama_n_rs_seq(ctx)))
    # where it all went, for the ready line: weights and KV (with compute buffers), on the
    # GPUs (their free memory before and after) and in RAM (this process's resident set)
    free2 = [d["free"] for d in offload_devices()]
    n_layer = int(llama_cpp.llama_model_n_layer(model))
    where = {
        "backend": ", ".join(f"{d['name']} ({d['description']})" for d in gpus) or "CPU",
        "gpu_layers": min(n_gpu_layers if n_gpu_layers >= 0 else n_layer + 1, n_layer + 1)
        if gpus else 0,
        "layers": n_layer + 1,  # llama.cpp counts the output layer as one, as its log does
        "weights_bytes": int(llama_cpp.llama_model_size(model)),
        "vram_weights_bytes": sum(a - b for a, b in zip(free0, free1, strict=True)),
        "vram_kv_bytes": sum(a - b for a, b in zip(free1, free2, strict=True)),
        "ram_weights_bytes": max(rss1 - rss0, 0), "ram_kv_bytes": max(resident_bytes() - rss1, 0),
        "threads": max(threads),  # what it computes with at most (proxy.worker_link.cores_note)
    }
    # what computes the KV, for the cache identity: the CPU too where it computes layers
    compute = compute_identity(gpus, where["gpu_layers"] < n_layer + 1 or bool(
        str(pl.get("override_tensor", "")).strip() or int(pl.get("n_cpu_moe", 0) or 0)),
        bool(mp.use_extra_bufts))
    where["repack"] = bool(mp.use_extra_bufts)
    if fa != flash_attn:  # `auto` decided here, not by llama.cpp: other bits
        compute += f"; flash attention {fa}"
    if memory.rollback:  # its states are kept through another kernel: other bits
        compute += f"; recurrent rollback {memory.rollback}"
    if rope:  # other positions' rotations: other bits
        where["rope"] = "RoPE " + ", ".join(f"{k} {v}" for k, v in sorted(rope.items()))
        compute += f"; {where['rope']}"
    if kv := kv_override.describe(kv_override.parse(str(pl.get("override_kv", "")))):
        where["metadata"] = kv  # other weights' settings: other bits
        compute += f"; {kv}"
    if numa:
        where["numa"] = f"NUMA {numa}"
    if not kv_offload and where["gpu_layers"]:  # the KV and its attention on the host
        where["kv_offload"] = "KV cache in host RAM (-nkvo)"
        compute += f"; {where['kv_offload']}"
    assert isinstance(compute, str)
    return Loaded(model, ctx, memory, fa, n_batch, threads[0], threads[1], where, compute)


_backend_ready = False


def backend_init(numa: str = "") -> None:
    """llama.cpp's backends, once per process; `numa`: its NUMA placement of the compute
    threads (a NUMA word), which must come before any model loads."""
    global _backend_ready
    if not _backend_ready:
        # llama-cpp-python routes llama.cpp's log through this logger: errors only, as
        # `Llama(verbose=False)` does, unless prefixgate itself logs at DEBUG
        if not log.isEnabledFor(logging.DEBUG):
            logging.getLogger("llama-cpp-python").setLevel(logging.ERROR)
        llama_cpp.llama_backend_init()
        if numa:
            llama_cpp.llama_numa_init(NUMA[numa])
        _backend_ready = True


def resolve_flash_attn(flash_attn: str, *, cpu_only: bool, n_seq: int, type_v: str,
                       memory: Memory, deterministic: str = "auto") -> str:
    """Flash attention as llama.cpp gets it: as given, except ``auto`` with `--deterministic
    on` on a CPU with several slots, which is ``off`` (llama.cpp's auto would turn it on)
    unless the V cache is quantized (only flash attention reads one) or the memory is
    recurrent.

    Why: with flash attention on, a CPU decodes a slot alone with other bits than beside other
    slots (module rules); off, decode steps of several slots share a llama_decode and each
    slot's answer stays its own on the quantized models measured (the decode check still
    decides: backend.selfcheck.check_decode). That is the cheapest way to `--deterministic on`
    on a CPU (the fixed shape cost a lone slot's step 2.4x on an AMD EPYC). Otherwise it is a
    bad trade: deep into a prompt flash attention off prefills up to 2x slower
    (bench/results/issue41), and agents' prompts are deep, so `auto` and `off`, which let
    answers depend on other sessions as llama-server does, keep llama.cpp's choice. A recurrent
    or hybrid model's decode steps differ batched either way (measured), so it keeps llama.cpp's
    choice; on a GPU nobody has measured it yet."""
    if flash_attn == "auto" and deterministic == "on" and cpu_only and n_seq > 1 \
            and memory.kind != "recurrent" and type_v in ("f32", "f16", "bf16"):
        return "off"
    return flash_attn


def default_threads() -> int:
    """The decode threads where `-t` is not given: one per physical core, as llama-server's
    default (llama.cpp's `common_cpu_get_num_math`: the distinct sets of thread siblings on
    Linux, less a hybrid Intel's efficiency cores; the performance cores on a Mac), among the
    CPUs this process may run on (a container's cpuset), less one where those cores are all the
    CPUs there are.

    Why one less there: llama.cpp's threads spin at their barriers, and the worker's own
    threads (the reader that verifies a restore, the writer, the HTTP shell) and the proxy need
    a CPU too. Where SMT siblings or efficiency cores are shown they run there; where every CPU
    is a core of its own (a cloud VM's vCPUs, Arm servers) one thread sharing a core with them
    slows every step several-fold. Measured on 2 AMD EPYC vCPUs (bench/results/issue41): one
    decode thread gave 0.66x llama-server's tokens/s alone and two 0.95x, but with two a slot
    generated at 3.06x its time per token while another restored a 1 GiB state (1 thread:
    0.97x). So 2 such CPUs keep one decode thread; 16 get 15 where half the CPUs (the default
    before) gave 8; a machine that shows its SMT siblings keeps one per physical core."""
    allowed = allowed_cpus()
    cores = 0
    if sys.platform == "darwin":
        for name in ("hw.perflevel0.physicalcpu", "hw.physicalcpu"):
            try:
                cores = int(subprocess.run(["sysctl", "-n", name], capture_output=True,
                                           text=True, timeout=5).stdout)
                break
            except (OSError, ValueError, subprocess.SubprocessError):
                continue
    cores = cores or physical_cores(allowed)
    return max(cores - 1 if cores >= len(allowed) else cores, 1)


def physical_cores(cpus: Iterable[int], root: Path = Path("/sys/devices")) -> int:
    """The physical cores among `cpus` (Linux: the distinct thread sibling sets), less a hybrid
    Intel's efficiency cores (`cpu_atom`: "efficiency cores harm lockstep threading", as
    llama.cpp skips them); where the topology cannot be read, llama.cpp's fallback: the CPUs up
    to 4, else half of them."""
    cpus = list(cpus)
    try:
        atoms = _cpu_list((root / "cpu_atom" / "cpus").read_text())
    except (OSError, ValueError):
        atoms = set()
    siblings = set()
    for cpu in cpus:
        if cpu in atoms:
            continue
        try:
            path = root / "system" / "cpu" / f"cpu{cpu}" / "topology" / "thread_siblings"
            siblings.add(path.read_text().strip())
        except OSError:
            siblings.clear()
            break
    if siblings:
        return len(siblings)
    return len(cpus) if len(cpus) <= 4 else len(cpus) // 2


def _cpu_list(text: str) -> set[int]:
    """A sysfs CPU list ("0-3,8,10-11") as its CPUs."""
    out: set[int] = set()
    for part in filter(None, text.strip().split(",")):
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def memory_of(model: Any, swa_full: bool) -> Memory:
    if llama_cpp.llama_model_is_recurrent(model) or llama_cpp.llama_model_is_hybrid(model):
        return Memory("recurrent")
    n_swa = int(llama_cpp.llama_model_n_swa(model))
    if n_swa > 0:
        return Memory("window", n_swa, swa_full)
    return Memory("plain")


def resident_bytes() -> int:
    """This process's resident bytes (0 where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0
