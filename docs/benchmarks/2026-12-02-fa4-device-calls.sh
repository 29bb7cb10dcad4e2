#!/usr/bin/env bash
# Issue 33, FlashAttention-4 inside our CUDA graphs: one H200 (kind nvidia-h200). Run 2026-12-02 (second session):
# callA, callB (the smoke test failed: 'too many values to unpack'; then 'windowed attention not supported'), callB
# and callC with FA4 computing local attention (NaN from step 2: those FA4 rows are no result), callD after the fix
# (the smoke test passes: docs/benchmarks/fa4-smoke-2026-12-02-*.json). Next session: callA, then callB and callC
# (HyperSloth at its defaults, `auto`, which now checks and times FA4 itself; hypersloth-1-flash; stock), then
# callA + callE (short-8b) and callA + callF (the 262k first steps) as the time allows.
# Third session: callA, callB (short-0.6b: auto picked FA4, 1.57x), callC (long-0.6b: auto's eager timing kept
# bundled flash; the kernel table), a call by hand (long-0.6b with attention="fa4": 1.41x; one 262k sample: 75.4 s).
# Next: callA, then callHJ (callH: long-0.6b at defaults with the check that now times graph replays, stock in the
# same run; callJ: FA4 against bundled flash, loss and gradients, 8k and 32k rows), then callE (short-8b), each right
# after the one before; then 2026-12-02-device-calls.sh callI (GRPO) as the time allows.
# Fourth session: callA, callHJ (long-0.6b at defaults 1.39x, auto picked FA4; FA4's gradients), callE (short-8b
# 1.05x); then GRPO. Next: callA, then callM (profiles of long-0.6b, FA4 against stock), then callF's 8B half.
# 2026-12-05 (second session): callA + callM ran. Next: callA, then callK (262k on 0.6B with attention's outputs kept
# through checkpointing, and without), callR2 + callE2 (long-0.6b and short-8b with rows within the graphs' reach),
# callP2 (a 131k sample's step profiled, plain and kept), then callF's 8B half (never run with FA4); each after callA
# when the machine went cold.
# 2026-12-05 (sixth session, one H100): callA, callR2 (capped rows: same median, worse mean; HYPERSLOTH_GRAPH_ROWS
# stays off), callK3 (callK cut to fit: kept vs plain on one 131,072-token sample). Next: callA, then callE2, callP2,
# callF's 8B half.
# 2026-12-05 (seventh session, one H100): callA, callP2 (the script ran cuDNN's SDPA, not FA4: fixed in 42a810e),
# callF8 (262k on 8B: 209.2 s), callK4 (262k on 0.6B: plain 64.2 s, kept 51.9 s), callE2 (capped rows: no gain).
# Next: callKT (the kept default's GPU test and the fixed reuse_check.py; .whl only), then callA + callP2 again (a
# 131k step profiled on FA4).
# The row cap that callR2 and callE2 switch on (HYPERSLOTH_GRAPH_ROWS=1) was removed after them (it did not pay): at
# later commits those calls time the defaults twice.
# Before the calls, on this machine, from the repository root:
#   bash ../shared/device/wheelhouse.sh   # .whl/ (unsloth, trl, ...: 25 MB), if not there yet
#   bash scripts/fa4_wheels.sh            # .fa4/part1 (the DSL's 193 MB compiler library as xz), .fa4/part2 (the rest)
# Then three calls, each right after the one before (the machine keeps .fa4/site only while warm, 30 s):
#   callA  carry [".fa4/part1"]          part 1 into .fa4/site (~10 s once the machine is up)
#   callB  carry [".whl", ".fa4/part2"]  part 2 beside it; the smoke test (scripts/fa4_smoke.py: FA4's varlen forward
#                                        and backward on Qwen3-0.6B heads vs bundled flash, the JIT time, a CUDA-graph
#                                        replay); then short-0.6b: hypersloth-1-fa4, hypersloth-1-flash, unsloth-best
#   callC  carry []                      (.whl, .fa4 and /tmp/site are still there) long-0.6b: the same three; the
#                                        smoke test as a kernel benchmark: 8B heads on 22k of chats, 0.6B on 8k, one
#                                        131,072-token sample on both layouts (as many as the time allows)
# Each `bash docs/benchmarks/2026-12-02-fa4-device-calls.sh callX`. Records (tag 2026-12-02-fa4) and logs in $OUT.
set -u

el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
T0=$(date +%s)

