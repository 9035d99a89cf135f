"""llama.cpp's option list, read from its own `common/arg.cpp`, as the table
`proxy/llama_options.json` that `prefixgate serve` scans a llama-server command line with.

    python -m bench.llama_options --arg-cpp PATH/common/arg.cpp   # writes the table
    python -m bench.llama_options --sdist llama_cpp_python-0.3.36.tar.gz
    python -m bench.llama_options --docs    # docs/llama-server.md's tables of the classes

The source is the llama.cpp that llama-cpp-python vendors (its sdist's `vendor/llama.cpp`), the
same llama.cpp the workers run. Each `add_opt(common_arg(...))` of `common_params_parser_init`
is one option:

- `args`: its spellings (`-c`, `--ctx-size`); `negs`: its negations (`--no-mmap`), which only a
  boolean option has;
- `values`: how many argv items follow it (0, 1 or 2), from its handler's signature (llama.cpp
  takes the next item as the value whatever it looks like: `--seed -1`);
- `env`: its variable (`LLAMA_ARG_CTX_SIZE`); a boolean one is also read as `LLAMA_ARG_NO_...`;
- `examples` / `excludes`: the programs it belongs to, as `LLAMA_EXAMPLE_*` names without the
  prefix, lowercased (`common` is every program's); `server` says whether llama-server takes it;
- `sampling` / `spec`: llama.cpp's own grouping (`set_sampling`, `set_spec`);
- `hint`: its value's placeholder in llama.cpp's --help (`N`, `FNAME`).

An option declared twice (`-np` under `if (ex == LLAMA_EXAMPLE_SERVER)` and its `else`) is one
row, its programs joined. The parser reads C++ only as far as these declarations need: string
and character literals, comments, and brackets.
"""

from __future__ import annotations

import argparse
import json
import re
import tarfile
from pathlib import Path
from typing import Any

TABLE = Path(__file__).resolve().parent.parent / "proxy" / "llama_options.json"
ARG_CPP_IN_SDIST = "vendor/llama.cpp/common/arg.cpp"

_OPEN = {"(": ")", "{": "}", "[": "]"}


def _skip_literal(src: str, i: int) -> int:
    """The index after the string or character literal (or comment) starting at i."""
    if src.startswith("//", i):
        return src.index("\n", i)
    if src.startswith("/*", i):
        return src.index("*/", i) + 2
    if src.startswith('R"', i):  # a raw string: R"delim( ... )delim"
        delim = src[i + 2:src.index("(", i)]
        return src.index(")" + delim + '"', i) + len(delim) + 2
    quote = src[i]
    j = i + 1
    while src[j] != quote:
        j += 2 if src[j] == "\\" else 1
    return j + 1


def _close(src: str, i: int) -> int:
    """The index of the bracket closing the one at i."""
    stack = [_OPEN[src[i]]]
    j = i + 1
    while stack:
        c = src[j]
        if c in "\"'" or src.startswith(("//", "/*"), j) or (c == "R" and src.startswith('R"', j)
                                                           and not src[j - 1].isalnum()):
            j = _skip_literal(src, j)
            continue
        if c in _OPEN:
            stack.append(_OPEN[c])
        elif c in ")}]":
            if c != stack.pop():
                raise ValueError(f"unbalanced {c!r} at offset {j}")
        j += 1
    return j - 1


def _split_top(src: str) -> list[str]:
    """The comma-separated items of a bracket's inside, at its own level, comments left out."""
    items, depth, item, j = [], 0, "", 0
    while j < len(src):
        c = src[j]
        if src.startswith(("//", "/*"), j):
            j = _skip_literal(src, j)
            continue
        if c in "\"'":
            end = _skip_literal(src, j)
            item += src[j:end]
            j = end
            continue
        if c in _OPEN:
            depth += 1
        elif c in ")}]":
            depth -= 1
        if c == "," and depth == 0:
            items.append(item.strip())
            item = ""
        else:
            item += c
        j += 1
    items.append(item.strip())
    return [i for i in items if i]


def _strings(src: str) -> list[str]:
    return [bytes(s, "utf-8").decode("unicode_escape") for s in re.findall(r'"((?:[^"\\]|\\.)*)"',
                                                                           src)]


def _examples(src: str, lists: dict[str, list[str]]) -> list[str]:
    src = src.strip()
    names = re.findall(r"LLAMA_EXAMPLE_(\w+)", src) if src.startswith("{") else lists[src]
    return sorted({n.lower() for n in names})


def _values(handler: str) -> int:
    """How many argv items the option takes, from its lambda's parameters."""
    params = handler[handler.index("(") + 1:_close(handler, handler.index("("))]
    rest = _split_top(params)[1:]  # after `common_params & params`
    if not rest or rest == ["bool value"] or "bool" in rest[0]:
        return 0
    return len(rest)


