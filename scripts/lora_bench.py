"""LoRA block microbenchmark: Unsloth's LoRA_QKV / LoRA_W / LoRA_MLP against HyperSloth.train.lora.passes.

On the GPU machine, from the repo root:
    source scripts/gpu_env.sh && OUT=$OUT python3 scripts/lora_bench.py
On CPU, to check the script end to end (tiny shapes, fp32, ours only when Unsloth is absent):
    python3 scripts/lora_bench.py --device cpu --quick

Per case (model shapes x tokens x block) it times forward+backward (CUDA events, --warmup then --reps, median
and p90) of Unsloth's Function, called through `.apply` with the arguments apply_lora_* passes, and of ours
in each mode (auto, concat, epilogue), records the peak memory of one pass above what was allocated before
it, and the max relative error (max |a - ref| / max |ref|) of every output and grad against an fp32
reference computed from the same bf16 inputs. Qwen3-8B runs on NF4 base weights quantized by bitsandbytes
as Unsloth loads them (blocksize 64, double quant); bf16 when bitsandbytes is missing (the record says so).
One JSON line per case on stdout (progress on stderr); all records in $OUT/lora_bench.json when OUT is set,
rewritten after every case so a run cut short keeps what it measured. Imports only lora_passes of ours.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repo root: HyperSloth without install

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from HyperSloth.train.lora import passes as lp  # noqa: E402

MODELS = {
    "qwen3-0.6b": {"hidden": 1024, "q": 2048, "kv": 1024, "inter": 3072, "nf4": False},
    "qwen3-8b": {"hidden": 4096, "q": 4096, "kv": 1024, "inter": 12288, "nf4": True},
}
QUICK_MODELS = {"tiny": {"hidden": 64, "q": 128, "kv": 64, "inter": 192, "nf4": False}}
BLOCKS = ("qkv", "mlp", "o")
OUR_MODES = ("auto", "concat", "epilogue")


def log(message: str) -> None:
    print(f"# {message}", file=sys.stderr, flush=True)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default) or cpu")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, fp32, 1 warm-up and 3 reps")
    parser.add_argument("--tokens", type=int, nargs="+", default=None, help="default 22528 8192 (quick: 37 64)")
    parser.add_argument("--models", nargs="+", default=None, choices=[*MODELS, *QUICK_MODELS])
    parser.add_argument("--blocks", nargs="+", default=list(BLOCKS), choices=BLOCKS)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--scale", type=float, default=1.0, help="LoRA s = alpha / r")
    parser.add_argument("--warmup", type=int, default=None, help="default 10 (quick: 1)")
    parser.add_argument("--reps", type=int, default=None, help="default 50 (quick: 3)")
    parser.add_argument("--budget-s", type=float, default=95.0, help="skip the cases left after this many seconds")
    args = parser.parse_args(argv)
    args.tokens = args.tokens or ([37, 64] if args.quick else [22528, 8192])
    args.models = args.models or list(QUICK_MODELS if args.quick else MODELS)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 10)
    args.reps = args.reps if args.reps is not None else (3 if args.quick else 50)
    args.dtype = torch.float32 if args.quick or args.device == "cpu" else torch.bfloat16
    return args


def load_unsloth() -> tuple[Any, Callable | None, str | None]:
    """(fast_lora module, fast_dequantize, None) or (None, None, why): Unsloth is optional here."""
    started = time.monotonic()
    try:
        with contextlib.redirect_stdout(sys.stderr):  # its banner must not mix with the JSON lines
            from unsloth.kernels import fast_lora
            from unsloth.kernels.utils import fast_dequantize
    except Exception as error:  # ImportError, or Unsloth refusing the machine: time ours only
        return None, None, f"{type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"
    log(f"unsloth imported in {time.monotonic() - started:.1f} s")
    return fast_lora, fast_dequantize, None


def quantizer(nf4: bool) -> tuple[Callable | None, str]:
    """bitsandbytes NF4 (quantize, dequantize) as Unsloth's 4-bit checkpoints, or None and why not."""
    if not nf4:
        return None, "dense"
    try:
        import bitsandbytes.functional as bnbf
    except Exception as error:
        return None, f"dense (bitsandbytes unavailable: {type(error).__name__})"

    def quantize(W: torch.Tensor):
        packed, state = bnbf.quantize_4bit(W, blocksize=64, compress_statistics=True, quant_type="nf4")
        return packed, state, bnbf.dequantize_4bit(packed, state)

    return quantize, "nf4"


