"""An MoE layer's experts as llama.cpp reads them: three tensors per layer, each stacking every expert,
(experts, rows, columns) in numpy order, named `...mlp.experts.{gate,up,down}_proj.weight` for the gguf
package's TensorNameMap (-> blk.N.ffn_{gate,up,down}_exps.weight), as llama.cpp's converter does
(conversion/qwen.py, Qwen2MoeModel.modify_tensors, which Qwen3MoeModel inherits).

A model folder holds the experts in one of two layouts, and both are read:
- one tensor per expert, `mlp.experts.E.{gate,up,down}_proj.weight`: the published checkpoints, and what
  transformers 5 writes by default (save_pretrained reverts its fused parameters to this "original format"),
  so what `hypersloth-export --merge` writes;
- fused, as transformers 5 holds them in memory (and saves them with save_original_format=False):
  `mlp.experts.gate_up_proj` (experts, 2*I, H) and `mlp.experts.down_proj` (experts, H, I).
  Qwen3MoeExperts.forward computes `gate, up = linear(x, gate_up_proj[e]).chunk(2, dim=-1)`: rows [:I] are
  the gate (through the activation), rows [I:] the up projection.

gpt-oss (`layout="gpt_oss"`) saves its experts fused the other way round, with biases: `gate_up_proj`
(experts, H, 2*I) whose columns interleave gate and up (GptOssExperts: `gate_up[..., ::2]`, `[..., 1::2]`),
`gate_up_proj_bias` (experts, 2*I) likewise, `down_proj` (experts, I, H) and `down_proj_bias` (experts, H).
llama.cpp's converter (conversion/gpt_oss.py) takes every other column and transposes each expert to
(rows = outputs); the attention sinks `self_attn.sinks` get its `.weight` suffix.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from HyperSloth.outputs.export import ExportError

_PER_EXPERT = re.compile(r"(?P<stem>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")
_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
_GPT_OSS_EXPERTS = ("mlp.experts.gate_up_proj", "mlp.experts.gate_up_proj_bias", "mlp.experts.down_proj",
                    "mlp.experts.down_proj_bias")
LAYOUTS = ("qwen", "gpt_oss")


@dataclass(frozen=True)
class TensorPart:
    """One GGUF tensor: a Hugging Face name the gguf package's TensorNameMap knows, its shape, the model's
    tensors it is read from (stacked on a new first axis when `stacked`), the rows of their second axis it
    takes (None: all), the entries of their last axis it takes (None: all), and whether the last two axes are
    then swapped (gpt-oss's (in, out) experts to llama.cpp's (out, in))."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    stacked: bool = False
    rows: slice | None = None
    columns: slice | None = None
    transposed: bool = False


def tensor_parts(shapes: dict[str, tuple[int, ...]], experts: int | None, layout: str = "qwen") -> list[TensorPart]:
    """The GGUF tensors of a model whose tensors have `shapes`; `experts`: experts per MoE layer (None: no MoE),
    whose tensors become the three stacked ones (`layout` "qwen": either Qwen layout; "gpt_oss": gpt-oss's, with
    their biases, and its attention sinks)."""
    if layout not in LAYOUTS:
        raise ValueError(f"unknown experts layout {layout!r}; one of {LAYOUTS}")
    if layout == "gpt_oss":
        return [part for name, shape in shapes.items() for part in _gpt_oss_parts(name, shape, experts)]
    parts: list[TensorPart] = []
    per_expert: dict[tuple[str, str], dict[int, TensorPart]] = {}
    for name, shape in shapes.items():
        match = _PER_EXPERT.fullmatch(name) if experts is not None else None
        if match:
            per_expert.setdefault((match["stem"], match["proj"]), {})[int(match["expert"])] = TensorPart(
                name, shape, (name,))
        elif experts is not None and name.endswith(_FUSED):
            parts.extend(fused_parts(name, shape))
        else:
            parts.append(TensorPart(name, shape, (name,)))
    return parts + stack_experts(per_expert, experts or 0, lambda stem, proj: f"{stem}.{proj}.weight")


