#!/usr/bin/env bash
# 2026-12-02, one H200 (kind nvidia-h200, carry .whl): issue 32's GPU items. Run from the repository root as
# `bash docs/benchmarks/2026-12-02-device-calls.sh callA`. Records and logs land in $OUT. (Slots with "+" run side
# by side on separate GPUs: on one GPU name the systems apart, "a,b", or the second gets no GPU.)
#
# This session ran callA (the "+" slip, then both systems: records-2026-12-02-moe-moe-short.json), callC
# (moe_diag + arch_check: arch-check-2026-12-02.json), callD (profiles: the cuDNN masked attention) and started callA
# again after the fix (patches.enable_unsloth_hf_packed_attention): the device time ran out while it built the
# checkpoint. The next session ran callA (records-2026-12-02-moe-fixed-moe-short.json: 0.331 vs 0.332 s/step). Then
# the FA4 calls A/B/C of
# 2026-12-02-fa4-device-calls.sh, then callE, callG (the grouped experts: slower than Unsloth's path; since then the
# grouped pass keeps half as much for the backward, GateThenWeight and GatheredLowRank: callG again when time
# allows); next callI, GRPO: `bench --workloads grpo-0.6b --warmup 2 --steps 8
# --slots hypersloth-1,trl-grpo-64x1,trl-grpo-32x2,trl-grpo-16x4 --tag grpo` (docs/grpo.md).
# Fourth session: callI ran (records-grpo-grpo-0.6b.json: HyperSloth 12.1 s/step, 11-12 s of it generation, against
# TRL 7.1 s: Unsloth's backend decoded on its training forward); after rollout.sampling_mode, callK.
source scripts/device_calls_lib.sh  # the GPU environment, $W / $L, el, left, bench, show, pack, ...

callA() {  # MoE speed (item 7): a Qwen3-30B-A3B-shaped model (12 layers, 128 experts, 8 active, bf16) on the short
  # chats: HyperSloth at its defaults (targets read from the model: attention + the fused experts through Unsloth's
  # MoE LoRA path) against stock Unsloth + TRL at its best (32 x 1, checkpointing off, same varlen patch; Unsloth maps
  # gate/up/down_proj onto the experts itself), 3 warm-up + 20 timed steps each (~9 minutes)
  bench --workloads moe-short --slots hypersloth-1,unsloth-best --tag moe-fixed --budget-s $(left 540) \
    > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  grep -h "LoRA targets\|LoRA projections\|eager decoder\|CUDA graphs\|budget\|median step\|memory      peak" \
    $W/moe-short/out_hypersloth-1/logs/rank0.log | cut -c1-500
  pack
}

callB() {  # the fast path per architecture (item 4): every tiny architecture at defaults, graphed and eager, on
  # Unsloth (scripts/arch_check.py; ~6 minutes)
  timeout 560 python3 scripts/arch_check.py --out $OUT/arch --parallel 7 > $L/arch.log 2>&1
  el "arch check done"; cut -c1-1500 $L/arch.log | tail -20
  tar czf $OUT/arch-logs.tgz -C $OUT arch && rm -rf $OUT/arch/*.log
  pack
}

callC() {  # callA measured HyperSloth's MoE step at 1.41 s against stock's 0.34 s, 103 vs 63 GB: the same checkpoint
  # loaded stock (get_peft_model, the seven names) and HyperSloth's way (targets from the model; and with the seven
  # names), the same packed row timed in one process (scripts/moe_diag.py), then the architecture check (callB)
  CK=$W/ckpt_30b-a3b-12l
  [ -f $CK/config.json ] || python3 scripts/benchmark.py --as-system build --model 30b-a3b-12l --checkpoint $CK \
    > $L/build.log 2>&1
  el "checkpoint ready"
  timeout 280 python3 scripts/moe_diag.py $CK > $L/diag.log 2>&1
  el "diag done"; grep -v "Unsloth\|^$\|==\|\\\\" $L/diag.log | tail -30 | cut -c1-400
  timeout $(left 570) python3 scripts/arch_check.py --out $OUT/arch --parallel 7 > $L/arch.log 2>&1
  el "arch check done"; cut -c1-1200 $L/arch.log | tail -14
  tar czf $OUT/arch-logs.tgz -C $OUT arch && rm -rf $OUT/arch/*.log
  pack
}

callD() {  # callC: stock loading and ours run the same packed row equally (1.34 s, 59.5 GiB), so the 4x is in the
  # trainer or its inputs: both systems under torch.profiler for steps 4-6 (the kernel tables)
  bench --workloads moe-short --slots hypersloth-1-profile,unsloth-best-profile --warmup 2 --steps 5 --tag moe-prof \
    --token-budget 43008 \
    --budget-s $(left 500) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  keep_profiles moe-short
  for f in $OUT/profiles/*.txt; do echo "== $f"; head -45 $f | cut -c1-220; done
  pack
}

callE() {  # the MoE expert adapters as grouped GEMMs (training.expert_lora="grouped", train/lora/experts.py; 4.3x
  # PEFT's speed on the CPU) against Unsloth's MoE LoRA path (HyperSloth's auto on Unsloth) and stock, moe-short,
  # 3 warm-up + 20 timed steps each (~8 minutes; the checkpoint is built first)
  bench --workloads moe-short --slots hypersloth-1-grouped-experts,hypersloth-1,unsloth-best --tag moe-grouped \
    --budget-s $(left 560) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  for d in $W/moe-short/out_hypersloth-1*/; do
    echo "--- $(basename $d)"; grep -h "expert LoRA\|LoRA projections\|eager decoder\|budget probe\|median step\|memory      peak" \
      $d/logs/rank0.log | cut -c1-400
  done
  pack
}