callA() {  # part 1 alone (no .whl in this call: the GPU environment is set up in callB)
  python3 scripts/fa4_pack.py unpack .fa4/part1 --site .fa4/site || exit 3
  el "part 1 in .fa4/site: $(du -sh .fa4/site | cut -f1)"
  nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader
  python3 -c "import sys, torch, importlib.util as u; print(sys.version.split()[0], torch.__version__, 'cuda.bindings' \
    if u.find_spec('cuda') and u.find_spec('cuda.bindings') else 'no cuda.bindings')"
}

fa4_ready() {  # the GPU environment (.whl), part 2 beside part 1, FA4 on PYTHONPATH; exit 3 when part 1 is gone
  source scripts/device_calls_lib.sh  # $W, $L, el (from its own start), left, bench, show, pack
  [ -f .fa4/site/.part1.done ] || { echo "part 1 is not on this machine (it went cold): run callA, then this call within 30 s"; exit 3; }
  [ -f .fa4/site/.part2.done ] || python3 scripts/fa4_pack.py unpack .fa4/part2 --site .fa4/site || exit 3
  source scripts/fa4_env.sh
  python3 -c "import flash_attn.cute.interface, cutlass; print('flash_attn.cute imports; cutlass', cutlass.__version__)" 2>&1 | tail -2
}

smoke() {  # NAME ARGS: scripts/fa4_smoke.py ARGS --out $OUT/fa4-smoke-NAME.json; its summary line; rc 2 = FA4 did not run
  local name=$1 limit=$(left 575); shift
  [ $limit -gt 180 ] && limit=180
  [ $limit -lt 30 ] && { echo "smoke $name: out of time"; return 2; }
  timeout $limit python3 scripts/fa4_smoke.py "$@" --out $OUT/fa4-smoke-$name.json > $L/smoke-$name.log 2>&1; local rc=$?
  tail -1 $L/smoke-$name.log | cut -c1-700; return $rc
}

attention_lines() {  # WORKLOAD: what each HyperSloth system attended with, its start-up and graphs
  for d in $W/$1/out_hypersloth-1*/; do
    echo "--- $(basename $d)"; grep -h "attention:\|graphs\|eager decoder\|start-up\|median step" $d/logs/rank0.log | cut -c1-300
  done
}

callB() {
  fa4_ready
  smoke 0.6b --layout 0.6b; rc=$?
  el "smoke rc=$rc"
  if [ $rc -eq 2 ]; then echo "FA4 did not run: benchmark left out (see the smoke log)"; pack; exit 1; fi
  bench --workloads short-0.6b --slots "hypersloth-1,hypersloth-1-flash,unsloth-best" --warmup 3 --steps 20 \
    --tag 2026-12-02-fa4 --budget-s $(left 560) > $L/bench-short.log 2>&1
  el "short-0.6b done"; show $L/bench-short.log; attention_lines short-0.6b
  du -sh ~/.cache/hypersloth/fa4 2>/dev/null
  pack
}

callC() {
  fa4_ready
  bench --workloads long-0.6b --slots "hypersloth-1,hypersloth-1-flash,unsloth-best" --warmup 3 --steps 20 \
    --tag 2026-12-02-fa4 --budget-s $(left 480) > $L/bench-long.log 2>&1
  el "long-0.6b done"; show $L/bench-long.log; attention_lines long-0.6b
  # FA4 vs bundled flash, forward+backward, eager and graphed (the attn_bench rows): short chats, one long sample
  smoke 8b-22k --layout 8b --row-tokens 22528
  smoke 0.6b-8k --layout 0.6b --row-tokens 8192
  smoke 0.6b-131k --layout 0.6b --lengths 131072 --reps 5
  smoke 8b-131k --layout 8b --lengths 131072 --reps 5
  el "smoke tests done"
  pack
}

callD() {  # after callA, carry [".whl", ".fa4/part2"]: the smoke test alone (callB/callC found FA4 wrong: outputs 4
  # off, NaN losses from step 2; torch 2.11 hands FA4 aten's window -1, read as local attention; fixed in
  # train/attention/fa4.py), the 0.6B layout, then 8B heads on 22k of chats while time is left
  fa4_ready
  smoke 0.6b --layout 0.6b --reps 10; el "smoke 0.6b rc=$?"
  [ $(left 150) -gt 60 ] && { smoke 8b-22k --layout 8b --row-tokens 22528 --reps 10; el "smoke 8b-22k rc=$?"; }
  pack
}

callE() {  # short-8b, 4-bit: defaults (auto), bundled flash, stock at its best split there (16 x 2); Unsloth's own rule
  # may pick FA4 at hidden 4096 (its record says), ~9 minutes
  fa4_ready
  bench --workloads short-8b --slots "hypersloth-1,hypersloth-1-flash,unsloth-best-16x2" --warmup 3 --steps 20 \
    --tag 2026-12-02-fa4 --budget-s $(left 560) > $L/bench-8b.log 2>&1
  el "short-8b done"; show $L/bench-8b.log; attention_lines short-8b
  pack
}

