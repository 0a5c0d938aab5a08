#!/bin/bash
# Issue 20 on the lent H200, in one device call: build llama.cpp with CUDA (or unpack a build
# an earlier call returned), then drive it from ggufcheck: the kernel matrix (`ggufcheck
# quants`), `diagnose` through the CUDA engine, and llama-server over HTTP.
#
# Stage first, here: bash tools/gpu/stage_llama_cpp.sh   (fills the git-ignored .gpu/)
# Device call:       bash tools/gpu/llama_cpp_cuda.sh [STEPS]   with carry [".gpu"]
#   STEPS: comma-separated subset of build,defectq5k,floatpaths,coldserver,row79bisect,row79head,nb8,fusionmoe,floatpaths3,provenance,arith,arithmore,f16moe,f16dense,switches,probe,matrix,matrix2,matrix3,lead,chunklead,families,hfprof,recheck,
#          recheck2,real,realquick,realhttp,reallead,oplead,envtime,server,
#          oldlead,hf (default: build,probe,matrix,lead,server,oldlead,hf)
# Writes $OUT/log.txt-style logs per step, $OUT/results.tgz, and on a fresh build the
# build's bin/ as $OUT/bin.tar.xz.part* (< 16 MiB each): move them to .gpu/prebuilt/ and the
# next call skips the 5-minute build.
set -u
export PYTHONUNBUFFERED=1 COLUMNS=150 GGUFCHECK_THREADS=8
STEPS=",${1:-build,probe,matrix,lead,server,oldlead,hf},"
DEADLINE=${DEADLINE:-560}
W=/tmp/l20; mkdir -p $W/models
has() { [[ "$STEPS" == *",$1,"* ]]; }
step() {  # step LIMIT NAME cmd...: min(LIMIT, time left); output to $W/NAME.log and the console tail
  local lim=$1 name=$2; shift 2
  local left=$((DEADLINE - SECONDS)); [ "$left" -lt "$lim" ] && lim=$left
  if [ "$lim" -le 5 ]; then echo "=== SKIPPED $name (no time left, t=${SECONDS}s)"; return; fi
  echo "=== START $name t=${SECONDS}s limit=${lim}s: $*"
  timeout -k 5 "$lim" "$@" > $W/$name.log 2>&1; local rc=$?
  echo "=== END $name rc=$rc t=${SECONDS}s"; tail -n ${TAILN:-25} $W/$name.log
}
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site .gpu/whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD/.gpu/site:$PWD/src
nvidia-smi --query-gpu=name,driver_version,compute_cap --format=csv,noheader; nvcc --version | tail -1

B=/tmp/llb
if has defectq5k; then  # issue 36 item 1: a one-line defect in the Q5_K matrix-vector kernel (mmvq only:
  # vec_dot_q5_K_q8_1_impl_vmmq drops the 5th bit of 2 of every 8 values), applied to this copy before the build
  sed -i 's/const int vh1i = ((vh\[1\] >> i) << 4) \& 0x10101010;/const int vh1i = ((vh[1] >> i) << 4) \& 0x10100000;/' \
    .gpu/llama.cpp/ggml/src/ggml-cuda/vecdotq.cuh
  grep -n "const int vh1i" .gpu/llama.cpp/ggml/src/ggml-cuda/vecdotq.cuh | head -2
  rm -rf .gpu/prebuilt  # never the healthy build
fi
if has defectq4kmmq; then  # issue 37 item 2 on CUDA: a one-line defect in the Q4_K matrix-matrix kernels only (mmq's
  # tile loader, the tensor-core path: the high nibble of every 4th byte loses its top bit); decode steps take mmvq
  sed -i '745s/(qs0 >> 4) \& 0x0F0F0F0F;/(qs0 >> 4) \& 0x0F0F0F07;/' .gpu/llama.cpp/ggml/src/ggml-cuda/mmq-load-tiles.cuh
  grep -n "(qs0 >> 4) & 0x0F0F0F07" .gpu/llama.cpp/ggml/src/ggml-cuda/mmq-load-tiles.cuh || { echo "defect not applied"; exit 1; }
  rm -rf .gpu/prebuilt; NOPACK=1  # never the healthy build; nothing to send back
fi
if ls .gpu/prebuilt/bin.tar.xz.part* >/dev/null 2>&1; then
  mkdir -p $B && cat .gpu/prebuilt/bin.tar.xz.part* | xz -d | tar -C $B -x && echo "=== unpacked the carried build t=${SECONDS}s"
elif has build; then
  # GGML_NATIVE=OFF: a -march=native build on an AMX host died with SIGSEGV at the first decode
  # (this CPU machine kind: native crashes, the AVX2 build below works; the H100 host of 2026-12-07:
  # every row of the matrix died the same way), so the CPU side is built for AVX2 as the wheels are
  # GIT_CEILING_DIRECTORIES: the source copy sits inside ggufcheck's git tree, and ggml records the
  # commit git finds (2026-12-07: ggufcheck's own); stopped at .gpu, ggml says "unknown"
  export GIT_CEILING_DIRECTORIES=$PWD/.gpu
  cmake -S .gpu/llama.cpp -B $B -G Ninja -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 -DLLAMA_CURL=OFF \
    -DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_BMI2=ON \
    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DCMAKE_BUILD_TYPE=Release > $W/cmake.log 2>&1 \
    || { tail -30 $W/cmake.log; exit 1; }
  echo "=== configured t=${SECONDS}s"
  cmake --build $B -j16 --target llama llama-server > $W/build.log 2>&1 || { tail -40 $W/build.log; exit 1; }
  echo "=== built t=${SECONDS}s"; ls -la $B/bin | head -30
  [ -z "${NOPACK:-}" ] && (cd $B && find bin -maxdepth 1 \( -name '*.so*' -o -name llama-server \) | tar -cf - -T - | xz -T16 -6 \
     | split -b 15M - $OUT/bin.tar.xz.part) && ls -la $OUT
