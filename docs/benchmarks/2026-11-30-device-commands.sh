# The commands run on the lent 2 x H200 (device tool, kind nvidia-h200-x2, carry .whl .bench) on 2026-11-30.
# Each call began with the two lines of ../shared/device/prelude.sh; .bench/src was 'git archive HEAD' plus the
# working copies of scripts/benchmark.py, scripts/profile_step.py, HyperSloth/profiling.py, HyperSloth/budget.py.

# ---- call 1, 05:19 UTC (HEAD 95842b3 + those files) ----
#!/usr/bin/env bash
# Call 1: diagnostics (probe, sweep, churn, torch.profiler, longest 8B sample) + harness shakedown.
set -u
ROOT=$PWD
cd .bench/src
export PYTHONPATH=$PWD:$SITE NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=/tmp/hs_out; mkdir -p $L; W=/tmp/hs_bench
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > $L/nvsmi.txt 2>&1
python3 -c "import torch, unsloth, trl, transformers; print(torch.__version__, unsloth.__version__, trl.__version__, transformers.__version__)" > $L/versions.txt 2>&1
el "versions: $(tail -1 $L/versions.txt)"
python3 scripts/benchmark.py --workloads short-0.6b,short-8b --slots "" --work $W --out $L/rec > $L/build.log 2>&1
el "built: $(ls $W)"
( CUDA_VISIBLE_DEVICES=0 python3 scripts/profile_step.py --checkpoint $W/ckpt_0.6b --probe --sweep 2048,4096,8192,16384,32768,65536 \
    --churn 25 --torch-profile 11264 --out $OUT/prof-0.6b.json > $L/prof-0.6b.log 2>&1; el "prof 0.6b done rc=$?"
  python3 scripts/benchmark.py --workloads short-0.6b --slots unsloth-best --work $W --out $OUT --tag c1a --budget-s 200 > $L/bench-a.log 2>&1; el "bench a done" ) &
( CUDA_VISIBLE_DEVICES=1 python3 scripts/profile_step.py --checkpoint $W/ckpt_8b --four-bit --probe --out $OUT/prof-8b.json > $L/prof-8b.log 2>&1; el "prof 8b done rc=$?"
  CUDA_VISIBLE_DEVICES=1 python3 scripts/profile_step.py --checkpoint $W/ckpt_8b --four-bit --gc unsloth --probe --cap 65536 --longest 32768,65536,98304 --out $OUT/prof-8b-gc.json > $L/prof-8b-gc.log 2>&1; el "prof 8b gc done rc=$?" ) &
wait
el "lanes done"
python3 scripts/benchmark.py --workloads short-0.6b --slots hypersloth-2-profile,unsloth-ddp --work $W --out $OUT --tag c1b --budget-s 200 > $L/bench-b.log 2>&1
el "bench b done"

# ---- call 2, 05:41 UTC (HEAD 9babcca: auto budget, bucketing; with the gradient_accumulation_steps=2 bug, see docs/benchmarks.md) ----
#!/usr/bin/env bash
# Call 2: the 0.6B workloads (short chats, long mix): anchors and HyperSloth at product defaults.
set -u
cd .bench/src
export PYTHONPATH=$PWD:$SITE NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
L=/tmp/hs_out; mkdir -p $L; W=/tmp/hs_bench
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv > $L/nvsmi.txt 2>&1
python3 scripts/benchmark.py --workloads short-0.6b,short-8b --slots "" --work $W --out $L/rec > $L/build.log 2>&1
el "built: $(ls $W | tr '\n' ' ')"
python3 scripts/benchmark.py --workloads short-0.6b,long-0.6b --slots "unsloth-best+hypersloth-1,hypersloth-2,unsloth-ddp" \
  --work $W --out $OUT --tag "$TAG" --budget-s $BUDGET 2>&1 | grep -v "^\s*$" | tail -40
el "bench done"
# run as: TAG=c2 BUDGET=440 bash .bench/call2.sh

# ---- call 3, 05:52 UTC (with the gradient_accumulation_steps=2 bug). Trees: t_head = HEAD 58c744d + budget peak reset; t_old / t_nob / t_mark = t_head with
# bucketing off and packed lengths moved to the GPU / bucketing off / Unsloth's pre-train marker cleared) ----
#!/usr/bin/env bash
# Call 3: bisect the hypersloth slowdown (4 trees, hypersloth-1 on 0.6B short), then 0.6B hypersloth-2 and
# the 8B short-chat rows with the fastest tree.
set -u
B=$PWD/.bench; W=/tmp/hs_bench; L=/tmp/hs_out; mkdir -p $L
export NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
bench() { local tree=$1; shift; (cd $B/$tree && PYTHONPATH=$B/$tree:$SITE python3 scripts/benchmark.py --ckpt-dir $W "$@"); }
bench t_head --workloads short-0.6b,short-8b --slots "" --work $W --out $L/rec > $L/build.log 2>&1
el "built $(ls $W | tr '\n' ' ')"
bench t_head --workloads short-0.6b --slots hypersloth-1 --work $W/r1a --first-gpu 0 --token-budget 65536 --tag v-head-explicit --out $OUT --budget-s 120 > $L/r1a.log 2>&1 &
bench t_old --workloads short-0.6b --slots hypersloth-1 --work $W/r1b --first-gpu 1 --tag v-old-auto --out $OUT --budget-s 120 > $L/r1b.log 2>&1 &
wait; el "round 1"; grep -h "^\[short" $L/r1a.log $L/r1b.log | cut -c1-200
R1=$(python3 $B/choose.py t_old=$OUT/records-v-old-auto-short-0.6b.json)
if [ "$R1" != "t_old" ]; then
bench t_nob --workloads short-0.6b --slots hypersloth-1 --work $W/r2a --first-gpu 0 --tag v-nob-auto --out $OUT --budget-s 120 > $L/r2a.log 2>&1 &
bench t_mark --workloads short-0.6b --slots hypersloth-1 --work $W/r2b --first-gpu 1 --tag v-mark-auto --out $OUT --budget-s 120 > $L/r2b.log 2>&1 &
wait; el "round 2"; grep -h "^\[short" $L/r2a.log $L/r2b.log | cut -c1-200
fi
BEST=$(python3 $B/choose.py t_old=$OUT/records-v-old-auto-short-0.6b.json t_nob=$OUT/records-v-nob-auto-short-0.6b.json t_mark=$OUT/records-v-mark-auto-short-0.6b.json)
el "best tree: $BEST"; echo $BEST > $L/best.txt
bench $BEST --workloads short-0.6b --slots hypersloth-2 --work $W/f06 --tag final-$BEST --out $OUT --budget-s 100 > $L/f06.log 2>&1
el "0.6b hs2"; grep -h "^\[short" $L/f06.log | cut -c1-250
bench $BEST --workloads short-8b --slots "unsloth-best+unsloth-best-gc,hypersloth-2,unsloth-ddp" --work $W/f8 --tag final-$BEST --out $OUT --budget-s $(( 555 - ($(date +%s) - T0) )) > $L/f8.log 2>&1
el "8b"; grep -h "^\[short\|FAILED\|out of time" $L/f8.log | cut -c1-250
