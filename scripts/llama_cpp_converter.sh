#!/usr/bin/env bash
# Fetches llama.cpp's own HF -> GGUF converter (convert_hf_to_gguf.py, conversion/, gguf-py/; and
# src/llama-vocab.cpp, whose pre-tokenizer regexes tests/text_generator/test_gguf_tokenizer.py checks) from
# the llama-cpp-python sdist on PyPI, which vendors llama.cpp, and prints the directory that holds
# it: what LLAMA_CPP_SRC points at for the tests that load GGUFs made by llama.cpp itself
# (tests/modeling/test_gguf_llama_cpp.py). Nothing is built. Usage:
#   export LLAMA_CPP_SRC=$(scripts/llama_cpp_converter.sh [DIR])   # DIR default: .cache/llama.cpp
set -euo pipefail
VERSION=0.3.36
dest=${1:-.cache/llama.cpp}
if [ -f "$dest/convert_hf_to_gguf.py" ] && [ -f "$dest/src/llama-vocab.cpp" ]; then
    (cd "$dest" && pwd); exit 0
fi
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
pip download --quiet --no-deps --no-binary :all: "llama-cpp-python==$VERSION" -d "$tmp" >&2
root="llama_cpp_python-$VERSION/vendor/llama.cpp"
tar xzf "$tmp"/llama_cpp_python-$VERSION.tar.gz -C "$tmp" \
    "$root/convert_hf_to_gguf.py" "$root/conversion" "$root/gguf-py" "$root/src/llama-vocab.cpp"
mkdir -p "$dest/src"
cp -r "$tmp/$root/convert_hf_to_gguf.py" "$tmp/$root/conversion" "$tmp/$root/gguf-py" "$dest/"
cp "$tmp/$root/src/llama-vocab.cpp" "$dest/src/"
(cd "$dest" && pwd)
