#!/usr/bin/env bash
# 2026-12-05 (second session): one H200 (kind nvidia-h200), carry .whl (`bash ../shared/device/wheelhouse.sh`).
# Run from the repository root as `bash docs/benchmarks/2026-12-05-device-calls.sh callN`. Records land in $OUT.
# In this order: callZ (the architectures through Unsloth: 2026-12-03's callX, callV and callY in one call), callP
# (where an MoE step's time goes), then callA + callM of 2026-12-02-fa4-device-calls.sh (long-0.6b FA4 profile), then
# callW of 2026-12-03-device-calls.sh (GRPO's sampling profiled) if time is left.
# Ran (second session of 2026-12-05): callZ, callP, callA + callM, and callW's sampling profile cut to three engines
# and 3 calls (docs/benchmarks.md). Next, in this order: callG (the sampling engines; merge next/folded-grpo-decode if
# -folded wins), callG2 (GRPO's 20 steps, ours), callQ2 (TRL's GRPO, 20 steps, on the same data), callR (the
# recurrent models sorted-pad on Unsloth at defaults, Gemma 4 / Qwen2 / Gemma 3 / Phi-3 graphed, graph_check's
# after-update pair), callQL (QLoRA of the tiny Qwen3 and Qwen3-MoE through Unsloth, never run), then callL if time
# is left. Where starts are scarce (the fourth session of 2026-12-05: a machine lent, nine starts failed), callGQ
# first: callG2 and callQ2 in one call.
# Ran (fifth session of 2026-12-05, one H200): callGQ (GRPO 1.72x), callR, callQL, and callG cut to 3 calls per engine
# (docs/benchmarks.md). Next: callS (the three fixes of 93f5f78 on tiny models, ~2 min), then the FA4 calls of
# 2026-12-02-fa4-device-calls.sh (callA, then callK, callR2, callE2), then callP (MoE profile) if time is left.
# Ran (sixth session of 2026-12-05, one H100 after seven failed starts): callS (the three fixes work), callPE (Phi-3
# eager, for callS's graphed losses), then of 2026-12-02-fa4-device-calls.sh callA, callR2 (rows within the graphs'
# reach do not pay) and callK3 (attention kept through checkpointing, one 131k sample: -1.9%). Next: the FA4 calls
# left there (callE2, callP2, callF's 8B half), then callP (MoE profile) if time is left.
source scripts/device_calls_lib.sh  # the GPU environment, $W / $L, el, left, bench, show, pack, ...

