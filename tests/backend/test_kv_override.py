"""llama-server's --override-kv, read as llama.cpp reads it (common.cpp's
string_parse_kv_override), stricter where llama.cpp would compute with something other than
what was asked, and handed to llama.cpp's loader as its struct array."""

from __future__ import annotations

import ctypes

import llama_cpp
import pytest

from backend import kv_override
from backend.kv_override import Override
from proxy.cli import serve_config


def test_llama_cpp_s_own_example_and_each_type() -> None:
    # llama.cpp's --help example, then one of each type; a value may hold '=' and ':'
    assert kv_override.parse("tokenizer.ggml.add_bos_token=bool:false,"
                             "tokenizer.ggml.add_eos_token=bool:false") == (
        Override("tokenizer.ggml.add_bos_token", "bool", False),
        Override("tokenizer.ggml.add_eos_token", "bool", False))
    got = kv_override.parse(" qwen3moe.expert_used_count=int:10 , a.eps=float:1e-6,"
                            "general.name=str:x=y:z,")
    assert got == (Override("qwen3moe.expert_used_count", "int", 10),
                   Override("a.eps", "float", 1e-6), Override("general.name", "str", "x=y:z"))
    assert kv_override.describe(got) == ("metadata qwen3moe.expert_used_count=int:10, "
                                         "a.eps=float:1e-06, general.name=str:x=y:z")
    assert kv_override.parse("") == () and kv_override.describe(()) == ""


def test_a_quoted_item_holds_commas_as_llama_cpp_reads_it() -> None:
    """llama.cpp splits the list with `parse_csv_row`: a field in double quotes runs to the
    closing quote, `""` is one quote, and a quote inside an unquoted field is a character."""
    got = kv_override.parse('"general.name=str:a, b",x.n=int:2,"c=str:say ""hi""",d=str:e"f')
    assert got == (Override("general.name", "str", "a, b"), Override("x.n", "int", 2),
                   Override("c", "str", 'say "hi"'), Override("d", "str", 'e"f'))
    # described so that it reads back the same, and no two lists describe alike
    assert kv_override.parse(",".join(map(str, got))) == got
    one, two = kv_override.parse('"a=str:x,b=int:1"'), kv_override.parse("a=str:x,b=int:1")
    assert (len(one), len(two)) == (1, 2) and kv_override.describe(one) != kv_override.describe(two)
    assert kv_override.csv_row('a,"b,c",,"d""e"') == ["a", "b,c", "", 'd"e']


@pytest.mark.parametrize(("text", "said"), [
    ("a.b", "give KEY=TYPE:VALUE"), ("a.b=1", "give KEY=TYPE:VALUE"),
    ("=int:1", "give KEY=TYPE:VALUE"), ("a=uint:1", "give KEY=TYPE:VALUE"),
    ("a=int:12abc", "'12abc' is not a int"), ("a=float:x", "is not a float"),
    ("a=bool:1", "is not a bool"), ("a=str:" + "x" * 128, "is not a str"),
    ("k" * 128 + "=int:1", "at most 127 bytes"),
    ("a=int:1,a=int:2", "gives a twice (a=int:1, then a=int:2): give it once"),
])
def test_what_llama_cpp_would_misread_stops_the_start(text: str, said: str) -> None:
    # llama.cpp reads 12abc as 12 and x as 0 (atol, atof), and keeps the first of a key given
    # twice: each is one line here
    with pytest.raises(ValueError, match=said.replace("(", r"\(").replace(")", r"\)")):
        kv_override.parse(text)
    assert kv_override.parse("a=int:1,a=int:1") == (Override("a", "int", 1),)


def test_a_key_the_file_has_keeps_its_type() -> None:
    meta = {"llama.block_count": 30, "llama.attention.layer_norm_rms_epsilon": 1e-5,
            "tokenizer.ggml.add_bos_token": False, "general.name": "m",
            "tokenizer.ggml.tokens": ["a", "b"]}
    ok = kv_override.parse("llama.block_count=int:24,tokenizer.ggml.add_bos_token=bool:true,"
                           "new.key=float:2")
    kv_override.checked(meta, ok)
    assert kv_override.applied(meta, ok) == {**meta, "llama.block_count": 24,
                                             "tokenizer.ggml.add_bos_token": True,
                                             "new.key": 2.0}
    assert kv_override.applied(meta, ()) is meta
    for text, has in (("llama.block_count=float:24", "int"),
                      ("tokenizer.ggml.add_bos_token=int:1", "bool"),
                      ("llama.attention.layer_norm_rms_epsilon=int:1", "float"),
                      ("tokenizer.ggml.tokens=str:a", "an array")):
        with pytest.raises(kv_override.Mismatch, match=f"is {has}, not"):
            kv_override.checked(meta, kv_override.parse(text))


def test_the_loader_gets_llama_cpp_s_struct_array() -> None:
    assert kv_override.TAGS == {"int": llama_cpp.LLAMA_KV_OVERRIDE_TYPE_INT,
                                "float": llama_cpp.LLAMA_KV_OVERRIDE_TYPE_FLOAT,
                                "bool": llama_cpp.LLAMA_KV_OVERRIDE_TYPE_BOOL,
                                "str": llama_cpp.LLAMA_KV_OVERRIDE_TYPE_STR}
    mp = llama_cpp.llama_model_default_params()
    assert kv_override.model_params(mp, ()) == [] and not mp.kv_overrides
    keep = kv_override.model_params(mp, kv_override.parse(
        "a.n=int:-3,a.eps=float:0.5,a.on=bool:true,a.s=str:hi"))
    assert keep
    arr = ctypes.cast(mp.kv_overrides, ctypes.POINTER(llama_cpp.llama_model_kv_override))
    got = [(arr[i].key, arr[i].tag) for i in range(5)]
    assert got == [(b"a.n", 0), (b"a.eps", 1), (b"a.on", 2), (b"a.s", 3), (b"", 0)]
    assert (arr[0].value.val_i64, arr[1].value.val_f64, arr[2].value.val_bool,
            arr[3].value.val_str) == (-3, 0.5, True, b"hi")


def test_the_flag_under_llama_server_s_name_adds_up_and_is_checked() -> None:
    cfg = serve_config(["--override-kv", "a=int:1", "--override-kv", "b=bool:false,c=str:x"],
                       environ={})
    assert cfg.override_kv == "a=int:1,b=bool:false,c=str:x"
    with pytest.raises(SystemExit, match="--override-kv 'a=int:x': 'x' is not a int"):
        serve_config(["--override-kv", "a=int:x"], environ={})


def test_c_0_takes_the_trained_context_as_overridden() -> None:
    """llama-server's -c 0 is the model's n_ctx_train, which llama.cpp reads with the overrides
    applied: an overridden `{arch}.context_length` is the context served."""
    trained = serve_config(["-c", "0"], environ={}).n_ctx
    cfg = serve_config(["-c", "0", "--override-kv", "llama.context_length=int:4096"], environ={})
    assert trained > 4096 and cfg.n_ctx == 4096
