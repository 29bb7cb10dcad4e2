#!/usr/bin/env bash
# Sixth session of 2026-12-01, one H200 (kind nvidia-h200, carry .whl); run from the repository root as
# `bash docs/benchmarks/2026-12-01f-device-calls.sh callX`. This session ran callW, callU and callV of
# docs/benchmarks/2026-12-01e-device-calls.sh (their records, tagged next-*, kept as records-2026-12-01f-*.json).
# Prepared here for the next session, not run in this one (no device time left). Records and logs land in $OUT.
source scripts/device_calls_lib.sh  # the GPU environment, $W / $L, el, left, bench, show, keep_profiles, pack, ...

REF131K=docs/benchmarks/records-2026-12-01e-exact131k-longctx-8b.json  # the sample alone (two machines agreed)

callX() {  # noticed in callU: the 131k step on Qwen3-8B 4-bit took 121.7 s untiled with HyperSloth's LoRA passes
  # (this session's log, 2026-12-01f-tiled-off.log); the issue measured 85 s for it with Unsloth's LoRA kernels, at an
  # older commit. First the blocks alone at the long row's length (lora_passes' concat-or-epilogue rule was fitted
  # at <= 22,528 tokens; at 151,809 it picks concat for gate/up), then the same step on Unsloth's LoRA kernels
  # (~7 minutes)
  OUT=$OUT timeout 150 python3 scripts/lora_bench.py --models qwen3-8b --tokens 151809 32768 --warmup 2 --reps 8 \
    --budget-s 120 > $L/lora-bench.log 2>&1
  el "lora bench done"; grep -v "^#" $L/lora-bench.log | cut -c1-400 | tail -12
  bench --workloads longctx-8b --long-tokens 131072 --warmup 0 --steps 1 --tag next-lora131k \
    --slots hypersloth-1-unsloth-lora --reference-from $REF131K --budget-s $(left 570) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  grep -h "start-up\|median step\|LoRA projections\|memory      peak" $W/longctx-8b/out_hypersloth-1*/logs/rank0.log \
    | cut -c1-400
  pack
}

callY() {  # the automatic tiled MLP on a GPU (budget.settle's third saver; CPU-tested only): another process holds
  # all but ~34.5 GiB of the H200, so the allocation limit is ~33 GiB. Checkpointed and untiled, the 151,809-token
  # row is predicted at ~36 GiB (callU's line: 11.75 GiB at 32,768 tokens, 0.192 MiB per token, +10% slack):
  # too much; tiled it peaked at 25.1 GiB (callU). Expected: the log's "turning on Unsloth's tiled MLP", the
  # budget summary's "tiled MLP (switched on ...)", a step-1 loss within ~2e-4 of the sample alone (~7 minutes)
  python3 - <<'PY' > $L/hog.log 2>&1 &
import time, torch
total = torch.cuda.get_device_properties(0).total_memory
hog = torch.empty(int(total * 0.92 - 34.5 * 2**30), dtype=torch.uint8, device="cuda")
print(f"holding {hog.numel() / 2**30:.1f} GiB; free {torch.cuda.mem_get_info()[0] / 2**30:.1f} GiB", flush=True)
time.sleep(900)
PY
  HOG=$!; sleep 20; cat $L/hog.log
  bench --workloads longctx-8b --long-tokens 131072 --warmup 0 --steps 1 --tag next-autotile --slots hypersloth-1 \
    --reference-from $REF131K --budget-s $(left 560) > $L/bench.log 2>&1
  el "bench done"; kill $HOG; show $L/bench.log
  grep -h "tiled MLP\|gradient checkpointing\|budget probe\|LoRA projections\|memory      peak" \
    $W/longctx-8b/out_hypersloth-1/logs/rank0.log | cut -c1-500
  pack
}

"$@"
