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
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from HyperSloth.outputs.export import ExportError

_PER_EXPERT = re.compile(r"(?P<stem>.+\.mlp\.experts)\.(?P<expert>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\.weight")
_FUSED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


@dataclass(frozen=True)
class TensorPart:
    """One GGUF tensor: a Hugging Face name the gguf package's TensorNameMap knows, its shape, the model's
    tensors it is read from (stacked on a new first axis when `stacked`), and the rows of their second axis it
    takes (None: all)."""

    name: str
    shape: tuple[int, ...]
    sources: tuple[str, ...]
    stacked: bool = False
    rows: slice | None = None


def tensor_parts(shapes: dict[str, tuple[int, ...]], experts: int | None) -> list[TensorPart]:
    """The GGUF tensors of a model whose tensors have `shapes`; `experts`: experts per MoE layer (None: no MoE),
    whose tensors in either layout become the three stacked ones."""
    parts: list[TensorPart] = []
    per_expert: dict[tuple[str, str], dict[int, str]] = {}
    for name, shape in shapes.items():
        match = _PER_EXPERT.fullmatch(name) if experts is not None else None
        if match:
            per_expert.setdefault((match["stem"], match["proj"]), {})[int(match["expert"])] = name
        elif experts is not None and name.endswith(_FUSED):
            parts.extend(_fused_parts(name, shape))
        else:
            parts.append(TensorPart(name, shape, (name,)))
    for (stem, proj), names in per_expert.items():
        if sorted(names) != list(range(experts)):
            raise ExportError(f"{stem} holds {proj} for experts {sorted(names)}, but config.json names {experts} "
                              "experts per layer: the model folder is incomplete")
        sources = tuple(names[index] for index in range(experts))
        parts.append(TensorPart(f"{stem}.{proj}.weight", (experts, *shapes[sources[0]]), sources, stacked=True))
    return parts


def _fused_parts(name: str, shape: tuple[int, ...]) -> list[TensorPart]:
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
