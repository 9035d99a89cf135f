"""llama-server's command line works for `prefixgate serve` (issue 21): its flags under their
names and short forms, its LLAMA_ARG_* variables, no abbreviations (`--api-key sk-...` once
became `--api-keys FILE` and printed the key in a traceback), an unknown flag said in one line
that shows no value, and the placement flags turned into llama.cpp's model parameters."""

from __future__ import annotations

import json

import pytest

from backend import placement
from proxy.cli import serve_config
from proxy.config import Config, worker_argv
from proxy.edge import aliases_of
from proxy.values import LAZY_MODES, LOAD_MODES

SECRET = "sk-test-0123456789"

# a typical llama-server line, every supported flag in its usual form
LLAMA_SERVER_LINE = [
    "-m", "model.gguf", "-c", "8192", "-ngl", "0", "-fa", "off", "-ctk", "q8_0", "-ctv", "q8_0",
    "--jinja", "-np", "1", "-a", "coder", "--api-key", SECRET, "--metrics", "-t", "2", "-tb", "2",
    "-b", "2048", "-ub", "128", "-ts", "1", "-sm", "layer", "--mlock", "--no-mmap", "-lzm", "off",
    "--n-cpu-moe", "0", "-ot", r"blk\.0\.ffn_up=CPU", "--api-key-file", "keys.txt",
    "--chat-template-file", "t.jinja", "--host", "127.0.0.2", "--port", "8081",
]


def test_a_llama_server_command_line_maps_onto_the_config() -> None:
    cfg = serve_config(LLAMA_SERVER_LINE, environ={})
    assert (cfg.model, cfg.n_ctx, cfg.n_gpu_layers, cfg.flash_attn) == ("model.gguf", 8192, 0,
                                                                        "off")
    assert (cfg.cache_type_k, cfg.cache_type_v, cfg.parallel, cfg.alias) == ("q8_0", "q8_0", 1,
                                                                            "coder")
    assert (cfg.api_key, cfg.api_keys) == ((SECRET,), "keys.txt")
    assert (cfg.threads, cfg.threads_batch, cfg.ubatch_size, cfg.batch) == (2, 2, 128, 128)
    assert (cfg.tensor_split, cfg.split_mode, cfg.load_mode, cfg.lazy_mode) == \
        ("1", "layer", "mlock", "off")
    assert (cfg.n_cpu_moe, cfg.override_tensor) == (0, r"blk\.0\.ffn_up=CPU")
    assert (cfg.chat_template_file, cfg.host, cfg.port) == ("t.jinja", "127.0.0.2", 8081)
    assert SECRET not in repr(cfg), "a key never shows in the Config's repr"
    # the long forms too, and prefixgate's own names
    long = serve_config(["serve", "--ctx-size", "4096", "--gpu-layers", "all", "--flash-attn",
                         "on", "--cache-type-k", "q4_0", "--alias", "x", "--api-key", "a,b",
                         "--api-key", "c", "--ubatch-size", "32", "--n-ctx", "2048"], environ={})
    # all layers where this build has a GPU to offload to; on the CPU with a note otherwise
    gpu = -1 if placement.offload_devices() else 0
    assert (long.n_ctx, long.n_gpu_layers, long.flash_attn, long.cache_type_k) == \
        (2048, gpu, "on", "q4_0"), "the last of two flags for one setting wins"
    assert gpu or long.llama_notes[-1].startswith("-ngl all: ")
    assert long.api_key == ("a", "b", "c") and long.ubatch_size == 32


def test_llama_arg_variables_under_prefixgate_ones_under_flags() -> None:
    env = {"LLAMA_ARG_CTX_SIZE": "2048", "LLAMA_ARG_N_GPU_LAYERS": "0", "LLAMA_API_KEY": SECRET,
           "LLAMA_ARG_ALIAS": "from-llama", "LLAMA_ARG_MLOCK": "1", "LLAMA_ARG_PORT": "9001",
           "PREFIXGATE_ALIAS": "from-prefixgate", "LLAMA_ARG_UBATCH": "256"}
    cfg = serve_config([], environ=env)
    assert (cfg.n_ctx, cfg.api_key, cfg.load_mode, cfg.port, cfg.ubatch_size) == \
        (2048, (SECRET,), "mmap+mlock", 9001, 256)
    assert cfg.alias == "from-prefixgate"
    assert serve_config(["-c", "1024"], environ=env).n_ctx == 1024


