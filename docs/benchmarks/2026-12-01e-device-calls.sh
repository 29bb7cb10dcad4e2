#!/usr/bin/env bash
# Fifth session of 2026-12-01, one H200 (kind nvidia-h200, carry .whl); run from the repository root as
# `bash docs/benchmarks/2026-12-01e-device-calls.sh callS`. This session also ran callP, callR and callQ of
# docs/benchmarks/2026-12-01d-device-calls.sh (prepared last session): their records, tagged next-*, are kept as
# records-2026-12-01e-exact131k-longctx-8b.json (callP), records-2026-12-01e-lc524k-longctx-0.6b.json (callQ) and
# memory-gap-2026-12-01e-8b-gc.json (callR). Records and logs land in $OUT.
source scripts/device_calls_lib.sh  # the GPU environment, $W / $L, el, left, bench, show, keep_profiles, pack, ...

callS() {  # issue 22 item 4: where training's checkpointed peak goes. callR found none of memory_gap.py's candidates
  # above the probe's line by more than 0.33 GiB, so this records the training run itself: HyperSloth-1 with
  # Unsloth's checkpointing at the row of the 2-GPU gap (18,432 tokens), the allocator's history over steps 1-4
  # (HYPERSLOTH_MEMORY_SNAPSHOT), summarised by scripts/memory_peak.py; the probe's own peak is callR's
  HYPERSLOTH_MEMORY_SNAPSHOT=4 bench --workloads short-8b --slots "hypersloth-1-gc" --token-budget 18432 \
    --warmup 1 --steps 3 --tag 2026-12-01e-memory --budget-s $(left 200) > $L/bench-memory.log 2>&1
  el "training done"; show $L/bench-memory.log
  snap=$W/short-8b/out_hypersloth-1-gc/logs/rank0.memory_snapshot.pickle
  grep -h "memory snapshot\|budget\|PEAK\|peak" $W/short-8b/out_hypersloth-1-gc/logs/rank0.log | cut -c1-400 | tail -6
  python3 scripts/memory_peak.py $snap --top 25 --json $OUT/memory-peak-8b-gc-train.json
  gzip -c $snap > $OUT/memory-snapshot-8b-gc-train.pickle.gz; ls -la $OUT
}

callT() {  # issue 22 item 1: callP's packed-vs-alone difference at 131,072 tokens on Qwen3-8B 4-bit (loss 2.0e-4,
  # gradient 7.4% of its largest entry) judged against its two controls on the same sample and short samples: the
  # sample first in the row (rounding only) and the row as one causal sequence (a leak)
  bench --workloads longctx-8b --long-tokens 131072 --warmup 0 --steps 1 --exactness controls \
    --tag 2026-12-01e-controls131k --slots "reference" --budget-s $(left 570) > $L/bench.log 2>&1
  el "controls 131k done"; grep -h "^\[longctx-8b reference\]\|Error" $L/bench.log | cut -c1-1500
}

callST() {  # callS then callT in one call (one machine start, the 8B checkpoint built once); ~8 minutes
  callS; callT; pack
}

# Prepared for the next session, and run in it (the sixth of 2026-12-01; docs/benchmarks.md, its section):

callU() {  # issue 22 item 4, the next cut: Unsloth's tiled MLP (unsloth_zoo/tiled_mlp.py: the MLP run in row tiles
  # of hidden_size rows under no_grad, each tile recomputed in the backward). HyperSloth-1 at 131,072 tokens on
  # Qwen3-8B 4-bit without and with UNSLOTH_TILED_MLP=arctic: GPU peak, first step, and the step-1 loss against
  # this session's reference (callP's record; the checkpoints are seeded, and two machines gave the same alone
  # loss to every digit). Under tiling, lora_install now puts HyperSloth's MLP pass into the tile hook
  # (`_unsloth_forward`; CPU-tested against a miniature of TiledMLP), so the first two runs compare like for like;
  # the third is the tiled run on Unsloth's LoRA kernels (`hypersloth-1-unsloth-lora`), the path until this session.
  # Expected: ~35% off the long row's peak (the MLP's ~74 of ~200 KB per token)
  bench --workloads longctx-8b --long-tokens 131072 --warmup 0 --steps 1 --slots hypersloth-1 --tag next-tiled-off \
    --reference-from docs/benchmarks/records-2026-12-01e-exact131k-longctx-8b.json --budget-s $(left 280) \
    > $L/bench-off.log 2>&1
  el "untiled done"; show $L/bench-off.log
  UNSLOTH_TILED_MLP=arctic bench --workloads longctx-8b --long-tokens 131072 --warmup 0 --steps 1 \
    --slots hypersloth-1,hypersloth-1-unsloth-lora --tag next-tiled-on --budget-s $(left 570) \
    --reference-from docs/benchmarks/records-2026-12-01e-exact131k-longctx-8b.json > $L/bench-on.log 2>&1
  el "tiled done"; show $L/bench-on.log
  grep -h "LoRA projections\|tiled\|Tiled\|budget probe\|tokens_per_micro_batch=auto" \
    $W/longctx-8b/out_hypersloth-1*/logs/rank0.log 2>/dev/null | cut -c1-300 | tail -8
  pack
}

callV() {  # issue 22 item 2: Qwen3-0.6B trained whole at 262,144 tokens (524,288 fit memory but outlasted a call:
  # callQ); the reference and HyperSloth-1, ~4 minutes
  bench --workloads longctx-0.6b --long-tokens 262144 --warmup 0 --steps 1 --tag next-lc262k \
    --slots "reference,hypersloth-1" --budget-s $(left 570) > $L/bench.log 2>&1
  el "bench done"; show $L/bench.log
  pack
}

callW() {  # the GPU paths the CPU suite cannot reach, never run on a GPU before: Unsloth's save path and an exact
  # resume, init_adapter_path under Unsloth, 4-bit with CUDA graphs (tests/gpu), and the varlen exactness test at the
  # tiny model's longest length, now judged between its controls. pytest travels as wheels in .whl (~3-5 minutes)
  ls .whl/pytest-*.whl >/dev/null 2>&1 || { echo "no pytest wheel in .whl: python3 -m pip download --no-deps \
    --only-binary=:all: --python-version 3.12 -d .whl pytest pluggy iniconfig pytest-timeout"; return 1; }
  timeout $(left 570) python3 -m pytest -q -p no:cacheprovider tests/gpu \
    "tests/unit/test_exactness.py::test_unsloth_varlen_rows_are_exact_at_the_longest_length" > $L/pytest.log 2>&1
  el "pytest done (exit $?)"; grep -v "^\s*$" $L/pytest.log | tail -40 | cut -c1-400
  pack
}

"$@"