fi
export LLAMA_CPP_LIB_PATH=$B/bin
python3 -c "import llama_cpp; print('gpu offload:', llama_cpp.llama_supports_gpu_offload()); print(llama_cpp.llama_print_system_info().decode())"

if has probe; then  # does llama-cpp-python run the CUDA library in process, and next to torch?
  python3 -c "from ggufcheck.synthetic.tiny import build_tiny_gguf as b; b('llama', '/tmp/l20/models/llama-q4k.gguf', qtypes='Q4_K', n_embd=256, head_dim=64, n_ff=512)"
  TAILN=200 step 200 probe python3 tools/gpu/probe_in_process.py /tmp/l20/models/llama-q4k.gguf
fi

if has probechild; then  # without torch: which of ggufcheck's settings crash the CUDA library?
  python3 -c "from ggufcheck.synthetic.tiny import build_tiny_gguf as b; b('llama', '/tmp/l20/models/llama-q4k.gguf', qtypes='Q4_K', n_embd=256, head_dim=64, n_ff=512)"
  TAILN=120 step 300 probechild python3 tools/gpu/probe_child.py /tmp/l20/models/llama-q4k.gguf ${PROBES:-}
fi

if has chunklead; then  # the cuBLAS-f32 chunked-prefill lead: which path, which layer (chunk_lead.py)
  python3 -c "from ggufcheck.synthetic.tiny import build_tiny_gguf as b; b('deepseek2', '/tmp/l20/models/ds2-q4k.gguf', seed=3, qtypes='Q4_K', n_embd=256, n_ff_exp=256, n_ff=512)"
  D="python3 -m ggufcheck diagnose --no-sanity --no-kernels --sweep-to 0"
  step 60 chunk-ds2-f32 env GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32 $D $W/models/ds2-q4k.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/chunk-ds2-f32.json
  TAILN=80 step 90 chunklead-f32 env GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32 python3 tools/gpu/chunk_lead.py $W/models/ds2-q4k.gguf --chunk 5
  TAILN=40 step 60 chunklead-auto python3 tools/gpu/chunk_lead.py $W/models/ds2-q4k.gguf --chunk 5 --worst 1
fi

if has families; then  # every family's tiny model through the CUDA backend (Q4_K; gpt-oss also MXFP4 experts)
  python3 - <<'EOF2'
from ggufcheck.synthetic.tiny import build_tiny_gguf as b
d = dict(seed=3, n_embd=256, n_ff=512, n_ff_exp=256)
for arch in ("llama", "qwen2", "phi3", "gemma3", "qwen3moe", "gpt-oss", "deepseek2", "glm4moe", "glm-dsa"):
    b(arch, f"/tmp/l20/models/fam-{arch}.gguf", qtypes="Q4_K", **d)
b("gpt-oss", "/tmp/l20/models/fam-gpt-oss-mxfp4.gguf", **d,
  qtypes={"ffn_gate_exps": "MXFP4", "ffn_up_exps": "MXFP4", "ffn_down_exps": "MXFP4", "default": "Q8_0"})
EOF2
  for m in llama qwen2 phi3 gemma3 qwen3moe gpt-oss gpt-oss-mxfp4 deepseek2 glm4moe glm-dsa; do
    TAILN=4 step 45 fam-$m python3 -m ggufcheck diagnose --no-sanity --no-kernels $W/models/fam-$m.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/fam-$m.json
  done
fi

if has matrix3; then  # the matrix without / with flash attention, and with a Q8_0 KV cache
  TAILN=12 step 120 quants-ngl99 python3 -m ggufcheck quants --engine llama-cpp:n_gpu_layers=99 --json $W/quants-ngl99.json
  TAILN=12 step 90 quants-ngl99-fa python3 -m ggufcheck quants --engine llama-cpp:n_gpu_layers=99,flash_attn=1 --json $W/quants-ngl99-fa.json
  TAILN=12 step 90 quants-ngl99-fa-kvq8 python3 -m ggufcheck quants --engine llama-cpp:n_gpu_layers=99,flash_attn=1,type_k=8,type_v=8 --json $W/quants-ngl99-fa-kvq8.json
fi

if has hfprof; then  # issue 20's hf lead: where the time of a tiny model's bf16 CUDA diagnose goes
  python3 -c "from ggufcheck.synthetic.tiny import build_tiny_gguf as b; b('glm-dsa', '/tmp/l20/models/dsa7.gguf', seed=7, qtypes='Q8_0', n_ff_exp=64)"
  step 150 hfprof python3 -m cProfile -o $W/hfprof.prof -m ggufcheck diagnose $W/models/dsa7.gguf --engine hf:bf16@cuda --device 0 --no-sanity --sweep-to 0 --json $W/hfprof.json
  python3 - "$W/hfprof.json" <<'EOF2'
import json, sys
doc = json.load(open(sys.argv[1]))
print("stage timings", doc.get("timings"))
for st in doc["stages"]:
    info = st.get("info") or {}
    if "time" in info:
        print(st.get("stage"), "time split", info["time"])
    for r in st.get("results", []):
        sec = (r.get("stats") or {}).get("seconds")
        if sec is not None and sec > 0.5:
            print("  ", st.get("stage"), r.get("check"), sec, "s")
