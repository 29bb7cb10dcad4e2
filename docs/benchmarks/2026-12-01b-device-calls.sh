#!/usr/bin/env bash
# Second session of 2026-12-01, one H200 (kind nvidia-h200, carry .whl); run from the repository root as
# `bash docs/benchmarks/2026-12-01b-device-calls.sh callN`. Each call stays under 9 minutes (the benchmark stops
# starting systems at --budget-s and kills one still running at it). Records and logs land in $OUT.
source scripts/device_calls_lib.sh  # the GPU environment, $W / $L, el, left, bench, show, keep_profiles, pack, ...

callA() {  # issue 21: DPO, HyperSloth-1 at defaults against TRL's DPOTrainer + Unsloth at the splits that fit
  # (32 x 1 ran out of memory in the first session), every row in this one call
  bench --workloads dpo-0.6b --slots "hypersloth-1,trl-dpo-16x2,trl-dpo-8x4" --warmup 3 --steps 20 \
    --tag 2026-12-01b-dpo --budget-s $(left 500) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
}

callC() {  # issue 22: one 262,144-token chat among 31 short ones on Qwen3-8B 4-bit (RoPE factor 2 past the
  # checkpoint's 131,072), HyperSloth-1 at defaults; then the attention floor for that length alone (the whole
  # `reference` system, with its model load and exact forward, does not fit in the same 10-minute call)
  bench --workloads longctx-8b --long-tokens 262144 --warmup 0 --steps 1 --tag 2026-12-01b-lc262k \
    --slots "hypersloth-1" --budget-s $(left 555) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  grep -h "budget probe\|RoPE\|tokens_per_micro_batch=auto\|turning on gradient\|checkpointing" \
    $W/*/out_*/logs/rank0.log 2>/dev/null | cut -c1-400
  timeout $(left 590) python3 -c "import sys; sys.path.insert(0, 'scripts'); from bench_longctx import attention_floor_s; \
print('ATTENTION_FLOOR_S', 262144, attention_floor_s(262144, 32, 8, 128, 36))" 2>&1 | grep ATTENTION_FLOOR
  el "floor done"
}

callB() {  # issue 18: the Qwen3-8B 4-bit row, HyperSloth-1 at defaults against unsloth-best, in one call; and the
  # machine's host memory and /tmp (the 262k run of call C died without a Python error)
  free -g | head -2; df -h /tmp | tail -1
  bench --workloads short-8b --slots "unsloth-best,hypersloth-1" --warmup 3 --steps 20 --tag 2026-12-01b-8b \
    --budget-s $(left 540) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log; free -g | head -2
  grep -h "budget probe\|tokens_per_micro_batch=auto\|eager decoder\|CUDA graphs" $W/*/out_*/logs/rank0.log 2>/dev/null | cut -c1-300
}

callE() {  # issue 18: (1) the LoRA blocks alone, Unsloth's against HyperSloth's passes (lora_bench, 0.6B cases first);
  # (2) short-0.6b: HyperSloth-1 at defaults (lora_passes on), with Unsloth's LoRA projections, and unsloth-best,
  # in one call; (3) short-8b HyperSloth-1 at defaults: it ran out of memory at step 3 in call B (graph pool beside
  # eager rows), fixed since
  timeout 100 python3 scripts/lora_bench.py --budget-s 70 > $L/lora_bench.log 2>&1
  el "lora_bench done"; grep -v "^{" $L/lora_bench.log | tail -12 | cut -c1-300
  python3 -c "
import json
for c in (json.load(open('$OUT/lora_bench.json'))['cases'] if __import__('os').path.exists('$OUT/lora_bench.json') else []):
    v = c.get('variants', {}); s = {k: round(x, 3) for k, x in c.items() if k.startswith('speedup')}
    print(c.get('model'), c.get('block'), c.get('tokens'), c.get('auto_path'), s,
          {k: (round(x.get('median_ms', -1), 2) if isinstance(x, dict) else x) for k, x in v.items()}, c.get('error', ''))
" 2>&1 | cut -c1-400
  bench --workloads short-0.6b --slots "hypersloth-1,hypersloth-1-unsloth-lora,unsloth-best" --warmup 3 --steps 20 \
    --tag 2026-12-01b-lora --budget-s $(left 360) > $L/bench06.log 2>&1
  el "0.6b done"; show $L/bench06.log
  grep -h "LoRA projections\|CUDA graphs for\|eager decoder\|start-up" $W/short-0.6b/out_*/logs/rank0.log 2>/dev/null | cut -c1-300
  bench --workloads short-8b --slots "hypersloth-1" --warmup 3 --steps 20 --tag 2026-12-01b-8b-fixed \
    --budget-s $(left 560) > $L/bench8b.log 2>&1
  el "8b done"; show $L/bench8b.log
  grep -h "LoRA projections\|CUDA graphs for\|eager decoder\|start-up" $W/short-8b/out_*/logs/rank0.log 2>/dev/null | cut -c1-300
}

# ---- prepared for the next session (not run in this one: the device time ran out) ----

callF() {  # issue 22: 262,144 tokens on Qwen3-8B 4-bit again, with host memory sampled every 10 s (call C's worker
  # died in step 1 without a Python error; 72 GiB of offloaded layer inputs is the suspect) and the kernel's log
  watch_host_memory
  bench --workloads longctx-8b --long-tokens 262144 --warmup 0 --steps 1 --tag next-lc262k --slots "hypersloth-1" \
    --budget-s $(left 560) > $L/bench.log 2>&1
  stop_host_memory; el "bench done"; show $L/bench.log; tail -5 $L/host-memory.log
  grep -h "host memory\|model's shape\|budget probe\|turning on gradient" $W/*/out_*/logs/rank0.log 2>/dev/null | cut -c1-300
  dmesg 2>/dev/null | grep -i "out of memory\|killed process" | tail -3
}

callG() {  # issue 18: what the LoRA passes are worth on 8B 4-bit (eager), and long-0.6b against unsloth-best
  bench --workloads short-8b --slots "hypersloth-1,hypersloth-1-unsloth-lora" --warmup 3 --steps 20 --tag next-8b-passes \
    --budget-s $(left 330) > $L/bench8b.log 2>&1
  el "8b done"; show $L/bench8b.log
  bench --workloads long-0.6b --slots "hypersloth-1,unsloth-best" --warmup 3 --steps 20 --tag next-long \
    --budget-s $(left 560) > $L/bench-long.log 2>&1
  el "long done"; show $L/bench-long.log
}

"$@"
