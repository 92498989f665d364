#!/usr/bin/env bash
# One GPU run = one or more of these sections; each step has its own timeout so one hang cannot eat the run.
# Usage (on the GPU machine, repo root): bash bench/gpu_bench.sh SECTION...   (logs under $OUT when set)
# Section names (`s15-attn`, ...) are the commands that bench/results/*.md cite: keep them. Which sections each
# dated entry ran, in order:
#   pipeline.md 2026-11-29: `verify pipeline-triton`, `verify-pipeline pipeline-triton step8b-more` (the ten cold
#     two-drafter runs again after the stream fix), `verify-pipeline pipeline-8b`; `env pipeline-transfer`
#     (features via the device vs via pinned host memory), `pipeline-recheck`; step.md: `auto-kernels`.
#   step.md 2026-12-01: `env profile dist-small`, then `step8b-adamw attn-tune dist-8b`.
#   step.md 2026-12-02 "The 8B seed step toward 56% MFU": `env s8-attn s8-step`, `s8-attn2 s8-step2`,
#     `s8-attn2 s8-confirm` (the interval-form BlockMask, compiled context/output, flex options).
#   step.md 2026-12-02 "The last 8-15 ms of the 8B seed step": `env s9-attn s9-step` (fused projections, attention
#     input layouts, Inductor's code of the layer), `s9-step2 s9-27b` (gate/up interleaved, flex's output gradient
#     contiguous), `s9-step3 s9-27b` (the earlier form against the new, twice each, interleaved against the GPU's
#     drift), `s9-clocks s9-27b`, `s9-final s9-27b` (the anchor slot's logits no longer computed) twice, `s9-chunks`
#     (its c6k and c8k at 6176 and 8224 rows), `s9-chunks2` (6144 rows as the default against the old sizing,
#     `triton-c4k`, run at b479183; the default went back to 4096 rows after it and triton-c4k is gone).
#   kernels.md 2026-12-04 (issue 32 item 4, issue 31 item 2): `env s13-topk s13-step`, `s13-conv s13-step2`,
#     `s13-conv` (twice, the second with s13-step3 gated on it), `s13-attn`; `env s15-attn`, then `s15-attn` (with
#     the ~99 KB rehearsal); `s15-topk s15-step`, then `s15-step2`.
#   pipeline.md 2026-12-04 (issue 31 items 3-4): `env s15-sf`, `s15-2`, `s15-wait`; `s15-next` (run 2026-12-05).
#   kernels.md 2026-12-05: `s17-attn` (at d2278b9; since then the split forward and `tma,tfo` are the defaults, and
#     the bench times the masked forward beside the default one); `s17-conv`, then `s17-conv2`; `s17-target`,
#     `s18-attn`, `s18-verify`; prepared, not run yet: `s19-convin`, and `s19-seeds` then `s19-pipe` (one
#     `s19-attn` would exceed a 600 s run).
set -u
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-cache
OUT=${OUT:-/tmp/bench-out}; mkdir -p "$OUT"
step() {  # step NAME TIMEOUT CMD...
  local name=$1 limit=$2; shift 2
  echo "=== $name ($(date +%T))" >&2
  local t0=$SECONDS
  timeout "$limit" "$@" >"$OUT/$name.log" 2>&1; local rc=$?
  echo "=== $name rc=$rc in $((SECONDS - t0)) s ($(date +%T))" >&2
  tail -n 25 "$OUT/$name.log"
}
for section in "$@"; do
  case $section in
    # 2026-12-02 (issue 28): the restart cycle through the CLI with the shared compile cache, which the trainer
    # chooses itself (trainer/core/compile_cache.py) only when TORCHINDUCTOR_CACHE_DIR is not set by hand.
    s10-cycle) step s10-cycle 560 env -u TORCHINDUCTOR_CACHE_DIR python3 bench/restart_cycle.py --steps 10 \
              --modes handover,code-change-outside,code-change-inside,handover,bad-code,bad-flag --fresh-workspace \
              --prune-checkpoints --json-out "$OUT/s10-cycle.json" ;;
    # 2026-12-03 (issue 28's missed goal): a cold deploy, one restart inside the compiled code (two code versions'
    # artifacts saved), then a deploy into a fresh workspace given only the artifacts folder, standby on.
    s11-fresh) step s11-fresh 300 env -u TORCHINDUCTOR_CACHE_DIR python3 bench/restart_cycle.py --steps 10 \
              --modes code-change-inside --fresh-workspace --prune-checkpoints --json-out "$OUT/s11-fresh.json" ;;
    # 2026-12-03 (issue 31): our Triton interval attention vs flex (parity, fwd/bwd), the ~100 KB shared-memory
    # rehearsal (DFLASH_SMEM_LIMIT=99K), the specforge shape's step (flex vs triton attention, interleaved).
    s12-attn) step s12-attn 300 python3 bench/attention_vs_flex.py --ref-dir "$OUT"
            step s12-fit 150 env DFLASH_SMEM_LIMIT=99K python3 bench/attention_vs_flex.py --fit-only --ref-dir "$OUT" ;;
    s12-specforge) step s12-specforge 330 python3 -m trainer bench step --preset qwen3-8b --shape specforge \
              --variants triton,triton-attn,triton,triton-attn --iters 10 --warmup 3 --profile \
              --json-out "$OUT/s12-specforge.json" ;;
    s12-seed) step s12-seed 420 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,triton-attn,triton,triton-attn --iters 5 --warmup 2 --json-out "$OUT/s12-seed.json" ;;
    # 2026-12-04 (issue 32 item 4): DFlash2's top-k inside the fused CE kernel (parity and cost on one chunk),
    # then DFlash vs DFlash2 at the qwen3-8b seed shape, interleaved, each profiled after timing.
    s13-topk) step s13-topk 200 python3 bench/topk_cost.py ;;
    s13-step) step s13-step 420 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,dflash2,triton,dflash2 --iters 5 --warmup 2 --profile --json-out "$OUT/s13-step.json" ;;
    # then the convolutions through trainer/kernels/conv_triton.py: parity and cost of one, then in the step
    s13-conv) step s13-conv 150 python3 bench/conv_triton_cost.py --best-out "$OUT/conv-best.txt" ;;
    # only when s13-conv found a backward config faster than Inductor's: the step with it
    s13-step3) [ -s "$OUT/conv-best.txt" ] && step s13-step3 450 \
              env DFLASH_CONV_TRITON_BWD="$(cat "$OUT/conv-best.txt")" python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,dflash2-conv,triton,dflash2-conv --iters 5 --warmup 2 --profile \
              --json-out "$OUT/s13-step3.json" ;;
    s13-step2) step s13-step2 450 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,dflash2-conv,triton,dflash2-conv,dflash2 --iters 5 --warmup 2 --profile \
              --json-out "$OUT/s13-step2.json" ;;
    # issue 31 item 2's in-step fault (q/k fp32 from the norms, v bf16): our Triton attention inside the compiled step
    s13-attn) step s13-attn 300 python3 -m trainer bench step --preset qwen3-8b --shape specforge \
              --variants triton,triton-attn,triton,triton-attn --iters 10 --warmup 3 --json-out "$OUT/s13-attn.json" ;;
    # 2026-12-04 (issue 31 item 1): q and k reach flex_attention in fp32 (RMSNorm's fp32 weight promotes under
    # autocast): the step with them cast to v's bf16 (variant triton-qkv16), A B A B, seed then specforge shape.
    # No difference (bench/results/kernels.md 2026-12-04 "q and k reach flex_attention in float32"): the variant is gone again; the section stays as the record.
    s14-qk) step s14-dtype 60 python3 -c 'import torch; from trainer.model.drafter import RMSNorm