def projection(n: int, d: int, args, quantize, gen: torch.Generator) -> dict:
    """One LoRA projection: the (W, quant_state, A, B, s) the Functions take and the dense W for the reference."""
    dev, dtype, r = args.device, args.dtype, args.rank
    W = (torch.randn(n, d, generator=gen, device=dev) / math.sqrt(d)).to(dtype)
    A = (torch.randn(r, d, generator=gen, device=dev) / math.sqrt(d)).to(dtype).requires_grad_()
    B = (torch.randn(n, r, generator=gen, device=dev) / math.sqrt(r)).to(dtype).requires_grad_()
    if quantize is None:
        return {"args": (W, None, A, B, args.scale), "dense": W}
    packed, state, dense = quantize(W)
    return {"args": (packed, state, A, B, args.scale), "dense": dense}


def block_projections(block: str, shape: dict, args, quantize, gen) -> tuple[int, list[dict]]:
    """(input width, projections) of one block of the model."""
    h, q, kv, inter = shape["hidden"], shape["q"], shape["kv"], shape["inter"]
    if block == "qkv":
        return h, [projection(n, h, args, quantize, gen) for n in (q, kv, kv)]
    if block == "o":
        return q, [projection(h, q, args, quantize, gen)]
    gate_up = [projection(inter, h, args, quantize, gen) for _ in range(2)]
    return h, gate_up + [projection(h, inter, args, quantize, gen)]


def runners(block: str, projs: list[dict], fast_lora, weight_fn) -> dict[str, Callable]:
    """name -> fn(X) returning the block's outputs, Unsloth's as apply_lora_qkv / _o / _mlp_swiglu call them."""
    p = [proj["args"] for proj in projs]
    found: dict[str, Callable] = {}
    if block == "qkv":
        if fast_lora is not None:  # inplace=True, dropout_p=None, no biases: apply_lora_qkv's plain call
            found["unsloth"] = lambda X: fast_lora.LoRA_QKV.apply(
                X, *p[0], *p[1], *p[2], True, None, None, None, None
            )
        for mode in OUR_MODES:
            found[f"ours_{mode}"] = lambda X, m=mode: lp.lora_qkv(X, *p, weight_fn=weight_fn, mode=m)
    elif block == "o":
        if fast_lora is not None:
            found["unsloth"] = lambda X: fast_lora.LoRA_W.apply(X, *p[0])
        found["ours_auto"] = lambda X: lp.lora_linear(X, p[0], weight_fn=weight_fn)
    else:
        if fast_lora is not None:
            kernels = (fast_lora.swiglu_fg_kernel, fast_lora.swiglu_DWf_DW_dfg_kernel)
            found["unsloth"] = lambda X: fast_lora.LoRA_MLP.apply(
                X, *p[0], *p[1], *p[2], *kernels, True, None, None, None, None
            )
        for mode in OUR_MODES:
            found[f"ours_{mode}"] = lambda X, m=mode: lp.lora_swiglu_mlp(X, *p, weight_fn=weight_fn, mode=m)
    return found


