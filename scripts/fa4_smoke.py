"""Does FlashAttention-4 run our packed attention, and match torch's bundled flash? (on the GPU: ~20 s + its JIT)

On one packed row (segments of mixed lengths, `cu_seqlens`) in a Qwen3 head layout (0.6B: 16 query / 8 key-value
heads; 8B: 32 / 8; head_dim 128), bf16, causal:
1. torch's bundled flash (FlashAttention-2) forward and backward through the two paths HyperSloth's packed rows
   take: aten's flash ops with fewer K/V heads than query heads (Unsloth's lean path, `_LeanFlashVarlen`) and
   `torch.nn.attention.varlen.varlen_attn` with K/V expanded (the GQA shim of train/patches.py on torch 2.11);
   and fp32 attention per segment, whose distance from bundled flash is the bf16 noise.
2. `activate_flash_attention_impl("FA4")` (torch's entry pointed at HyperSloth.train.attention.fa4 first, as training
   does), the same calls, counted through torch's FA4 hooks (so FA4 ran them,
   not a fallback); the first call's seconds are its JIT compile.
3. FA4's forward and backward captured in a CUDA graph and replayed on new values and new segment lengths
   (what train/step_graph.py does), against eager FA4 on the same values.
4. Forward+backward milliseconds (median of --reps), bundled flash and FA4, eager and graphed.
Verdicts (the record to --out): `ran` (both paths reached FA4: its hooks counted forward and backward calls),
`accurate` (every FA4 output and gradient within max(3 x the bf16 noise, 1e-3 x max|ref|) of bundled flash's),
`graph_ok` (the replay within the same bound of eager FA4). Exit 0: all three; 1: FA4 ran but a check failed
(training may still be measured, the record says which); 2: FA4 did not run (do not benchmark it).

    python scripts/fa4_smoke.py --layout 0.6b --lengths 1,7,130,200,333,512,1024,2048,4000,1337 --out fa4.json
    python scripts/fa4_smoke.py --layout 8b --row-tokens 22528     # a packed row of short chats (attn_bench's)
    python scripts/fa4_smoke.py --layout 0.6b --lengths 131072     # one long sample
"""

from __future__ import annotations

import argparse
import inspect
import json
import time
from contextlib import contextmanager
from pathlib import Path

LAYOUTS = {"0.6b": (16, 8, 128), "8b": (32, 8, 128)}  # query heads, key-value heads, head_dim (Qwen3)
DEFAULT_LENGTHS = "1,7,130,200,333,512,1024,2048,4000,1337"


def offsets(lengths: list[int]) -> list[int]:
    """cu_seqlens: 0 and the running totals."""
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def within(diff: float, noise: float, scale: float) -> bool:
    """FA4's distance from bundled flash is bf16 rounding: both are about `noise` (bundled flash's distance from
    fp32) from the exact values, so at most ~2x apart; 3x leaves room for the max over ~1e7 values. A thousandth
    of the values' size where that distance is ~0."""
    return diff <= max(3.0 * noise, 1e-3 * scale)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layout", choices=sorted(LAYOUTS), default="0.6b")
    p.add_argument("--lengths", default=DEFAULT_LENGTHS, help="the packed row's segment lengths, comma-separated")
    p.add_argument("--row-tokens", type=int, help="instead of --lengths: a row of short chats of this many tokens "
                   "(the benchmark's lognormal lengths, scripts/attn_bench.py's rows)")
    p.add_argument("--reps", type=int, default=20, help="timed forward+backward repetitions")
    p.add_argument("--out", type=Path, help="write the record here (JSON)")
    a = p.parse_args(argv)
    if a.row_tokens:
        from attn_bench import row_lengths  # scripts/ is on sys.path when this file runs

        a.lengths = row_lengths(a.row_tokens)
    else:
        a.lengths = [int(x) for x in a.lengths.split(",") if x.strip()]
    if not a.lengths or min(a.lengths) < 1:
        p.error("--lengths: positive segment lengths, e.g. 100,2048,7")
    return a


# ------------------------------------------------------------------ on the GPU


def lean(torch, q, k, v, cu, max_len, scale, grad):
    """Unsloth's lean varlen path: aten's flash forward and backward, K/V heads as they are (the FA4 check's)."""
    from HyperSloth.train.attention.fa4 import aten_flash_attention

    return aten_flash_attention(q, k, v, grad, cu, max_len, scale)


