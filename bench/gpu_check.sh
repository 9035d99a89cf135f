#!/usr/bin/env bash
# The GPU checks on a CUDA machine with no network (how they run on the H100/H200 the device
# tool lends), in stages that fit a short lease:
#
#   BUDGET=SECONDS bench/gpu_check.sh CARRY_DIR [OUT_DIR] [STAGES]
#
# CARRY_DIR holds what cannot be fetched there (bench/gpu_carry.sh makes it, 25 MB): the
# llama-cpp-python sdist stripped to travel light, wheels of the Python packages the image lacks
# in whl/, and ggml-vocab-qwen35.gguf. Stages (STAGES: a comma list, all by default, in order):
#
#   build   llama-cpp-python for the GPU found (CUDA, CUDA_ARCH or the native architecture)
#   server  llama-server from the same build tree (in the background, for `team`)
#   models  random-weight models: one of each memory (plain attention, a 512-token sliding
#           window, the Qwen3.5 hybrid) and TinyLlama 1.1B's shape in f16 and Q4_K_M
#   doctor  `prefixgate doctor --parallel 3` on the 1.1B Q4_K_M and each memory's model: exact
#           reuse, what decode steps of 3 slots do (batched as they come, the fixed shape and
#           its cost, apart), and what each --deterministic takes
#   rate    bench.decode_rate on the 1.1B Q4_K_M: 3 slots generating at once, tokens/s of
#           prefixgate --deterministic auto, on and off against llama-server -np 3 (issue 41:
#           auto at least 0.9x)
#   spec    bench.spec on the 1.1B Q4_K_M (issue 47): n-gram drafts and a draft model (the small
#           random llama) against llama-server with the same types, the verify cost on this GPU;
#           then bench.spec_replay: that cost on the answers the real model gave on a CPU
#           (bench/results/issue47), what they would gain here; then a 1B-class Qwen3.5 hybrid
#           drafting through its rollback states against llama-server's checkpoints
#   team    bench.team on the 1.1B Q4_K_M model: 1 worker with 3 slots against llama-server -np 3
#   decode  bench.decode_batch: batched versus alone decode steps, bit for bit and ms per step
#   tests   the exactness suite (engines and servers, slots included) on all three families
#
# Each stage is bounded by the time left of BUDGET (from the start) and skipped when too little
# is left; a stage that finished is remembered in $BUILD/done, so a second call on the same
# machine goes on where the first stopped (the llama-server build runs on between calls).
# OUT_DIR gets one file per stage, the build, models and llama-server's build together in
# setup.txt, and timeline.txt: 8 files (the device tool brings back 8).
set -uo pipefail
self=$(realpath "$0")
export carry=$(realpath "$1") out=$(realpath -m "${2:-$1/out}")
stages=${3:-build,server,models,doctor,rate,spec,team,decode,tests}
export build=${BUILD:-/tmp/prefixgate-gpu-build}
export site=${SITE:-/tmp/site}  # where the carried wheels and the built library go
export models=$build/models PYTHONPATH=$site:$PWD PYTHONUNBUFFERED=1
# the suite's and the benchmarks' models, by their memory (tests/models.py), all on the GPU
export PREFIXGATE_TEST_MODEL_SMOLLM2=$models/llama.gguf PREFIXGATE_TEST_MODEL_GEMMA3=$models/gemma3.gguf
export PREFIXGATE_TEST_MODEL_QWEN35=$models/qwen35.gguf
# the qwen35 draft model (a random llama of its vocabulary: the smollm2 stand-in is one)
export PREFIXGATE_TEST_DRAFT_QWEN35=$models/llama.gguf
export PREFIXGATE_TEST_GPU_LAYERS=-1 PREFIXGATE_N_GPU_LAYERS=-1
# a server the suite starts without --model takes the stand-in (the default SmolLM2 is not here)
export PREFIXGATE_MODEL=$PREFIXGATE_TEST_MODEL_SMOLLM2
# Seen on the H100 image (CUDA 13 toolkit): libggml-cuda.so carries libstdc++ symbols of its own,
# and when another extension loaded first (lmdb, aiohttp) llama_model::print_info crashed in
# std::ostream inside them (SIGSEGV at model load). The system libstdc++ loaded first avoids it.
LD_PRELOAD=$(ldconfig -p | grep -m1 'libstdc++.so.6 ' | awk '{print $NF}')
export LD_PRELOAD
mkdir -p "$out" "$site" "$build/done" "$models"