def reference(block: str, projs: list[dict], X0: torch.Tensor, cotangents) -> list[torch.Tensor]:
    """fp32 outputs and grads (dX, dA_1, dB_1, ...) of the same bf16 inputs by plain autograd."""
    X = X0.float().requires_grad_()
    params = [(p["dense"].float(), p["args"][2].detach().float().requires_grad_(),
               p["args"][3].detach().float().requires_grad_(), p["args"][4]) for p in projs]

    def linear(x, prm):
        W, A, B, s = prm
        return x @ W.t() + s * (x @ A.t()) @ B.t()

    if block == "mlp":
        outs = [linear(F.silu(linear(X, params[0])) * linear(X, params[1]), params[2])]
    else:
        outs = [linear(X, prm) for prm in params]
    leaves = [X] + [t for prm in params for t in prm[1:3]]
    return outs + list(torch.autograd.grad(outs, leaves, [c.float() for c in cotangents]))


def as_tuple(out) -> tuple:
    return out if isinstance(out, tuple) else (out,)


def one_pass(fn: Callable, X0: torch.Tensor, cotangents, leaves) -> list[torch.Tensor]:
    """Outputs and grads of one forward+backward on a fresh copy of X (Unsloth writes dX into X)."""
    X = X0.clone().requires_grad_()
    outs = as_tuple(fn(X))
    return list(outs) + list(torch.autograd.grad(outs, [X, *leaves], cotangents))


