"""Host time of a GEMM launch on a row count cuBLAS has not seen yet, against one it has (the tail chunk of
Unsloth's fused cross-entropy changes its row count every step: docs/benchmarks.md, third session).

    python scripts/gemm_shapes.py [--hidden 1024] [--vocab 151936]

For each row count: host seconds of the first `torch.mm(h, w.t(), out_dtype=float32)` and of a repeat (the
GPU is drained before each, so the host time is the launch alone), for bf16 inputs as Unsloth's loss runs them.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch


def host_ms(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    launched = time.perf_counter()
    torch.cuda.synchronize()
    return (launched - start) * 1e3


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=151936)
    p.add_argument("--counts", type=int, default=12)
    a = p.parse_args()
    w = torch.randn(a.vocab, a.hidden, device="cuda", dtype=torch.bfloat16)
    h_all = torch.randn(4096, a.hidden, device="cuda", dtype=torch.bfloat16)
    out = torch.empty(4096, a.vocab, device="cuda", dtype=torch.float32)
    rng = np.random.default_rng(0)
    host_ms(lambda: torch.mm(h_all[:4096], w.t(), out_dtype=torch.float32, out=out[:4096]))  # library warm-up
    rows = [int(n) for n in rng.integers(1, 4096, a.counts)]
    firsts, repeats = [], []
    for n in rows:
        call = lambda: torch.mm(h_all[:n], w.t(), out_dtype=torch.float32, out=out[:n])  # noqa: E731
        firsts.append(host_ms(call))
        repeats.append(host_ms(call))
    dz = torch.randn(4096, a.vocab, device="cuda", dtype=torch.bfloat16)
    acc = torch.zeros(4096, a.hidden, device="cuda", dtype=torch.float32)
    add_first, add_repeat = [], []
    for n in [int(n) for n in rng.integers(1, 4096, a.counts)]:
        call = lambda: torch.addmm(acc[:n], dz[:n], w, out_dtype=torch.float32, out=acc[:n])  # noqa: E731
        add_first.append(host_ms(call))
        add_repeat.append(host_ms(call))
    print(f"torch {torch.__version__}, cuBLAS {torch.backends.cuda.preferred_blas_library()}, rows {rows}")
    print(f"mm    host ms, new row count: median {np.median(firsts):.3f} max {max(firsts):.3f}; "
          f"seen before: median {np.median(repeats):.3f}")
    print(f"addmm host ms, new row count: median {np.median(add_first):.3f} max {max(add_first):.3f}; "
          f"seen before: median {np.median(add_repeat):.3f}")


if __name__ == "__main__":
    main()