callZ() {  # every architecture not yet run through Unsloth, at defaults, graphed and eager: gpt-oss with the sink
  # attention's per-sample masks (callX), dense Qwen3.5 and Qwen3.5-MoE as published (multimodal), Gemma 4 and its MoE
  # (per-layer head widths), Granite 4.0-H (Mamba-2 hybrid), LFM2 and LFM2-MoE (short convolutions) (callY); beside
  # them, the tiny Qwen3.5-MoE eager sorted-pad, the packed-row check skipped: does training itself run where the
  # check's first forward hit an illegal memory access (callV) (~6 min)
  timeout $(left 420) python3 scripts/arch_check.py --out $OUT/arch \
    --architectures gpt_oss,qwen3_5,qwen3_5_moe_mm,gemma4,gemma4_moe,granite4_h,lfm2,lfm2_moe --parallel 8 \
    > $L/arch-new.log 2>&1 &
  timeout $(left 420) python3 scripts/arch_check.py --out $OUT/arch-sorted --work /tmp/hs_arch2 \
    --architectures qwen3_5_moe --modes eager --batching sorted-pad > $L/arch-sorted.log 2>&1 &
  wait; el "arch checks done"
  arch_runs $OUT/arch $OUT/arch-sorted
  tail -5 $L/arch-new.log | cut -c1-600; tail -5 $L/arch-sorted.log | cut -c1-600
  tar czf $OUT/arch-logs.tgz -C $OUT arch arch-sorted && rm -rf $OUT/arch/*.log $OUT/arch-sorted/*.log
  pack
}

callP() {  # where an MoE step's 0.33 s go (issue 32 item 7, 1.00x stock): moe-short (Qwen3-30B-A3B's shape, 12 layers)
  # under torch.profiler over steps 4-6, ours at defaults and stock Unsloth at its best, kernel tables side by side:
  # 115 ms of a step are the experts' grouped GEMMs, the rest was never profiled (host time? the router? attention?).
  # The token budget is given (the probe's 59 s are not what is measured here) (~6 min)
  bench --workloads moe-short --slots hypersloth-1-profile,unsloth-best-profile --token-budget 66816 --warmup 3 \
    --steps 6 --tag moe-prof --budget-s $(left 540) > $L/bench-moe-prof.log 2>&1
  el "profiles done"; show $L/bench-moe-prof.log; keep_profiles moe-short
  for f in $OUT/profiles/moe-short-*.txt; do echo "== $f"; head -c 2500 $f; echo; done
  pack
}

callG() {  # GRPO's sampling on merged weights (grpo.sampling_weights="merged", train/grpo/merged_sampling.py) against
  # the adapter and the adapter-free bound, and merged with the decode attention's GQA folded (patches.py
  # unsloth_folded_gqa_decode: is it faster, the same completions?), the stop check deferred in all (~4 min).
  # If -folded gives the same completions faster: `git merge next/folded-grpo-decode` (GRPO samples folded, and the
  # stock side of bench_grpo gets it too) before callG2 and callQ
  [ -f $W/ckpt_0.6b/config.json ] || python3 scripts/benchmark.py --as-system build --model 0.6b --checkpoint $W/ckpt_0.6b
  timeout $(left 560) python3 scripts/sampling_bench.py --model $W/ckpt_0.6b --engines unsloth,unsloth-merged,unsloth-merged-folded,unsloth-no-lora \
    --calls 5 --out $OUT/sampling-merged.json > $L/sampling.log 2>&1
  el "sampling bench done"; grep '^{' $L/sampling.log | cut -c1-600; grep -h "Error\|Traceback" $L/sampling.log | head -5 | cut -c1-300
  pack
}

callG2() {  # GRPO at defaults, 2 warm-up + 20 timed steps (~5 min): the line "GRPO samples on merged weights" and
  # generation_s per step; then callQ of 2026-12-03-device-calls.sh (TRL's GRPO on the same data) for the headline
  bench --workloads grpo-0.6b --slots hypersloth-1 --warmup 2 --steps 20 --tag grpo-merged --budget-s $(left 570) \
    > $L/bench-grpo.log 2>&1
  el "bench done"; show $L/bench-grpo.log
  grep -h "merged weights\|samples with the adapter\|CUDA-graph decode\|Error\|Traceback" \
    $W/grpo-0.6b/out_hypersloth-1/logs/rank0.log | head -5 | cut -c1-400
  pack
}

callQ2() {  # TRL GRPOTrainer + Unsloth at 64x1, 2 warm-up + 20 timed steps, on callG2's data (the benchmark builds it
  # again on a fresh machine), with the same deferred stop check (and the folded decode if it was merged): the other
  # half of the GRPO headline (~6 min)
  bench --workloads grpo-0.6b --slots trl-grpo-64x1 --warmup 2 --steps 20 --tag grpo-merged-trl \
    --budget-s $(left 570) > $L/bench-trl.log 2>&1
  el "bench (TRL) done"; show $L/bench-trl.log
  pack
}

callGQ() {  # callG2 and callQ2 in one call, for a session that may get only one machine start (fourth session of
  # 2026-12-05: starts kept failing): ours at defaults, then TRL GRPOTrainer + Unsloth at 64x1, 2 warm-up + 20 timed
  # steps each, on one machine (~8-9 min; the budget stops before TRL's slot if ours ran long)
  bench --workloads grpo-0.6b --slots hypersloth-1,trl-grpo-64x1 --warmup 2 --steps 20 --tag grpo-merged \
    --budget-s $(left 560) > $L/bench-grpo.log 2>&1
  el "bench done"; show $L/bench-grpo.log
  grep -h "merged weights\|samples with the adapter\|CUDA-graph decode\|Error\|Traceback" \
    $W/grpo-0.6b/out_hypersloth-1/logs/rank0.log | head -5 | cut -c1-400
  pack
}

callR() {  # after commits 4182e08 and 09c0b70: Qwen3.5 dense, Qwen3.5-MoE as published and Granite 4.0-H through
  # Unsloth at defaults (no packed-row check on Unsloth for recurrent mixers: sorted-pad; the budget probe under
  # training's autocast, where Granite's Mamba raised a dtype error outside it), graphed and eager; and Gemma 4
  # graphed, whose capture failed on a host sync (Unsloth's mask checks, answered from the warm-up since the commit
  # after 33cf022: does it capture now? if not, capture_failed_at says where), with Qwen2, Gemma 3 and Phi-3, whose
  # graphs were last run before Unsloth's varlen routing for transformers' attention was switched on (~6 min). Then
  # scripts/graph_check.py at 8k with its "after-update" pair (33cf022: a replay after every weight moved, captures
  # without autocast's weight cache) (~2 min)
  timeout $(left 400) python3 scripts/arch_check.py --out $OUT/arch \
    --architectures qwen3_5,qwen3_5_moe_mm,granite4_h,gemma4,qwen2,gemma3,phi3 \
    --parallel 8 > $L/arch.log 2>&1
  el "arch check done"
  arch_runs $OUT/arch
  tar czf $OUT/arch-logs.tgz -C $OUT arch && rm -rf $OUT/arch
  timeout $(left 560) python3 scripts/graph_check.py --model 0.6b --checkpoint $W/ckpt_0.6b --rows 8192 --repeats 5 \
    --out $OUT/graph-check-after-update.json > $L/graph-check.log 2>&1
  el "graph check done"; grep -h '"kind"\|loss_rel_diff\|grad_rel_l2_diff\|Error' $L/graph-check.log | head -30 | cut -c1-200
  pack
}

callL() {  # if time is left: the fused loss's host time on long-0.6b. The 2026-12-05 FA4 profile left the GPU idle 8-13%
  # of a step around the eager loss and the optimizer; Unsloth's fused cross-entropy runs a packed row in 4,096-row
  # chunks (~100 kernels a step on 45k-token rows). Ours at defaults, then with its chunk rows at 16,384
  # (unsloth_zoo/fused_losses/fused_linear.py's environment knobs), 20 steps each (~4 min; bundled flash unless the
  # .fa4 parts were unpacked on this machine). If it pays, the setting goes to both sides (stock runs the same loss)
  bench --workloads long-0.6b --slots hypersloth-1 --warmup 3 --steps 20 --tag loss-rows-4k --budget-s $(left 270) \
    > $L/bench-loss4k.log 2>&1
  el "4k rows done"; show $L/bench-loss4k.log
  UNSLOTH_FUSED_LINEAR_MAX_ROWS=16384 UNSLOTH_FUSED_LINEAR_BWD_ROWS=16384 bench --workloads long-0.6b \
    --slots hypersloth-1 --warmup 3 --steps 20 --tag loss-rows-16k --budget-s $(left 560) > $L/bench-loss16k.log 2>&1
  el "16k rows done"; show $L/bench-loss16k.log
  pack
}

callQL() {  # QLoRA at defaults through Unsloth (load_in_4bit=True), the way most fine-tune Qwen3-30B-A3B on one GPU:
  # the tiny Qwen3 and Qwen3-MoE (do the experts load in NF4 through Unsloth's MoE path, do they get adapters, does it
  # train?), graphed (MoE steps aside) (~3 min); never run before
  timeout $(left 300) python3 scripts/arch_check.py --out $OUT/arch4 --work /tmp/hs_arch4 --load-in-4bit \
    --architectures qwen3,qwen3_moe --modes graphs --parallel 2 > $L/arch4.log 2>&1
  el "4-bit arch check done"
  arch_runs $OUT/arch4
  tar czf $OUT/arch4-logs.tgz -C $OUT arch4 && rm -rf $OUT/arch4
  pack
}

callS() {  # after 93f5f78, its three fixes on tiny models at once (~2 min): QLoRA of the tiny Qwen3-MoE (do the experts
  # get adapters now, and train?), Phi-3 graphed (does the capture pass the maskless check now?), Granite 4.0-H through
  # Unsloth (does step 2 run with Unsloth's per-layer compile off?)
  timeout $(left 170) python3 scripts/arch_check.py --out $OUT/arch4 --work /tmp/hs_arch4 --load-in-4bit \
    --architectures qwen3_moe --modes graphs > $L/arch4.log 2>&1 &
  timeout $(left 170) python3 scripts/arch_check.py --out $OUT/arch --architectures phi3,granite4_h --modes graphs \
    --parallel 2 > $L/arch.log 2>&1 &
  wait; el "arch checks done"
  arch_runs $OUT/arch4 $OUT/arch
  grep -h "LoRA targets\|UNSLOTH_BLOCK_COMPILE\|capture" $OUT/arch4/*.log $OUT/arch/*.log | cut -c1-300
  tar czf $OUT/arch-logs.tgz -C $OUT arch arch4 && rm -rf $OUT/arch $OUT/arch4
  pack
}

callPE() {  # right after callS, same machine (~90 s): Phi-3 eager, the other half of callS's graphed Phi-3 (graphed
  # vs eager losses; arch_check's --modes graphs ran only the graphed half)
  timeout $(left 130) python3 scripts/arch_check.py --out $OUT/arch --architectures phi3 --modes eager > $L/arch.log 2>&1
  el done; arch_runs $OUT/arch; rm -rf $OUT/arch
}

"$@"
