#!/bin/bash
# GPU evidence for docs/gpu-evidence.md, one device call: bash tools/gpu/run.sh  (writes $OUT/log.txt, $OUT/results.tgz)
set -u
export PYTHONUNBUFFERED=1 COLUMNS=150 NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
DEADLINE=${DEADLINE:-215}   # seconds for everything; steps get what is left
W=/tmp/ev; mkdir -p $W
step() {  # step LIMIT NAME cmd...: run with min(LIMIT, time left), log rc and wall time
  local lim=$1 name=$2; shift 2
  local left=$((DEADLINE - SECONDS)); [ "$left" -lt "$lim" ] && lim=$left
  if [ "$lim" -le 5 ]; then echo "=== SKIPPED $name (no time left, t=${SECONDS}s)"; return; fi
  echo "=== START $name t=${SECONDS}s limit=${lim}s: $*"
  local t0=$(date +%s.%N)
  timeout -k 5 "$lim" "$@"; local rc=$?
  echo "=== END $name rc=$rc wall=$(awk "BEGIN{print $(date +%s.%N) - $t0}")s t=${SECONDS}s"
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/src:$PWD/tools/gpu
echo "=== ENV"
nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv
uname -r; nproc; free -g | head -2; df -h /dev/shm /tmp | tail -2
python3 - <<'EOF'
import sys, torch, torch.distributed as dist, numpy, numba, regex, rich, gguf, triton, importlib.metadata as md
print("python", sys.version.split()[0], sys.executable)
print("torch", torch.__version__, "cuda", torch.version.cuda, "nccl", torch.cuda.nccl.version(),
      "nccl_available", dist.is_nccl_available(), "gloo_available", dist.is_gloo_available())
print("gpu", torch.cuda.get_device_name(0), torch.cuda.get_device_capability(0), "count", torch.cuda.device_count())
print("numpy", numpy.__version__, "numba", numba.__version__, "regex", regex.__version__, "gguf", md.version("gguf"),
      "rich", md.version("rich"), "triton", triton.__version__)
EOF
# the GLM-5-dimension model is built in the background while the tiny runs go
(python3 tools/gpu/build_glm5.py $W/glm5.gguf ${DRY_BUILD:-} > $W/build_glm5.json 2> $W/build_glm5.err; echo "build rc=$?" >> $W/build_glm5.err) &
BUILD=$!
# tiny shard runs (each its own process group and temp dir) concurrently with the tiny reference
(for m in deepseek2 glm-dsa; do for b in nccl gloo; do
   step 60 shard-$m-$b python3 -m ggufcheck shard .gpu/tiny-$m.gguf --tp 1 --backend $b --timeout 50 -v --json $W/shard-$m-$b.json > $W/shard-$m-$b.log 2>&1 &
 done; done
 step 20 shard-glm-dsa-nccl-tp2 python3 -m ggufcheck shard .gpu/tiny-glm-dsa.gguf --tp 2 --backend nccl --json $W/shard-glm-dsa-nccl-tp2.json > $W/shard-glm-dsa-nccl-tp2.log 2>&1 &
 step 90 nccl-vs-gloo python3 tools/gpu/nccl_vs_gloo.py $W/nccl_vs_gloo.json .gpu/tiny-deepseek2.gguf .gpu/tiny-glm-dsa.gguf > $W/nccl_vs_gloo.log 2>&1 &
 wait) &
SHARDS=$!
step 100 tiny_reference python3 tools/gpu/ref_cuda.py $W/tiny_reference.json .gpu/tiny-llama.gguf .gpu/tiny-deepseek2.gguf .gpu/tiny-glm-dsa.gguf ${DRY_REF:-}
wait $SHARDS; for f in $W/shard-*.log $W/nccl_vs_gloo.log; do echo "##### $f"; cat $f; done
echo "=== waiting for the GLM-5 build t=${SECONDS}s"; wait $BUILD; cat $W/build_glm5.json $W/build_glm5.err; ls -la $W/glm5.gguf
echo "=== build done t=${SECONDS}s"
step 150 shard-glm5-nccl python3 -m ggufcheck shard $W/glm5.gguf --tp 1 --backend nccl --timeout 140 -v --json $W/shard-glm5-nccl.json
step 150 reference-glm5 python3 tools/gpu/ref_glm5.py $W/reference_glm5.json $W/glm5.gguf ${DRY_G5:---device cuda --long 2080}
nvidia-smi --query-gpu=name,memory.used,clocks.sm --format=csv
rm -f $W/glm5.gguf
tar czf $OUT/results.tgz -C $W . && ls -la $OUT
echo "=== ALL DONE t=${SECONDS}s"
