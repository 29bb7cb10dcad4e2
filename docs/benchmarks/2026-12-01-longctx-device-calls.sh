#!/usr/bin/env bash
# Long samples (issue 22) and start-up (issue 18.3), on one H200 (kind nvidia-h200, carry .whl), run from the
# repository root as `bash docs/benchmarks/2026-12-01-longctx-device-calls.sh callN`; each call stays under
# 8 minutes (the benchmark stops starting systems at --budget-s). Records and logs land in $OUT.
# Every longctx record carries longest_sample_tokens, first_step_s, startup_s, probe_s, peak_gb, ref_loss_diff,
# attention_floor_s, trained_whole, truncated; the `reference` record the exact step-1 loss, the attention
# floor and (with --exactness True) the long sample's packed-vs-alone loss and LoRA-gradient differences.
set -u
source scripts/gpu_env.sh
W=/tmp/hs_bench; L=$OUT/logs; mkdir -p "$L"
export HYPERSLOTH_CACHE_DIR=$OUT/probe-cache  # the budget probe cache comes back with the records
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - T0) )); }
bench() { python3 scripts/benchmark.py --work $W --out $OUT --num-gpus 1 "$@"; }
show() { grep -h "^\[\|FAILED\|out of time\|Error\|error\|budget probe\|RoPE\|tokens_per_micro_batch=auto" "$@" | cut -c1-400; }
logs() { grep -h "budget probe\|RoPE\|tokens_per_micro_batch=auto\|turning on gradient\|probe cache" $W/*/out_*/logs/rank0.log 2>/dev/null | cut -c1-400; }

call1() {  # Qwen3-0.6B, one 131,072-token chat among 31 short ones: every system, exactness with gradients
  bench --workloads longctx-0.6b --long-tokens 131072 --warmup 0 --steps 2 --exactness True --tag lc-c1 \
    --slots "reference,hypersloth-1,unsloth-best-gc,unsloth-best" --budget-s $(left 450) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log; logs
}

call2() {  # Qwen3-8B 4-bit, 131,072 tokens: reference, HyperSloth, Unsloth with and without its checkpointing
  bench --workloads longctx-8b --long-tokens 131072 --warmup 0 --steps 2 --tag lc-c2 \
    --slots "reference,hypersloth-1,unsloth-best-gc,unsloth-best" --budget-s $(left 450) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log; logs
}

call3() {  # the exactness proof on the GPU: the tiny model through Unsloth's varlen path (the marked GPU test),
  # then Qwen3-8B 4-bit at 32,768 and 131,072 tokens (reference only)
  # (pytest is not among the carried wheels: add its wheel to .whl to run the marked test; the reference's
  # --exactness below is the same check at length without it)
  if python3 -c "import pytest" 2>/dev/null; then
    python3 -m pytest -q -m gpu tests/unit/test_exactness.py > $L/gpu-test.log 2>&1; el "gpu test: $(tail -1 $L/gpu-test.log)"
  fi
  for n in 32768 131072; do
    bench --workloads longctx-8b --long-tokens $n --warmup 0 --steps 1 --exactness True --tag lc-c3-$n \
      --slots "reference" --budget-s $(left 450) > $L/bench-$n.log 2>&1
    el "exactness $n done"; grep -h "^\[longctx-8b reference\]" $L/bench-$n.log | cut -c1-900
  done
}

call4a() {  # 262,144 tokens on Qwen3-8B 4-bit (RoPE factor 2 past the checkpoint's 131,072): the reference
  bench --workloads longctx-8b --long-tokens 262144 --warmup 0 --steps 1 --tag lc-c4 --slots "reference" \
    --budget-s $(left 450) > $L/bench.log 2>&1
  el "reference done"; show $L/bench.log
}

call4b() {  # 262,144 tokens on Qwen3-8B 4-bit: HyperSloth, judged against call4a's reference (copy its
  # records-lc-c4-longctx-8b.json into the repo root first; untracked files travel)
  bench --workloads longctx-8b --long-tokens 262144 --warmup 0 --steps 1 --tag lc-c4b --slots "hypersloth-1" \
    --reference-from records-lc-c4-longctx-8b.json --budget-s $(left 460) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log; logs
}

call5() {  # Qwen3-0.6B, 262,144 tokens: reference + HyperSloth (the longest for 0.6B; raise if it fits)
  bench --workloads longctx-0.6b --long-tokens 262144 --warmup 0 --steps 1 --tag lc-c5 \
    --slots "reference,hypersloth-1" --budget-s $(left 450) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log; logs
}

call6() {  # start-up (issue 18.3): stock load + first step against hypersloth-train twice (measured, then
  # cached probe); then the checkpointed-memory gap's candidates on 8B 4-bit (issue 22 item 4)
  bench --workloads short-0.6b --warmup 3 --steps 5 --tag lc-c6 --slots "unsloth-best,hypersloth-1,hypersloth-1" \
    --budget-s $(left 300) > $L/bench.log 2>&1
  el "start-up done"; show $L/bench.log; logs
  python3 -c "import json; [print(r['system'], 'startup_s', round(r.get('startup_s') or -1, 1), 'probe_s', r.get('probe_s'), 'first_step_s', round(r['first_step_s'], 2)) for r in json.load(open('$OUT/records-lc-c6-short-0.6b.json')) if 'first_step_s' in r]"
  bench --workloads short-8b --slots "" > $L/build8b.log 2>&1  # builds the 8B checkpoint only
  timeout $(left 470) python3 scripts/memory_gap.py --checkpoint $W/ckpt_8b --four-bit --gc unsloth --tokens 18432 \
    --out $OUT/memory-gap-8b-gc.json > $L/memory-gap.log 2>&1
  el "memory gap done"; grep -h "MEMORY_GAP\|Error" $L/memory-gap.log | cut -c1-900
}

"$@"
