"""A real consumer reads our GGUF files: llama.cpp (through llama-cpp-python) loads each one, tokenises a
chat-formatted text into the Hugging Face tokenizer's ids, and computes the Hugging Face model's logits.

Skipped where `llama_cpp` is not importable: CI does not build llama.cpp (docs/export.md says how it was
built and what these tests measured). Thresholds from issue 35: f16 (and bf16, f32) max |diff| within 2% of the
logit range and the same argmax at >= 99% of positions; q8_0 the same argmax at >= 90%.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from gguf_models import CHAT, build_arch_model
from transformers import AutoModelForCausalLM, AutoTokenizer

llama_cpp = pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from HyperSloth.outputs.gguf import write_gguf  # noqa: E402

ARCHS = ("Qwen3ForCausalLM", "Qwen2ForCausalLM", "LlamaForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM")
LOOSE_TYPES = {"q8_0": 0.90, "q5_1": 0.0, "q5_0": 0.0, "q4_1": 0.0, "q4_0": 0.0}  # argmax share required


def chat_text(model_dir: Path) -> str:
    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    return tokenizer.apply_chat_template(CHAT, tokenize=False, add_generation_prompt=True)


def hf_logits(model_dir: Path, ids: list[int]) -> np.ndarray:
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0].numpy()


def llama_tokens_and_logits(gguf_file: Path, text: str) -> tuple[list[int], np.ndarray]:
    llm = llama_cpp.Llama(str(gguf_file), n_ctx=512, n_batch=512, logits_all=True, n_threads=2, verbose=False)
    try:
        ids = llm.tokenize(text.encode("utf-8"), add_bos=True, special=True)  # add_bos: as the GGUF says
        llm.eval(ids)
        return ids, np.array(llm.scores[: len(ids)], dtype=np.float32)
    finally:
        llm.close()


def compare(model_dir: Path, gguf_file: Path) -> dict[str, float]:
    """Tokens must be equal; returns max |diff| / logit range and the share of positions with the same argmax."""
    text = chat_text(model_dir)
    hf_ids = AutoTokenizer.from_pretrained(str(model_dir))(text)["input_ids"]
    ids, ours = llama_tokens_and_logits(gguf_file, text)
    assert ids == hf_ids, f"llama.cpp tokens differ from the HF tokenizer's on {text!r}"
    reference = hf_logits(model_dir, hf_ids)
    return {"max_diff_over_range": float(np.abs(ours - reference).max() / np.ptp(reference)),
            "argmax_agreement": float((ours.argmax(-1) == reference.argmax(-1)).mean()),
            "tokens": len(ids)}


def check(measured: dict[str, float], gguf_type: str) -> None:
    if gguf_type in LOOSE_TYPES:
        assert measured["argmax_agreement"] >= LOOSE_TYPES[gguf_type], measured
    else:
        assert measured["max_diff_over_range"] <= 2e-2, measured
        assert measured["argmax_agreement"] >= 0.99, measured


@pytest.mark.parametrize("gguf_type", ["f16", "bf16", "q8_0", "f32", "q5_1", "q5_0", "q4_1", "q4_0"])
def test_llama_cpp_runs_the_tiny_model(tiny_model_dir, tmp_path, gguf_type):
    measured = compare(tiny_model_dir, write_gguf(tiny_model_dir, tmp_path / "m.gguf", gguf_type))
    print(f"tiny Qwen3 {gguf_type}: {measured}")
    check(measured, gguf_type)


@pytest.mark.parametrize("arch", ARCHS)
def test_llama_cpp_runs_each_architecture(tiny_model_dir, tmp_path, arch):
    model = build_arch_model(arch, tmp_path / arch, tiny_model_dir)
    measured = compare(model, write_gguf(model, tmp_path / "m.gguf", "f16"))
    print(f"{arch} f16: {measured}")
    check(measured, "f16")
