#!/usr/bin/env bash
# Fourth session of 2026-12-01, one H200 (kind nvidia-h200, carry .whl); run from the repository root as
# `bash docs/benchmarks/2026-12-01d-device-calls.sh callN`. Each call stays under 9.5 minutes (the benchmark
# stops starting systems at --budget-s and kills one still running at it). Records and logs land in $OUT.
source scripts/device_calls_lib.sh  # the GPU environment, $W / $L, el, left, bench, show, keep_profiles, pack, ...

callL() {  # issue 18: the fused loss's last row chunk rounded to 256 rows (patches.pad_unsloth_loss_rows, in both
  # systems' shim) and the LoRA path rule refitted last session (callK, never run), end to end: (1) short-0.6b,
  # HyperSloth-1 against unsloth-best in one run; (2) the same two with the rounding off (HYPERSLOTH_PAD_LOSS_ROWS=0):
  # what it is worth to each; (3) long-0.6b, the pair; (4) HyperSloth-1 under the profiler: GPU busy against wall
  bench --workloads short-0.6b --slots "hypersloth-1,unsloth-best" --warmup 3 --steps 20 --tag 2026-12-01d-pad \
    --budget-s $(left 170) > $L/bench-short06.log 2>&1
  el "short-0.6b done"; show $L/bench-short06.log
  grep -h "row chunk\|varlen flash" $W/short-0.6b/out_hypersloth-1/logs/rank0.log 2>/dev/null | head -3 | cut -c1-200
  HYPERSLOTH_PAD_LOSS_ROWS=0 bench --workloads short-0.6b --slots "hypersloth-1,unsloth-best" --warmup 3 --steps 20 \
    --tag 2026-12-01d-nopad --budget-s $(left 300) > $L/bench-short06-nopad.log 2>&1
  el "short-0.6b no-pad done"; show $L/bench-short06-nopad.log
  bench --workloads long-0.6b --slots "hypersloth-1,unsloth-best" --warmup 3 --steps 20 --tag 2026-12-01d-pad \
    --budget-s $(left 450) > $L/bench-long06.log 2>&1
  el "long-0.6b done"; show $L/bench-long06.log
  bench --workloads short-0.6b --slots "hypersloth-1-profile" --warmup 3 --steps 6 --tag 2026-12-01d-prof \
    --budget-s $(left 560) > $L/bench-prof.log 2>&1
  el "profile done"; show $L/bench-prof.log; keep_profiles short-0.6b
  pack
}

callM() {  # issue 18: (1) short-8b, the pair with unsloth-best-16x2 first on the fresh machine (call J ran HyperSloth
  # first: the first system pays the cold Unsloth import and Triton compiles, so its start-up said little);
  # (2) short-0.6b, the pair again, stock first: a second measurement of call L's ratio on another machine
  bench --workloads short-8b --slots "unsloth-best-16x2,hypersloth-1" --warmup 3 --steps 20 --tag 2026-12-01d-pad \
    --budget-s $(left 330) > $L/bench-8b.log 2>&1
  el "short-8b done"; show $L/bench-8b.log
  bench --workloads short-0.6b --slots "unsloth-best,hypersloth-1" --warmup 3 --steps 20 --tag 2026-12-01d-pad2 \
    --budget-s $(left 470) > $L/bench-short06.log 2>&1
  el "short-0.6b done"; show $L/bench-short06.log
  pack
}

callN() {  # issue 22: 262,144 tokens on Qwen3-8B 4-bit (call C's worker died in step 1 without a Python error),
  # host memory sampled every 10 s and the kernel's log; the attention floor alone is 218 s for this sample
  watch_host_memory
  bench --workloads longctx-8b --long-tokens 262144 --warmup 0 --steps 1 --tag 2026-12-01d-lc262k \
    --slots "hypersloth-1" --budget-s $(left 570) > $L/bench.log 2>&1
  stop_host_memory; el "bench done"; show $L/bench.log; tail -8 $L/host-memory.log
  grep -h "host memory\|model's shape\|budget probe\|turning on gradient\|RoPE\|SIGKILL\|killed" $W/*/out_*/logs/rank0.log \
    $L/bench.log 2>/dev/null | cut -c1-300 | tail -20
  dmesg 2>/dev/null | grep -i "out of memory\|killed process" | tail -3
  pack
}

