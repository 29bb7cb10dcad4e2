#!/usr/bin/env bash
# FlashAttention-4 for the GPU machine (torch 2.11+cu130, Python 3.12, no package index there), in two parts that
# each fit one device call (64 MiB carried per call): run from the repository root on this (CPU) machine, after
# ../shared/device/wheelhouse.sh has filled .whl/ (the second call carries .whl/ beside part 2).
#
#   bash scripts/fa4_wheels.sh            -> .fa4/wheels/ (the downloads), .fa4/part1/, .fa4/part2/ (git-ignored)
#
# Part 1 (first call, alone): the CUDA-13 DSL library's 193 MB compiler library as xz, unpacked there into
# .fa4/site, which stays while the machine is warm. Part 2 (the next call, within the 30 s the machine stays warm,
# beside .whl/): the rest, unpacked beside it; then `source scripts/fa4_env.sh` puts .fa4/site on PYTHONPATH.
# The recipe: docs/benchmarks/2026-12-02-fa4-device-calls.sh. What is cut and why: scripts/fa4_pack.py.
set -euo pipefail
mkdir -p .fa4/wheels
plat="--platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64"
get() { python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat -d .fa4/wheels "$1" 2>&1 | grep -v "is ignored" || true; }
# flash-attn-4 and what it imports (its METADATA, and nvidia-cutlass-dsl's): the DSL's CUDA-13 flavour only (its
# default cu12 libraries are left out), cuda-bindings of CUDA 13.0 like torch's cu130 build. Versions seen together.
for p in flash-attn-4==4.0.0b36 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
         nvidia-cutlass-dsl-libs-core==4.8.1 nvidia-cutlass-dsl-libs-cu13==4.8.1 quack-kernels==0.6.5 \
         apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 einops==0.8.2 cuda-bindings==13.0.3 \
         cuda-pathfinder==1.9.1 protobuf==7.36.2; do
  get "$p"
done
python3 scripts/fa4_pack.py pack .fa4/wheels --out .fa4 --limit-mib 56 --beside .whl  # 56: the call also carries the working tree (~6 MiB) under its 64 MiB
du -sh .fa4/part1 .fa4/part2 .whl 2>/dev/null || true
