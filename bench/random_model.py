"""Tiny random-weight GGUF models of architectures llama.cpp supports, with a real vocabulary.

    python -m bench.random_model --arch qwen35 --vocab ggml-vocab-qwen35.gguf --out m.gguf

What a cache needs from a model is its memory, not its answers: a random-weight model writes
gibberish, but whether a cache hit's greedy output equals a cold run's is exactly testable on
it, and so is every snapshot's size and position. This is how llama.cpp tests its own
architectures (``tests/test-llama-archs.cpp`` in its sources: random weights, tiny dimensions,
the hyperparameters below are the ones it uses); here the vocabulary and chat template are a
real model family's, copied from one of llama.cpp's vocabulary-only GGUFs
(``models/ggml-vocab-*.gguf``), so prompts tokenize and render as that family's would.

Architectures:

- ``qwen35``: Qwen3.5/3.6's hybrid stack, gated delta net (linear attention, a recurrent state)
  and full attention layers interleaved (``full_attention_interval``): memory that cannot be cut
  back to an arbitrary position.
- ``llama``: plain attention (for machines where the real default model cannot be carried).
- ``gemma3``: interleaved sliding-window and global attention (every 6th layer global), the
  window ``--window`` tokens: memory whose window layers forget what is behind the window.

The weights are drawn from a seeded normal distribution (std 0.1 for matrices, 1 +- 0.1 for
norms, negative for the state decay ``ssm_a``), so the file is the same byte for byte for the
same arguments. Matrices are written as f16, the rest (and the short convolution) as f32.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import gguf
import numpy as np

# tokenizer.* and the chat template are copied from the vocabulary GGUF; everything else is ours
_COPIED_PREFIXES = ("tokenizer.",)


def _copy_vocab(writer: gguf.GGUFWriter, vocab_path: Path) -> int:
    reader = gguf.GGUFReader(vocab_path)
    n_vocab = 0
    for name, field in reader.fields.items():
        if not name.startswith(_COPIED_PREFIXES):
            continue
        value = field.contents()
        vtype = field.types[0]
        if vtype == gguf.GGUFValueType.ARRAY:
            sub = field.types[-1]
            writer.add_key_value(name, value, vtype, sub_type=sub)
            if name == "tokenizer.ggml.tokens":
                n_vocab = len(value)
        else:
            writer.add_key_value(name, value, vtype)
    if not n_vocab:
        raise SystemExit(f"{vocab_path}: no tokenizer.ggml.tokens")
    return n_vocab


class _Tensors:
    def __init__(self, writer: gguf.GGUFWriter, seed: int) -> None:
        self.writer = writer
        self.rng = np.random.default_rng(seed)

    def add(self, name: str, shape: tuple[int, ...], kind: str = "matrix") -> None:
        """`shape` as llama.cpp names it (ne0 first); numpy takes it reversed."""
        np_shape = tuple(reversed(shape))
        if kind == "norm":
            data = (1.0 + 0.1 * self.rng.standard_normal(np_shape)).astype(np.float32)
        elif kind == "decay":  # ssm_a: the state must decay
            data = -np.abs(self.rng.standard_normal(np_shape)).astype(np.float32)
        elif kind in ("bias", "f32"):  # f32: small tensors llama.cpp's kernels need in f32
            data = (0.1 * self.rng.standard_normal(np_shape)).astype(np.float32)
        else:
            data = (0.1 * self.rng.standard_normal(np_shape)).astype(np.float16)
            if len(shape) < 2:
                data = data.astype(np.float32)
        self.writer.add_tensor(name, data)


def _start(w: gguf.GGUFWriter, t: _Tensors, arch: str, n_vocab: int, n_embd: int, n_ff: int,
           n_layer: int, n_head: int, n_head_kv: int, eps: float, context: int,
           extra: dict[str, Any]) -> None:
    """The keys every architecture here has, then `extra`; the embeddings and the output norm."""
    _put(w, arch, {
        "context_length": context, "embedding_length": n_embd, "block_count": n_layer,
        "feed_forward_length": n_ff, "attention.head_count": n_head,
        "attention.head_count_kv": n_head_kv, "attention.layer_norm_rms_epsilon": eps,
        **extra,
    })
    t.add("token_embd.weight", (n_embd, n_vocab))
    t.add("output_norm.weight", (n_embd,), "norm")


def _qkv(t: _Tensors, b: str, n_embd: int, q: int, kv: int) -> None:
    t.add(f"{b}.attn_q.weight", (n_embd, q))
    t.add(f"{b}.attn_k.weight", (n_embd, kv))
    t.add(f"{b}.attn_v.weight", (n_embd, kv))


def _qk_norms(t: _Tensors, b: str, head: int) -> None:
    t.add(f"{b}.attn_q_norm.weight", (head,), "norm")
    t.add(f"{b}.attn_k_norm.weight", (head,), "norm")


def _ffn(t: _Tensors, b: str, n_embd: int, n_ff: int) -> None:
    t.add(f"{b}.ffn_gate.weight", (n_embd, n_ff))
    t.add(f"{b}.ffn_up.weight", (n_embd, n_ff))
    t.add(f"{b}.ffn_down.weight", (n_ff, n_embd))


def _qwen35(w: gguf.GGUFWriter, t: _Tensors, n_vocab: int, a: argparse.Namespace) -> None:
    arch = "qwen35"
    # --size: the heads are the attention's and the delta net's value heads, the KV heads its
    # key heads (groups)
    n_embd, n_head, n_group, n_ff = a.size or (256, 2, 2, 384)
    n_layer = a.layers
    head = n_embd // n_head
    d_state, dt_rank, d_conv = 128, n_head, 4
    d_inner = d_state * dt_rank
    interval = 2  # every 2nd layer full attention: recurrent, attention, recurrent, ...
    key_dim, value_dim = d_state * n_group, d_state * dt_rank
    _start(w, t, arch, n_vocab, n_embd, n_ff, n_layer, n_head, n_head, 1e-6, 262144, {
        "attention.key_length": head, "attention.value_length": head,
        "rope.dimension_count": head, "rope.freq_base": 10_000_000.0,
        "ssm.conv_kernel": d_conv, "ssm.inner_size": d_inner, "ssm.state_size": d_state,
        "ssm.time_step_rank": dt_rank, "ssm.group_count": n_group,
        "full_attention_interval": interval,
    })
    w.add_array(f"{arch}.rope.dimension_sections", [head // 4] * 4)
    for il in range(n_layer):
        b = f"blk.{il}"
        t.add(f"{b}.attn_norm.weight", (n_embd,), "norm")
        t.add(f"{b}.post_attention_norm.weight", (n_embd,), "norm")
        if (il + 1) % interval != 0:  # gated delta net
            t.add(f"{b}.attn_qkv.weight", (n_embd, key_dim * 2 + value_dim))
            t.add(f"{b}.attn_gate.weight", (n_embd, value_dim))
            t.add(f"{b}.ssm_conv1d.weight", (d_conv, key_dim * 2 + value_dim), "f32")
            t.add(f"{b}.ssm_dt.bias", (dt_rank,), "bias")
            t.add(f"{b}.ssm_a", (dt_rank,), "decay")
            t.add(f"{b}.ssm_beta.weight", (n_embd, dt_rank))
            t.add(f"{b}.ssm_alpha.weight", (n_embd, dt_rank))
            t.add(f"{b}.ssm_norm.weight", (d_state,), "norm")
            t.add(f"{b}.ssm_out.weight", (value_dim, n_embd))
        else:
            _qkv(t, b, n_embd, head * n_head * 2, head * n_head)  # the query and its gate
            t.add(f"{b}.attn_output.weight", (head * n_head, n_embd))
            _qk_norms(t, b, head)
        _ffn(t, b, n_embd, n_ff)


def _llama(w: gguf.GGUFWriter, t: _Tensors, n_vocab: int, a: argparse.Namespace) -> None:
    n_embd, n_head, n_head_kv, n_ff = a.size or (256, 4, 2, 384)
    n_layer = a.layers
    head = n_embd // n_head
    _start(w, t, "llama", n_vocab, n_embd, n_ff, n_layer, n_head, n_head_kv, 1e-5, 32768,
           {"rope.dimension_count": head, "rope.freq_base": 10000.0})
    for il in range(n_layer):
        b = f"blk.{il}"
        t.add(f"{b}.attn_norm.weight", (n_embd,), "norm")
        _qkv(t, b, n_embd, head * n_head, head * n_head_kv)
        t.add(f"{b}.attn_output.weight", (head * n_head, n_embd))
        t.add(f"{b}.ffn_norm.weight", (n_embd,), "norm")
        _ffn(t, b, n_embd, n_ff)


def _gemma3(w: gguf.GGUFWriter, t: _Tensors, n_vocab: int, a: argparse.Namespace) -> None:
    n_embd, n_head, n_head_kv, n_ff, n_layer = 256, 4, 1, 384, a.layers
    head = 64
    _start(w, t, "gemma3", n_vocab, n_embd, n_ff, n_layer, n_head, n_head_kv, 1e-6, 32768, {
        "attention.key_length": head, "attention.value_length": head,
        "attention.sliding_window": a.window, "rope.freq_base": 1_000_000.0,
    })
    for il in range(n_layer):
        b = f"blk.{il}"
        t.add(f"{b}.attn_norm.weight", (n_embd,), "norm")
        _qkv(t, b, n_embd, head * n_head, head * n_head_kv)
        _qk_norms(t, b, head)
        t.add(f"{b}.attn_output.weight", (head * n_head, n_embd))
        t.add(f"{b}.post_attention_norm.weight", (n_embd,), "norm")
        t.add(f"{b}.ffn_norm.weight", (n_embd,), "norm")
        _ffn(t, b, n_embd, n_ff)
        t.add(f"{b}.post_ffw_norm.weight", (n_embd,), "norm")


_ARCHS = {"qwen35": (_qwen35, 4), "llama": (_llama, 2), "gemma3": (_gemma3, 6)}


def _put(w: gguf.GGUFWriter, arch: str, kv: dict[str, Any]) -> None:
    for key, value in kv.items():
        name = f"{arch}.{key}"
        if isinstance(value, float):
            w.add_float32(name, value)
        else:
            w.add_uint32(name, value)


def generate(arch: str, vocab: Path, out: Path, seed: int = 0, layers: int | None = None,
             window: int = 128, size: tuple[int, int, int, int] | None = None) -> Path:
    """Write the model to `out` (atomically) and return it. `size` (llama, qwen35): n_embd,
    n_head, n_head_kv, n_ff of a model of real size (TinyLlama 1.1B: 2048, 32, 4, 5632 with
    22 layers), where the default is llama.cpp's test size."""
    build, default_layers = _ARCHS[arch]
    if size is not None and arch not in ("llama", "qwen35"):
        raise SystemExit("--size is for --arch llama or qwen35")
    args = argparse.Namespace(layers=layers or default_layers, window=window, size=size)
    tmp = out.with_name(out.name + ".tmp")
    out.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(tmp, arch)
    writer.add_name(f"random {arch} ({vocab.name})")
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    n_vocab = _copy_vocab(writer, vocab)
    build(writer, _Tensors(writer, seed), n_vocab, args)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    tmp.replace(out)
    return out