callF() {  # one 262,144-token sample trained whole, first step (issue 33: <= 60 s on 0.6B, <= 120 s on 8B 4-bit)
  fa4_ready
  bench --workloads longctx-0.6b --long-tokens 262144 --warmup 0 --steps 1 --slots hypersloth-1 --tag fa4-lc262k \
    --budget-s $(left 250) > $L/bench-lc06.log 2>&1
  el "longctx-0.6b done"; show $L/bench-lc06.log; attention_lines longctx-0.6b
  bench --workloads longctx-8b --long-tokens 262144 --warmup 0 --steps 1 --slots hypersloth-1 --tag fa4-lc262k \
    --budget-s $(left 570) > $L/bench-lc8.log 2>&1
  el "longctx-8b done"; show $L/bench-lc8.log; attention_lines longctx-8b
  pack
}

callF8() {  # after callA, carry [".whl", ".fa4/part2"]: callF's 8B half alone (never run with FA4): one 262,144-token
  # sample on Qwen3-8B 4-bit trained whole, first step (<= 120 s; 199 s on 2026-12-01 with bundled flash), ~9 min
  fa4_ready
  bench --workloads longctx-8b --long-tokens 262144 --warmup 0 --steps 1 --slots hypersloth-1 --tag fa4-lc262k \
    --budget-s $(left 585) > $L/bench-lc8.log 2>&1
  el "longctx-8b done"; show $L/bench-lc8.log; attention_lines longctx-8b
  grep -h "step 1\|first step\|peak" $W/longctx-8b/out_hypersloth-1/logs/rank0.log | tail -5 | cut -c1-300
  pack
}

callK4() {  # after callA, carry [".whl", ".fa4/part2"]: one 262,144-token sample on Qwen3-0.6B (among 31 short ones), first
  # step, the plain recompute then attention's outputs kept (typed as one command on 2026-12-05, seventh session: plain
  # 64.2 s, kept 51.9 s; kept is the default since 42a810e, so the plain run now needs HYPERSLOTH_REUSE_ATTENTION=0)
  fa4_ready
  HYPERSLOTH_REUSE_ATTENTION=0 bench --workloads longctx-0.6b --long-tokens 262144 --warmup 0 --steps 1 \
    --slots hypersloth-1 --tag h100-lc262k --budget-s 250 > $L/bench-plain.log 2>&1
  el "plain done"; show $L/bench-plain.log
  bench --workloads longctx-0.6b --long-tokens 262144 --warmup 0 --steps 1 --slots hypersloth-1 \
    --tag h100-lc262k-kept --budget-s $(left 560) > $L/bench-kept.log 2>&1
  el "kept done"; show $L/bench-kept.log
  grep -h "attention outputs\|attention:" $W/longctx-0.6b/out_hypersloth-1/logs/rank0.log | head -4 | cut -c1-300
  pack
}

callRC() {  # carry [".whl"] (no FA4 needed: Unsloth's lean varlen path on bundled flash): scripts/reuse_check.py after
  # it applies the worker's patches (patches.unsloth_training_patches; before, its rows went to SDPA and the kept path
  # was never reached): loss and LoRA gradients kept vs plain next to plain vs plain, at 32k and 64k (~3 min)
  source scripts/device_calls_lib.sh
  timeout $(left 560) python3 scripts/reuse_check.py --model 0.6b --checkpoint $W/ckpt_0.6b --rows 32768,65536 \
    --repeats 2 --out $OUT/reuse-check-0.6b.json > $L/reuse-check.log 2>&1; echo "rc=$?"
  el "reuse check done"; grep -v "^Unsloth\|^==\|^ *$" $L/reuse-check.log | tail -40 | cut -c1-300
  pack
}

callKT() {  # carry [".whl"]: the kept-attention default on the GPU, both checks in one call (~5 min): the GPU test (the
  # tiny model through hypersloth-train with Unsloth's checkpointing, kept against HYPERSLOTH_REUSE_ATTENTION=0: losses,
  # adapter, kept == reused), then callRC's reuse_check.py (Qwen3-0.6B's shape, loss and gradients at 32k and 64k)
  source scripts/device_calls_lib.sh
  timeout $(left 240) python3 -m pytest -q -x -p no:cacheprovider tests/gpu/test_unsloth_runs.py \
    -k attention_outputs_kept > $L/gpu-test.log 2>&1; echo "gpu test rc=$?"; tail -15 $L/gpu-test.log | cut -c1-300
  timeout $(left 560) python3 scripts/reuse_check.py --model 0.6b --checkpoint $W/ckpt_0.6b --rows 32768,65536 \
    --repeats 2 --out $OUT/reuse-check-0.6b.json > $L/reuse-check.log 2>&1; echo "reuse check rc=$?"
  el "reuse check done"; grep -v "^Unsloth\|^==\|^ *$" $L/reuse-check.log | tail -40 | cut -c1-300
  pack
}

