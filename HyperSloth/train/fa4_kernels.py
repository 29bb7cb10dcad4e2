"""FlashAttention-4's two kernels as torch's flash-impl registry calls them, whatever the installed wheel returns.

torch's FA4 registration (torch/nn/attention/_fa4.py, 2.11 to 2.13) imports a module exposing `_flash_attn_fwd` and
`_flash_attn_bwd` and unpacks `out, lse = _flash_attn_fwd(...)` and `dq, dk, dv = _flash_attn_bwd(...)`. The
flash-attn-4 betas since 4.0.0b3x return more (`out, lse, p, row_max, o_lo` forward; `dq, dk, dv` and a sink
gradient backward), so activating FA4 as torch ships it fails on the first call with "too many values to unpack
(expected 2)" (measured on the H200, 4.0.0b36 with torch 2.11). `route_torch_fa4_here` points torch's "FA4" entry
at this module, which hands torch the values it unpacks; activation itself stays torch's
(`activate_flash_attention_impl("FA4")`), and so does every check torch makes before calling a kernel.
"""

from __future__ import annotations

import functools
from typing import Any

FA4_MODULE = "flash_attn.cute.interface"  # the kernels' own module (flash-attn-4)


def _kernels():
    import importlib

    return importlib.import_module(FA4_MODULE)


def _flash_attn_fwd(*args: Any, **kwargs: Any):
    """FA4's forward: (out, lse), the two values torch unpacks (newer wheels return extra ones after them)."""
    result = _kernels()._flash_attn_fwd(*args, **kwargs)
    return tuple(result[:2])


def _flash_attn_bwd(*args: Any, **kwargs: Any):
    """FA4's backward: (dq, dk, dv), the three values torch unpacks."""
    result = _kernels()._flash_attn_bwd(*args, **kwargs)
    return tuple(result[:3])


def route_torch_fa4_here() -> bool:
    """Point torch's registry entry "FA4" at this module; False where torch has no FA4 registration (< 2.11)."""
    try:
        from torch.nn.attention import _fa4, register_flash_attention_impl
    except ImportError:
        return False
    if not hasattr(_fa4, "register_flash_attention_fa4"):
        return False
    register_flash_attention_impl(
        "FA4", register_fn=functools.partial(_fa4.register_flash_attention_fa4, module_path=__name__))
    return True