def shim(torch, q, k, v, cu, max_len, scale, grad):
    """torch's varlen_attn with K/V expanded to the query heads (patches.py's GQA shim), through autograd."""
    from torch.nn.attention.varlen import varlen_attn

    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    # causal: torch 2.11 spells it window_size=(-1, 0) (as Unsloth passes it), older ones is_causal=True
    causal = {"window_size": (-1, 0)} if "window_size" in inspect.signature(varlen_attn).parameters else {"is_causal": True}
    out = varlen_attn(q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), cu, cu, max_len, max_len,
                      scale=scale, **causal)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def fp32_reference(torch, q, k, v, lengths, scale, grad):
    """Each segment alone in fp32 (SDPA, causal): what both kernels approximate."""
    import torch.nn.functional as F

    groups = q.shape[1] // k.shape[1]
    q, k, v = (t.detach().float().requires_grad_() for t in (q, k, v))
    outs, start = [], 0
    for n in lengths:
        s = slice(start, start + n)
        qs, ks, vs = (t[s].transpose(0, 1).unsqueeze(0) for t in (q, k, v))
        ks, vs = ks.repeat_interleave(groups, 1), vs.repeat_interleave(groups, 1)
        outs.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True, scale=scale)[0].transpose(0, 1))
        start += n
    out = torch.cat(outs)
    out.backward(grad.float())
    return out.detach(), q.grad, k.grad, v.grad


@contextmanager
def counted_fa4_calls():
    """Count the calls that reach FA4 through torch's registry hooks (torch/nn/attention/_fa4.py)."""
    from torch.nn.attention import _fa4

    if not (hasattr(_fa4, "_fa4_run_forward") and hasattr(_fa4, "_fa4_run_backward")):
        yield None  # another torch's private names: not countable (the record says so; `ran` trusts the registry)
        return
    calls = {"forward": 0, "backward": 0}
    originals = _fa4._fa4_run_forward, _fa4._fa4_run_backward

    def counting(key, fn):
        def run(*args, **kwargs):
            calls[key] += 1
            return fn(*args, **kwargs)
        return run

    _fa4._fa4_run_forward, _fa4._fa4_run_backward = counting("forward", originals[0]), counting("backward", originals[1])
    try:
        yield calls
    finally:
        _fa4._fa4_run_forward, _fa4._fa4_run_backward = originals


def max_diffs(got, ref) -> list[float]:
    return [float((a.float() - b.float()).abs().max()) for a, b in zip(got, ref)]