long_defaults() {  # long-0.6b at defaults after the check's fix (it times graph replays for a graphed decoder: FA4
  # 0.41 ms against 0.70 there), stock at its best in the same run; the 1.45x target (~4 minutes)
  bench --workloads long-0.6b --slots "hypersloth-1,unsloth-best" --warmup 3 --steps 20 \
    --tag 2026-12-03-fa4 --budget-s $(left $1) > $L/bench-long.log 2>&1
  el "long-0.6b done"; show $L/bench-long.log; attention_lines long-0.6b
}

fa4_gradients() {  # issue 33 item 3: FA4's loss and gradients against bundled flash next to eager-vs-eager, graphed,
  # on packed rows of 8k and 32k tokens (scripts/graph_check.py --attention fa4; ~3 minutes)
  timeout $(left $1) python3 scripts/graph_check.py --model 0.6b --rows 8192,32768 --attention fa4 \
    --out $OUT/graph-check-fa4-0.6b.json > $L/graph-check.log 2>&1
  el "graph check done"; grep -v "^Unsloth\|^==\|^ *$" $L/graph-check.log | tail -60 | cut -c1-300
}

callM() {  # after callA, carry [".whl", ".fa4/part2"]: why long-0.6b stops at 1.39x (0.349 s against stock's 0.485;
  # 1.45x asks 0.334): steps 4-6 under torch.profiler on FA4 at defaults and on stock, kernel tables side by side
  # (~4 minutes)
  fa4_ready
  bench --workloads long-0.6b --slots "hypersloth-1-profile,unsloth-best-profile" --warmup 3 --steps 8 \
    --tag 2026-12-02-fa4-prof --budget-s $(left 480) > $L/bench-prof.log 2>&1
  el "profiles done"; show $L/bench-prof.log; keep_profiles long-0.6b
  pack
}

callH() { fa4_ready; long_defaults 400; pack; }
callJ() { fa4_ready; fa4_gradients 560; pack; }
callHJ() { fa4_ready; long_defaults 330; fa4_gradients 570; pack; }  # both in one call (one start fewer)

callK() {  # after callA, carry [".whl", ".fa4/part2"]: one 262,144-token sample on Qwen3-0.6B, first step (<= 60 s; 75.4 s
  # on 2026-12-03), with attention's outputs kept through checkpointing (HYPERSLOTH_REUSE_ATTENTION=1,
  # train/attention/recompute.py: the recompute skips attention's forward) and then without, same machine; first
  # scripts/reuse_check.py: the kept outputs' loss and gradients against the plain recompute at 32k (~9 min in all)
  fa4_ready
  timeout $(left 120) python3 scripts/reuse_check.py --model 0.6b --checkpoint $W/ckpt_0.6b --rows 32768 \
    --out $OUT/reuse-check-0.6b.json > $L/reuse-check.log 2>&1
  el "reuse check done"; grep -v "^Unsloth\|^==\|^ *$" $L/reuse-check.log | tail -25 | cut -c1-300
  HYPERSLOTH_REUSE_ATTENTION=1 bench --workloads longctx-0.6b --long-tokens 262144 --warmup 0 --steps 1 \
    --slots hypersloth-1 --tag fa4-lc262k-kept --budget-s $(left 350) > $L/bench-lc06-kept.log 2>&1
  el "kept done"; show $L/bench-lc06-kept.log
  grep -h "attention outputs\|Traceback\|Error" $W/longctx-0.6b/out_hypersloth-1/logs/rank0.log | head -5 | cut -c1-300
  bench --workloads longctx-0.6b --long-tokens 262144 --warmup 0 --steps 1 --slots hypersloth-1 --tag fa4-lc262k \
    --budget-s $(left 570) > $L/bench-lc06.log 2>&1
  el "without done"; show $L/bench-lc06.log
  pack
}

