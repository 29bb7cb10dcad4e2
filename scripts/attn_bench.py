"""Packed-row attention kernels on one GPU: forward+backward of one layer's attention over a packed row of
short chats, per kernel route, against torch's flash kernel with the key/value heads as they are (GQA).

    python scripts/attn_bench.py [--tokens 22528] [--out attn_bench.json]

Routes (each exact attention; the gradients are compared with the first):
- `flash-gqa`: aten's flash kernel, fewer key/value heads than query heads (Unsloth's lean path, and what
  torch >= 2.12's `varlen_attn(enable_gqa=True)` runs);
- `flash-expand`: the same kernel after expanding the key/value heads (torch 2.11's `varlen_attn` through
  HyperSloth's GQA shim, before the lean path was switched on);
- `cudnn-gqa` / `cudnn-expand`: cuDNN's attention over ragged offsets (`aten._cudnn_attention_forward` with
  cumulative sequence offsets), which torch's `varlen_attn` does not use yet.
Samples: lognormal lengths as the benchmark's short chats (median ~490 tokens), until the row holds --tokens.
Prints one line per case and writes the JSON.
"""

from __future__ import annotations

import argparse
import json

import numpy as np
import torch

from HyperSloth.train.profiling import cuda_event_ms

SHAPES = {"0.6b": (16, 8), "8b": (32, 8)}  # query heads, key/value heads (head_dim 128)


def row_lengths(tokens: int, seed: int = 0) -> list[int]:
    rng = np.random.default_rng(seed)
    lengths, left = [], tokens
    while left > 0:
        n = int(min(left, np.clip(np.exp(rng.normal(6.2, 0.8)), 32, 4096)))
        lengths.append(n)
        left -= n
    return lengths


def flash(q, k, v, cu, max_len):
    out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, cu, cu, max_len, max_len, 0.0, True, return_debug_mask=False, scale=None)

    def backward(grad):
        return torch.ops.aten._flash_attention_backward(
            grad, q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, seed, offset, scale=None)
    return out, backward


def cudnn(q, k, v, cu, max_len):
    res = torch.ops.aten._cudnn_attention_forward(q, k, v, None, cu, cu, max_len, max_len, True, 0.0, True, False,
                                                  scale=None)
    out, lse, seed, offset = res[0], res[1], res[6], res[7]

    def backward(grad):
        return torch.ops.aten._cudnn_attention_backward(
            grad, q, k, v, out, lse, seed, offset, torch.empty(0, device=q.device), cu, cu, max_len, max_len, 0.0,
            True, scale=None)
    return out, backward


def route(name: str):
    kernel = flash if name.startswith("flash") else cudnn
    expand = name.endswith("expand")

    def run(q, k, v, cu, max_len):
        groups = q.shape[1] // k.shape[1]
        kk, vv = (k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)) if expand else (k, v)
        out, backward = kernel(q, kk, vv, cu, max_len)

        def grads(grad):
            dq, dk, dv = backward(grad)
            if expand:  # the expansion's own backward: sum the copies of each key/value head
                dk = dk.view(dk.shape[0], k.shape[1], groups, -1).sum(2)
                dv = dv.view(dv.shape[0], v.shape[1], groups, -1).sum(2)
            return dq, dk, dv
        return out, grads
    return run


def case(model: str, tokens: int, reps: int) -> dict:
    heads, kv_heads = SHAPES[model]
    lengths = row_lengths(tokens)
    cu = torch.tensor(np.concatenate([[0], np.cumsum(lengths)]), dtype=torch.int32, device="cuda")
    max_len = max(lengths)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(tokens, h, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
               for h in (heads, kv_heads, kv_heads))
    grad = torch.randn(tokens, heads, 128, device="cuda", dtype=torch.bfloat16, generator=gen)
    flops = 2 * sum(n * n for n in lengths) * 128 * heads  # causal: half of 4 * L^2 * d * heads, forward
    result = {"model": model, "tokens": tokens, "samples": len(lengths), "max_len": max_len, "routes": {}}
    reference = None
    for name in ("flash-gqa", "flash-expand", "cudnn-gqa", "cudnn-expand"):
        try:
            run = route(name)
            out, grads = run(q, k, v, cu, max_len)
            got = (out, *grads(grad))
            if reference is None:
                reference = got
            diff = max(float((a.float() - b.float()).abs().max()) for a, b in zip(got, reference))
            fwd = cuda_event_ms(lambda: run(q, k, v, cu, max_len), reps)
            both = cuda_event_ms(lambda: run(q, k, v, cu, max_len)[1](grad), reps)
            f, b = float(np.median(fwd)), float(np.median(both))
            result["routes"][name] = {"fwd_ms": round(f, 3), "fwd_bwd_ms": round(b, 3), "max_abs_diff": diff,
                                      "fwd_tflops": round(flops / f / 1e9, 1),
                                      "fwd_bwd_tflops": round(3.5 * flops / b / 1e9, 1)}
        except Exception as error:  # noqa: BLE001 - a route this torch/cuDNN cannot run is reported, not fatal
            result["routes"][name] = {"error": f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"}
        print(model, tokens, name, result["routes"][name], flush=True)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, nargs="+", default=[22528])
    p.add_argument("--reps", type=int, default=20)
    p.add_argument("--out", default="attn_bench.json")
    a = p.parse_args()
    print(f"torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}, {torch.cuda.get_device_name()}")
    cases = [case(model, tokens, a.reps) for model in SHAPES for tokens in a.tokens]
    with open(a.out, "w") as f:
        json.dump({"torch": torch.__version__, "cudnn": torch.backends.cudnn.version(), "cases": cases}, f, indent=1)


if __name__ == "__main__":
    main()