def rel_errors(values: list[torch.Tensor], ref: list[torch.Tensor], n_out: int) -> dict[str, float]:
    def err(a, b):
        return ((a.float() - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()

    grads = list(zip(values[n_out:], ref[n_out:]))
    return {
        "out": max(err(a, b) for a, b in zip(values[:n_out], ref[:n_out])),
        "dX": err(*grads[0]),
        "dA": max(err(a, b) for a, b in grads[1::2]),
        "dB": max(err(a, b) for a, b in grads[2::2]),
    }


def timed(fn: Callable, X0, cotangents, leaves, args) -> dict[str, float]:
    """median / p90 ms of forward+backward (X copied and grads cleared outside the timed span)."""
    cuda = X0.is_cuda
    spans: list[tuple[Any, Any]] = []
    for rep in range(args.warmup + args.reps):
        X = X0.clone().requires_grad_()
        for leaf in leaves:
            leaf.grad = None
        start = torch.cuda.Event(enable_timing=True) if cuda else None
        begin = time.perf_counter()
        if cuda:
            start.record()
        torch.autograd.backward(as_tuple(fn(X)), cotangents)
        if cuda:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            spans.append((start, end))
        else:
            spans.append((begin, time.perf_counter()))
    if cuda:
        torch.cuda.synchronize()
        ms = [s.elapsed_time(e) for s, e in spans[args.warmup :]]
    else:
        ms = [(e - s) * 1e3 for s, e in spans[args.warmup :]]
    ms.sort()
    return {"median_ms": statistics.median(ms), "p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))]}


def peak_mib(fn: Callable, X0, cotangents, leaves) -> float | None:
    """Peak memory of one forward+backward above what was allocated before it (CUDA only)."""
    if not X0.is_cuda:
        return None
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    one_pass(fn, X0, cotangents, leaves)
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def run_case(model: str, block: str, tokens: int, args, unsloth, quantize, base: str) -> dict:
    fast_lora, fast_dequantize = unsloth
    shape = (MODELS | QUICK_MODELS)[model]
    gen = torch.Generator(device=args.device).manual_seed(tokens + len(block))
    d, projs = block_projections(block, shape, args, quantize, gen)
    X0 = torch.randn(1, tokens, d, generator=gen, device=args.device).to(args.dtype)
    n_outs = [shape["hidden"]] if block == "mlp" else [p["args"][3].shape[0] for p in projs]
    cotangents = [torch.randn(1, tokens, n, generator=gen, device=args.device).to(args.dtype) for n in n_outs]
    leaves = [t for p in projs for t in p["args"][2:4]]
    weight_fn = (lambda W, q: fast_dequantize(W, q)) if fast_dequantize else dense_or_bnb
    record: dict[str, Any] = {"model": model, "block": block, "tokens": tokens, "rank": args.rank,
                              "base": base, "dtype": str(args.dtype).replace("torch.", "")}
    if block != "o":
        n_total = sum(n_outs) if block == "qkv" else 2 * shape["inter"]
        record["auto_path"] = "concat" if lp.concat_pays(tokens, d, n_total) else "epilogue"
    ref = reference(block, projs, X0, cotangents)
    record["variants"] = {}
    for name, fn in runners(block, projs, fast_lora, weight_fn).items():
        record["variants"][name] = measure(fn, X0, cotangents, leaves, ref, len(n_outs), args)
    del ref
    add_speedups(record)
    return record


def dense_or_bnb(W: torch.Tensor, quant_state) -> torch.Tensor:
    """Weight accessor without Unsloth: bitsandbytes' own dequantize for NF4, else the dense weight."""
    if quant_state is None:
        return W
    import bitsandbytes.functional as bnbf

    return bnbf.dequantize_4bit(W, quant_state)


def measure(fn, X0, cotangents, leaves, ref, n_out, args) -> dict:
    try:
        result = {"rel_err": rel_errors(one_pass(fn, X0, cotangents, leaves), ref, n_out)}
        result.update(timed(fn, X0, cotangents, leaves, args))
        result["peak_mib"] = peak_mib(fn, X0, cotangents, leaves)
        return result
    except Exception as error:  # one variant failing must not lose the others
        return {"error": f"{type(error).__name__}: {error}", "trace": traceback.format_exc(limit=3)[-800:]}


def add_speedups(record: dict) -> None:
    """speedup_<variant> = Unsloth's median / ours (> 1: ours is faster)."""
    variants = record["variants"]
    base = variants.get("unsloth", {}).get("median_ms")
    for name, result in variants.items():
        if name != "unsloth" and base and "median_ms" in result:
            record[f"speedup_{name}"] = round(base / result["median_ms"], 3)


def write(records: list[dict], header: dict) -> None:
    out = os.environ.get("OUT")
    if out:
        Path(out).mkdir(parents=True, exist_ok=True)
        Path(out, "lora_bench.json").write_text(json.dumps({"header": header, "cases": records}, indent=1))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    started = time.monotonic()
    if args.device == "cuda" and not torch.cuda.is_available():
        print(json.dumps({"error": "no CUDA device: run with --device cpu --quick"}), flush=True)
        return 2
    fast_lora, fast_dequantize, why = load_unsloth() if args.device == "cuda" else (None, None, "not on CPU")
    device = torch.cuda.get_device_name() if args.device == "cuda" else "cpu"
    header = {"torch": torch.__version__, "device": device,
              "unsloth": "imported" if fast_lora else f"absent ({why}): timing ours only",
              "warmup": args.warmup, "reps": args.reps}
    print(json.dumps({"header": header}), flush=True)
    records: list[dict] = []
    for model in args.models:
        quantize, base = quantizer(MODELS.get(model, {}).get("nf4", False) and args.device == "cuda")
        for tokens in args.tokens:
            for block in args.blocks:
                case = {"model": model, "block": block, "tokens": tokens}
                if time.monotonic() - started > args.budget_s:
                    record = {**case, "skipped": f"time budget {args.budget_s:.0f} s spent"}
                else:
                    log(f"{model} {block} T={tokens} ({time.monotonic() - started:.0f} s)")
                    try:
                        record = run_case(model, block, tokens, args, (fast_lora, fast_dequantize), quantize, base)
                    except Exception as error:
                        record = {**case, "error": f"{type(error).__name__}: {error}",
                                  "trace": traceback.format_exc(limit=4)[-1200:]}
                    if args.device == "cuda":
                        torch.cuda.empty_cache()
                print(json.dumps(record), flush=True)
                records.append(record)
                write(records, header)
    log(f"done in {time.monotonic() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