n = RMSNorm(128, 1e-6).cuda(); x = torch.randn(4, 128, device="cuda", dtype=torch.bfloat16)
with torch.autocast("cuda", dtype=torch.bfloat16): print("RMSNorm out under autocast:", n(x).dtype)'
            step s14-seed 300 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,triton-qkv16,triton,triton-qkv16 --iters 5 --warmup 2 --json-out "$OUT/s14-seed.json"
            step s14-specforge 200 python3 -m trainer bench step --preset qwen3-8b --shape specforge \
              --variants triton,triton-qkv16,triton,triton-qkv16 --iters 10 --warmup 3 --json-out "$OUT/s14-sf.json" ;;
    # 2026-12-04 (issue 31 item 2): backward schedules of our interval attention against flex (parity, registers,
    # timing at both shapes), then the step with the fastest correct schedule only where our fwd + bwd beat
    # flex's standalone (bench/attention_bwd_schedules.py writes the gate file).
    s15-attn) step s15-bwd 200 python3 bench/attention_bwd_schedules.py --json-out "$OUT/s15-bwd.json" \
              --best-out "$OUT/s15-best.txt"
              if [ -s "$OUT/s15-best.txt" ]; then
                export DFLASH_ATTENTION_BWD_CONFIG=$(cat "$OUT/s15-best.txt")
                step s15-seed 170 python3 -m trainer bench step --preset qwen3-8b --shape seed \
                  --variants triton,triton-attn,triton,triton-attn --iters 5 --warmup 2 --json-out "$OUT/s15-seed.json"
                step s15-specforge 90 python3 -m trainer bench step --preset qwen3-8b --shape specforge \
                  --variants triton,triton-attn,triton,triton-attn --iters 10 --warmup 3 --json-out "$OUT/s15-sf.json"
              else echo "s15: gate closed (no schedule beats flex standalone): no step"; fi
              step s15-fit 60 env -u DFLASH_ATTENTION_BWD_CONFIG DFLASH_SMEM_LIMIT=99K python3 bench/attention_vs_flex.py \
                --fit-only ;;
    # 2026-12-05 (issue 31 item 2): the backward's 2026-12-04 schedules against dQ transposed ("t"), the scale
    # folded into P ("f") and the matmuls reordered ("o"), and the forward walking its full tiles unmasked, three
    # interleaved rounds; the seed step A B A B (flex against ours with the fastest correct backward and, where it
    # won standalone, the split forward) when the gate opens; then the ~99 KB rehearsal of the new one-stage rung.
    s17-attn) step s17-bwd 220 python3 bench/attention_bwd_schedules.py --rounds 3 --json-out "$OUT/s17-bwd.json" \
              --best-out "$OUT/s17-best.txt" --split-out "$OUT/s17-split.txt" \
              --variants none,tma,tma-s1,atomic,tma-f,tma-t,tma-tf,tma-o,tma-tfo,tma-tf-s3,tma-tf-s1,atomic-tf
              if [ -s "$OUT/s17-best.txt" ]; then
                step s17-seed 150 env DFLASH_ATTENTION_BWD_CONFIG="$(cat "$OUT/s17-best.txt")" \
                  DFLASH_ATTENTION_FWD_SPLIT="$(cat "$OUT/s17-split.txt")" python3 -m trainer bench step \
                  --preset qwen3-8b --shape seed --variants triton,triton-attn,triton,triton-attn --iters 5 --warmup 2 \
                  --json-out "$OUT/s17-seed.json"
              else echo "s17: the gate is closed: no step"; fi
              step s17-fit 45 env DFLASH_ATTENTION_BWD_CONFIG=128,64,8,1,tma,tf DFLASH_SMEM_LIMIT=99K \
                python3 bench/attention_vs_flex.py --fit-only ;;
    # 2026-12-05 (issue 31 items 1, 4): our attention as the default on Hopper (`--attention-kernel auto`): the
    # one-GPU specforge pipeline flex against auto A B A B (the threaded pipeline never ran our kernel), then the
    # qwen3-8b and qwen3.6-27b seed steps flex (`triton`) against ours (`triton-attn`), interleaved
    # (`s19-pipe s19-seeds` in one run would be ~680 s at the steps' limits, over a 600 s run: two runs)
    s19-pipe) step s19-pipe 340 python3 bench/gpu_pipeline.py --scale specforge --modes dual --steps 60 \
                --adamw triton --attention-kernel flex,auto --repeats 2 --warm-cache --timeout-s 200 --budget-s 300 \
                --log-dir "$OUT/pipeline-logs" ;;
    s19-seeds) step s19-seed 170 python3 -m trainer bench step --preset qwen3-8b --shape seed \
                --variants triton,triton-attn,triton,triton-attn --iters 5 --warmup 2 --json-out "$OUT/s19-seed.json"
              step s19-27b 170 python3 -m trainer bench step --preset qwen3.6-27b --shape seed \
                --variants triton,triton-attn,triton,triton-attn --iters 3 --warmup 2 --json-out "$OUT/s19-27b.json" ;;
    # 2026-12-05 (issue 31 items 2, 4, 5): rung 0's schedule with `o` on other tiles and the ~99 KB candidates
    # (two rounds, no step), then the specforge step flex against ours with the 2026-12-05 defaults, A B A B
    s18-attn) step s18-bwd 150 python3 bench/attention_bwd_schedules.py --rounds 2 --json-out "$OUT/s18-bwd.json" \
              --variants tma,tma-tfo,tma-tfo-s3,tma-tfo-s1,tma-m32-tfo,tma-m32-tfo-s1,tma-n64-o-s1,tma-n64-w4-tfo,tma-s1
              step s18-specforge 150 python3 -m trainer bench step --preset qwen3-8b --shape specforge \
                --variants triton,triton-attn,triton,triton-attn --iters 10 --warmup 3 --json-out "$OUT/s18-sf.json" ;;
    # 2026-12-05: --target-compile auto (on for a CUDA target) as the default: the taps of the eager and the compiled
    # bf16 target against the same weights in fp32 (specforge shape; the seed shape last), then the small pipeline single and dual through the
    # defaults (the single engine compiles the target at its first step, the pipeline in its warm-up)
    s18-verify) step s18-prefill-sf 120 python3 -m trainer bench pipeline --preset qwen3-8b --shape specforge \
                --target-intermediate 12288 --iters 10 --warmup 3 --target-compile --target-only
              step s18-pipeline 200 python3 bench/gpu_pipeline.py --scale small --modes single,dual --steps 100 \
                --timeout-s 150 --budget-s 180 --log-dir "$OUT/pipeline-logs"
              step s18-prefill-seed 140 python3 -m trainer bench pipeline --preset qwen3-8b --shape seed \
                --target-intermediate 12288 --iters 3 --warmup 1 --target-compile --target-only ;;
    # 2026-12-04 (issue 31 items 3-4): the optimizer step alone (torch's fused AdamW vs trainer/kernels/adamw_triton.py),
    # the specforge step with and without it (per call and back to back, profiled), the one-GPU pipeline at the
    # specforge shape (full-depth random Qwen3-8B target, two drafter threads).
    s15-sf) step s15-adamw 100 python3 bench/adamw_cost.py --iters 10 --configs 4096:8,2048:4,8192:8
            step s15-step 200 python3 -m trainer bench step --preset qwen3-8b --shape specforge \
              --variants triton,triton-adamw,triton,triton-adamw --iters 10 --warmup 3 --profile \
              --json-out "$OUT/s15-step.json"
            step s15-pipe 200 python3 bench/gpu_pipeline.py --scale specforge --modes dual --steps 40 --timeout-s 190 ;;
    # run 2: the AdamW parity again (IEEE div/sqrt), the pipeline with replica followers (fused vs triton AdamW, one
    # shared compile cache), the qwen3-8b seed step with and without --adamw triton (issue 31 item 1)
    s15-2) step s15-adamw2 60 python3 bench/adamw_cost.py --iters 10 --configs 4096:8,2048:4
           step s15-pipe2 170 python3 bench/gpu_pipeline.py --scale specforge --modes dual --steps 30 \
              --adamw auto,triton --warm-cache --timeout-s 120
           step s15-seed 100 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,triton-adamw --iters 5 --warmup 2 --json-out "$OUT/s15-seed.json" ;;
    # next (not run on 2026-12-04): the target's forward alone at the specforge shape (the pipeline's unmeasured
    # ~90 ms per step), and the pipeline A B A B with torch's fused AdamW against --adamw triton, 100 steps each
    s15-next) step s15-prefill 150 python3 -m trainer bench pipeline --preset qwen3-8b --shape specforge \
              --target-intermediate 12288 --iters 10 --warmup 3
              step s15-pipe3 420 python3 bench/gpu_pipeline.py --scale specforge --modes dual --steps 100 \
              --adamw auto,triton --repeats 2 --warm-cache --timeout-s 200 ;;
    # 2026-12-05 (issue 31 item 4): the target's layers through one compiled call (--target-compile): the prefill
    # alone eager vs compiled (and the taps' difference), then the specforge pipeline A B A B, triton AdamW
    s17-target) step s17-prefill 200 python3 -m trainer bench pipeline --preset qwen3-8b --shape specforge \
              --target-intermediate 12288 --iters 10 --warmup 3 --target-compile
              step s17-pipe 420 python3 bench/gpu_pipeline.py --scale specforge --modes dual --steps 80 \
              --adamw triton --target-compile off,on --repeats 2 --warm-cache --timeout-s 200 --budget-s 380 ;;
    # 2026-12-04 (issue 32 item 4): the DFlash2 convolutions' hand-written backward (GroupedDynamicConv) against
    # the 2026-12-04 form (dflash2-autograd), DFlash between, profiled; and the in-kernel top-16 by tile width.
    s15-topk) step s15-topk 120 python3 bench/topk_tiles.py ;;
    s15-step) step s15-step 420 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,dflash2,dflash2-autograd,triton,dflash2 --iters 5 --warmup 2 --profile \
              --json-out "$OUT/s15-step.json" ;;
    # then the confirmation with the top-16 kernel at 2048:4 and the selector's projection before the slot-0 drop,
    # and one experiment: Inductor's N-D tiling for the element-wise kernels (dflash2-nd)
    s15-step2) step s15-step2 420 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,dflash2,dflash2-nd,triton,dflash2 --iters 5 --warmup 2 --profile \
              --json-out "$OUT/s15-step2.json" ;;
    # 2026-12-05 (issue 32 item 4): the output-side convolution's backward as one Triton kernel
    # (trainer/kernels/conv_bwd_triton.py) against Inductor's, one layer call's shapes (parity, cost, the config ladder; the
    # fastest rung goes first in the step), then the seed step A B A B with Inductor's backward as the third form
    # 2026-12-05 (issue 32 item 4): the input-side convolution's kernel gradients (trainer/kernels/conv_in_triton.py):
    # one call's parity and cost with its ladder, then the seed step A B A B: the kernel (dflash2-tin) against the
    # default input side (dflash2: Inductor's)
    s19-convin) step s19-convin 120 python3 bench/conv_in_cost.py --iters 20 --best-out "$OUT/s19-best.txt"
              export DFLASH_CONV_IN_CONFIG="$(cat "$OUT/s19-best.txt" 2>/dev/null)"  # the sweep's best rung first
              echo "DFLASH_CONV_IN_CONFIG=$DFLASH_CONV_IN_CONFIG" >&2
              step s19-step 360 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,dflash2-tin,dflash2,triton,dflash2-tin,dflash2 --iters 5 --warmup 2 --profile \
              --json-out "$OUT/s19-step.json"
              unset DFLASH_CONV_IN_CONFIG ;;
    s17-conv) step s17-conv 150 python3 bench/conv_bwd_cost.py --iters 20 --best-out "$OUT/s17-best.txt"
              export DFLASH_CONV_BWD_CONFIG="$(cat "$OUT/s17-best.txt" 2>/dev/null)"
              echo "DFLASH_CONV_BWD_CONFIG=$DFLASH_CONV_BWD_CONFIG" >&2
              step s17-step 330 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,dflash2,dflash2-ibwd,triton,dflash2 --iters 5 --warmup 2 --profile \
              --json-out "$OUT/s17-step.json"
              unset DFLASH_CONV_BWD_CONFIG ;;
    # run 2: the coefficient left unrounded (Inductor's semantics), parity and a wider ladder, no step
    s17-conv2) step s17-conv2 120 python3 bench/conv_bwd_cost.py --iters 20 ;;
    # 2026-12-04: the one-GPU specforge pipeline with the replica sync waiting on the whole device
    # (every sync also waited for the target thread's forward) against its own stream only ($DFLASH_SYNC_WAIT), A B A B
    s15-wait) step s15-wait 400 python3 bench/gpu_pipeline.py --scale specforge --modes dual --steps 50 \
              --sync-wait device,stream --repeats 2 --warm-cache --timeout-s 150 --budget-s 330 ;;
    env) nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
         python3 -c 'import torch, triton, transformers; print(torch.__version__, triton.__version__, transformers.__version__)' ;;
    parity) step parity 240 python3 bench/gpu_parity.py ;;
    parity-drafter) step parity-drafter 100 python3 bench/gpu_parity.py --drafter-only --no-timing ;;
    attention) step attention 240 python3 -m trainer bench attention --preset qwen3-8b --shape seed --iters 10 ;;
    loss) step loss 240 python3 -m trainer bench loss --preset qwen3-8b --shape seed --iters 10 ;;
    step8b) step step8b 420 python3 -m trainer bench step --preset qwen3-8b --shape seed,recipe \
              --variants compiled,eager,unsorted,ckpt-loss --iters 8 --warmup 3 --json-out "$OUT/step8b.json" ;;
    step8b-quick) TORCH_LOGS=recompiles step step8b-quick 280 python3 -m trainer bench step --preset qwen3-8b \
              --shape seed --variants compiled,eager --iters 5 --warmup 2 --json-out "$OUT/step8b.json" ;;
    step27b) step step27b 420 python3 -m trainer bench step --preset qwen3.6-27b --shape seed,recipe \
              --variants compiled,soft,act-ckpt --iters 6 --warmup 3 --json-out "$OUT/step27b.json" ;;
    step8b-diag) step step8b-diag 270 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants eager,compiled --iters 3 --warmup 1 --stacks-every 60 --json-out "$OUT/step8b.json" ;;
    step8b-more) step step8b-more 150 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants soft,cap,ckpt-loss --iters 5 --warmup 2 --json-out "$OUT/step8b-more.json" ;;
    benchpipe) step benchpipe 130 python3 -m trainer bench pipeline --preset qwen3-8b --shape recipe \
              --target-intermediate 12288 --iters 5 --warmup 2 ;;
    pipeline) step pipeline 480 python3 bench/gpu_pipeline.py ;;
    pipeline-pair) step pipeline-pair 330 python3 bench/gpu_pipeline.py --modes single,dual --steps 200 --timeout-s 320 ;;
    pipeline-small-pair) step pipeline-small-pair 300 python3 bench/gpu_pipeline.py --scale small --modes single,dual \
              --steps 200 --timeout-s 150 --budget-s 150 ;;
    loss-triton) step loss-triton 100 python3 bench/loss_gemm.py --device cuda --rows 32832 --hidden 4096 --vocab 151936 \
              --block-size 32 --chunks 1728,4096 --kernels compiled,triton --terms ce --profile ;;
    verify) step step8b-quick 200 python3 -m trainer bench step --preset qwen3-8b --shape seed --variants compiled,triton \
              --iters 5 --warmup 2 --json-out "$OUT/step8b.json" ;&
    verify-pipeline) step pipeline-ten 300 python3 bench/gpu_pipeline.py --scale small --modes dual --repeats 10 --parallel 5 \
              --steps 200 --timeout-s 200 --budget-s 150 --log-dir /tmp/pipeline-logs ;;
    pipeline-triton) step pipeline-triton 170 python3 bench/gpu_pipeline.py --scale small --modes single,dual \
              --loss-kernels triton --steps 200 --timeout-s 140 --log-dir /tmp/pipeline-logs ;;
    pipeline-8b) step pipeline-8b 240 python3 bench/gpu_pipeline.py --scale 8b --modes single,dual --steps 50 \
              --timeout-s 200 --log-dir /tmp/pipeline-logs ;;
    pipeline-transfer) step pipeline-transfer-8b 260 python3 bench/gpu_pipeline.py --scale 8b --modes dual \
              --transfers device,pinned --steps 50 --timeout-s 240 --log-dir /tmp/pipeline-logs
            step pipeline-transfer-small 170 python3 bench/gpu_pipeline.py --scale small --modes dual \
              --transfers device,pinned --steps 200 --timeout-s 160 --log-dir /tmp/pipeline-logs ;;
    pipeline-recheck) step pipeline-small-compiled 150 python3 bench/gpu_pipeline.py --scale small --modes single,dual \
              --steps 200 --timeout-s 140 --budget-s 100 --log-dir /tmp/pipeline-logs
            step pipeline-small-triton 150 python3 bench/gpu_pipeline.py --scale small --modes single,dual \
              --loss-kernels triton --steps 200 --timeout-s 140 --budget-s 100 --log-dir /tmp/pipeline-logs
            step pipeline-ten-triton 270 python3 bench/gpu_pipeline.py --scale small --modes dual --repeats 10 \
              --parallel 5 --loss-kernels triton --steps 200 --timeout-s 200 --budget-s 140 --log-dir /tmp/pipeline-ten ;;
    auto-kernels) python3 -c 'import torch; from trainer.training.loss import resolve_loss_kernels as r; d = torch.device("cuda:0"); print("auto resolves to", r("auto", d, True), "(eager drafter:", r("auto", d, False) + ")")'
            step pipeline-auto 150 python3 bench/gpu_pipeline.py --scale small --modes dual --steps 200 --timeout-s 140 \
              --log-dir /tmp/pipeline-auto
            grep -h "loss kernels" /tmp/pipeline-auto/*.log ;;
    profile) step profile-8b 300 python3 -m trainer bench step --preset qwen3-8b --shape seed --variants triton \
              --iters 5 --warmup 2 --profile --json-out "$OUT/profile8b.json"
            step profile-27b 300 python3 -m trainer bench step --preset qwen3.6-27b --shape seed --variants triton \
              --iters 4 --warmup 2 --profile --json-out "$OUT/profile27b.json" ;;
    step8b-adamw) step step8b-adamw 200 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,triton-foreach --iters 5 --warmup 2 --json-out "$OUT/step8b-adamw.json" ;;
    attn-tune) step attn-tune 240 python3 -m trainer bench attention --preset qwen3-8b --shape seed --layers full \
              --orders sorted --iters 5 --warmup 2 --flex-options "default;BLOCK_M1=64,BLOCK_N1=128,BLOCK_M2=128,BLOCK_N2=64,num_warps=8,num_stages=3;BLOCK_M1=32,BLOCK_N1=128,BLOCK_M2=128,BLOCK_N2=32,num_warps=4,num_stages=3;BLOCK_M1=64,BLOCK_N1=64,BLOCK_M2=64,BLOCK_N2=64,num_warps=4,num_stages=3;BLOCK_M1=64,BLOCK_N1=128,BLOCK_M2=128,BLOCK_N2=64,num_warps=8,num_stages=2;BLOCK_M1=32,BLOCK_N1=64,BLOCK_M2=64,BLOCK_N2=32,num_warps=4,num_stages=4" ;;
    loss-kl) step loss-kl 330 python3 bench/loss_gemm.py --device cuda --rows 32832 --hidden 4096 --vocab 151936 \
              --block-size 32 --chunks 4096,1728 --kernels compiled,triton --terms ce,ce-kl,ce-kl-cap \
              --kl-triton-configs 1024:4:0,2048:4:0,2048:8:0,512:4:0,4096:16:0,4096:16:1 --repeats 5 --profile ;;
    s8-attn) step s8-attn-predicate 150 python3 -m trainer bench attention --preset qwen3-8b --shape seed --layers full \
              --orders sorted --mask-forms predicate --iters 5 --warmup 2
            step s8-attn-intervals 300 python3 -m trainer bench attention --preset qwen3-8b --shape seed --layers full \
              --orders sorted --mask-forms intervals --iters 5 --warmup 2 \
              --flex-options "default;USE_TMA=true;PRESCALE_QK=true;fwd_BLOCK_N=128,fwd_num_stages=2" ;;
    s8-step) step s8-step 330 python3 -m trainer bench step --preset qwen3-8b --shape seed --variants triton-s7,triton \
              --iters 5 --warmup 2 --profile --json-out "$OUT/s8-step.json" ;;
    s8-attn2) step s8-attn2 150 python3 -m trainer bench attention --preset qwen3-8b --shape seed --layers full \
              --orders sorted --mask-forms intervals --iters 5 --warmup 2 ;;
    s8-step2) step s8-step2 200 python3 -m trainer bench step --preset qwen3-8b --shape seed --variants triton \
              --iters 5 --warmup 2 --profile --json-out "$OUT/s8-step2-profile.json"
            step s8-step2-variants 330 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton-s7,triton,triton-nopad,triton-ctx32,triton-noprologue --iters 5 --warmup 2 \
              --json-out "$OUT/s8-step2.json"
            step s8-step2-27b 200 python3 -m trainer bench step --preset qwen3.6-27b --shape seed --variants triton \
              --iters 4 --warmup 2 --json-out "$OUT/s8-step2-27b.json" ;;
    s8-confirm) step s8-confirm 330 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,triton,triton --iters 7 --warmup 3 --json-out "$OUT/s8-confirm.json" ;;
    s9-attn) step s9-attn 200 python3 -m trainer bench attention --preset qwen3-8b --shape seed --layers full \
              --orders sorted --layouts bhsd,bshd --iters 5 --warmup 2 ;;
    # s9-step and s9-step2 ran at 9cff5bb and 9633018; their fused-projection variants are gone since.
    s9-step) TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-s9 step s9-step 420 python3 -m trainer bench step --preset qwen3-8b \
              --shape seed --variants triton-sepproj,triton --iters 5 --warmup 2 --profile --json-out "$OUT/s9-step.json"
            # Inductor's output code of the newest (fused, default) layer graphs, forward and backward
            code=$(grep -rl --include='*.py' -e "def call(" /tmp/inductor-s9)
            bwd=$(grep -l flex_attention_backward $code | xargs ls -t | head -1)
            fwd=$(grep -l flex_attention $code | xargs grep -L flex_attention_backward | xargs ls -t | head -1)
            cp "$bwd" "$OUT/layer-backward.py"; cp "$fwd" "$OUT/layer-forward.py"; ls -la "$OUT" ;;
    s9-step2) TORCHINDUCTOR_CACHE_DIR=/tmp/inductor-s9 step s9-step2 480 python3 -m trainer bench step --preset qwen3-8b \
              --shape seed --variants triton-sepproj,triton-dobshd,triton-sepmlp,triton --iters 5 --warmup 2 --profile \
              --json-out "$OUT/s9-step2.json"
            code=$(grep -rl --include='*.py' -e "def call(" /tmp/inductor-s9)
            cp "$(grep -l flex_attention_backward $code | xargs ls -t | head -1)" "$OUT/layer-backward.py" ;;
    s9-27b) step s9-27b 200 python3 -m trainer bench step --preset qwen3.6-27b --shape seed --variants triton \
              --iters 4 --warmup 2 --json-out "$OUT/s9-27b.json" ;;
    s9-step3) step s9-step3 480 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton-s8,triton,triton-s8,triton --iters 5 --warmup 2 --profile --json-out "$OUT/s9-step3.json" ;;
    s9-clocks) # SM clock, power and throttle reasons every 200 ms while one attention layer runs alone, then the step
            nvidia-smi --query-gpu=timestamp,clocks.sm,power.draw,temperature.gpu,clocks_throttle_reasons.active \
              --format=csv -lms 200 >"$OUT/clocks.csv" & smi=$!
            step s9-attn-clocks 150 python3 -m trainer bench attention --preset qwen3-8b --shape seed --layers full \
              --orders sorted --layouts bhsd,bshd --iters 20 --warmup 2
            step s9-step3 480 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton-s8,triton,triton-s8,triton --iters 5 --warmup 2 --profile --json-out "$OUT/s9-step3.json"
            kill $smi ;;
    s9-final) step s9-final 480 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton-s8,triton,triton-s8,triton --iters 5 --warmup 2 --profile --json-out "$OUT/s9-final.json" ;;
    s9-confirm) step s9-confirm 330 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,triton,triton --iters 7 --warmup 3 --json-out "$OUT/s9-confirm.json" ;;
    s9-chunks) step s9-chunks 400 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton,triton-c8k,triton-c6k,triton,triton-c8k --iters 5 --warmup 2 --json-out "$OUT/s9-chunks.json" ;;
    s9-chunks2) step s9-chunks2-8b 200 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants triton-c4k,triton,triton-c4k,triton --iters 5 --warmup 2 --json-out "$OUT/s9-chunks2-8b.json"
            step s9-chunks2-27b 200 python3 -m trainer bench step --preset qwen3.6-27b --shape seed \
              --variants triton-c4k,triton --iters 4 --warmup 2 --json-out "$OUT/s9-chunks2-27b.json" ;;
    step8b-soft) step step8b-soft 200 python3 -m trainer bench step --preset qwen3-8b --shape seed \
              --variants soft,soft-triton --iters 5 --warmup 2 --json-out "$OUT/step8b-soft.json" ;;
    dist-small) step dist-small 260 python3 bench/gpu_pipeline.py --scale small --modes dual --engines threaded,dist \
              --steps 200 --timeout-s 200 --budget-s 200 --log-dir /tmp/pipeline-dist ;;
    dist-8b) step dist-8b 330 python3 bench/gpu_pipeline.py --scale 8b --modes dual --engines threaded,dist \
              --steps 50 --timeout-s 240 --budget-s 260 --log-dir /tmp/pipeline-dist ;;
    pipeline-small) step pipeline-small 170 python3 bench/gpu_pipeline.py --scale small --steps 60 ;;
    *) echo "unknown section $section" >&2 ;;
  esac
done
