#!/usr/bin/env bash
# Third session of 2026-12-01, one H200 (kind nvidia-h200, carry .whl); run from the repository root as
# `bash docs/benchmarks/2026-12-01c-device-calls.sh callN`. Each call stays under 9.5 minutes (the benchmark
# stops starting systems at --budget-s and kills one still running at it). Records and logs land in $OUT.
source scripts/device_calls_lib.sh  # the GPU environment, $W / $L, el, left, bench, show, keep_profiles, pack, ...

callH() {  # issue 18: (1) short-0.6b, every row in one run: HyperSloth-1 and unsloth-best at defaults (both with the
  # shim, now also switching on Unsloth's lean flash path: GQA without expanding K/V), and both under torch.profiler
  # (steps 4-6); (2) HyperSloth-1 with the lean path off (UNSLOTH_LEAN_VARLEN=0): what it is worth;
  # (3) short-8b HyperSloth-1 under the profiler (where 8B's 1.4 s go)
  bench --workloads short-0.6b --slots "hypersloth-1,unsloth-best,hypersloth-1-profile,unsloth-best-profile" \
    --warmup 3 --steps 20 --tag 2026-12-01c-0.6b --budget-s $(left 300) > $L/bench06.log 2>&1
  el "0.6b done"; show $L/bench06.log; keep_profiles short-0.6b
  grep -h "lean\|varlen\|CUDA graphs for\|eager decoder\|KERNEL_PROFILE" $W/short-0.6b/out_*/logs/rank0.log 2>/dev/null | cut -c1-300
  UNSLOTH_LEAN_VARLEN=0 bench --workloads short-0.6b --slots "hypersloth-1" --warmup 3 --steps 20 \
    --tag 2026-12-01c-0.6b-nolean --budget-s $(left 380) > $L/bench06-nolean.log 2>&1
  el "0.6b no-lean done"; show $L/bench06-nolean.log
  bench --workloads short-8b --slots "hypersloth-1-profile" --warmup 3 --steps 6 --tag 2026-12-01c-8b-profile \
    --budget-s $(left 560) > $L/bench8b.log 2>&1
  el "8b profile done"; show $L/bench8b.log; keep_profiles short-8b
}

callI() {  # issue 18: (1) attention kernels alone for packed short chats (scripts/attn_bench.py: flash with GQA,
  # flash with expanded K/V, cuDNN ragged); (2) short-0.6b under torch.profiler (now with Python stacks):
  # HyperSloth-1 with the lean path fixed (call H's trace still showed the K/V expansion: torch 2.11's per-device
  # cuDNN check kept Unsloth's lean path off) and unsloth-best (call H ran out of its time budget before it);
  # (3) HyperSloth-1 at defaults, 20 timed steps
  timeout 120 python3 scripts/attn_bench.py --tokens 22528 --out $OUT/attn_bench.json > $L/attn.log 2>&1
  el "attn done"; cat $L/attn.log | cut -c1-400
  bench --workloads short-0.6b --slots "hypersloth-1-profile,unsloth-best-profile,hypersloth-1" --warmup 3 --steps 20 \
    --tag 2026-12-01c-0.6b-prof --budget-s $(left 330) > $L/bench06.log 2>&1
  el "0.6b done"; show $L/bench06.log; keep_profiles short-0.6b
  pack
}

callJ() {  # issue 18, the session's comparison rows, each pair in one benchmark run: short-0.6b and long-0.6b
  # (HyperSloth-1 at defaults against unsloth-best, 32 x 1), short-8b (against unsloth-best-16x2: 32 x 1 ran out of
  # memory on 8B), 3 warm-up + 20 timed steps; HyperSloth now skips the per-step model.train() walk and gets its
  # steps from the loader's worker as arrays (call I's trace: ~13 ms of GPU idle between steps went there);
  # last, if time is left, HyperSloth-1 under the profiler (GPU busy against wall)
  bench --workloads short-0.6b --slots "hypersloth-1,unsloth-best" --warmup 3 --steps 20 --tag 2026-12-01c-final \
    --budget-s $(left 175) > $L/bench-short06.log 2>&1
  el "short-0.6b done"; show $L/bench-short06.log
  bench --workloads long-0.6b --slots "hypersloth-1,unsloth-best" --warmup 3 --steps 20 --tag 2026-12-01c-final \
    --budget-s $(left 320) > $L/bench-long06.log 2>&1
  el "long-0.6b done"; show $L/bench-long06.log
  bench --workloads short-8b --slots "hypersloth-1,unsloth-best-16x2" --warmup 3 --steps 20 --tag 2026-12-01c-final \
    --budget-s $(left 555) > $L/bench-8b.log 2>&1
  el "short-8b done"; show $L/bench-8b.log
  bench --workloads short-0.6b --slots "hypersloth-1-profile" --warmup 3 --steps 6 --tag 2026-12-01c-final-prof \
    --budget-s $(left 590) > $L/bench-prof.log 2>&1
  el "profile done"; show $L/bench-prof.log; keep_profiles short-0.6b
  grep -h "CUDA graphs for\|eager decoder\|KERNEL_PROFILE\|start-up" $W/*/out_hypersloth-1*/logs/rank0.log 2>/dev/null | cut -c1-300
  pack
}

# ---- prepared for the next session (not run in this one: the device time ran out) ----

callK() {  # issue 18: the LoRA path rule end to end (concat_pays with the copies at 4x, committed after call J:
  # compare with call J's hypersloth-1 rows, 0.209 / 0.417 / 1.371 s), every row again in one run each
  bench --workloads short-0.6b --slots "hypersloth-1,unsloth-best" --warmup 3 --steps 20 --tag next-rule \
    --budget-s $(left 175) > $L/bench-short06.log 2>&1
  el "short-0.6b done"; show $L/bench-short06.log
  bench --workloads short-8b --slots "hypersloth-1,unsloth-best-16x2" --warmup 3 --steps 20 --tag next-rule \
    --budget-s $(left 420) > $L/bench-8b.log 2>&1
  el "short-8b done"; show $L/bench-8b.log
  bench --workloads long-0.6b --slots "hypersloth-1,unsloth-best" --warmup 3 --steps 20 --tag next-rule \
    --budget-s $(left 570) > $L/bench-long06.log 2>&1
  el "long-0.6b done"; show $L/bench-long06.log
  pack
}

"$@"