def milliseconds(fn, reps: int) -> float:
    """The median of attn_bench's CUDA-event timings of `fn`, in milliseconds."""
    from HyperSloth.train.profiling import cuda_event_ms

    times = sorted(cuda_event_ms(fn, reps))
    return times[len(times) // 2]


def run(a: argparse.Namespace) -> dict:
    import torch
    from torch.nn.attention import activate_flash_attention_impl, current_flash_attention_impl

    from HyperSloth.train.profiling import captured

    heads, kv_heads, head_dim = LAYOUTS[a.layout]
    total, max_len, scale = sum(a.lengths), max(a.lengths), head_dim ** -0.5
    g = torch.Generator(device="cuda").manual_seed(0)

    def randn(*shape):
        return torch.randn(*shape, device="cuda", dtype=torch.bfloat16, generator=g)

    q, k, v, grad = randn(total, heads, head_dim), randn(total, kv_heads, head_dim), randn(total, kv_heads, head_dim), randn(total, heads, head_dim)
    cu = torch.tensor(offsets(a.lengths), device="cuda", dtype=torch.int32)
    record = {"layout": a.layout, "heads": heads, "kv_heads": kv_heads, "head_dim": head_dim, "lengths": a.lengths,
              "device": torch.cuda.get_device_name(), "torch": torch.__version__}
    args = (torch, q, k, v, cu, max_len, scale, grad)
    flash = {"lean": lean(*args), "shim": shim(*args)}
    reference = fp32_reference(torch, q, k, v, a.lengths, scale, grad)
    noise = max_diffs(flash["lean"], reference)
    bundled_ms = milliseconds(lambda: lean(*args), a.reps)
    try:
        replay, _ = captured(lambda *t: lean(torch, *t[:3], t[3], max_len, scale, t[4]),
                             [t.clone() for t in (q, k, v, cu, grad)])
        record["bundled_graphed_ms"] = milliseconds(replay, a.reps)
    except Exception as err:
        record["bundled_graph_error"] = f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"
    from HyperSloth.train.attention.fa4 import route_torch_fa4_here

    record["routed_through_hypersloth"] = route_torch_fa4_here()  # as training does (train/attention/setting.py)
    started = time.perf_counter()
    activate_flash_attention_impl("FA4")
    record["activate_s"], record["active"] = time.perf_counter() - started, current_flash_attention_impl()
    checks = {}
    for path, fn in (("lean", lean), ("shim", shim)):
        with counted_fa4_calls() as calls:
            started = time.perf_counter()
            got = fn(*args)
            torch.cuda.synchronize()
            record[f"{path}_first_call_s"] = time.perf_counter() - started  # the JIT compile, on the first path
        diffs = max_diffs(got, flash[path])
        scales = [float(t.float().abs().max()) for t in flash[path]]
        reached = all(calls.values()) if calls is not None else record["active"] == "FA4"
        checks[path] = {"calls": dict(calls) if calls is not None else "not countable", "reached_fa4": reached,
                        "max_diff": diffs, "bf16_noise": noise,
                        "ok": reached and all(within(d, n, s) for d, n, s in zip(diffs, noise, scales))}
    fa4_ms = milliseconds(lambda: lean(*args), a.reps)
    record.update(checks=checks, bundled_ms=bundled_ms, fa4_ms=fa4_ms)
    record.update(graph_check(torch, a, args, noise))
    record["ran"] = all(c["reached_fa4"] for c in checks.values())
    record["accurate"] = all(c["ok"] for c in checks.values())
    return record


def graph_check(torch, a, args, noise) -> dict:
    """FA4 captured in a CUDA graph, replayed on new values and new lengths with the same bound, vs eager FA4."""
    from HyperSloth.train.profiling import captured

    _, q, k, v, cu, max_len, scale, grad = args
    statics = [t.clone() for t in (q, k, v, cu, grad)]
    try:
        replay, outputs = captured(lambda q, k, v, cu, grad: lean(torch, q, k, v, cu, max_len, scale, grad), statics)
    except Exception as err:  # say why, in one line: the benchmark's graphed rows would run eagerly
        return {"graph_ok": False, "graph_error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    lengths = list(reversed(a.lengths))  # other segment lengths, the same count and bound
    new = [t * 0.5 for t in (q, k, v)] + [torch.tensor(offsets(lengths), device="cuda", dtype=torch.int32), grad.flip(0)]
    for static, value in zip(statics, new):
        static.copy_(value)
    replay()
    torch.cuda.synchronize()
    eager = lean(torch, *new[:3], new[3], max_len, scale, new[4])
    diffs = max_diffs(outputs, eager)
    scales = [float(t.float().abs().max()) for t in eager]
    graphed_ms = milliseconds(replay, a.reps)
    return {"graph_max_diff": diffs, "graph_ok": all(within(d, n, s) for d, n, s in zip(diffs, noise, scales)),
            "fa4_graphed_ms": graphed_ms}


def exit_code(record: dict) -> int:
    """0: FA4 ran, matched and replayed from a graph; 1: it ran, a check failed; 2: it did not run."""
    if not record.get("ran"):
        return 2
    return 0 if record.get("accurate") and record.get("graph_ok") else 1


def summary_line(record: dict) -> str:
    verdict = {0: "PASS", 1: "RAN, CHECK FAILED", 2: "DID NOT RUN"}[exit_code(record)]
    if "error" in record:
        return f"fa4 smoke {verdict}: {record['error']}"
    nan = float("nan")
    return (f"fa4 smoke {verdict}: {record['layout']} layout, {len(record['lengths'])} segments / "
            f"{sum(record['lengths']):,} tokens; ran={record['ran']} accurate={record['accurate']} "
            f"graph_ok={record.get('graph_ok')}; first FA4 call {record['lean_first_call_s']:.1f} s (JIT); fwd+bwd "
            f"ms bundled flash {record['bundled_ms']:.2f} eager / {record.get('bundled_graphed_ms', nan):.2f} graphed, FA4 "
            f"{record['fa4_ms']:.2f} / {record.get('fa4_graphed_ms', nan):.2f}"
            + (f"; graph: {record['graph_error']}" if "graph_error" in record else ""))


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    try:
        record = run(a)
    except Exception as err:  # an import or kernel error: one line, the benchmark then leaves FA4 out
        record = {"layout": a.layout, "lengths": a.lengths, "ran": False,
                  "error": f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}"}
    if a.out:
        a.out.write_text(json.dumps(record, indent=1))
    print(json.dumps(record), flush=True)
    print(summary_line(record), flush=True)
    return exit_code(record)


if __name__ == "__main__":
    raise SystemExit(main())