callK3() {  # after callA, carry [".whl", ".fa4/part2"]: callK cut to ~4 min (the sixth session had 400 s left): the
  # reuse check at 32k, then one 131,072-token sample on Qwen3-0.6B, first step, kept then plain
  fa4_ready
  timeout $(left 100) python3 scripts/reuse_check.py --model 0.6b --checkpoint $W/ckpt_0.6b --rows 32768 \
    --out $OUT/reuse-check-0.6b.json > $L/reuse-check.log 2>&1
  el "reuse check done"; grep -v "^Unsloth\|^==\|^ *$" $L/reuse-check.log | tail -12 | cut -c1-300
  HYPERSLOTH_REUSE_ATTENTION=1 bench --workloads longctx-0.6b --long-tokens 131072 --warmup 0 --steps 1 \
    --slots hypersloth-1 --tag fa4-lc131k-kept --budget-s 140 > $L/bench-kept.log 2>&1
  el "kept done"; show $L/bench-kept.log
  grep -h "attention outputs" $W/longctx-0.6b/out_hypersloth-1/logs/rank0.log | head -3 | cut -c1-300
  bench --workloads longctx-0.6b --long-tokens 131072 --warmup 0 --steps 1 --slots hypersloth-1 --tag fa4-lc131k \
    --budget-s 140 > $L/bench-plain.log 2>&1
  el "plain done"; show $L/bench-plain.log
  pack
}

callR2() {  # after callA, carry [".whl", ".fa4/part2"]: long-0.6b with packed rows capped at the CUDA graphs' reach
  # (HYPERSLOTH_GRAPH_ROWS=1, trainer_args.rows_within_graphs: 3 of 23 steps ran eagerly at ~2x a graphed row's cost per
  # token, 2026-12-02/05) with stock at its best in the same run, then ours at defaults; mean, p90 and median (~6 min)
  fa4_ready
  HYPERSLOTH_GRAPH_ROWS=1 bench --workloads long-0.6b --slots "hypersloth-1,unsloth-best" --warmup 3 --steps 20 \
    --tag rows-capped --budget-s $(left 330) > $L/bench-long-capped.log 2>&1
  el "capped done"; show $L/bench-long-capped.log; grep -h "packed rows of at most\|eager decoder" \
    $W/long-0.6b/out_hypersloth-1/logs/rank0.log | head -3 | cut -c1-300
  bench --workloads long-0.6b --slots hypersloth-1 --warmup 3 --steps 20 --tag rows-default --budget-s $(left 570) \
    > $L/bench-long-default.log 2>&1
  el "default done"; show $L/bench-long-default.log
  pack
}

callP2() {  # after callA, carry [".whl", ".fa4/part2"]: where one long sample's step goes (262,144 tokens on Qwen3-0.6B:
  # 75.4 s against 60; attention's forward+backward and the recompute explain ~57 s): torch.profiler over one
  # 131,072-token sample with checkpointing and FA4 (scripts/profile_step.py --profile-long), plain and with
  # attention's outputs kept (~5 min)
  fa4_ready
  [ -f $W/ckpt_0.6b/config.json ] || python3 scripts/benchmark.py --as-system build --model 0.6b --checkpoint $W/ckpt_0.6b
  for reuse in "" "--reuse-attention"; do
    timeout $(left 560) python3 scripts/profile_step.py --checkpoint $W/ckpt_0.6b --gc unsloth --attention fa4 \
      --profile-long 131072 $reuse --out $OUT/profile-long-131k${reuse:+-kept}.json > $L/profile-long${reuse:+-kept}.log 2>&1
    el "profile ${reuse:-plain} done"; grep -h "^PROFILE" $L/profile-long${reuse:+-kept}.log | cut -c1-800
    head -c 3000 $OUT/profile-long-131k${reuse:+-kept}-long.txt 2>/dev/null; echo
  done
  pack
}

callE2() {  # after callA, carry [".whl", ".fa4/part2"]: short-8b 4-bit with packed rows capped at the CUDA graphs' reach
  # (HYPERSLOTH_GRAPH_ROWS=1: every step two graphed rows instead of one eager row of ~22-29k tokens) and at defaults,
  # 20 steps each (~6 min): the row cap becomes the default only if this does not lose (callR2 is the long-0.6b half)
  fa4_ready
  HYPERSLOTH_GRAPH_ROWS=1 bench --workloads short-8b --slots hypersloth-1 --warmup 3 --steps 20 --tag rows-capped \
    --budget-s $(left 300) > $L/bench-8b-capped.log 2>&1
  el "capped done"; show $L/bench-8b-capped.log
  bench --workloads short-8b --slots hypersloth-1 --warmup 3 --steps 20 --tag rows-default --budget-s $(left 570) \
    > $L/bench-8b-default.log 2>&1
  el "default done"; show $L/bench-8b-default.log
  pack
}

"$@"