EOF2
  python3 -c "import pstats; pstats.Stats('$W/hfprof.prof').sort_stats('cumulative').print_stats(45)" | tail -60
fi

if has recheck; then  # the second call: the first call's open rows, after the fixes they led to
  python3 - <<'EOF2'
from ggufcheck.synthetic.tiny import build_tiny_gguf as b
d = dict(seed=3, n_embd=256, n_ff=512, n_ff_exp=256)
b("deepseek2", "/tmp/l20/models/ds2-q4k.gguf", qtypes="Q4_K", **d)
for arch in ("qwen2", "phi3", "glm4moe"):
    b(arch, f"/tmp/l20/models/fam-{arch}.gguf", qtypes="Q4_K", **d)
EOF2
  D="python3 -m ggufcheck diagnose --no-sanity --no-kernels"
  TAILN=30 step 60 re-ds2-f32 env GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32 $D --sweep-to 0 $W/models/ds2-q4k.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/re-ds2-f32.json
  TAILN=4 step 60 re-ds2-auto $D --sweep-to 0 $W/models/ds2-q4k.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/re-ds2-auto.json
  for m in qwen2 phi3 glm4moe; do
    TAILN=14 step 45 re-fam-$m $D $W/models/fam-$m.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/re-fam-$m.json
  done
  # Q2_K with a q8_0 KV cache and flash attention: prefill KL 0.09 on CUDA (5e-05 on the CPU backend)
  TAILN=4 step 60 q2k-keep python3 -m ggufcheck quants --types Q2_K,Q4_K --engine llama-cpp:n_gpu_layers=99,flash_attn=1,type_k=8,type_v=8 --keep $W/models/qm --json $W/q2k-keep.json
  for kv in "type_k=8,type_v=8" "type_k=8,type_v=1" "type_k=1,type_v=8" "type_k=1,type_v=1"; do
    TAILN=40 step 45 q2k-$kv $D --sweep-to 0 $W/models/qm/matrix-q2_k.gguf --engine llama-cpp:n_gpu_layers=99,flash_attn=1,$kv --json $W/q2k-$kv.json
  done
  TAILN=6 step 45 q4k-kvq8 $D --sweep-to 0 $W/models/qm/matrix-q4_k.gguf --engine llama-cpp:n_gpu_layers=99,flash_attn=1,type_k=8,type_v=8 --json $W/q4k-kvq8.json
fi

if has recheck2; then  # router ids read from ffn_moe_argsort; Q2_K with a q8_0 K cache without flash attention
  python3 - <<'EOF2'
from ggufcheck.synthetic.tiny import build_tiny_gguf as b
d = dict(seed=3, n_embd=256, n_ff=512, n_ff_exp=256)
b("deepseek2", "/tmp/l20/models/ds2-q4k.gguf", qtypes="Q4_K", **d)
b("glm4moe", "/tmp/l20/models/fam-glm4moe.gguf", qtypes="Q4_K", **d)
EOF2
  D="python3 -m ggufcheck diagnose --no-sanity --no-kernels"
  TAILN=12 step 60 re2-ds2-f32 env GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32 $D --sweep-to 0 $W/models/ds2-q4k.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/re2-ds2-f32.json
  TAILN=12 step 45 re2-glm4moe $D $W/models/fam-glm4moe.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/re2-glm4moe.json
  TAILN=2 step 40 q2k-keep python3 -m ggufcheck quants --types Q2_K --engine llama-cpp:n_gpu_layers=99 --keep $W/models/qm
  for kv in "type_k=8,flash_attn=0" "type_k=8,type_v=8,flash_attn=1,n_batch=16"; do
    TAILN=12 step 40 q2k-$kv $D --sweep-to 0 $W/models/qm/matrix-q2_k.gguf --engine llama-cpp:n_gpu_layers=99,$kv --json $W/q2k-$kv.json
  done
fi