callG() {  # callE's grouped system stepped aside on Unsloth (its compiled Qwen3MoeExperts lacks transformers' layout
  # attributes; lora/experts.read_layout now reads them from the tensors): the grouped experts alone, the token budget
  # callE's probe measured (66,816) given so no probe runs, against callE's figures for Unsloth's path (0.329 s) and
  # stock (0.335 s) on the same workload (~4 minutes with the checkpoint build)
  bench --workloads moe-short --slots hypersloth-1-grouped-experts --token-budget 66816 --warmup 3 --steps 20 \
    --tag moe-grouped2 --budget-s $(left 280) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  grep -h "expert LoRA\|LoRA projections\|eager decoder\|median step\|memory      peak\|Error\|error" \
    $W/moe-short/out_hypersloth-1-grouped-experts/logs/rank0.log | cut -c1-400
  pack
}

callI() {  # GRPO's speed (issue 34, item 8), its first run on a GPU: HyperSloth at its defaults against TRL's
  # GRPOTrainer + Unsloth at the splits that fit (docs/grpo.md), 2 warm-up + 8 timed steps (~9 minutes; each
  # step generates 64 completions of 256 tokens)
  bench --workloads grpo-0.6b --slots hypersloth-1,trl-grpo-64x1,trl-grpo-16x4 --warmup 2 --steps 8 --tag grpo \
    --budget-s $(left 570) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  grep -h "generation\|reward\|median step\|Error\|error" $W/grpo-0.6b/out_hypersloth-1/logs/rank0.log | tail -15 | cut -c1-400
  pack
}

callK() {  # GRPO again after rollout.sampling_mode (Unsloth's fused decode + CUDA-graph decode, as Unsloth's own GRPO
  # samples): HyperSloth at its defaults against TRL + Unsloth at callI's best split (64 x 1), same run (~6 minutes)
  bench --workloads grpo-0.6b --slots hypersloth-1,trl-grpo-64x1 --warmup 2 --steps 8 --tag grpo-decode \
    --budget-s $(left 560) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  grep -h "generation\|reward\|median step\|Error\|error\|Traceback" $W/grpo-0.6b/out_hypersloth-1/logs/rank0.log \
    | tail -15 | cut -c1-400
  pack
}

callL() {  # next: callK again with what this session added, TRL's generate seconds per step (bench_grpo.GenerateTimer)
  # and our log line on Unsloth's CUDA-graph decode (replayed token steps, or why it was off): is the 22 ms per
  # token step of callK the decode or HF generate's loop around it (~6 minutes)
  bench --workloads grpo-0.6b --slots hypersloth-1,trl-grpo-64x1 --warmup 2 --steps 8 --tag grpo-split \
    --budget-s $(left 560) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  grep -h "CUDA-graph decode\|Error\|Traceback" $W/grpo-0.6b/out_hypersloth-1/logs/rank0.log | head -5 | cut -c1-400
  python3 -c "import json; [print(r['system'], 'generation_s', [round(g, 2) if g else g for g in r['generation_s']]) \
    for r in json.load(open('$OUT/records-grpo-split-grpo-0.6b.json'))]"
  pack
}

"$@"
