#!/usr/bin/env bash
# 2026-12-03: the device plans of that day's two sessions. One H200 (kind nvidia-h200), carry .whl
# (`bash ../shared/device/wheelhouse.sh`). Run from the repository root as
# `bash docs/benchmarks/2026-12-03-device-calls.sh callN`. Records land in $OUT.
# Ran in the second session: callO, then callN (docs/benchmarks.md, 2026-12-03 second session). Next, in this order:
#   callS  GRPO's sampling, engine against engine (~6 min): where GRPO's 1.5x must come from
#   callR  GRPO's step under torch.profiler (~4 min)
#   callT  the tiny Qwen3.5-MoE on Unsloth with CUDA_LAUNCH_BLOCKING=1 and its traceback, and gemma3_mm (~3 min)
#   then callG of 2026-12-02-device-calls.sh (the leaner grouped MoE pass) and callA + callM of
#   2026-12-02-fa4-device-calls.sh (long-0.6b FA4 profile).
# Ran in the third session: callS, callR, callT, callU. Next (2026-12-05 had no device time): callW (GRPO's sampling
#   profiled), callX (gpt-oss packed on Unsloth), callV (Qwen3.5-MoE sorted-pad on Unsloth), callY (the architectures
#   added 2026-12-05), then callA + callM of 2026-12-02-fa4-device-calls.sh.
source scripts/device_calls_lib.sh  # the GPU environment, $W / $L, el, left, bench, show, pack, ...

callN() {  # GRPO (issue 34 item 8) with the brief's 20 timed steps (callI / callK timed 8): HyperSloth at defaults
  # against TRL GRPOTrainer + Unsloth at 64x1 (its fastest split in callI), TRL's generate seconds per step
  # (bench_grpo.GenerateTimer) and our line on Unsloth's CUDA-graph decode (replayed token steps, or why it was
  # off): is the ~22 ms per token step of callK the decode or HF generate's loop around it (~9.5 minutes)
  bench --workloads grpo-0.6b --slots hypersloth-1,trl-grpo-64x1 --warmup 2 --steps 20 --tag grpo-split20 \
    --budget-s $(left 570) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  grep -h "CUDA-graph decode\|packed rows\|Error\|Traceback" $W/grpo-0.6b/out_hypersloth-1/logs/rank0.log | head -5 \
    | cut -c1-400
  python3 -c "import json; [print(r['system'], r['s_median'], r['s_p90'], 'generation_s', \
    [round(g, 2) if g else g for g in r['generation_s']]) \
    for r in json.load(open('$OUT/records-grpo-split20-grpo-0.6b.json'))]"
  pack
}