if has real; then  # SmolLM2-135M Q4_1 (98 MB), carried in two calls as .gpu/realA + .gpu/realB (split -b 55M)
  cat .gpu/realA/* .gpu/realB/* > $W/models/smollm2.gguf && sha256sum $W/models/smollm2.gguf | cut -c1-16
  M=$W/models/smollm2.gguf
  TAILN=30 step 150 real-ngl99 python3 -m ggufcheck diagnose $M --engine llama-cpp:n_gpu_layers=99 --json $W/real-ngl99.json
  TAILN=20 step 100 real-ngl99-fa python3 -m ggufcheck diagnose $M --no-sanity --no-kernels --engine llama-cpp:n_gpu_layers=99,flash_attn=1 --json $W/real-ngl99-fa.json
  $B/bin/llama-server -m $M -ngl 99 --host 127.0.0.1 --port 8093 -c 4096 -np 1 > $W/server-real.log 2>&1 &
  SP=$!
  for i in $(seq 60); do curl -sf 127.0.0.1:8093/health >/dev/null && break; sleep 0.5; done
  TAILN=25 step 150 real-http python3 -m ggufcheck diagnose $M --no-sanity --engine http://127.0.0.1:8093 --json $W/real-http.json
  kill $SP; wait $SP 2>/dev/null
  TAILN=25 step 150 real-hf-bf16 python3 -m ggufcheck diagnose $M --no-sanity --no-kernels --engine hf:bf16@cuda --device 0 --json $W/real-hf-bf16.json
fi

if has realquick; then  # SmolLM2 in process only (the readings that changed: chunked pair judged per path)
  cat .gpu/realA/* .gpu/realB/* > $W/models/smollm2.gguf && sha256sum $W/models/smollm2.gguf | cut -c1-16
  TAILN=30 step 150 real-ngl99 python3 -m ggufcheck diagnose $W/models/smollm2.gguf --no-sanity --engine llama-cpp:n_gpu_layers=99 --json $W/real-ngl99.json
fi

if has realhttp; then  # SmolLM2 through llama-server -ngl 99, judged with CUDA's rounding (?backend=cuda)
  cat .gpu/realA/* .gpu/realB/* > $W/models/smollm2.gguf && sha256sum $W/models/smollm2.gguf | cut -c1-16
  $B/bin/llama-server -m $W/models/smollm2.gguf -ngl 99 --host 127.0.0.1 --port 8093 -c 4096 -np 1 > $W/server-real.log 2>&1 &
  SP=$!
  for i in $(seq 60); do curl -sf 127.0.0.1:8093/health >/dev/null && break; sleep 0.5; done
  TAILN=25 step 200 real-http-cuda python3 -m ggufcheck diagnose $W/models/smollm2.gguf --no-sanity --engine "http://127.0.0.1:8093?backend=cuda" --json $W/real-http-cuda.json
  kill $SP; wait $SP 2>/dev/null
fi

if has oplead; then  # the SmolLM2 lead one product at a time: layer 0's Q4_1 products on the engine's own input
  cat .gpu/realA/* .gpu/realB/* > $W/models/smollm2.gguf && sha256sum $W/models/smollm2.gguf | cut -c1-16
  TAILN=16 step 40 oplead-ngl99 python3 tools/gpu/op_lead.py $W/models/smollm2.gguf --spec n_gpu_layers=99 --tokens 1 --tokens 16 --tokens 96
  # what the CUDA products should be if the q8_1 block sums are the cause (CPU emulation, same file)
  TAILN=8 step 40 q8emu python3 tools/gpu/q8_1_emulation.py $W/models/smollm2.gguf
fi

if has reallead; then  # the SmolLM2 lead (which layer / block makes CUDA prefill 5.8x further from fp64 than
  # the CPU) and the MoE / Q2_K chunked leads; most telling first
  cat .gpu/realA/* .gpu/realB/* > $W/models/smollm2.gguf && sha256sum $W/models/smollm2.gguf | cut -c1-16
  M=$W/models/smollm2.gguf
  TAILN=40 step 60 lead-ngl99 python3 tools/gpu/real_lead.py $M --spec n_gpu_layers=99 --prompt 3
  # the MoE chunked leads: the chunked path's MoE output is wrong at one token (same experts chosen);
  # chunks of 2..8 tokens take the matrix-vector MUL_MAT_ID kernels on sm_90, 9 the matrix-matrix ones
  python3 - <<'EOF2'
from ggufcheck.synthetic.tiny import build_tiny_gguf as b
d = dict(seed=3, n_embd=256, n_ff=512, n_ff_exp=256)
b("deepseek2", "/tmp/l20/models/ds2-q4k.gguf", qtypes="Q4_K", **d)
b("glm4moe", "/tmp/l20/models/fam-glm4moe.gguf", qtypes="Q4_K", **d)
EOF2
  TAILN=20 step 40 moe-ds2-f32-c5 env GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32 python3 tools/gpu/chunk_lead.py $W/models/ds2-q4k.gguf --chunk 5 --prompt 2 --worst 2 --runs 1 --trace-above 1
  for c in 9 8 2; do
    TAILN=4 step 40 moe-ds2-f32-c$c env GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32 python3 tools/gpu/chunk_lead.py $W/models/ds2-q4k.gguf --chunk $c --prompt 2 --worst 2 --runs 1 --trace-above 100
  done
  TAILN=20 step 40 moe-glm4moe-c5 python3 tools/gpu/chunk_lead.py $W/models/fam-glm4moe.gguf --chunk 5 --prompt 2 --worst 2 --runs 1 --trace-above 0.1
  TAILN=4 step 40 moe-glm4moe-c9 python3 tools/gpu/chunk_lead.py $W/models/fam-glm4moe.gguf --chunk 9 --prompt 2 --worst 2 --runs 1 --trace-above 100
  TAILN=10 step 45 re3-ds2-f32 env GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32 python3 -m ggufcheck diagnose --no-sanity --no-kernels --sweep-to 0 $W/models/ds2-q4k.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/re3-ds2-f32.json
  TAILN=10 step 45 re3-glm4moe python3 -m ggufcheck diagnose --no-sanity --no-kernels $W/models/fam-glm4moe.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/re3-glm4moe.json
  # Q2_K with a q8_0 K cache: one batch wrong, chunks of 5 right; batches of <= 8 take the
  # matrix-vector (MMVQ / FA vec) kernels that read q8_0 directly, 9 the batched ones
  TAILN=2 step 40 q2k-keep python3 -m ggufcheck quants --types Q2_K --engine llama-cpp:n_gpu_layers=99 --keep $W/models/qm
  for kv in "flash_attn=0,n_batch=8" "flash_attn=0,n_batch=9" "flash_attn=1,n_batch=8"; do
    TAILN=3 step 30 q2k-k8-$kv python3 -m ggufcheck diagnose --no-sanity --no-kernels --sweep-to 0 --decode-to 0 $W/models/qm/matrix-q2_k.gguf --engine llama-cpp:n_gpu_layers=99,type_k=8,$kv --json $W/q2k-k8-$kv.json
  done
  TAILN=40 step 60 lead-ngl99-cublas32 env GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32 python3 tools/gpu/real_lead.py $M --spec n_gpu_layers=99 --prompt 3
  TAILN=40 step 60 lead-ngl0 python3 tools/gpu/real_lead.py $M --spec n_gpu_layers=0 --prompt 3
  TAILN=40 step 60 lead-ngl99-fa python3 tools/gpu/real_lead.py $M --spec n_gpu_layers=99,flash_attn=1 --prompt 3
fi

if has envtime; then  # where the environment stage's time goes (imports, fatbinary parse, cuobjdump)
  step 120 envtime python3 -m ggufcheck env --device 0 --json $W/envtime.json
  python3 -c "import json; d=json.load(open('$W/envtime.json')); print([ (s['stage'], s['info'].get('time')) for s in d['stages']])"
fi

if has provenance; then { # issue 37 item 5: what a CUDA build says of the toolkit that compiled it
  nvcc --version | tail -2
  python3 -c "import json; from ggufcheck.probe.scripts.ggufcheck_build_info import llama_cpp_build as b; print(json.dumps(b('.gpu/site/llama_cpp')))"
  for f in $B/bin/libggml-cuda.so*; do [ -f "$f" ] || continue; echo "== $f"
    strings -n 8 "$f" | grep -i -m8 "cuda compilation tools\|nvcc\|V1[0-9]\.[0-9]*\.[0-9]" | cut -c1-200
    readelf -d "$f" | grep NEEDED
    python3 -c "import sys, json; sys.path.insert(0, 'src/ggufcheck/probe/scripts'); import ggufcheck_fatbin as f; r = f.scan_file(sys.argv[1]); print(json.dumps(r)[:1500])" "$f"
    python3 - "$f" <<'EOF2'
import sys, struct
sys.path.insert(0, "src/ggufcheck/probe/scripts")
import ggufcheck_fatbin as fb
with open(sys.argv[1], "rb") as f:
    secs = fb.elf_sections(f)
    off, size = secs.get(".nv_fatbin", (0, 0))
    f.seek(off); head = f.read(16 + 160)
    print("fatbin header + first entry header:", head.hex())
EOF2
  done
} 2>&1 | tee $W/provenance.log  # kept in results.tgz
fi

if has arith; then  # issue 36 item 1: each path against its stated arithmetic, at two widths
  grep -o -m1 "amx[a-z_0-9]*" /proc/cpuinfo | head -1 | sed 's/^/host CPU has: /'
  TAILN=45 step 200 ar-256 python3 -m ggufcheck quants --engine llama-cpp:n_gpu_layers=99 --json $W/ar-256.json
  TAILN=45 step 330 ar-1024 python3 -m ggufcheck quants --width 1024 --engine llama-cpp:n_gpu_layers=99 --json $W/ar-1024.json
fi

if has arithmore; then  # the same in routed experts (MUL_MAT_ID), with a q8_0 KV cache, and the Q5_K rows
  TAILN=45 step 120 ar-q5k python3 -m ggufcheck quants --types Q5_K,Q4_K,Q6_K --engine llama-cpp:n_gpu_layers=99 --json $W/ar-q5k.json
  TAILN=30 step 120 ar-q5k-1024 python3 -m ggufcheck quants --width 1024 --types Q5_K --engine llama-cpp:n_gpu_layers=99 --json $W/ar-q5k-1024.json
  TAILN=45 step 150 ar-moe python3 -m ggufcheck quants --arch qwen3moe --types F16,Q4_0,Q8_0,Q4_K,Q5_K,Q6_K,IQ4_XS --engine llama-cpp:n_gpu_layers=99 --json $W/ar-moe.json
  TAILN=30 step 120 ar-kvq8 python3 -m ggufcheck quants --types quick --engine llama-cpp:n_gpu_layers=99,flash_attn=1,type_k=8,type_v=8 --json $W/ar-kvq8.json
fi

if has f16moe; then  # F16 routed experts on a one-token step: 4797x their stated arithmetic (2026-12-07); which switch?
  variants=("" ",cuda_fusion=0" ",cuda_graphs=0" ",n_batch=8" ",cublas_f32=1")
  [ -n "${F16MOE_QUICK:-}" ] && variants=("")  # after the fix: the default, and the CPU control
  for v in "${variants[@]}"; do
    TAILN=14 step 60 "f16moe$v" python3 -m ggufcheck quants --arch qwen3moe --types F16,BF16,Q8_0 --engine "llama-cpp:n_gpu_layers=99$v" --json "$W/f16moe$v.json"
  done
  TAILN=14 step 60 f16moe-cpu python3 -m ggufcheck quants --arch qwen3moe --types F16,BF16,Q8_0 --engine llama-cpp:n_gpu_layers=0,isolate=1 --json $W/f16moe-cpu.json
fi

if has f16dense; then  # F16 dense prefill 10.7x its stated arithmetic at width 1024 (2026-12-07, unexplained): cuBLAS compute type?
  for v in "" ",cublas_f32=1" ",n_batch=8"; do
    TAILN=14 step 60 "f16dense$v" python3 -m ggufcheck quants --width 1024 --types F16,BF16,F32 --engine "llama-cpp:n_gpu_layers=99$v" --json "$W/f16dense$v.json"
  done
fi

if has floatpaths; then  # issue 36 item 1: F32 / F16 weights against the stated tensor-core paths (float_sums cuda:
  # TF32 operands past 3 tokens, cuBLAS's F16 compute type past 16), then the same with cuBLAS in f32 (the emulation
  # then over-states the F16 prefill: that row should read well under 1x) and the F16 experts
  TAILN=16 step 75 fp-1024 python3 -m ggufcheck quants --width 1024 --types F16,BF16,F32 --engine llama-cpp:n_gpu_layers=99 --json $W/fp-1024.json
  TAILN=16 step 60 fp-256 python3 -m ggufcheck quants --types F16,BF16,F32 --engine llama-cpp:n_gpu_layers=99 --json $W/fp-256.json
  TAILN=16 step 75 fp-1024-cublas32 python3 -m ggufcheck quants --width 1024 --types F16,F32 --engine llama-cpp:n_gpu_layers=99,cublas_f32=1 --json $W/fp-1024-cublas32.json
  TAILN=16 step 60 fp-moe python3 -m ggufcheck quants --arch qwen3moe --types F16,F32,Q8_0 --engine llama-cpp:n_gpu_layers=99 --json $W/fp-moe.json
fi

if has floatpaths2; then  # after tagging routed experts (mmf: tf32 at any count) and stating cublas_f32=1 (F16 as TF32)
  TAILN=16 step 60 fp2-moe python3 -m ggufcheck quants --arch qwen3moe --types F16,BF16,F32 --engine llama-cpp:n_gpu_layers=99 --json $W/fp2-moe.json
  TAILN=16 step 75 fp2-1024 python3 -m ggufcheck quants --width 1024 --types F16,BF16,F32 --engine llama-cpp:n_gpu_layers=99 --json $W/fp2-1024.json
  TAILN=16 step 75 fp2-1024-cublas32 python3 -m ggufcheck quants --width 1024 --types F16,F32 --engine llama-cpp:n_gpu_layers=99,cublas_f32=1 --json $W/fp2-1024-cublas32.json
  TAILN=16 step 75 fp2-1024-nb8 python3 -m ggufcheck quants --width 1024 --types F16,F32 --engine llama-cpp:n_gpu_layers=99,n_batch=8 --json $W/fp2-1024-nb8.json
fi

if has nmseds2; then  # the tiny deepseek2 Q4_K through the CUDA llama-server: logits.nmse 0.209 (one row's NMSE 98.7,
  # median 5e-6): the run saved (--save-run) to look at that row here and with the in-process engine beside it
  python3 -c "from ggufcheck.synthetic.tiny import build_tiny_gguf as b; b('deepseek2', '/tmp/l20/models/cs-ds2-Q4_K.gguf', seed=3, qtypes='Q4_K', n_embd=256, n_ff_exp=256, n_ff=512)"
  $B/bin/llama-server -m $W/models/cs-ds2-Q4_K.gguf -ngl 99 --host 127.0.0.1 --port 8095 -c 4096 -np 1 > $W/server-nmse.log 2>&1 &
  SP=$!
  for i in $(seq 60); do curl -sf 127.0.0.1:8095/health >/dev/null && break; sleep 0.5; done
  TAILN=8 step 70 nmse-http python3 -m ggufcheck diagnose $W/models/cs-ds2-Q4_K.gguf --no-sanity --no-kernels --engine "http://127.0.0.1:8095?backend=cuda" --save-run $OUT/nmse-http-run --json $W/nmse-http.json
  kill $SP; wait $SP 2>/dev/null
  TAILN=8 step 70 nmse-inproc python3 -m ggufcheck diagnose $W/models/cs-ds2-Q4_K.gguf --no-sanity --no-kernels --engine llama-cpp:n_gpu_layers=99 --json $W/nmse-inproc.json
  cp $W/models/cs-ds2-Q4_K.gguf $OUT/ 2>/dev/null; du -sh $OUT/*
fi

if has q4kmmq; then  # the defect build: the kernel matrix names the path; llama-server's cold prefill names prefill
  TAILN=14 step 90 q4k-quants python3 -m ggufcheck quants --types Q4_K,Q5_K,Q8_0 --engine llama-cpp:n_gpu_layers=99 --json $W/q4k-quants.json
  python3 -c "from ggufcheck.synthetic.tiny import build_tiny_gguf as b; b('llama', '/tmp/l20/models/d-Q4_K.gguf', seed=3, qtypes='Q4_K', n_embd=256, head_dim=64, n_ff=512)"
  $B/bin/llama-server -m $W/models/d-Q4_K.gguf -ngl 99 --host 127.0.0.1 --port 8096 -c 4096 -np 1 > $W/server-d.log 2>&1 &
  SP=$!
  for i in $(seq 60); do curl -sf 127.0.0.1:8096/health >/dev/null && break; sleep 0.5; done
  TAILN=14 step 90 q4k-server python3 -m ggufcheck diagnose $W/models/d-Q4_K.gguf --no-sanity --no-kernels --engine "http://127.0.0.1:8096?backend=cuda" --json $W/q4k-server.json
  python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print('  ', s['stage'], r['check'], r['status'], r.get('message','')[:300]) for s in d['stages'] for r in s.get('results',[]) if r['status'] in ('FAIL','ERROR') or r['check']=='paths.cold_prefill']" $W/q4k-server.json
  kill $SP; wait $SP 2>/dev/null
fi

if has row79; then  # the ds2 Q4_K row 79 (tools/gpu/row79.py; model and tokens carried in .gpu/row79)
  TAILN=40 step 200 row79 python3 tools/gpu/row79.py .gpu/row79/cs-ds2-Q4_K.gguf .gpu/row79/tokens.json $B/bin/llama-server
fi

if has floatpaths3; then  # after the source-read rules (TF32 cut in ggml's mma kernels, fused one-token gate / up,
  # BF16 with f32 results): the same rows as floatpaths2, each should land near 1x
  TAILN=16 step 60 fp3-moe python3 -m ggufcheck quants --arch qwen3moe --types F16,BF16,F32 --engine llama-cpp:n_gpu_layers=99 --json $W/fp3-moe.json
  TAILN=16 step 75 fp3-1024 python3 -m ggufcheck quants --width 1024 --types F16,BF16,F32 --engine llama-cpp:n_gpu_layers=99 --json $W/fp3-1024.json
  TAILN=16 step 60 fp3-256 python3 -m ggufcheck quants --types F16,BF16,F32 --engine llama-cpp:n_gpu_layers=99 --json $W/fp3-256.json
  TAILN=16 step 75 fp3-1024-nb8 python3 -m ggufcheck quants --width 1024 --types F16,BF16,F32 --engine llama-cpp:n_gpu_layers=99,n_batch=8 --json $W/fp3-1024-nb8.json
  TAILN=16 step 75 fp3-1024-cublas32 python3 -m ggufcheck quants --width 1024 --types F16,F32 --engine llama-cpp:n_gpu_layers=99,cublas_f32=1 --json $W/fp3-1024-cublas32.json
  TAILN=16 step 60 fp3-moe-nofusion python3 -m ggufcheck quants --arch qwen3moe --types F16,F32 --engine llama-cpp:n_gpu_layers=99,cuda_fusion=0 --json $W/fp3-moe-nofusion.json
fi

if has row79head; then  # the output layer, or its input? (tools/gpu/row79_head.py: the normed state and logits, ngl 99 vs 3)
  TAILN=10 step 200 row79head python3 tools/gpu/row79_head.py .gpu/row79/cs-ds2-Q4_K.gguf .gpu/row79/tokens.json
fi
if has row79bisect; then  # which setting makes row 79 healthy (tools/gpu/row79_bisect.py: fusion, graphs, FA, offload)
  TAILN=20 step 240 row79bisect python3 tools/gpu/row79_bisect.py .gpu/row79/cs-ds2-Q4_K.gguf .gpu/row79/tokens.json
fi

if has nb8; then  # issue 36: n_batch=8 with the piece size stated (ubatch): the mma kernels at 2-16 tokens
  TAILN=16 step 75 nb8-1024 python3 -m ggufcheck quants --width 1024 --types F16,BF16,F32 --engine llama-cpp:n_gpu_layers=99,n_batch=8 --json $W/nb8-1024.json
fi

if has fusionmoe; then  # routed F16 / F32 / BF16 experts with ggml-cuda's fusions off: is the 3.4x (F32) a fused kernel's?
  TAILN=16 step 60 moe-fused python3 -m ggufcheck quants --arch qwen3moe --types F16,BF16,F32 --engine llama-cpp:n_gpu_layers=99 --json $W/moe-fused.json
  GGML_CUDA_DISABLE_FUSION=1 TAILN=16 step 60 moe-nofusion python3 -m ggufcheck quants --arch qwen3moe --types F16,BF16,F32 --engine llama-cpp:n_gpu_layers=99 --json $W/moe-nofusion.json
fi

if has coldserver; then  # issue 37 item 2 on CUDA: llama-server -ngl 99, its batched prefill (paths.cold_prefill) vs its steps
  python3 - <<'EOF2'
from ggufcheck.synthetic.tiny import build_tiny_gguf as b
for q in ("Q4_K", "Q8_0", "F16"):
    b("llama", f"/tmp/l20/models/cs-{q}.gguf", seed=3, qtypes=q, n_embd=256, head_dim=64, n_ff=512)
b("deepseek2", "/tmp/l20/models/cs-ds2-Q4_K.gguf", seed=3, qtypes="Q4_K", n_embd=256, n_ff_exp=256, n_ff=512)
EOF2
  for m in cs-Q4_K cs-Q8_0 cs-F16 cs-ds2-Q4_K; do
    $B/bin/llama-server -m $W/models/$m.gguf -ngl 99 --host 127.0.0.1 --port 8094 -c 4096 -np 1 > $W/server-$m.log 2>&1 &
    SP=$!
    for i in $(seq 60); do curl -sf 127.0.0.1:8094/health >/dev/null && break; sleep 0.5; done
    TAILN=6 step 70 cold-$m python3 -m ggufcheck diagnose $W/models/$m.gguf --no-sanity --no-kernels --engine "http://127.0.0.1:8094?backend=cuda" --json $W/cold-$m.json
    python3 -c "import json,sys; d=json.load(open(sys.argv[1])); [print('  ', r['check'], r['status'], r.get('message','')[:240]) for s in d['stages'] for r in s.get('results',[]) if r['check'].startswith('paths.')]" $W/cold-$m.json
    kill $SP; wait $SP 2>/dev/null
  done
fi

if has switches; then  # issue 37 item 1: every llama.cpp switch flipped on the GPU (CUDA graphs, fusion included)
  python3 -c "from ggufcheck.synthetic.tiny import build_tiny_gguf as b; b('llama', '/tmp/l20/models/sw-q4k.gguf', seed=3, qtypes='Q4_K', n_embd=256, n_ff=512)"
  TAILN=30 step 200 switches python3 -m ggufcheck diagnose --no-sanity --no-kernels --sweep-to 0 --switches always $W/models/sw-q4k.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/switches.json
fi

if has matrix2; then  # the matrix quiet, then with llama.cpp's log on
  TAILN=30 step 100 quants-ngl99 python3 -m ggufcheck quants --engine llama-cpp:n_gpu_layers=99 --json $W/quants-ngl99.json
  TAILN=30 step 100 quants-ngl99-fa python3 -m ggufcheck quants --engine llama-cpp:n_gpu_layers=99,flash_attn=1 --json $W/quants-ngl99-fa.json
fi

if has matrix; then
  TAILN=30 step 150 quants-ngl99 python3 -m ggufcheck quants --engine llama-cpp:n_gpu_layers=99 --json $W/quants-ngl99.json
  TAILN=30 step 120 quants-ngl99-fa python3 -m ggufcheck quants --engine llama-cpp:n_gpu_layers=99,flash_attn=1 --json $W/quants-ngl99-fa.json
fi

if has lead; then  # issue 20's lead: tiny deepseek2 Q4_K, prefill disagrees on CUDA, decode agrees
  python3 - <<'EOF'
from ggufcheck.synthetic.tiny import build_tiny_gguf as b
b('deepseek2', '/tmp/l20/models/ds2-q4k.gguf', seed=3, qtypes='Q4_K', n_embd=256, n_ff_exp=256, n_ff=512)
b('deepseek2', '/tmp/l20/models/ds2-q80.gguf', seed=3, qtypes='Q8_0', n_embd=256, n_ff_exp=256, n_ff=512)
b('glm-dsa', '/tmp/l20/models/dsa-q4k.gguf', seed=3, qtypes='Q4_K', n_embd=256, n_ff_exp=256, n_ff=512)
EOF
  D="python3 -m ggufcheck diagnose --no-sanity --no-kernels --sweep-to 0"
  step 60 lead-ds2-gpu $D $W/models/ds2-q4k.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/lead-ds2-gpu.json
  step 60 lead-ds2-gpu-cublas32 env GGML_CUDA_CUBLAS_COMPUTE_TYPE=f32 $D $W/models/ds2-q4k.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/lead-ds2-gpu-cublas32.json
  step 60 lead-ds2-cpu $D $W/models/ds2-q4k.gguf --engine llama-cpp:isolate=1 --json $W/lead-ds2-cpu.json
  step 60 lead-ds2-q80-gpu $D $W/models/ds2-q80.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/lead-ds2-q80-gpu.json
  step 60 lead-dsa-gpu $D $W/models/dsa-q4k.gguf --engine llama-cpp:n_gpu_layers=99 --json $W/lead-dsa-gpu.json
fi

if has server; then  # llama-server over HTTP on the same models
  for m in ds2-q4k ds2-q80; do
    $B/bin/llama-server -m $W/models/$m.gguf -ngl 99 --host 127.0.0.1 --port 8091 -c 2048 -np 1 > $W/server-$m.log 2>&1 &
    SP=$!
    for i in $(seq 60); do curl -sf 127.0.0.1:8091/health >/dev/null && break; sleep 0.5; done
    curl -s 127.0.0.1:8091/completion -d '{"prompt":[1,2,3,4,5,6,7,8],"n_predict":4,"n_probs":3,"temperature":0,"return_tokens":true}' > $W/server-$m-raw.json
    head -c 1500 $W/server-$m-raw.json; echo
    step 90 http-$m python3 -m ggufcheck compare $W/models/$m.gguf --engine http://127.0.0.1:8091 --no-sanity --sweep-to 0 --decode-to 0 --json $W/http-$m.json
    kill $SP; wait $SP 2>/dev/null
  done
fi

if has oldlead; then  # the lead's own files (random blocks before the spread fix), carried in .gpu/models:
  # llama-server with the default cuBLAS compute type, then with f32 forced
  # as the lead ran it: the server's default slots (-np) and context
  for m in ds2-q4k-old; do for ct in auto; do
    GGML_CUDA_CUBLAS_COMPUTE_TYPE=$ct $B/bin/llama-server -m .gpu/models/$m.gguf -ngl 99 --host 127.0.0.1 --port 8092 > $W/server-$m-$ct.log 2>&1 &
    SP=$!
    for i in $(seq 60); do curl -sf 127.0.0.1:8092/health >/dev/null && break; sleep 0.5; done
    step 90 http-$m-$ct-defaults python3 -m ggufcheck compare .gpu/models/$m.gguf --engine http://127.0.0.1:8092 --no-sanity --sweep-to 0 --decode-to 0 --json $W/http-$m-$ct-defaults.json
    kill $SP; wait $SP 2>/dev/null
  done; done
fi

if has hf; then  # issue 20's hf lead: tiny glm-dsa in bf16 on CUDA, and where its time goes
  python3 -c "from ggufcheck.synthetic.tiny import build_tiny_gguf as b; b('glm-dsa', '/tmp/l20/models/dsa7.gguf', seed=7, qtypes='Q8_0', n_ff_exp=64)"
  step 120 hf-dsa7-bf16 python3 -m ggufcheck diagnose $W/models/dsa7.gguf --engine hf:bf16@cuda --device 0 --no-sanity --sweep-to 0 --json $W/hf-dsa7-bf16.json
fi
nvidia-smi --query-gpu=memory.used --format=csv,noheader
tar czf $OUT/results.tgz -C $W --exclude=models . && ls -la $OUT
echo "=== ALL DONE t=${SECONDS}s"