build() {
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target "$site" \
    "$carry"/whl/*.whl 2>&1 | grep -v "already exists" || true
  if ! python3 -c "import llama_cpp" 2>/dev/null; then
    if ! ls "$build"/llama_cpp_python-*.whl >/dev/null 2>&1; then
      [ -d /tmp/sdist ] || { mkdir /tmp/sdist && tar -xzf "$carry"/llama_cpp_python-*.tar.gz -C /tmp/sdist; }
      CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=${CUDA_ARCH:-native} -DLLAVA_BUILD=off" \
        CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) python3 -m pip wheel -v --no-deps \
        --no-build-isolation -w "$build" -C build-dir="$build/cmake" /tmp/sdist/llama_cpp_python-*/ \
        > "$build/build.log" 2>&1
      local rc=$?
      grep -E "nvcc|CUDA|Built target|error" "$build/build.log" | tail -15
      (( rc == 0 )) || { tail -40 "$build/build.log"; return 1; }
    fi
    python3 -m pip install -q --no-index --no-deps --target "$site" "$build"/llama_cpp_python-*.whl
  fi
  python3 -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__,
    'GPU offload:', llama_cpp.llama_supports_gpu_offload())" || return 1
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
  nvcc --version | tail -2 || true
}

server() {  # the llama-server target of the same build tree: its ggml-cuda is already compiled
  echo $$ > "$build/server.pid"
  cmake -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF "$build/cmake" >/dev/null &&
    nice -n 10 cmake --build "$build/cmake" --target llama-server -j "$(nproc)" | tail -3 &&
    find "$build/cmake" -name llama-server -type f -perm -u+x | head -1 > "$build/llama-server.path"
}

models() {
  local vocab=$carry/ggml-vocab-qwen35.gguf
  for arch in llama gemma3 qwen35; do
    [ -f "$models/$arch.gguf" ] || python3 -m bench.random_model --arch "$arch" --window 512 \
      --vocab "$vocab" --out "$models/$arch.gguf" || return 1
  done
  [ -f "$models/tiny-q4_k_m.gguf" ] || python3 -m bench.random_model --arch llama --layers 22 \
    --size 2048,32,4,5632 --vocab "$vocab" --out "$models/tiny.gguf" --quantize q4_k_m
}

doctor() {
  local rc=0
  for m in tiny-q4_k_m llama gemma3 qwen35 tiny-q4_k_m/off; do
    local fa=auto
    [[ $m == */off ]] && { m=${m%/off}; fa=off; }
    {
      echo "### $m.gguf, --parallel 3 -ngl 99 -fa $fa"
      python3 -m proxy.cli doctor --model "$models/$m.gguf" --parallel 3 -ngl 99 -fa "$fa" \
        2>/tmp/doctor.err || { rc=1; grep -v "^llama_\|^load\|^print_info\|^\." /tmp/doctor.err | tail -5; }
    }
  done
  {  # -dev and -mg as llama.cpp picks them: the first GPU alone holds the model
    echo "### tiny-q4_k_m.gguf, -dev CUDA0 -sm none -mg 0"
    python3 -m proxy.cli doctor --model "$models/tiny-q4_k_m.gguf" -ngl 99 -dev CUDA0 -sm none \
      -mg 0 2>/tmp/doctor.err || { rc=1; grep -v "^llama_\|^load\|^print_info\|^\." /tmp/doctor.err | tail -5; }
  }
  return $rc
}

decode() {
  python3 -m bench.decode_batch --models smollm2,gemma3,qwen35 --out /tmp/decode-small &&
    PREFIXGATE_TEST_MODEL_SMOLLM2=$models/tiny-q4_k_m.gguf python3 -m bench.decode_batch \
      --models smollm2 --out /tmp/decode-q4 &&
    PREFIXGATE_TEST_MODEL_SMOLLM2=$models/tiny.gguf python3 -m bench.decode_batch \
      --models smollm2 --out /tmp/decode-f16
}

wait_server() {
  while [ ! -s "$build/llama-server.path" ]; do
    kill -0 "$(cat "$build/server.pid" 2>/dev/null)" 2>/dev/null \
      || { echo "llama-server was not built: $build/server.log"; return 1; }
    sleep 2
  done
}

rate() {
  wait_server || return 1
  python3 -m bench.decode_rate --llama-server "$(cat "$build/llama-server.path")" \
    --model "$models/tiny-q4_k_m.gguf" -ngl 99 --slots 3 --tokens 256 --modes auto,on,off \
    --out /tmp/rate
}

