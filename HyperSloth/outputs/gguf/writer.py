"""Write a merged Hugging Face model folder (config.json + safetensors + tokenizer) as one GGUF file.

The file format, tensor names, metadata keys and quantisation are the `gguf` package's (GGUFWriter,
TensorNameMap, gguf.quants); the choice of each tensor's type follows convert_hf_to_gguf.py: norms, biases,
MoE routers (ffn_gate_inp) and other 1-D tensors stay F32, a row whose length is not a multiple of the type's
block is written F16, every other weight in the requested type. Tensors are read, converted and written one at a
time (the writer gets every tensor's shape and type first), so memory holds one GGUF tensor (at most an MoE
layer's stacked experts), not the model. The file is written under a hidden temporary name beside the destination
and renamed into place at the end: a failure leaves no half-written GGUF.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from loguru import logger

from HyperSloth.outputs import run_files
from HyperSloth.outputs.export import ExportError
from HyperSloth.outputs.gguf.architectures import (
    Architecture,
    add_hyperparameters,
    architecture_of,
    caveats,
    expert_count,
    llama3_rope_factors,
    text_config,
    transform,
)
from HyperSloth.outputs.gguf.experts import TensorPart, tensor_parts
from HyperSloth.outputs.gguf.vocab import add_tokenizer

EMBEDDINGS = "model.embed_tokens.weight"  # also the output projection of a model with tied embeddings

# --gguf TYPE -> (GGMLQuantizationType name, LlamaFileType name). Only types the gguf package quantises itself
# (its quants module has no K-quant or i-quant encoder); each one loaded by llama.cpp in the consumer test.
GGUF_TYPES: dict[str, tuple[str, str]] = {
    "f16": ("F16", "MOSTLY_F16"),
    "bf16": ("BF16", "MOSTLY_BF16"),
    "q8_0": ("Q8_0", "MOSTLY_Q8_0"),
    "f32": ("F32", "ALL_F32"),
    "q5_1": ("Q5_1", "MOSTLY_Q5_1"),
    "q5_0": ("Q5_0", "MOSTLY_Q5_0"),
    "q4_1": ("Q4_1", "MOSTLY_Q4_1"),
    "q4_0": ("Q4_0", "MOSTLY_Q4_0"),
}


@dataclass(frozen=True)
class PlannedTensor:
    """One tensor of the GGUF: its name there, shape (numpy order), type, and how to produce its float32 data."""

    name: str
    shape: tuple[int, ...]
    qtype: Any  # gguf.GGMLQuantizationType
    load: Callable[[], np.ndarray]


def write_gguf(model_dir: str | os.PathLike, dest: str | os.PathLike, gguf_type: str, *, name: str | None = None) -> Path:
    """Write `model_dir` (a merged model folder) as the GGUF file `dest` in `gguf_type` (a GGUF_TYPES key)."""
    import gguf

    if gguf_type not in GGUF_TYPES:
        raise ExportError(f"GGUF type {gguf_type!r} is not supported: choose one of {', '.join(GGUF_TYPES)}")
    model_dir, dest = Path(model_dir), Path(dest)
    config = text_config(read_config(model_dir))
    arch = architecture_of(config, str(model_dir))
    for caveat in caveats(config, arch):
        logger.warning(f"GGUF of {model_dir.name}: {caveat}")
    qtype_name, file_type = GGUF_TYPES[gguf_type]
    writer = gguf.GGUFWriter(path=None, arch=arch.arch_name)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or model_dir.name)
    add_hyperparameters(writer, config, arch)
    writer.add_file_type(getattr(gguf.LlamaFileType, file_type))
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    add_tokenizer(writer, model_dir, config["vocab_size"])
    planned = list(plan_tensors(model_dir, config, arch, getattr(gguf.GGMLQuantizationType, qtype_name)))
    for tensor in planned:
        writer.add_tensor_info(tensor.name, *_stored_shape_and_dtype(tensor))
    _write_file(writer, planned, dest)
    return dest


def read_config(model_dir: Path) -> dict[str, Any]:
    path = model_dir / "config.json"
    if not path.is_file():
        raise ExportError(f"{model_dir} has no config.json: give --gguf a merged model folder")
    return json.loads(path.read_text())


def plan_tensors(model_dir: Path, config: dict[str, Any], arch: Architecture, qtype) -> Iterator[PlannedTensor]:
    """Every tensor of the model under its GGUF name, with its type; ExportError for a tensor with no GGUF name."""
    import gguf

    names = gguf.get_tensor_name_map(arch.model_arch, config["num_hidden_layers"])
    hooks = arch.hooks
    rope = [] if (factors := llama3_rope_factors(config)) is None else [(gguf.MODEL_TENSOR.ROPE_FREQS, factors)]
    for kind, data in [*rope, *(hooks.rope_tensors(config) if hooks.rope_tensors is not None else [])]:
        yield PlannedTensor(gguf.TENSOR_NAMES[kind] + ".weight", data.shape, gguf.GGMLQuantizationType.F32,
                            lambda data=data: data)
    tied = bool(config.get("tie_word_embeddings"))
    files, shapes = _tensor_index(model_dir, tied=tied)
    parts = tensor_parts(shapes, expert_count(config) if arch.moe else None, arch.experts_layout)
    if hooks.split_parts is not None:
        parts = hooks.split_parts(parts, config)
    if tied and arch.output_required:  # llama.cpp's graph for it reads output.weight, never token_embd
        parts.append(TensorPart("lm_head.weight", shapes[EMBEDDINGS], (EMBEDDINGS,)))
    for part in parts:
        lookup, shape = text_model_name(part.name), part.shape
        if hooks.rename is not None:
            lookup, shape = hooks.rename(lookup, shape, config)
        gguf_name = (hooks.gguf_name(lookup, names) if hooks.gguf_name is not None
                     else names.get_name(lookup, try_suffixes=(".weight", ".bias")))
        if gguf_name is None:
            raise ExportError(f"tensor {part.sources[0]} of {model_dir} has no name in llama.cpp's {arch.arch_name} "
                              f"architecture: this {arch.hf_name} variant is not supported")
        yield PlannedTensor(gguf_name, shape, tensor_type(gguf_name, shape, qtype), _loader(files, part, config, arch))


# Where a language model's tensors lie inside a multimodal checkpoint -> where a text-only model holds them
_TEXT_PREFIXES = {"model.language_model.": "model.", "language_model.model.": "model.", "language_model.lm_head.":
                  "lm_head."}
# the multimodal parts (Gemma 4's projections of image and audio features into the text model: embed_vision/_audio)
_NOT_TEXT = ("vision_tower.", "multi_modal_projector.", "visual.", "audio_tower.", "embed_vision.", "embed_audio.")


def text_model_name(name: str) -> str:
    """A tensor's name as a text-only model holds it. transformers 5 saves a text model loaded from a multimodal
    checkpoint (Qwen3.5-35B-A3B is one) under the checkpoint's own names, `model.language_model.layers...`, and a
    multimodal model (Gemma 3 4B+) its language model under `language_model.model...`: llama.cpp's converter maps
    both as `model.layers...`."""
    for prefix, text in _TEXT_PREFIXES.items():
        if name.startswith(prefix):
            return text + name[len(prefix):]
    return name


def _outside_text(name: str) -> bool:
    return name.removeprefix("model.").startswith(_NOT_TEXT)


def _tensor_index(model_dir: Path, tied: bool) -> tuple[dict[str, Path], dict[str, tuple[int, ...]]]:
    """Each tensor's file and shape, without the tied output (llama.cpp reads it from token_embd when
    output.weight is absent), RoPE buffers, and a multimodal model's other towers."""
    from safetensors import safe_open

    files, shapes = {}, {}
    for file in _weight_files(model_dir):
        with safe_open(str(file), framework="pt") as handle:
            for hf_name in handle.keys():
                text_name = text_model_name(hf_name)
                if ((tied and text_name == "lm_head.weight") or text_name.endswith("rotary_emb.inv_freq")
                        or _outside_text(hf_name)):
                    continue
                files[hf_name], shapes[hf_name] = file, tuple(handle.get_slice(hf_name).get_shape())
    return files, shapes


