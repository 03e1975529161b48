#!/usr/bin/env bash
# The Python packages ngdist imports that the GPU machine's image may lack (onnx, onnx-ir,
# protobuf, ml_dtypes, tqdm; pytest for the contract suite), as wheels for its Python 3.12, into .gpu/deps/ (ignored by git,
# like the rest of .gpu/). docs/gpu.md says when to carry them and how they are installed there.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
mkdir -p "$root/.gpu/deps"
plat=(--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64)
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  "${plat[@]}" -d "$root/.gpu/deps" "onnx==1.23.*" onnx-ir protobuf ml_dtypes tqdm typing_extensions \
  pytest pluggy iniconfig packaging pytest-timeout
du -sh "$root/.gpu/deps"; ls "$root/.gpu/deps"