callO() {  # gpt-oss, Qwen3.5-MoE, GLM-4.7-Flash and Qwen3-MoE at defaults through Unsloth, graphed and eager (scripts/arch_check.py): the
  # packed-row check's first GPU measurement (train/packing/check.py; gpt-oss's transformers decoder builds its mask
  # without the position ids), and gpt-oss's row of docs/models.md's fast-path table (~4 minutes)
  timeout $(left 290) python3 scripts/arch_check.py --out $OUT/arch --architectures gpt_oss,qwen3_5_moe,glm4_moe_lite,qwen3_moe,qwen3 \
    --parallel 10 > $L/arch.log 2>&1
  el "arch check done"; cut -c1-1500 $L/arch.log | tail -12
  python3 -c "import json; [print(r['architecture'], k, (r[k].get('packing') or {}), r[k].get('exit')) \
    for r in json.load(open('$OUT/arch/arch_check.json')) for k in ('graphed', 'eager')]"
  tar czf $OUT/arch-logs.tgz -C $OUT arch && rm -rf $OUT/arch/*.log
  pack
}

# The second session of 2026-12-03 (1800 s of device time): callN ran first and our GRPO slot failed 35 s in (the
# packed-row check under Unsloth's compiled blocks, fixed since), then hung ~4 minutes before it exited; TRL's slot
# ran out of time at 17 of 22 steps. callN is therefore split over two calls on the warm machine: callP times our
# slot and then runs callO's architecture check, callQ times TRL's slot (same data, same machine, within 30 s).
callP() {  # GRPO, HyperSloth at defaults, 2 warm-up + 20 timed steps; then callO's check of four MoE models (~9 min)
  bench --workloads grpo-0.6b --slots hypersloth-1 --warmup 2 --steps 20 --tag grpo-split20-ours \
    --budget-s $(left 300) > $L/bench-ours.log 2>&1
  el "bench (ours) done"; show $L/bench-ours.log
  cp $W/grpo-0.6b/out_hypersloth-1/logs/rank0.log $L/grpo-rank0.log 2>/dev/null
  grep -h "CUDA-graph decode\|packed rows\|Error\|Traceback" $L/grpo-rank0.log | head -5 | cut -c1-400
  timeout $(left 575) python3 scripts/arch_check.py --out $OUT/arch \
    --architectures gpt_oss,qwen3_5_moe,glm4_moe_lite,qwen3_moe,qwen3 --parallel 10 > $L/arch.log 2>&1
  el "arch check done"; cut -c1-1500 $L/arch.log | tail -12
  python3 -c "import json; [print(r['architecture'], k, (r[k].get('packing') or {}), r[k].get('exit')) \
    for r in json.load(open('$OUT/arch/arch_check.json')) for k in ('graphed', 'eager')]"
  tar czf $OUT/arch-logs.tgz -C $OUT arch && rm -rf $OUT/arch/*.log
  pack
}

callQ() {  # GRPO, TRL GRPOTrainer + Unsloth at 64x1, 2 warm-up + 20 timed steps, on the data callP built (~6 min)
  bench --workloads grpo-0.6b --slots trl-grpo-64x1 --warmup 2 --steps 20 --tag grpo-split20-trl \
    --budget-s $(left 570) > $L/bench-trl.log 2>&1
  el "bench (TRL) done"; show $L/bench-trl.log
  python3 -c "import json; [print(r['system'], r.get('s_median'), r.get('s_p90'), 'generation_s', \
    [round(g, 2) if g else g for g in r.get('generation_s') or []]) \
    for r in json.load(open('$OUT/records-grpo-split20-trl-grpo-0.6b.json'))]"
  pack
}

callR() {  # GRPO's sampling under torch.profiler (issue 34): ours at defaults with the per-phase timer and
  # torch.profiler over steps 4-6, which hold the sampling (HyperSlothGRPOTrainer.training_step). Where do the ~22.7 ms
  # per token step go: the replayed decode graph, the logits processor (SeededSampler), HF generate's loop (~4 min)
  bench --workloads grpo-0.6b --slots hypersloth-1-profile --warmup 2 --steps 6 --tag grpo-profile \
    --budget-s $(left 280) > $L/bench-profile.log 2>&1
  el "bench (profile) done"; show $L/bench-profile.log
  keep_profiles grpo-0.6b
  pack
}

callS() {  # GRPO's sampling, engine against engine (scripts/sampling_bench.py, issue 34): Unsloth's segmented decode
  # graphs (today) against HF generate on the transformers backend, dynamic cache eager and static cache compiled
  # (CUDA graphs through torch.compile): which one can take sampling below the ~19 ms per token step 1.5x needs (~6 min)
  [ -f $W/ckpt_0.6b/config.json ] || python3 scripts/benchmark.py --as-system build --model 0.6b --checkpoint $W/ckpt_0.6b
  timeout $(left 560) python3 scripts/sampling_bench.py --model $W/ckpt_0.6b --engines unsloth,hf-static,hf-dynamic \
    --calls 6 --out $OUT/sampling.json > $L/sampling.log 2>&1
  el "sampling bench done"; grep '^{' $L/sampling.log; grep -h "Error\|Traceback" $L/sampling.log | head -5 | cut -c1-300
  pack
}

callT() {  # the tiny Qwen3.5-MoE through Unsloth stopped with an illegal memory access in callO: again with
  # CUDA_LAUNCH_BLOCKING=1, eager and graphed, the failed runs' tracebacks in the record; and the tiny multimodal
  # Gemma 3 (gemma3_mm, Gemma 3 4B+'s form), never run through Unsloth yet (~3 min)
  timeout $(left 200) python3 scripts/arch_check.py --out $OUT/arch --architectures qwen3_5_moe,gemma3_mm --launch-blocking \
    > $L/arch.log 2>&1
  el "arch check done"
  python3 -c "import json; [print(r['architecture'], k, r[k].get('exit'), '\n'.join(r[k].get('traceback') or [])[-3000:]) \
    for r in json.load(open('$OUT/arch/arch_check.json')) for k in ('graphed', 'eager')]"
  tar czf $OUT/arch-logs.tgz -C $OUT arch && rm -rf $OUT/arch/*.log
  pack
}

# The third session of 2026-12-03 (1800 s): callS, callR (its profiler never finished: timeout) and callT (its record
# was lost to the call's timeout; arch_check.py now writes each run's record and a failed run's rank log as it ends)
# ran first. callU: the two findings of callT and callG of 2026-12-02-device-calls.sh, in one call.
callU() {  # gemma3_mm graphed after step_graph._output keeps the decoder's output class (callT: AttributeError
  # image_hidden_states) and the tiny Qwen3.5-MoE eager with CUDA_LAUNCH_BLOCKING=1 and its rank log, side by side;
  # then the grouped MoE experts alone on the 30B-A3B shape (callG) (~9.5 minutes)
  timeout $(left 230) python3 scripts/arch_check.py --out $OUT/arch --architectures gemma3_mm --modes graphs \
    > $L/arch-gemma.log 2>&1 &
  timeout $(left 230) python3 scripts/arch_check.py --out $OUT/arch --work /tmp/hs_arch2 --architectures qwen3_5_moe \
    --modes eager --launch-blocking > $L/arch-qwen35.log 2>&1 &
  wait; el "arch checks done"
  for f in $OUT/arch/*-graphs.json $OUT/arch/*-eager.json; do python3 -c "import json, sys; r = json.load(open(sys.argv[1])); \
    print(r['run'], r['exit'], r.get('losses'), r.get('cuda_graphs'), '\n'.join(r.get('traceback') or [])[-2500:])" $f; done
  tar czf $OUT/arch-logs.tgz -C $OUT arch && rm -rf $OUT/arch
  bench --workloads moe-short --slots hypersloth-1-grouped-experts --token-budget 66816 --warmup 3 --steps 20 \
    --tag moe-grouped2 --budget-s $(left 560) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  grep -h "expert LoRA\|LoRA projections\|eager decoder\|median step\|memory      peak\|Error\|error" \
    $W/moe-short/out_hypersloth-1-grouped-experts/logs/rank0.log | cut -c1-400
  pack
}

callV() {  # next: callU found the tiny Qwen3.5-MoE's illegal memory access in the packed-row check's first forward
  # (one 16-token sample, no_grad, Unsloth's blocks forced eager), surfacing at the next block's fork_rng, so a Triton
  # kernel (they do not check launches, CUDA_LAUNCH_BLOCKING or not): does training itself run, the check skipped
  # (batching sorted-pad), and packed? (~3 min)
  timeout $(left 200) python3 scripts/arch_check.py --out $OUT/arch --architectures qwen3_5_moe --modes eager \
    --batching sorted-pad > $L/arch-sorted.log 2>&1
  el "arch check done"
  for f in $OUT/arch/*-eager.json; do python3 -c "import json, sys; r = json.load(open(sys.argv[1])); \
    print(r['run'], r['exit'], r.get('losses'), '\n'.join(r.get('traceback') or [])[-2500:])" $f; done
  tar czf $OUT/arch-logs.tgz -C $OUT arch && rm -rf $OUT/arch
  pack
}

callW() {  # next: where GRPO's ~20 ms per token step goes (callS: Unsloth 20.6, HF static compiled 19.4, HF dynamic
  # 92.6; a 0.6B decode at batch 64 reads ~2-3 GB, ~1 ms): token steps 101-108 of a sampling under torch.profiler,
  # and Unsloth's decode with HF's per-token-step host sync deferred (unsloth-deferred: what that sync costs),
  # wall against GPU-busy per token step and the operator tables, Unsloth's decode with and without its LoRA GEMMs
  # (unsloth-no-lora: what sampling on merged weights could gain at most) and HF static (~9 min)
  [ -f $W/ckpt_0.6b/config.json ] || python3 scripts/benchmark.py --as-system build --model 0.6b --checkpoint $W/ckpt_0.6b
  timeout $(left 560) python3 scripts/sampling_bench.py --model $W/ckpt_0.6b --engines unsloth,unsloth-deferred,unsloth-no-lora,hf-static --calls 4 \
    --profile-steps 8 --profile-from 100 --profile-dir $OUT/profiles --out $OUT/sampling-profile.json > $L/sampling.log 2>&1
  el "sampling profile done"; grep '^{' $L/sampling.log; head -c 3000 $OUT/profiles/unsloth.txt
  pack
}

callX() {  # next: gpt-oss through Unsloth with the sink attention's per-sample masks (train/packing/sink_attention.py,
  # the packed-row check's third fix on Unsloth): does the check now measure it exact and train it packed, graphed
  # and eager the same losses (callO: leaked 1.32 against 1.30, sorted-pad) (~3 min)
  timeout $(left 200) python3 scripts/arch_check.py --out $OUT/arch --architectures gpt_oss > $L/arch-gptoss.log 2>&1
  el "arch check done"
  for f in $OUT/arch/*-graphs.json $OUT/arch/*-eager.json; do python3 -c "import json, sys; r = json.load(open(sys.argv[1])); \
    print(r['run'], r['exit'], r.get('packing'), r.get('losses'), '\n'.join(r.get('lines') or [])[-1500:], \
    '\n'.join(r.get('traceback') or [])[-2500:])" $f; done
  tar czf $OUT/arch-logs.tgz -C $OUT arch && rm -rf $OUT/arch
  pack
}


callY() {  # next (written 2026-12-05, a session without device time): the architectures added on the CPU that day
  # through Unsloth at defaults, graphed and eager: dense Qwen3.5 and Qwen3.5-MoE as published (multimodal), Gemma 4
  # and its MoE (per-layer head widths), Granite 4.0-H (Mamba-2 hybrid: on Unsloth the per-sample Mamba fix is not
  # installed, so expect sorted-pad unless Unsloth's kernels keep samples apart) (~5 min)
  timeout $(left 320) python3 scripts/arch_check.py --out $OUT/arch \
    --architectures qwen3_5,qwen3_5_moe_mm,gemma4,gemma4_moe,granite4_h --parallel 10 > $L/arch-new.log 2>&1
  el "arch check done"
  for f in $OUT/arch/*-graphs.json $OUT/arch/*-eager.json; do python3 -c "import json, sys; r = json.load(open(sys.argv[1])); \
    print(r['run'], r['exit'], r.get('packing'), r.get('losses'), '\n'.join(r.get('traceback') or [])[-1500:])" $f; done
  tar czf $OUT/arch-logs.tgz -C $OUT arch && rm -rf $OUT/arch
  pack
}

"$@"
