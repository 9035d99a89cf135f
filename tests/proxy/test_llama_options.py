"""llama-server's command line read as llama-server reads it (issue 42): the option table is
llama.cpp's own (checked against the vendored `common/arg.cpp`), every spelling of it parses to
exactly one class (works, ignored with a line, refused with a line that names it and no other
flag), the misparses argparse made are gone, LLAMA_ARG_* variables are read or warned about,
`--help` states the defaults the Config resolves, and two command lines copied from model guides
start on the test model."""

from __future__ import annotations

import argparse
import os
import re
from pathlib import Path

import pytest

from bench.llama_options import parse, render
from policies.prefix import CPU_BATCH, GPU_BATCH
from proxy.cli import serve_config
from proxy.config import (
    NOT_FLAGS,
    SECRETS,
    SHOWN_DEFAULTS,
    Config,
    _coerce,
    add_arguments,
    from_args,
)
from proxy.flags import LLAMA_SERVER
from proxy.llama_cli import TABLE, WORKS, classify, options, spellings
from proxy.rope import settings as rope_settings
from tests.conftest import ROOT

SECRET = "sk-test-0123456789"


def llama_cpp_source(name: str) -> Path | None:
    """A file of the llama.cpp that llama-cpp-python vendors: `make fixtures` unpacks it into
    build/fixtures/llama.cpp; LLAMA_CPP_SRC may name another unpacked tree."""
    for root in (os.environ.get("LLAMA_CPP_SRC"), ROOT / "build/fixtures/llama.cpp"):
        if root and (Path(root) / name).is_file():
            return Path(root) / name
    return None


def test_the_table_is_llama_cpps_own_option_list() -> None:
    src = llama_cpp_source("common/arg.cpp")
    if src is None:
        pytest.skip("llama.cpp's common/arg.cpp is not unpacked: `make fixtures` puts it in "
                    "build/fixtures/llama.cpp/common (from the llama-cpp-python sdist)")
    assert TABLE.read_text() == render(parse(src.read_text())), \
        "regenerate it: python -m bench.llama_options --arg-cpp " + str(src)


def test_the_table_reads_what_llama_server_takes() -> None:
    by = spellings()
    assert len([o for o in options() if o.server]) >= 250
    # the shapes of common/arg.cpp's declarations, one of each
    assert by["-c"][0].values == 1 and by["-c"][0].env == "LLAMA_ARG_CTX_SIZE"
    assert by["--no-webui"] == (by["--webui"][0], False) and by["--webui"][0].values == 0
    assert by["--control-vector-layer-range"][0].values == 2
    assert by["-mmdev"][0].args == ("-mmdev", "--mmproj-device")  # a comment in its list
    assert by["-np"][0].server and "server" in by["-np"][0].examples  # declared twice
    assert by["-md"][0].spec and not by["-p"][0].server  # llama-cli's prompt


# --- every spelling, one class -----------------------------------------------------------------

# a value each works option accepts (the others take "1"); -m so that -hf downloads nothing,
# and an absolute -md so that -hfd does not (DRAFT_FILE)
VALUES = {"-fa": "on", "-ctk": "q8_0", "-ctv": "q8_0", "-sm": "layer", "-lm": "auto",
          "-lzm": "auto", "--reasoning-format": "none", "-rea": "off", "--reasoning-budget": "0",
          "--chat-template-kwargs": '{"a": 1}', "-c": "4096", "-ngl": "0", "--port": "8081",
          "-hf": "user/repo:Q8_0", "--reasoning-effort": "high", "-ts": "1",
          "-ot": "exps=CPU", "--host": "127.0.0.1", "--api-key": SECRET,
          "--chat-template-file": "t.jinja", "--api-key-file": "keys.txt", "-a": "coder",
          "--spec-type": "ngram-mod", "--spec-draft-model": "d.gguf", "--spec-draft-p-min": "0.5",
          "--rope-scaling": "yarn", "--numa": "distribute", "--chat-template": "chatml",
          "--spec-draft-hf": "user/draft:Q8_0", "--api-prefix": "/llama",
          "--override-kv": "tokenizer.ggml.add_bos_token=bool:false", "-dev": "none"}