callO() {  # issue 22: call N again after the fix: HyperSloth now lowers the budget until Unsloth's offloaded
  # checkpoints fit host memory (call N: 283,136 tokens packed in one micro-batch, 36 pinned blocks of 4 GiB, the
  # kernel's out-of-memory killer in step 1); 262,144 tokens keep them at 2 GiB and the long chat trains alone
  watch_host_memory
  bench --workloads longctx-8b --long-tokens 262144 --warmup 0 --steps 1 --tag 2026-12-01d-lc262k-fit \
    --slots "hypersloth-1" --budget-s $(left 585) > $L/bench.log 2>&1
  stop_host_memory; el "bench done"; show $L/bench.log; tail -8 $L/host-memory.log
  grep -h "host memory\|budget probe\|tokens_per_micro_batch=auto\|SIGKILL" $W/*/out_*/logs/rank0.log \
    $L/bench.log 2>/dev/null | cut -c1-400 | tail -8
  dmesg 2>/dev/null | grep -i "out of memory\|killed process" | tail -3
  pack
}

# ---- prepared for the next session (issue 22's open items; not run in this one: the device time ran out) ----

callP() {  # issue 22 item 1: the long sample's loss AND LoRA gradient, packed among step 1's short samples against
  # alone, through Unsloth's varlen path with its checkpointing, on the GPU at 131,072 tokens on Qwen3-8B 4-bit
  # (reference system with --exactness True: records `exactness` with the loss and gradient differences)
  bench --workloads longctx-8b --long-tokens 131072 --warmup 0 --steps 1 --exactness True --tag next-exact131k \
    --slots "reference" --budget-s $(left 560) > $L/bench.log 2>&1
  el "exactness 131k done"; grep -h "^\[longctx-8b reference\]" $L/bench.log | cut -c1-1200
  pack
}

callQ() {  # issue 22 item 2: the longest sample for Qwen3-0.6B (RoPE factor 12.8 past its 40,960 positions):
  # 524,288 tokens, HyperSloth-1 judged against the exact reference (host memory: 28 pinned 1 GiB blocks)
  watch_host_memory
  bench --workloads longctx-0.6b --long-tokens 524288 --warmup 0 --steps 1 --tag next-lc524k \
    --slots "reference,hypersloth-1" --budget-s $(left 570) > $L/bench.log 2>&1
  stop_host_memory; el "bench done"; show $L/bench.log; tail -4 $L/host-memory.log
  grep -h "host memory\|budget probe\|tokens_per_micro_batch=auto\|RoPE" $W/*/out_*/logs/rank0.log 2>/dev/null \
    | cut -c1-400 | tail -6
  pack
}

callR() {  # issue 22 item 4: where the checkpointed peak goes (Qwen3-8B 4-bit, Unsloth's checkpointing, 18,432
  # tokens: short chats) -- scripts/memory_gap.py, the peak by phase against Unsloth's own run of the same batch
  bench --workloads short-8b --slots "" > $L/build8b.log 2>&1  # builds the 8B checkpoint only
  timeout $(left 560) python3 scripts/memory_gap.py --checkpoint $W/ckpt_8b --four-bit --gc unsloth --tokens 18432 \
    --out $OUT/memory-gap-8b-gc.json > $L/memory-gap.log 2>&1
  el "memory gap done"; grep -h "MEMORY_GAP\|Error" $L/memory-gap.log | cut -c1-900
  pack
}

"$@"