def tensor_type(gguf_name: str, shape: tuple[int, ...], requested):
    """convert_hf_to_gguf.py's rule: 1-D, norms, MoE routers and non-weights F32; rows not a multiple of the
    block F16."""
    import gguf

    kept = tuple(gguf.TENSOR_NAMES[kind].split(".", 2)[-1] + ".weight"  # routers, the shared expert's gate, convs
                 for kind in (gguf.MODEL_TENSOR.FFN_GATE_INP, gguf.MODEL_TENSOR.FFN_GATE_INP_SHEXP,
                              gguf.MODEL_TENSOR.SSM_CONV1D, gguf.MODEL_TENSOR.SHORTCONV_CONV))
    if (len(shape) <= 1 or gguf_name.endswith(("_norm.weight", *kept))
            or not gguf_name.endswith(".weight")):
        return gguf.GGMLQuantizationType.F32
    block_size, _ = gguf.GGML_QUANT_SIZES[requested]
    return requested if shape[-1] % block_size == 0 else gguf.GGMLQuantizationType.F16


def _loader(files: dict[str, Path], part: TensorPart, config: dict[str, Any],
            arch: Architecture) -> Callable[[], np.ndarray]:
    """Reads the part's tensors (each file opened once; only `part.rows` when given) as float32, stacks
    experts, and applies the architecture's transform."""

    def load() -> np.ndarray:
        import torch
        from safetensors import safe_open

        arrays = []
        with ExitStack() as stack:
            handles = {file: stack.enter_context(safe_open(str(file), framework="pt"))
                       for file in dict.fromkeys(files[name] for name in part.sources)}
            for name in part.sources:
                handle = handles[files[name]]
                data = handle.get_tensor(name) if part.rows is None else handle.get_slice(name)[:, part.rows, :]
                if part.columns is not None:
                    data = data[..., part.columns]
                if part.transposed:
                    data = data.transpose(-1, -2)
                arrays.append(np.ascontiguousarray(data.to(torch.float32).numpy()))
        data = np.stack(arrays) if part.stacked else arrays[0]
        return transform(part.name, data, config, arch)

    return load


