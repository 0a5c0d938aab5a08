#!/bin/bash
# Stage, here, what a device call needs to build llama.cpp with CUDA and drive it from
# ggufcheck (issue 20): the git-ignored .gpu/ folder, named in the device call's `carry`.
#   .gpu/llama.cpp   the llama-cpp-python 0.3.36 sdist's vendored llama.cpp (ggml 0.25.3),
#                    trimmed to the CPU and CUDA backends and the server (~15 MB of 217)
#   .gpu/site        llama_cpp's Python package without its CPU libraries (the device loads
#                    the CUDA build through LLAMA_CPP_LIB_PATH), diskcache, gguf 0.19.0
# Usage (repo root): bash tools/gpu/stage_llama_cpp.sh
set -euo pipefail
V=0.3.36
SD=${SDIST_DIR:-/tmp/ggufcheck-sdist}
mkdir -p "$SD" .gpu
if [ ! -d "$SD/llama_cpp_python-$V" ]; then
  python3 -m pip download -q --no-binary :all: --no-deps "llama-cpp-python==$V" -d "$SD"
  tar xzf "$SD/llama_cpp_python-$V.tar.gz" -C "$SD"
fi
SRC="$SD/llama_cpp_python-$V/vendor/llama.cpp"
rm -rf .gpu/llama.cpp && mkdir -p .gpu/llama.cpp
tar -C "$SRC" --exclude=./models --exclude=./docs --exclude=./benches --exclude=./tests \
    --exclude=./examples --exclude=./media --exclude=./.git --exclude=./gguf-py --exclude=./conversion --exclude=./tools/ui/tests --exclude=./vendor/miniaudio/miniaudio.h.bak \
    --exclude='./ggml/src/ggml-'{cann,et,hexagon,hip,metal,musa,opencl,openvino,sycl,virtgpu,vulkan,webgpu,zdnn,zendnn} \
    -cf - . | tar -C .gpu/llama.cpp -xf -
# the root CMakeLists adds tests/examples only when asked (both OFF in the build)
rm -rf .gpu/site && mkdir -p .gpu/site
WHL=$(ls ../shared/wheels/llama_cpp_python-$V-*.whl 2>/dev/null || true)
if [ -z "$WHL" ]; then python3 -m pip download -q --no-deps "llama-cpp-python==$V" -d "$SD"; WHL=$(ls "$SD"/llama_cpp_python-$V-*.whl); fi
python3 - "$WHL" <<'PY'
import sys, zipfile
with zipfile.ZipFile(sys.argv[1]) as z:
    for n in z.namelist():
        if n.startswith("llama_cpp/") and "/lib/" not in n and "/server/" not in n:
            z.extract(n, ".gpu/site")
PY
python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 diskcache==5.6.3 gguf==0.19.0 -d .gpu/whl
du -sh .gpu/*
