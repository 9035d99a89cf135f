#!/usr/bin/env bash
# The exactness suite on a CUDA GPU, on a machine with no network (how it was run on an H100):
#
#   bench/gpu_check.sh CARRY_DIR [OUT_DIR]
#
# CARRY_DIR holds what cannot be fetched there: the llama-cpp-python sdist (its vendored
# llama.cpp; docs, models and .git may be stripped to travel light) as
# llama_cpp_python-*.tar.gz, wheels of the Python packages the machine lacks in whl/, and
# ggml-vocab-qwen35.gguf. llama-cpp-python is built for the GPU found (CUDA, native
# architecture) in $BUILD (/tmp/prefixgate-gpu-build), so a second call on the same machine
# resumes it. The models are random-weight ones of each memory
# (bench/random_model.py: plain attention, a 512-token sliding window, the Qwen3.5 hybrid),
# since real weights do not travel: hit == cold is exactly as testable on them.
set -euo pipefail
carry=$(realpath "$1")
out=${2:-$carry/out}
build=${BUILD:-/tmp/prefixgate-gpu-build}
mkdir -p "$out" /tmp/site "$build"
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "$carry"/whl/*.whl 2>&1 | grep -v "already exists" || true
if ! python3 -c "import llama_cpp" 2>/dev/null; then
  if [ ! -f "$build/llama_cpp.whl.done" ]; then
    rm -rf /tmp/sdist && mkdir /tmp/sdist && tar -xzf "$carry"/llama_cpp_python-*.tar.gz -C /tmp/sdist
    CMAKE_ARGS="-DGGML_CUDA=on -DCMAKE_CUDA_ARCHITECTURES=native" \
      CMAKE_BUILD_PARALLEL_LEVEL=$(nproc) \
      python3 -m pip wheel -q --no-deps --no-build-isolation -w "$build" \
      -C build-dir="$build/cmake" /tmp/sdist/llama_cpp_python-*/
    touch "$build/llama_cpp.whl.done"
  fi
  python3 -m pip install -q --no-index --no-deps --target /tmp/site "$build"/llama_cpp_python-*.whl
fi
python3 -c "import llama_cpp; print('llama-cpp-python', llama_cpp.__version__,
  'GPU offload:', llama_cpp.llama_supports_gpu_offload())"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
[ -z "${BUILD_ONLY:-}" ] || exit 0
models=$build/models
for arch in llama gemma3 qwen35; do
  [ -f "$models/$arch.gguf" ] || python3 -m bench.random_model --arch "$arch" --window 512 \
    --vocab "$carry/ggml-vocab-qwen35.gguf" --out "$models/$arch.gguf"
done
export PREFIXGATE_TEST_MODEL_SMOLLM2=$models/llama.gguf PREFIXGATE_TEST_MODEL_GEMMA3=$models/gemma3.gguf
export PREFIXGATE_TEST_MODEL_QWEN35=$models/qwen35.gguf
export PREFIXGATE_TEST_GPU_LAYERS=-1 PREFIXGATE_N_GPU_LAYERS=-1
# Seen on the H100 image (CUDA 13 toolkit): libggml-cuda.so carries libstdc++ symbols of its own,
# and when another extension loaded first (lmdb, aiohttp) llama_model::print_info crashed in
# std::ostream inside them (SIGSEGV at model load). The system libstdc++ loaded first avoids it.
export LD_PRELOAD=$(ldconfig -p | grep -m1 'libstdc++.so.6 ' | awk '{print $NF}')
for fa in off on; do
  echo "=== flash attention $fa"
  # the image's own pytest plugins stay out (one of them crashed the first model load)
  PREFIXGATE_FLASH_ATTN=$fa PYTEST_DISABLE_PLUGIN_AUTOLOAD=1 python3 -X faulthandler -m pytest \
    -q -p no:cacheprovider -p pytest_asyncio.plugin -o addopts="" \
    tests/backend/test_memory.py tests/proxy/test_models.py 2>&1 | tee "$out/exactness-fa-$fa.txt" \
    | grep -E "passed|failed|^FAILED|Error" || true
done
