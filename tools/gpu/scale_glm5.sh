#!/bin/bash
# issue 35 on the lent GPU, one device call (carry .gpu): a GLM-5-dims glm-dsa file with all
# 256 experts (1 dense + 2 MoE layers, vocabulary 154880, Q8_0, ~23 GB) built on the device,
# reference passes on the GPU at 8 / 96 / 2080 tokens (the per-layer cost the projection rests
# on), then `ggufcheck diagnose --engine hf:bf16@cuda --reference-device cuda`.
# Writes $OUT/log.txt, $OUT/reference.json, $OUT/diagnose.json, $OUT/gpumem.csv.
set -u
export PYTHONUNBUFFERED=1 COLUMNS=160 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src
exec > >(tee $OUT/log.txt) 2>&1
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv
nproc; free -g | head -2; df -h /tmp | tail -1
python3 -c "import torch, transformers, numba, triton; print('torch', torch.__version__, 'transformers', transformers.__version__, 'numba', numba.__version__, 'triton', triton.__version__)"
nvidia-smi --query-gpu=timestamp,memory.used --format=csv,noheader -lms 500 > $OUT/gpumem.csv &
F=/tmp/glm5-3L-256E.gguf
[ -f $F ] || python3 tools/gpu/scale_gpu.py build $F
[ "${SKIP_REFERENCE:-0}" = 1 ] || python3 tools/gpu/scale_gpu.py reference $F $OUT/reference.json
timeout -k 10 ${DIAG_LIMIT:-420} python3 tools/gpu/scale_gpu.py diagnose $F $OUT/diagnose.json ${DIAG_ARGS:-}
echo "=== done t=${SECONDS}s"