def parse(src: str) -> list[dict[str, Any]]:
    """The options `common_params_parser_init` declares, in declaration order."""
    lists = {m.group(1): re.findall(r"LLAMA_EXAMPLE_(\w+)", m.group(2)) for m in re.finditer(
        r"initializer_list<enum llama_example>\s+(\w+)\s*=\s*\{([^}]*)\}", src)}
    start = src.index("common_params_context common_params_parser_init(")
    end = _close(src, src.index("{", src.index(")", start)))
    body = src[start:end]
    rows: dict[str, dict[str, Any]] = {}
    for m in re.finditer(r"\badd_opt\(\s*common_arg\(", body):
        open_arg = m.end() - 1
        close_arg = _close(body, open_arg)
        close_add = _close(body, m.end() - len("common_arg(") - 1)
        parts = _split_top(body[open_arg + 1:close_arg])
        chain = body[close_arg + 1:close_add]
        negs = _strings(parts[1]) if parts[1].startswith("{") else []
        handler = next(p for p in parts if p.startswith("["))
        values = _values(handler)
        hint = _strings(parts[1])[0] if values and parts[1].startswith('"') else ""
        row = {"args": _strings(parts[0]), "negs": negs, "values": values,
               "env": (_strings(e)[0] if (e := _call(chain, "set_env")) else None),
               "examples": _examples(_call(chain, "set_examples") or "{LLAMA_EXAMPLE_COMMON}",
                                     lists),
               "excludes": _examples(_call(chain, "set_excludes") or "{}", lists),
               "sampling": ".set_sampling()" in chain, "spec": ".set_spec()" in chain,
               "hint": hint}
        key = row["args"][0]
        if key in rows:  # declared again for another program: one row, its programs joined
            old = rows[key]
            old["examples"] = sorted(set(old["examples"]) | set(row["examples"]))
            continue
        rows[key] = row
    for row in rows.values():
        row["server"] = ("server" in row["examples"] or "common" in row["examples"]) \
            and "server" not in row["excludes"]
    return list(rows.values())


def _call(chain: str, name: str) -> str:
    """The argument of `.name(...)` in a declaration's method chain, or ""."""
    i = chain.find("." + name + "(")
    if i < 0:
        return ""
    i += len(name) + 1
    return chain[i + 1:_close(chain, i)]


def read_arg_cpp(sdist: Path) -> str:
    """`common/arg.cpp` out of a llama-cpp-python sdist (a .tar.gz), unpacked or not."""
    with tarfile.open(sdist) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(ARG_CPP_IN_SDIST))
        f = tar.extractfile(member)
        assert f is not None
        return f.read().decode()


def render(rows: list[dict[str, Any]]) -> str:
    """The table's file: one option a line, so a llama.cpp update reads as a small diff."""
    lines = ",\n".join("  " + json.dumps(r, sort_keys=True) for r in rows)
    return "[\n" + lines + "\n]\n"


DOCS = TABLE.parent.parent / "docs" / "llama-server.md"
BEGIN = "<!-- the classes: python -m bench.llama_options --docs -->"
END = "<!-- end of the classes -->"


def docs_section() -> str:
    """docs/llama-server.md's tables: each llama-server spelling's class, and why."""
    from proxy.llama_cli import describe, options

    d = describe()
    lines = [BEGIN, "", f"### Works ({len(d['works'])} spellings)", "",
             " ".join(f"`{s}`" for s in sorted(d["works"], key=str.lower)), ""]
    for kind, title in (("ignored", "Accepted, no effect here"), ("refused", "Refused")):
        by_why: dict[str, list[str]] = {}
        for s, why in d[kind].items():
            by_why.setdefault(why, []).append(s)
        lines += [f"### {title} ({len(d[kind])} spellings)", "", "| spellings | why |",
                  "|---|---|"]
        lines += [f"| {' '.join(f'`{s}`' for s in group)} | {why} |"
                  for why, group in sorted(by_why.items(), key=lambda kv: kv[1][0].lower())]
        lines.append("")
    others = sum(len(o.args) + len(o.negs) for o in options() if not o.server)
    lines += [f"The {others} spellings of llama.cpp's other programs (llama-cli's `-p`, ...) "
              "are refused as not llama-server's.", "", END]
    return "\n".join(lines)


def write_docs(path: Path = DOCS) -> None:
    text = path.read_text()
    head, _, rest = text.partition(BEGIN)
    _, _, tail = rest.partition(END)
    path.write_text(head + docs_section() + tail)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--arg-cpp", type=Path, help="llama.cpp's common/arg.cpp")
    src.add_argument("--sdist", type=Path, help="llama-cpp-python's sdist (.tar.gz)")
    src.add_argument("--docs", action="store_true", help=f"rewrite {DOCS.name}'s tables")
    p.add_argument("--out", type=Path, default=TABLE)
    a = p.parse_args(argv)
    if a.docs:
        return write_docs()
    text = a.arg_cpp.read_text() if a.arg_cpp else read_arg_cpp(a.sdist)
    a.out.write_text(render(parse(text)))


if __name__ == "__main__":
    main()