DRAFT_FILE = ["-md", "/models/draft.gguf"]
FLAG = re.compile(r"(?<![\w-])--?[A-Za-z][\w.-]*")


def argv_of(spelling: str) -> list[str]:
    """The spelling and its values: a secret where it is not one that works (never shown)."""
    o, _ = spellings()[spelling]
    value = VALUES.get(o.name, "1") if classify(spelling)[0] == "works" else SECRET
    return [spelling, *([value] * o.values)]


@pytest.mark.parametrize("spelling", sorted(spellings()))
def test_every_spelling_parses_to_its_one_class(spelling: str,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    kind, why = classify(spelling)
    argv = ["-m", "model.gguf", *argv_of(spelling)]
    if spellings()[spelling][0].name == "--spec-draft-hf":
        argv += DRAFT_FILE
    if spelling in ("-h", "--help", "--usage", "--version"):
        with pytest.raises(SystemExit) as e:
            serve_config(argv, environ={})
        assert e.value.code in (0, None) and capsys.readouterr().out
        return
    if kind == "refused":
        with pytest.raises(SystemExit) as e:
            serve_config(argv, environ={})
        message = str(e.value)
        assert message == f"prefixgate: {spelling}: {why}" and "\n" not in message
        assert FLAG.findall(message) == [spelling], "a refusal names its flag and no other"
        assert SECRET not in message + capsys.readouterr().err
        return
    cfg = serve_config(argv, environ={})
    notes = [n for n in cfg.llama_notes if not n.startswith("-ngl ")]
    if kind == "ignored":
        assert notes == [f"{spelling}: accepted for llama-server's command line, no effect "
                         f"here: {why}"]
        assert SECRET not in repr(cfg)
    else:
        assert kind == "works" and notes == []


def test_no_llama_server_spelling_is_left_without_a_class() -> None:
    for s, (o, _) in spellings().items():
        kind, _ = classify(s)  # an AssertionError for a spelling of none
        assert kind != "works" or o.name in WORKS


@pytest.mark.parametrize(("argv", "field", "value"), [
    # the misparses of argparse that issue 42 lists, each now llama-server's own reading
    (["-ctxcp", "8"], "n_ctx", Config().n_ctx),  # ignored, not `-c txcp`
    (["-to", "600"], "threads", 0),  # ignored, not `-t o`
    (["-cmoe"], "n_cpu_moe", -1),  # every layer's experts on the CPU, not `-c moe`
    (["-s", "42"], "seed", 42),  # the seed, not `-sm 42`
    (["-ngl", "0", "--seed", "-1"], "seed", -1),  # a value that starts with a dash
    (["-a", "g"], "alias", "g"),
    (["--top_k", "20"], "top_k", 20),  # llama.cpp reads `_` as `-` in a long spelling
    (["--temp=0.5"], "temperature", 0.5),  # prefixgate's own form
    # speculative decoding: llama.cpp's types, tried in its own order; their sizes
    (["--spec-type", "ngram-mod,ngram-simple"], "spec_type", "ngram-simple,ngram-mod"),
    (["--spec-ngram-mod-n-max", "16"], "spec_ngram_mod_n_max", 16),
    (["--spec-ngram-map-k4v-min-hits", "2"], "spec_ngram_map_k4v_min_hits", 2),
    # a draft model drafts: -md alone means draft-simple, after the n-gram types
    (["-md", "d.gguf"], "spec_type", "draft-simple"),
    (["-md", "d.gguf", "--spec-type", "ngram-mod"], "spec_type", "ngram-mod,draft-simple"),
    (["-ngld", "all"], "spec_draft_ngl", "all"),
    (["--draft-p-min", "0.75"], "spec_draft_p_min", 0.75),
    # RoPE scaling and NUMA, as llama-server spells them (proxy/rope.py)
    (["--rope-scaling", "yarn", "--rope-scale", "4"], "rope_scale", 4.0),
    (["--rope-scaling", "YaRN"], "rope_scaling", "yarn"),
    (["--yarn-orig-ctx", "32768"], "yarn_orig_ctx", 32768),
    (["--rope-freq-base=1e6"], "rope_freq_base", 1e6),
    (["--yarn-beta-fast", "32"], "yarn_beta_fast", 32.0),
    (["--numa", "isolate"], "numa", "isolate"),
    # -mg is llama-server's main GPU, never -m g; -dev names the GPUs (none: the CPU only)
    (["-mg", "1"], "main_gpu", 1),
    (["--main-gpu", "-1"], "main_gpu", -1),
    (["-dev", "none"], "device", "none"),
    # a chat template's source on the command line (proxy/prompt.py), chatml by name
    (["--chat-template", "chatml"], "chat_template", "chatml"),
    (["--chat-template", "{{ messages[0].content }}"], "chat_template",
     "{{ messages[0].content }}"),
])
def test_what_argparse_misparsed(argv: list[str], field: str, value: object) -> None:
    assert getattr(serve_config(["-m", "model.gguf", *argv], environ={}), field) == value


@pytest.mark.parametrize(("argv", "line"), [
    (["--spec-draft-hf", "u/not-cached", "--offline"], "prefixgate: -hfd u/not-cached: not in "
                                                       "the Hugging Face cache"),
    (["--spec-type", "draft-simple"], "prefixgate: --spec-type draft-simple drafts with a "
                                      "draft model"),
    (["--draft-max", "16"], "prefixgate: --draft-max: removed in llama.cpp too"),
    (["--spec-type", "ngram-cache"], "invalid value for --spec-type: 'ngram-cache' "
                                     "(ngram-cache: the n-gram cache type"),
    (["--spec-type", "draft-mtp"], "invalid value for --spec-type: 'draft-mtp' (draft-mtp: "
                                   "multi-token prediction heads are not supported"),
    (["--spec-ngram-mod-n-match", "0"], "prefixgate: --spec-ngram-mod-n-match 0: ngram size N "
                                        "must be between 1 and 1024 inclusive"),
    (["-ag"], "prefixgate: -ag: the server's built-in tools"),
    (["-p", "hi"], "prefixgate: -p: not a llama-server option (llama.cpp's"),
    (["-dev", "VULKAN7"], "prefixgate: -dev VULKAN7: no device VULKAN7 to offload to here "
                          "(there are: "),
    (["-mx", "1"], "prefixgate: not supported: -mx "),  # neither llama.cpp's nor ours
    (["-c"], "prefixgate: -c: expects a value"),
    (["--rope-scaling", "ntk"], "invalid value for --rope-scaling: 'ntk' (one of none, linear, "
                                "yarn)"),
    (["--rope-scale", "-2"], "prefixgate: --rope-scale -2.0: give N > 0"),
    (["--rope-scale", "4", "--rope-freq-scale", "0.5"], "prefixgate: --rope-scale N and "
                                                         "--rope-freq-scale 1/N set one thing"),
    (["--rope-freq-base", "-1"], "prefixgate: --rope-freq-base -1.0: give a value above 0"),
    (["--yarn-orig-ctx", "-5"], "prefixgate: --yarn-orig-ctx -5: give the model's original"),
    (["--numa", "mirror"], "invalid value for --numa: 'mirror' (one of distribute, isolate, "
                           "numactl)"),
    (["--chat-template", "llama3"], "prefixgate: --chat-template llama3: a built-in template by "
                                    "name is not supported (chatml is)"),
    (["--chat-template", "chatml", "--chat-template-file", "t.jinja"],
     "prefixgate: --chat-template and --chat-template-file both give the chat template"),
])
def test_what_stops_the_start_is_one_line_naming_it(argv: list[str], line: str) -> None:
    with pytest.raises(SystemExit) as e:
        serve_config(argv, environ={})
    assert str(e.value).startswith(line), str(e.value)


# --- LLAMA_ARG_* variables -------------------------------------------------------------------


def test_llama_server_variables_are_read_or_each_warned_about() -> None:
    env = {"LLAMA_ARG_TEMPERATURE": "0.3", "LLAMA_ARG_TOP_K": "20", "LLAMA_ARG_CPU_MOE": "1",
           "LLAMA_ARG_REASONING_PRESERVE": "true", "LLAMA_ARG_NO_UI": "1",
           "LLAMA_ARG_SPEC_DRAFT_MODEL": "d.gguf", "LLAMA_ARG_NOT_A_THING": "x",
           "LLAMA_ARG_CTX_SIZE": "2048", "PREFIXGATE_TOP_K": "30"}
    cfg = serve_config(["-m", "model.gguf", "-ngl", "0"], environ=env)
    assert (cfg.temperature, cfg.top_k, cfg.n_cpu_moe, cfg.n_ctx) == (0.3, 30, -1, 2048)
    assert cfg.reasoning_preserve == "on"
    assert sorted(cfg.llama_notes) == [
        "LLAMA_ARG_NOT_A_THING is not a llama-server variable; ignored",
        "LLAMA_ARG_NO_UI (--no-ui) is ignored: prefixgate has no web UI (/ is a status page)"]
    assert (cfg.spec_draft_model, cfg.spec_type) == ("d.gguf", "draft-simple")
    assert serve_config(["-m", "m.gguf", "--temp", "0.9"], environ=env).temperature == 0.9
    rope = serve_config(["-m", "m.gguf"], environ={
        "LLAMA_ARG_ROPE_SCALING_TYPE": "yarn", "LLAMA_ARG_ROPE_SCALE": "4",
        "LLAMA_ARG_YARN_ORIG_CTX": "32768", "LLAMA_ARG_NUMA": "numactl"})
    assert (rope.rope_scaling, rope.rope_scale, rope.yarn_orig_ctx, rope.numa) == (
        "yarn", 4.0, 32768, "numactl")
    assert rope_settings(rope) == {"rope_scaling": "yarn", "rope_freq_scale": 0.25,
                                   "yarn_orig_ctx": 32768}  # what the worker's context gets
    assert rope_settings(Config()) == {}  # none given: the model's own, the cache keys as before


def test_every_working_option_with_a_variable_is_read_under_it() -> None:
    for o in options():
        if o.server and o.env and o.name in WORKS and isinstance(WORKS[o.name], str) \
                and not str(WORKS[o.name]).startswith("--"):
            field = str(WORKS[o.name])
            if field in LLAMA_SERVER and LLAMA_SERVER[field][1]:
                assert LLAMA_SERVER[field][1] == o.env, o.name


# --- --help says what the Config resolves ----------------------------------------------------


def test_each_default_help_states_is_the_one_the_config_resolves() -> None:
    p = argparse.ArgumentParser()
    add_arguments(p)
    resolved = from_args(p.parse_args([]), environ={})
    shown = {a.dest: a.help for a in p._actions if a.help}
    for name, field in Config.__dataclass_fields__.items():
        if name in NOT_FLAGS or name in SECRETS:
            continue
        m = re.search(r", default (.*)\)$", shown[name] or "")
        assert m, name
        said = m.group(1)
        value = getattr(resolved, name)
        if said == "unset":
            assert value is None, name
        elif name in SHOWN_DEFAULTS or said != str(field.default):
            assert _coerce(name, said) == value, (name, said, value)
        else:
            assert str(value) == said, (name, said, value)
    # the batch the help promises where none is set, on a CPU (issue 42: it said 64)
    # (issue 41: a CPU worker measures 128 against 512 once, the workers told 0)
    batch = re.search(r"0 = (\d+) on a GPU, else (\d+) or (\d+), measured",
                      shown["ubatch_size"] or "")
    assert batch and Config(n_gpu_layers=0).batch == int(batch.group(2))
    assert (Config(n_gpu_layers=0).worker_batch, Config(n_gpu_layers=0, ubatch_size=64)
            .worker_batch) == (0, 64)
    assert {int(batch.group(2)), int(batch.group(3))} == {CPU_BATCH, GPU_BATCH}
    assert Config(n_gpu_layers=-1).batch == Config(n_gpu_layers=-1).worker_batch == \
        int(batch.group(1))


# --- what a model guide's command line becomes -----------------------------------------------

# Unsloth's Qwen3-Coder line (its llama-server section), the model swapped for the test model
UNSLOTH_QWEN3_CODER = """--model {model} --alias unsloth/Qwen3-Coder-30B-A3B-Instruct
    --jinja -ngl 99 --threads -1 --ctx-size 32684
    --temp 0.7 --min-p 0.0 --top-p 0.80 --top-k 20 --repeat-penalty 1.05 --port {port}"""
# llama.cpp's gpt-oss guide (ggml-org/llama.cpp discussion 15396), -hf swapped for -m
GPT_OSS_GUIDE = "-m {model} --ctx-size 0 --jinja -ub 2048 -b 2048 --port {port}"
# the gpt-oss model card's line (llama.cpp pull request 15091), -fa as this llama.cpp takes it
GPT_OSS_CARD = "-m {model} -c 0 -fa on --jinja --reasoning-format none --port {port}"


def line(template: str, model: str, port: int = 8080) -> list[str]:
    return template.format(model=model, port=port).split()


def test_the_guides_lines_parse_as_llama_server_reads_them(model_path: str) -> None:
    cfg = serve_config(line(UNSLOTH_QWEN3_CODER, model_path), environ={})
    assert (cfg.temperature, cfg.min_p, cfg.top_p, cfg.top_k, cfg.repeat_penalty) == \
        (0.7, 0.0, 0.8, 20, 1.05)
    assert (cfg.alias, cfg.n_ctx, cfg.threads) == ("unsloth/Qwen3-Coder-30B-A3B-Instruct",
                                                   32684, os.cpu_count())
    assert cfg.llama_notes[0].startswith("--jinja: accepted")
    guide = serve_config(line(GPT_OSS_GUIDE, model_path), environ={})
    assert (guide.n_ctx, guide.ubatch_size) == (8192, 2048)  # SmolLM2's trained context
    assert [n.split(":")[0] for n in guide.llama_notes] == ["--jinja", "-b"]
    card = serve_config(line(GPT_OSS_CARD, model_path), environ={})
    assert (card.n_ctx, card.flash_attn, card.reasoning_format) == (8192, "on", "none")


def test_gpu_layers_on_a_cpu_only_build_run_on_the_cpu_and_say_so() -> None:
    import llama_cpp

    if llama_cpp.llama_supports_gpu_offload():
        pytest.skip("this llama-cpp-python offloads to a GPU")
    cfg = serve_config(["-m", "model.gguf", "-ngl", "99"], environ={})
    assert cfg.n_gpu_layers == 0 and cfg.batch == Config(n_gpu_layers=0).batch
    [note] = cfg.llama_notes
    assert note.startswith("-ngl 99: ") and "CPU" in note and "GPU=cuda" in note


@pytest.mark.model
def test_the_unsloth_qwen3_coder_line_starts_and_serves(tmp_path: Path, model_path: str
                                                        ) -> None:
    """Pasted as a user would (the model swapped): it starts, says what it ignores, and a
    request without sampling fields is sampled with the line's."""
    import openai

    from tests.conftest import free_port, running

    with running(tmp_path, *line(UNSLOTH_QWEN3_CODER, model_path, free_port())[:-2]) as srv:
        props = srv.get_json("/props")
        assert props["default_generation_settings"]["params"]["temperature"] == 0.7
        oa = openai.OpenAI(base_url=srv.v1, api_key="x", max_retries=0, timeout=120)
        r = oa.chat.completions.create(model="x", max_tokens=4, messages=[
            {"role": "user", "content": "Say hi."}])
        assert r.choices[0].message.content is not None
        log = srv.log()
    assert "--jinja: accepted for llama-server's command line" in log


@pytest.mark.model
@pytest.mark.slow  # the self-check proves -ub 2048 batches: about 3 minutes on 2 CPU cores
def test_the_gpt_oss_guide_line_starts_with_the_models_trained_context(tmp_path: Path,
                                                                       model_path: str) -> None:
    """`--ctx-size 0` is the model's own context (SmolLM2's 8192); -b is said to change
    nothing; the guide's -ub 2048 is kept (the batch the self-check proves)."""
    from tests.conftest import free_port, running

    with running(tmp_path, *line(GPT_OSS_GUIDE, model_path, free_port())[:-2],
                 timeout_s=600) as srv:
        props = srv.get_json("/props")
        assert (props["n_ctx"], props["ubatch_size"]) == (8192, 2048)
        assert [n.split(":")[0] for n in props["llama_server_notes"]] == ["--jinja", "-b"]


def test_docs_list_each_spelling_with_its_class_and_why() -> None:
    from bench.llama_options import DOCS, docs_section

    assert docs_section() in DOCS.read_text(), "python -m bench.llama_options --docs"