def quantize(src: Path, out: Path, ftype: str) -> Path:
    """`src` quantized to `out` by llama.cpp (llama_model_quantize, as `llama-quantize` does):
    `ftype` is a llama_ftype name without its prefix (q4_k_m, q8_0, ...)."""
    import ctypes

    import llama_cpp

    code = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype.upper()}", None)
    if code is None:
        raise SystemExit(f"--quantize {ftype}: not a llama_ftype (q4_k_m, q5_k_m, q8_0, ...)")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = code
    tmp = out.with_name(out.name + ".tmp")
    if llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(),
                                      ctypes.byref(params)) != 0:
        raise SystemExit(f"llama_model_quantize failed for {src}")
    tmp.replace(out)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.random_model", description=__doc__.split(
        "\n\n")[0])
    p.add_argument("--arch", choices=sorted(_ARCHS), required=True)
    p.add_argument("--vocab", type=Path, required=True, help="a ggml-vocab-*.gguf")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--layers", type=int, default=None)
    p.add_argument("--window", type=int, default=128, help="gemma3: sliding window, tokens")
    p.add_argument("--size", default="", help="llama, qwen35: N_EMBD,N_HEAD,N_HEAD_KV,N_FF for a "
                   "model of real size (2048,32,4,5632 with --layers 22: TinyLlama 1.1B's shape; "
                   "qwen35: the heads are the delta net's value heads, the KV heads its key "
                   "heads)")
    p.add_argument("--quantize", default="", metavar="FTYPE", help="also write OUT quantized "
                   "(q4_k_m, q8_0, ...) as OUT's name with -FTYPE before .gguf")
    a = p.parse_args(argv)
    dims = [int(x) for x in a.size.split(",")] if a.size else []
    if dims and len(dims) != 4:
        p.error("--size takes N_EMBD,N_HEAD,N_HEAD_KV,N_FF")
    size = (dims[0], dims[1], dims[2], dims[3]) if dims else None
    paths = [generate(a.arch, a.vocab, a.out, a.seed, a.layers, a.window, size)]
    if a.quantize:
        paths.append(quantize(a.out, a.out.with_name(f"{a.out.stem}-{a.quantize}.gguf"),
                              a.quantize))
    for path in paths:
        print(f"{path}: {path.stat().st_size / 1e6:.1f} MB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