def stack_experts(per_expert: dict[tuple[str, str], dict[int, TensorPart]], count: int,
                  name: Callable[[str, str], str]) -> list[TensorPart]:
    """One tensor per (layer stem, projection): the `count` experts' tensors stacked in expert order, named
    `name(stem, projection)`; ExportError where one is missing (an incomplete model folder)."""
    stacked = []
    for (stem, proj), by_expert in per_expert.items():
        if sorted(by_expert) != list(range(count)):
            raise ExportError(f"{stem} holds {proj} for experts {sorted(by_expert)}, but config.json names {count} "
                              "experts per layer: the model folder is incomplete")
        sources = tuple(by_expert[index].sources[0] for index in range(count))
        stacked.append(TensorPart(name(stem, proj), (count, *by_expert[0].shape), sources, stacked=True))
    return stacked


def fused_parts(name: str, shape: tuple[int, ...]) -> list[TensorPart]:
    """Fused experts (transformers 5 in memory): `...gate_up_proj` (experts, 2*I, H) as its gate rows and its up
    rows, `...down_proj` as it is."""
    if len(shape) != 3:
        raise ExportError(f"tensor {name} has shape {shape}: fused experts are 3-D (experts, rows, columns)")
    if name.endswith("down_proj"):
        return [TensorPart(f"{name}.weight", shape, (name,))]
    experts, rows, columns = shape
    if rows % 2:
        raise ExportError(f"tensor {name} has shape {shape}: gate_up_proj needs an even number of rows (gate, up)")
    stem, half = name.removesuffix("gate_up_proj"), rows // 2
    return [TensorPart(f"{stem}gate_proj.weight", (experts, half, columns), (name,), rows=slice(0, half)),
            TensorPart(f"{stem}up_proj.weight", (experts, half, columns), (name,), rows=slice(half, rows))]


def _gpt_oss_parts(name: str, shape: tuple[int, ...], experts: int | None) -> list[TensorPart]:
    """gpt-oss's tensors as llama.cpp's converter writes them (module docstring)."""
    if name.endswith("self_attn.sinks"):
        return [TensorPart(f"{name}.weight", shape, (name,))]
    if not name.endswith(_GPT_OSS_EXPERTS):
        return [TensorPart(name, shape, (name,))]
    if shape[0] != experts or len(shape) not in (2, 3):
        raise ExportError(f"tensor {name} has shape {shape}: gpt-oss's experts are ({experts}, ...) with "
                          f"{experts} experts per layer (config.json)")
    if name.endswith("down_proj"):  # (E, I, H) -> (E, H, I)
        return [TensorPart(f"{name}.weight", (shape[0], shape[2], shape[1]), (name,), transposed=True)]
    if name.endswith("down_proj_bias"):
        return [TensorPart(name.removesuffix("_bias") + ".bias", shape, (name,))]
    if shape[-1] % 2:
        raise ExportError(f"tensor {name} has shape {shape}: gate_up needs an even last axis (gate and up "
                          "interleaved)")
    stem = name.removesuffix("gate_up_proj_bias").removesuffix("gate_up_proj")
    if name.endswith("_bias"):  # (E, 2I): gate = [:, ::2], up = [:, 1::2]
        half = (shape[0], shape[1] // 2)
        return [TensorPart(f"{stem}{proj}.bias", half, (name,), columns=slice(start, None, 2))
                for proj, start in (("gate_proj", 0), ("up_proj", 1))]
    half = (shape[0], shape[2] // 2, shape[1])  # (E, H, 2I): every other column, then (E, I, H)
    return [TensorPart(f"{stem}{proj}.weight", half, (name,), columns=slice(start, None, 2), transposed=True)
            for proj, start in (("gate_proj", 0), ("up_proj", 1))]
