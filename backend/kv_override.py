"""llama-server's `--override-kv KEY=TYPE:VALUE,...`: the model's metadata, changed by key
before llama.cpp reads it (a MoE model's experts per token, a tokenizer's BOS flag, a norm's
epsilon).

    parse(text) -> tuple[Override, ...]       llama.cpp's rules (common.cpp,
                                              string_parse_kv_override), a ValueError in one line
    checked(metadata, overrides)              `Mismatch` where the model's file has the key with
                                              another type (llama.cpp would log a warning and
                                              keep the file's value; here the start stops)
    applied(metadata, overrides) -> dict      the metadata as llama.cpp reads it: what the proxy
                                              reads of the file (tokenizer, chat template,
                                              sampling defaults) sees the same values
    model_params(params, overrides) -> keep   `llama_model_params.kv_overrides` (keep alive until
                                              the model is loaded)
    describe(overrides) -> str                for the ready line, /props and the cache identity

A value changed here changes what the model computes: the workers name it in their compute
identity, so a state made without it is never restored with it, and the start-up self-check
proves a hit exact with it.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Any

TYPES = ("int", "float", "bool", "str")
# enum llama_model_kv_override_type, in llama.h's order (the proxy does not load llama.cpp)
TAGS = {"int": 0, "float": 1, "bool": 2, "str": 3}
MAX_CHARS = 127  # a key's and a string value's (llama.cpp's char[128])


@dataclass(frozen=True, slots=True)
class Override:
    key: str
    type: str  # int | float | bool | str
    value: int | float | bool | str

    def __str__(self) -> str:
        value = str(self.value).lower() if self.type == "bool" else self.value
        item = f"{self.key}={self.type}:{value}"
        # quoted as llama.cpp's list reads it back (a string value may hold commas)
        return f'"{item.replace(chr(34), chr(34) * 2)}"' if "," in item or '"' in item else item


def parse(text: str) -> tuple[Override, ...]:
    """`KEY=TYPE:VALUE` items, comma-separated (the flag given again: joined with commas; an
    item in double quotes may hold commas, as llama.cpp reads it: `csv_row`); a ValueError that
    names the item and what is wrong. Stricter than llama.cpp's `atol` and
    `atof`, which read `12abc` as 12 and `x` as 0: such a value is refused."""
    out: dict[str, Override] = {}
    for item in (x.strip() for x in csv_row(text)):
        if not item:
            continue
        key, eq, rest = item.partition("=")
        kind, colon, raw = rest.partition(":")
        if not eq or not key or not colon or kind not in TYPES:
            raise ValueError(f"--override-kv {item!r}: give KEY=TYPE:VALUE, TYPE one of "
                             f"{', '.join(TYPES)} (e.g. tokenizer.ggml.add_bos_token=bool:false)")
        if len(key.encode()) > MAX_CHARS:
            raise ValueError(f"--override-kv {key[:40]!r}...: a key is at most {MAX_CHARS} bytes")
        try:
            value = _value(kind, raw)
        except ValueError:
            raise ValueError(f"--override-kv {item!r}: {raw!r} is not a {kind}") from None
        o = Override(key, kind, value)
        if out.setdefault(key, o) != o:  # llama.cpp would keep the first, unsaid
            raise ValueError(f"--override-kv gives {key} twice ({out[key]}, then {o}): give "
                             "it once")
    return tuple(out.values())


def csv_row(text: str) -> list[str]:
    """`text` split at its commas as llama.cpp's `parse_csv_row` splits a flag's list: a field
    that begins with a double quote runs to the closing one, commas included, and ``""``
    inside it is one quote; a quote inside an unquoted field is itself."""
    fields: list[str] = []
    field: list[str] = []
    quoted, i = False, 0
    while i < len(text):
        ch = text[i]
        if ch == '"' and not quoted:
            if field:
                field.append(ch)  # inside an unquoted field: a character like another
            else:
                quoted = True
        elif ch == '"':
            if text.startswith('""', i):
                field.append(ch)
                i += 1
            else:
                quoted = False
        elif ch == "," and not quoted:
            fields.append("".join(field))
            field = []
        else:
            field.append(ch)
        i += 1
    fields.append("".join(field))
    return fields


def _value(kind: str, raw: str) -> int | float | bool | str:
    if kind == "int":
        return int(raw)
    if kind == "float":
        return float(raw)
    if kind == "bool":
        if raw not in ("true", "false"):
            raise ValueError(raw)
        return raw == "true"
    if len(raw.encode()) > MAX_CHARS:
        raise ValueError(raw)
    return raw


def _type_of(value: Any) -> str | None:
    if isinstance(value, bool):
        return "bool"
    if isinstance(value, int):
        return "int"
    if isinstance(value, float):
        return "float"
    return "str" if isinstance(value, str) else None  # an array: no override takes it


class Mismatch(ValueError):
    """An override of a key the model's file has with another type."""


def checked(metadata: dict[str, Any], overrides: tuple[Override, ...]) -> None:
    """`Mismatch`, in one line, for an override of a key the file has with another type."""
    for o in overrides:
        if o.key in metadata and _type_of(metadata[o.key]) != o.type:
            has = _type_of(metadata[o.key]) or "an array"
            raise Mismatch(f"--override-kv {o}: the model's {o.key} is {has}, not {o.type} "
                             "(llama.cpp would keep the file's value)")


def applied(metadata: dict[str, Any], overrides: tuple[Override, ...]) -> dict[str, Any]:
    return {**metadata, **{o.key: o.value for o in overrides}} if overrides else metadata


def model_params(params: Any, overrides: tuple[Override, ...]) -> list[Any]:
    """`params.kv_overrides` set to these overrides (an array ended by an empty key, as
    llama.cpp reads it); what it returns must live until the model is loaded."""
    if not overrides:
        return []
    import llama_cpp

    arr = (llama_cpp.llama_model_kv_override * (len(overrides) + 1))()
    for slot, o in zip(arr, overrides, strict=False):
        slot.key, slot.tag = o.key.encode(), TAGS[o.type]
        if o.type == "str":
            slot.value.val_str = str(o.value).encode()
        elif o.type == "bool":
            slot.value.val_bool = bool(o.value)
        elif o.type == "int":
            slot.value.val_i64 = int(o.value)
        else:
            slot.value.val_f64 = float(o.value)
    arr[len(overrides)].key = b""
    params.kv_overrides = ctypes.cast(arr, ctypes.POINTER(llama_cpp.llama_model_kv_override))
    return [arr]


def describe(overrides: tuple[Override, ...]) -> str:
    return "metadata " + ", ".join(map(str, overrides)) if overrides else ""
