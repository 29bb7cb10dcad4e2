# Sourced by the session call scripts (docs/benchmarks/*-device-calls.sh) on the device machine, from the
# repository root: the GPU environment, the work and log folders, and the helpers every call uses.
#   el MSG             MSG with the seconds since the call started
#   left N             seconds left until N seconds after the start (a --budget-s that ends the call in time)
#   bench ARGS         scripts/benchmark.py on one GPU, records into $OUT
#   show LOG...        the lines of a benchmark log that say how each system did
#   keep_profiles W    the -profile systems' kernel tables and traces of workload W, into $OUT/profiles
#   watch_host_memory  sample the host's memory every 10 s into $L/host-memory.log until stop_host_memory
#   arch_runs DIR...   each scripts/arch_check.py run record in DIR: exit, packing, losses, a failed run's traceback
#   pack               the profiles and logs as one archive (at most 8 files come back from $OUT)
set -u
source scripts/gpu_env.sh
W=/tmp/hs_bench; L=$OUT/logs; mkdir -p "$L" "$OUT/profiles"
T0=$(date +%s); el() { echo "[t+$(( $(date +%s) - T0 ))s] $*"; }
left() { echo $(( $1 - ($(date +%s) - T0) )); }
bench() { python3 scripts/benchmark.py --work $W --out $OUT --num-gpus 1 "$@"; }
show() { grep -h "^\[\|FAILED\|out of time\|Error\|error\|budget probe\|tokens_per_micro_batch=auto" "$@" | cut -c1-600; }

keep_profiles() {
  for d in $W/$1/out_*-profile; do
    [ -d "$d" ] || continue
    n=$(basename "$d")  # (until the third session of 2026-12-01 the two files lay in $d itself)
    cp "$d/logs/rank0.profile_kernels.txt" "$OUT/profiles/$1-$n.txt" 2>/dev/null || cp "$d/profile_kernels.txt" "$OUT/profiles/$1-$n.txt" 2>/dev/null
    cp "$d/logs/rank0.profile_trace.json.gz" "$OUT/profiles/$1-$n.trace.json.gz" 2>/dev/null || cp "$d/profile_trace.json.gz" "$OUT/profiles/$1-$n.trace.json.gz" 2>/dev/null
    head -c 400 "$OUT/profiles/$1-$n.txt" 2>/dev/null; echo
  done
}

watch_host_memory() {
  ( while true; do echo "$(date +%T) $(free -g | awk '/Mem:/ {print "used", $3, "avail", $7}')"; sleep 10; done ) \
    > $L/host-memory.log 2>&1 &
  HOST_MEMORY_WATCH=$!
}
stop_host_memory() { kill $HOST_MEMORY_WATCH; }

pack() {
  tar czf $OUT/profiles-logs.tgz -C $OUT profiles logs && rm -rf $OUT/profiles $OUT/logs
}

arch_runs() {
  for d in "$@"; do
    for f in "$d"/*-graphs.json "$d"/*-eager.json; do
      [ -f "$f" ] || continue
      python3 -c "import json, sys; r = json.load(open(sys.argv[1])); \
        print(r['run'], r['exit'], r.get('packing'), r.get('losses'), (r.get('cuda_graphs') or {}).get('capture_failed_at'), \
        '\n'.join(r.get('traceback') or [])[-1200:])" "$f"
    done
  done
}