def _weight_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        return [model_dir / shard for shard in shards]
    if (model_dir / "model.safetensors").is_file():
        return [model_dir / "model.safetensors"]
    raise ExportError(f"{model_dir} holds no model.safetensors (or sharded index): --gguf reads safetensors weights")


def _stored_shape_and_dtype(tensor: PlannedTensor) -> tuple[tuple[int, ...], np.dtype, int, Any]:
    """GGUFWriter.add_tensor_info's (shape, numpy dtype, bytes, raw type) for the tensor once converted."""
    import gguf

    numel = int(np.prod(tensor.shape))
    if tensor.qtype == gguf.GGMLQuantizationType.F32:
        return tensor.shape, np.dtype(np.float32), numel * 4, None
    if tensor.qtype == gguf.GGMLQuantizationType.F16:
        return tensor.shape, np.dtype(np.float16), numel * 2, None
    byte_shape = gguf.quant_shape_to_byte_shape(tensor.shape, tensor.qtype)
    return byte_shape, np.dtype(np.uint8), int(np.prod(byte_shape)), tensor.qtype


def _write_file(writer, planned: list[PlannedTensor], dest: Path) -> None:
    import gguf

    dest.parent.mkdir(parents=True, exist_ok=True)
    temporary = dest.with_name(f".{dest.name}.tmp-{os.getpid()}")
    try:
        writer.write_header_to_file(path=temporary)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        for tensor in planned:
            writer.write_tensor_data(gguf.quants.quantize(tensor.load(), tensor.qtype))
        writer.flush()
        os.fsync(writer.fout[0].fileno())
        writer.close()
        run_files.replace_path(temporary, dest)
    except BaseException:
        writer.close()
        temporary.unlink(missing_ok=True)
        raise