@pytest.mark.parametrize("argv", [
    ["--api-k", SECRET],  # an abbreviation is not taken for --api-key or --api-keys
    ["--api-keys-typo", SECRET],
    [SECRET],
])
def test_an_unknown_flag_is_one_line_that_shows_no_value(argv: list[str],
                                                         capsys: pytest.CaptureFixture[str]
                                                         ) -> None:
    with pytest.raises(SystemExit) as e:
        serve_config(argv, environ={})
    message = str(e.value)
    assert message.startswith("prefixgate: not supported: ") and "\n" not in message
    assert SECRET not in message + capsys.readouterr().err


def test_each_refused_llama_flag_is_its_own_line_that_shows_no_value(
        capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        serve_config(["--control-vector", SECRET, "--api-key", SECRET, "--lora", SECRET],
                     environ={})
    lines = str(e.value).splitlines()
    assert [line.split(":")[:2] for line in lines] == [["prefixgate", " --control-vector"],
                                                       ["prefixgate", " --lora"]]
    assert SECRET not in str(e.value) + capsys.readouterr().err


def test_slots_share_the_context_as_in_llama_server(capsys: pytest.CaptureFixture[str]) -> None:
    cfg = serve_config(["-np", "4", "-c", "32768", "-cram", "-1"], environ={})
    assert (cfg.parallel, cfg.slot_ctx, cfg.cache_ram) == (4, 8192, -1)
    assert serve_config([], environ={"LLAMA_ARG_N_PARALLEL": "3",
                                     "LLAMA_ARG_CACHE_RAM": "0"}).parallel == 3
    with pytest.raises(SystemExit) as e:
        serve_config(["-np", "8", "-c", "2048", "--api-key", SECRET], environ={})
    assert "256 tokens each" in str(e.value) and "shared" in str(e.value)
    with pytest.raises(SystemExit) as e:
        serve_config(["-np", "0"], environ={})
    assert "--parallel 0" in str(e.value)
    # llama-server's auto (-1): one slot with the whole context here, and it says why
    for auto in (serve_config(["-np", "-1"], environ={}),
                 serve_config([], environ={"LLAMA_ARG_N_PARALLEL": "-1"})):
        assert (auto.parallel, auto.slot_ctx) == (1, auto.n_ctx)
        assert [n for n in auto.llama_notes if n.startswith("-np -1: 1 slot")]
    assert not serve_config(["-np", "2"], environ={"LLAMA_ARG_N_PARALLEL": "-1"}).llama_notes


def test_a_slot_save_path_is_taken_with_a_note() -> None:
    """llama-server's compose files often carry --slot-save-path: prefixgate keeps its
    states itself, so the start goes on and one line says what the option would have done."""
    cfg = serve_config(["--slot-save-path", "/data/slots", "-c", "2048"], environ={})
    assert cfg.n_ctx == 2048
    assert [n for n in cfg.llama_notes if n.startswith("--slot-save-path") and
            "POST /slots save and restore" in n], cfg.llama_notes


def test_what_is_not_supported_yet_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as e:
        serve_config(["-sm", "diagonal", "--api-key", SECRET], environ={})
    assert "one of none, layer, row" in str(e.value)
    assert SECRET not in str(e.value) + capsys.readouterr().err


def test_placement_flags_become_model_parameters() -> None:
    import llama_cpp

    assert placement.overrides("", 2) == [
        (r"blk\.0\.ffn_(up|down|gate|gate_up)_(ch|)exps", "CPU"),
        (r"blk\.1\.ffn_(up|down|gate|gate_up)_(ch|)exps", "CPU")]
    assert placement.overrides(r"exps=CPU, attn_q=CPU", 0) == [("exps", "CPU"), ("attn_q", "CPU")]
    # -cmoe: every layer's experts, llama.cpp's one pattern
    assert placement.overrides("", -1) == [(r"\.ffn_(up|down|gate|gate_up)_(ch|)exps", "CPU")]
    with pytest.raises(ValueError, match="PATTERN=BUFFER"):
        placement.overrides("exps", 0)
    assert "CPU" in placement.buffer_types()
    mp = llama_cpp.llama_model_default_params()
    keep = placement.apply(mp, "row", "3,1", r"ffn=CPU", 1, load_mode="mlock")
    assert (mp.split_mode, mp.load_mode) == (2, llama_cpp.LLAMA_LOAD_MODE_MLOCK)
    assert list(mp.tensor_split[:2]) == [3.0, 1.0] and mp.tensor_buft_overrides and keep
    # every --load-mode word reaches the one field this llama.cpp reads
    # (llama_model_params.load_mode; not use_mmap/use_mlock, which it no longer has)
    assert "load_mode" in {name for name, *_ in type(mp)._fields_}
    assert (set(placement.LOAD_MODES), set(placement.LAZY_MODES)) == (set(LOAD_MODES),
                                                                       set(LAZY_MODES))
    for word, mode in {"auto": llama_cpp.LLAMA_LOAD_MODE_AUTO,
                       "mmap+mlock": llama_cpp.LLAMA_LOAD_MODE_MMAP_MLOCK,
                       "none": llama_cpp.LLAMA_LOAD_MODE_NONE,
                       "dio": llama_cpp.LLAMA_LOAD_MODE_DIRECT_IO}.items():
        p = llama_cpp.llama_model_default_params()
        placement.apply(p, load_mode=word)
        assert p.load_mode == mode, word
    with pytest.raises(ValueError, match="--load-mode is one of"):
        placement.apply(llama_cpp.llama_model_default_params(), load_mode="fast")
    p = llama_cpp.llama_model_default_params()
    placement.apply(p, lazy_mode="on")
    assert p.lazy_mode == llama_cpp.LLAMA_LAZY_MODE_ON
    with pytest.raises(ValueError, match="no buffer type CUDA7"):
        placement.apply(llama_cpp.llama_model_default_params(), override_tensor="x=CUDA7")


def test_flags_llama_cpp_takes_again_add_to_each_other() -> None:
    """`-ot` and `--chat-template-kwargs` add to what they said before in llama.cpp (a MoE
    split over a GPU and the CPU is often two or three `-ot`): every one of them counts here
    too, under either spelling, and a worker gets them all."""
    cfg = serve_config(["-m", "m.gguf", "-ot", r"blk\.[0-3]\.ffn=CUDA0", "-ot", "exps=CPU",
                        "--override-tensor", "attn_q=CPU",
                        "--chat-template-kwargs", '{"enable_thinking": false, "x": 1}',
                        "--chat-template-kwargs", '{"x": 2, "reasoning_effort": "high"}'],
                       environ={"LLAMA_ARG_OVERRIDE_TENSOR": "lost=CPU"})
    assert cfg.override_tensor == r"blk\.[0-3]\.ffn=CUDA0,exps=CPU,attn_q=CPU"
    assert placement.overrides(cfg.override_tensor, 0) == [
        (r"blk\.[0-3]\.ffn", "CUDA0"), ("exps", "CPU"), ("attn_q", "CPU")]
    assert json.loads(cfg.chat_template_kwargs) == {"enable_thinking": False, "x": 2,
                                                    "reasoning_effort": "high"}
    argv = worker_argv(cfg)
    assert argv[argv.index("--override-tensor") + 1] == cfg.override_tensor
    # -a names aliases, comma-separated or given again; the model's id is the first of them
    # in llama-server's order (a set's), the others shown beside it in /v1/models
    named = serve_config(["-a", "qwen-coder, local", "-a", "coder"], environ={})
    assert aliases_of(named.alias) == ["coder", "local", "qwen-coder"]
    assert aliases_of("") == [] and aliases_of("one") == ["one"]
    # one given once is as given; a value that is not JSON is still said as before
    assert serve_config(["-ot", "exps=CPU"], environ={}).override_tensor == "exps=CPU"
    with pytest.raises(SystemExit, match="--chat-template-kwargs"):
        serve_config(["--chat-template-kwargs", "{bad", "--chat-template-kwargs", "{}"],
                     environ={})


def test_the_defaults_are_llama_servers_where_they_make_sense() -> None:
    cfg = Config()
    assert (cfg.split_mode, cfg.load_mode, cfg.lazy_mode, cfg.parallel) == ("layer", "auto",
                                                                           "auto", 1)


@pytest.mark.parametrize(("argv", "env", "mode"), [
    (["-lm", "none"], {}, "none"),
    (["--load-mode", "MMAP+MLOCK"], {}, "mmap+mlock"),
    ([], {"LLAMA_ARG_LOAD_MODE": "dio"}, "dio"),
    # the older spellings, as llama-server took them before -lm
    (["--no-mmap"], {}, "none"),
    (["--mlock"], {}, "mmap+mlock"),
    (["--mlock", "--no-mmap"], {}, "mlock"),
    ([], {"LLAMA_ARG_MMAP": "0"}, "none"),
    ([], {"PREFIXGATE_MMAP": "false", "LLAMA_ARG_MLOCK": "1"}, "mlock"),
    (["--mmap"], {"LLAMA_ARG_MMAP": "0"}, "auto"),  # a flag over a variable
    (["-lm", "mmap", "--no-mmap"], {}, "mmap"),  # -lm over an older spelling
])
def test_load_mode_and_its_older_spellings(argv: list[str], env: dict[str, str],
                                           mode: str) -> None:
    cfg = serve_config(argv, environ=env)
    assert cfg.load_mode == mode
    # a worker is given it as one flag
    assert worker_argv(cfg)[worker_argv(cfg).index("--load-mode") + 1] == mode


def test_an_unknown_load_mode_is_one_line() -> None:
    with pytest.raises(SystemExit, match=r"invalid value for --load-mode: 'fast' \(one of auto"):
        serve_config(["-lm", "fast"], environ={})


@pytest.mark.model
def test_serve_runs_a_llama_server_command_line(tmp_path, model_path: str) -> None:  # type: ignore[no-untyped-def]
    """The same flags a llama-server user types (a quantized V cache needs flash attention, as
    in llama-server), both SDKs with the key, a wrong key refused, the first alias as the model
    id,
    the log lines in --log-file too, a projector said as not loaded, and the keys (the API's,
    the hub's) in no output."""
    import anthropic
    import openai

    from tests.conftest import running

    logged = tmp_path / "llama.log"
    line = ["-m", model_path, "-c", "8192", "-ngl", "0", "-fa", "on", "-ctk", "q8_0", "-ctv",
            "q8_0", "--jinja", "-np", "1", "-a", "zed-coder", "-a", "coder", "--api-key", SECRET,
            "--metrics", "-ub", "64", "--rope-scaling", "yarn", "--rope-scale", "2",
            "--yarn-orig-ctx", "4096", "--numa", "distribute", "--log-file", str(logged),
            "--mmproj", "mmproj.gguf", "-hft", SECRET]
    with running(tmp_path, *line) as srv:
        oa = openai.OpenAI(base_url=srv.v1, api_key=SECRET, max_retries=0, timeout=120)
        r = oa.chat.completions.create(model="coder", messages=[{"role": "user", "content":
                                       "Say hi."}], max_tokens=4, temperature=0)
        assert r.model == "coder" and r.choices[0].message.content
        assert [m.id for m in oa.models.list().data] == ["coder"]
        an = anthropic.Anthropic(base_url=srv.url, api_key=SECRET, max_retries=0, timeout=120)
        m = an.messages.create(model="coder", max_tokens=4, messages=[
            {"role": "user", "content": "Say hi."}])
        assert m.content and m.model == "coder"
        with pytest.raises(openai.AuthenticationError):
            openai.OpenAI(base_url=srv.v1, api_key="sk-wrong", max_retries=0).chat.completions\
                .create(model="coder", messages=[{"role": "user", "content": "Hi"}], max_tokens=1)
        import json
        import urllib.request

        req = urllib.request.Request(srv.v1 + "/models", headers={"x-api-key": SECRET})
        card = json.loads(urllib.request.urlopen(req, timeout=30).read())["data"][0]
        assert card["aliases"] == ["coder", "zed-coder"]  # two -a: both names, as llama-server
        req = urllib.request.Request(srv.url + "/props", headers={"x-api-key": SECRET})
        props = json.loads(urllib.request.urlopen(req, timeout=30).read())
        assert props["model"] == "coder" and SECRET not in str(props)
        # the RoPE settings and NUMA reach the worker's context, and are said; the self-check
        # proves a hit exact with them
        assert props["placement"]["0"].endswith(
            "; RoPE rope_freq_scale 0.5, rope_scaling yarn, yarn_orig_ctx 4096; NUMA distribute")
        assert [w["ok"] for w in props["exact"]] == [True]
        log = srv.log()
    assert SECRET not in log
    # --log-file: the proxy's and the worker's lines, as stderr has them
    lines = logged.read_text().splitlines()
    assert SECRET not in "\n".join(lines)
    assert [x for x in lines if " prefixgate INFO prefixgate ready on " in x]
    assert [x for x in lines if " worker0 INFO worker 0: exact reuse proven" in x]
    assert [x for x in lines if "--mmproj: accepted for llama-server's command line, no effect "
            "here: no vision projector is loaded" in x], "a projector given is said"
    assert set(lines) <= set(log.splitlines())


@pytest.mark.model
def test_a_kv_cache_off_the_gpu_reaches_the_worker_s_context() -> None:
    """-nkvo (and its variable) keeps the KV in host RAM: the worker's flag, its placement, the
    context's offload_kqv; on this CPU-only build nothing computes elsewhere, so the identity
    is the default's (on a GPU it says "KV cache in host RAM" and keys the states apart)."""
    from backend.context import load
    from proxy.cli import worker_spec
    from proxy.config import default_model

    cfg = serve_config(["-m", default_model(), "-ngl", "0", "-nkvo"], environ={})
    assert cfg.kv_offload is False and "--no-kv-offload" in worker_argv(cfg)
    assert worker_spec(cfg).placement["kv_offload"] is False
    assert serve_config(["-ngl", "0"], environ={"LLAMA_ARG_NO_KV_OFFLOAD": "1"}).kv_offload \
        is False
    assert serve_config(["-ngl", "0", "--kv-offload"], environ={}).kv_offload is True
    off = load(default_model(), 512, 2, 0, placement={"kv_offload": False})
    on = load(default_model(), 512, 2, 0, placement={"kv_offload": True})
    try:
        assert off.compute == on.compute and "kv_offload" not in off.placement
    finally:
        import llama_cpp

        for got in (off, on):
            llama_cpp.llama_free(got.ctx)
            llama_cpp.llama_model_free(got.model)


@pytest.mark.model
def test_override_kv_reaches_the_tokenizer_and_the_workers(tmp_path, cold_server) -> None:  # type: ignore[no-untyped-def]
    """--override-kv as llama-server takes it: the proxy's tokenizer reads the model as
    llama.cpp does with it (add_bos_token: a BOS before raw text), the worker computes with it
    (another answer than the plain server's), /props says it, and the self-check proves a hit
    exact with it; a key the file has with another type stops the start in one line (llama.cpp
    would keep the file's value and log a warning)."""
    import urllib.request

    import openai

    from tests.conftest import running, start_server

    messages = [{"role": "user", "content": "Name three colours."}]

    def ask(url: str) -> openai.types.chat.ChatCompletion:
        c = openai.OpenAI(base_url=url, api_key="k", max_retries=0, timeout=120)
        return c.chat.completions.create(model="m", messages=messages,  # type: ignore[arg-type]
                                         max_tokens=12, temperature=0)

    plain = ask(cold_server.v1)
    bos, eps = "tokenizer.ggml.add_bos_token=bool:true", \
        "llama.attention.layer_norm_rms_epsilon=float:0.25"
    with running(tmp_path / "a", "--workers", "1", "--disk-prefix-cache", "off",
                 "--override-kv", bos, "--override-kv", eps) as srv:
        got = ask(srv.v1)
        # SmolLM2's BOS is <|im_start|>, which its chat prompts start with: seen in raw text
        def tokens(url: str) -> list[int]:
            req = urllib.request.Request(url + "/tokenize", json.dumps(
                {"content": "Hello", "add_special": True}).encode(),
                {"Content-Type": "application/json"})
            return list(json.loads(urllib.request.urlopen(req, timeout=30).read())["tokens"])

        assert tokens(srv.url) == [1, *tokens(cold_server.url)]
        assert got.choices[0].message.content != plain.choices[0].message.content
        props = srv.get_json("/props")
        assert props["placement"]["0"].endswith(f"; metadata {bos}, {eps}")
        assert [w["ok"] for w in props["exact"]] == [True]
    with pytest.raises(RuntimeError) as e:
        start_server(tmp_path / "b", "--override-kv", "llama.block_count=float:2")
    said = str(e.value)
    assert "the model's llama.block_count is int, not float" in said
    assert "Traceback" not in said


GPUS = [{"name": "CUDA0", "description": "NVIDIA RTX 4090", "type": "gpu"},
        {"name": "CUDA1", "description": "NVIDIA RTX 3090", "type": "gpu"},
        {"name": "Vulkan0", "description": "AMD Radeon Graphics", "type": "igpu"}]


def test_devices_and_main_gpu_choose_what_computes_as_llama_cpp_does(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """-dev and -mg (llama-server's; refused before): the GPUs that compute are the ones
    named, in their order, and with -sm none the -mg'th of them, or of llama.cpp's own list
    (the discrete GPUs, the integrated ones only where there are none); the cache identity
    names only those. This machine has no GPU: the device list is given (the one fake here)."""
    monkeypatch.setattr(placement, "offload_devices", lambda: GPUS)
    names = lambda gpus: [d["name"] for d in gpus]  # noqa: E731
    assert names(placement.chosen()) == ["CUDA0", "CUDA1", "Vulkan0"]  # as before: all
    assert names(placement.chosen("cuda1,CUDA0")) == ["CUDA1", "CUDA0"]  # case as llama.cpp
    assert placement.chosen("none") == [] and placement.chosen("NONE", "none", 0) == []
    assert names(placement.chosen("", "none", 1)) == ["CUDA1"]  # not the iGPU's index
    assert names(placement.chosen("CUDA1,Vulkan0", "none", 1)) == ["Vulkan0"]
    assert placement.chosen("", "none", -1) == []
    assert names(placement.chosen("", "layer", 1)) == ["CUDA0", "CUDA1", "Vulkan0"]
    with pytest.raises(ValueError, match=r"-mg 2: with -sm none the model goes to one of 2 "
                                         r"GPUs \(CUDA0, CUDA1\): give 0 to 1"):
        placement.chosen("", "none", 2)
    with pytest.raises(ValueError, match=r"-dev CUDA2,CPU: no device CUDA2, CPU to offload to "
                                         r"here \(there are: CUDA0, CUDA1, Vulkan0;"):
        placement.chosen("CUDA2,CPU")
    one = placement.compute_identity(placement.chosen("", "none", 0), False)
    other = placement.compute_identity(placement.chosen("", "none", 1), False)
    assert one == "CUDA (NVIDIA RTX 4090)" and other == "CUDA (NVIDIA RTX 3090)"
    # the proxy checks them before it spawns a worker, in one line
    with pytest.raises(SystemExit, match="prefixgate: -mg 5: with -sm none"):
        serve_config(["-m", "model.gguf", "-sm", "none", "-mg", "5"], environ={})
    cfg = serve_config(["-m", "model.gguf", "-dev", "none", "-ngl", "99"], environ={})
    assert cfg.n_gpu_layers == 0 and cfg.llama_notes == (
        "-dev none: no device to offload to, so every layer runs on the CPU",)
    assert "--device" in worker_argv(cfg) and "--main-gpu" in worker_argv(cfg)


def test_no_devices_reach_llama_cpp_as_its_empty_list() -> None:
    """-dev none: llama.cpp's NULL-terminated device list holds only its NULL (no offload);
    no -dev: no list (every device); -mg reaches its field."""
    import ctypes

    import llama_cpp

    mp = llama_cpp.llama_model_default_params()
    keep = placement.apply(mp, device="none", main_gpu=1)
    assert mp.devices and ctypes.cast(mp.devices, ctypes.POINTER(ctypes.c_void_p))[0] is None
    assert mp.main_gpu == 1 and keep
    mp = llama_cpp.llama_model_default_params()
    placement.apply(mp)
    assert not mp.devices and mp.main_gpu == 0