spec() {
  wait_server || return 1
  python3 -m bench.spec --llama-server "$(cat "$build/llama-server.path")" \
    --model "$models/tiny-q4_k_m.gguf" -ngl 99 --threads 8 --workloads edit,patch \
    --spec-types ngram-simple,draft-simple --draft-model "$models/llama.gguf" --out /tmp/spec &&
    python3 -m bench.spec_replay bench/results/issue47/spec-shadows.json \
      bench/results/issue47/spec-1130.json --costs /tmp/spec/spec.json || return 1
  # a Qwen3.5 hybrid of 1B-class size drafting through its rollback states, against
  # llama-server's checkpoints: what a verify and a rejected draft cost there (random weights
  # accept nothing: no speed-up to see, only the cost)
  [ -f "$models/qwen35-1b.gguf" ] || python3 -m bench.random_model --arch qwen35 --layers 24 \
    --size 2048,16,2,5632 --vocab "$carry/ggml-vocab-qwen35.gguf" --out "$models/qwen35-1b.gguf"
  python3 -m bench.spec --llama-server "$(cat "$build/llama-server.path")" \
    --model "$models/qwen35-1b.gguf" -ngl 99 --threads 8 --workloads edit \
    --spec-types draft-simple --draft-model "$models/llama.gguf" --out /tmp/spec-qwen35 \
    --arms prefixgate,prefixgate:draft-simple,prefixgate:draft-simple:all,llama-server,llama-server:draft-simple
}

team() {
  wait_server || return 1
  python3 -m bench.team --llama-server "$(cat "$build/llama-server.path")" \
    --model "$models/tiny-q4_k_m.gguf" --arms slots,llama-server --flash-attn auto \
    --peer-defaults --threads 8 --rounds 1 --keep-logs --out /tmp/team
}

tests() {
  # the image's own pytest plugins stay out (one of them crashed the first model load)
  PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python3 -X faulthandler -m pytest -q -p no:cacheprovider \
    -p pytest_asyncio.plugin -o addopts="" --durations=10 \
    tests/backend/test_slots.py tests/proxy/test_slots.py tests/proxy/test_models.py \
    tests/backend/test_memory.py tests/proxy/test_exact_check.py tests/backend/test_selfcheck.py
}

if [ "${4:-}" = "--stage" ]; then "$5"; exit; fi  # one stage, run under `timeout` below

t0=$(date +%s)
left() { echo $(( ${BUDGET:-100000} - ($(date +%s) - t0) )); }
say() { echo "[$(( $(date +%s) - t0 ))s] $*" | tee -a "$out/timeline.txt"; }
stage() {  # NAME LEAST_SECONDS: run it under the time left, unless it finished before
  local name=$1 least=$2 l
  [[ ",$stages," == *",$name,"* ]] || return 0
  [ -f "$build/done/$name" ] && { say "$name: finished in an earlier call"; return 0; }
  l=$(left)
  (( l >= least )) || { say "$name: skipped, $l s left (it needs $least)"; return 0; }
  say "$name: start ($l s left)"
  local s=$(date +%s) rc
  local file=$out/$name.txt
  [[ $name == build || $name == models ]] && file=$out/setup.txt
  timeout -k 5 "$l" bash "$self" "$carry" "$out" "$stages" --stage "$name" >> "$file" 2>&1
  rc=$?
  tail -4 "$file"
  say "$name: exit $rc after $(( $(date +%s) - s )) s"
  (( rc == 0 )) && touch "$build/done/$name"
}

stage build 60
if [[ ",$stages," == *",server,"* ]] && [ -f "$build/done/build" ] \
    && [ ! -f "$build/done/server" ] \
    && ! kill -0 "$(cat "$build/server.pid" 2>/dev/null)" 2>/dev/null; then
  say "server: building in the background"  # runs on between calls (its own session)
  setsid nohup bash -c "bash '$self' '$carry' '$out' '$stages' --stage server \
    > '$build/server.log' 2>&1 && touch '$build/done/server'" >/dev/null 2>&1 &
fi
stage models 30
stage doctor 30
stage rate 60
stage spec 90
stage team 60
stage decode 30
stage tests 60
{ echo "### llama-server's build"; cat "$build/server.log"; } >> "$out/setup.txt" 2>/dev/null || true
say "done"
