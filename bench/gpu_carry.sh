#!/usr/bin/env bash
# What bench/gpu_check.sh needs on a GPU machine that reaches no network, made here:
#
#   bench/gpu_carry.sh [DIR]     (default gpu/, git-ignored through .git/info/exclude)
#
# then, with the device tool: run(command='CUDA_ARCH=90 BUDGET=520 bash bench/gpu_check.sh gpu
# "$OUT"', carry=["gpu"], timeout_s=560), and the same again at once to go on where it stopped.
# - the llama-cpp-python sdist without its models, docs, tests, .git and the other backends'
#   sources (76 MB down to 8.5 MB; the device takes 64 MiB a call);
# - wheels for Python 3.12 of what the CUDA image lacks (its list: .library/device/KINDS.md):
#   the runtime's lmdb and redis, llama-cpp-python's diskcache, the tests' pytest-asyncio,
#   openai and anthropic with their pydantic, jiter and httpx2, and bench.random_model's gguf;
# - Qwen3.5's vocabulary GGUF, for the random-weight models.
set -euo pipefail
cd "$(dirname "$0")/.."
dir=${1:-gpu}
grep -qx "/$dir/" .git/info/exclude 2>/dev/null || echo "/$dir/" >> .git/info/exclude
mkdir -p "$dir/whl"
version=$(.venv/bin/python -c "import importlib.metadata as m; print(m.version('llama-cpp-python'))")
tmp=$(mktemp -d)
.venv/bin/pip download -q --no-deps --no-binary :all: -d "$tmp" "llama-cpp-python==$version"
tar -xzf "$tmp"/llama_cpp_python-*.tar.gz -C "$tmp"
src=$(echo "$tmp"/llama_cpp_python-*/)
rm -rf "$src"{docs,examples,tests,.git} "$src"vendor/llama.cpp/{models,docs,tests,benches,media,examples,.github,.git}
for b in opencl sycl vulkan hexagon metal et cann webgpu zdnn zendnn openvino virtgpu; do
  rm -rf "$src"vendor/llama.cpp/ggml/src/ggml-$b
done
tar -czf "$dir/llama_cpp_python-$version.tar.gz" -C "$tmp" "$(basename "$src")"
rm -rf "$tmp"
# cp312 wheels of the versions this venv runs; what the image has (numpy, pyyaml, requests...)
# stays out, so that nothing compiled against its own libraries is replaced
pins=$(.venv/bin/pip freeze | grep -iE '^(lmdb|redis|diskcache|pytest-asyncio|openai|anthropic|gguf)==')
# shellcheck disable=SC2086
.venv/bin/pip download -q --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 -d "$dir/whl" $pins
(cd "$dir/whl" && rm -f numpy-* pyyaml-* charset_normalizer-* requests-* urllib3-* idna-* \
  certifi-* tqdm-* pygments-*)
cp build/fixtures/llama.cpp/models/ggml-vocab-qwen35.gguf "$dir/"
du -sh "$dir"
