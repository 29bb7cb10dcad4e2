"""gpt-oss's attention with sinks over packed rows (train/packing/sink_attention.py), on the CPU with torch's own
flex attention: a sample in a packed row gets exactly what it gets alone, full and sliding-window layers, grouped
heads; the wrapper leaves every other call to Unsloth's function; the decoder's pre-hook records the documents.
Unsloth's compiled flex attention and the check's verdict on the GPU are docs/models.md's."""

from __future__ import annotations

import sys
import types
import warnings

import pytest
import torch
from torch.nn.attention.flex_attention import AuxRequest, create_block_mask, flex_attention

from HyperSloth.train.packing import sink_attention
from HyperSloth.train.packing.sink_attention import (
    document_ids,
    document_mask_mod,
    document_masks_for_sink_attention,
    packed_sink_attention,
)

HEADS, KV_HEADS, DIM = 4, 2, 16
LSE = {"return_aux": AuxRequest(lse=True)}


def _output_and_lse(output):
    out, aux = output
    return out, aux.lse


class _Attention(torch.nn.Module):
    """What the sink attention reads of gpt-oss's attention module."""

    def __init__(self, window: int | None):
        super().__init__()
        self.sinks = torch.nn.Parameter(torch.randn(HEADS))
        self.scaling, self.num_key_value_groups, self.sliding_window = DIM**-0.5, HEADS // KV_HEADS, window


def _alone(attn: _Attention, q, k, v, window: int | None) -> torch.Tensor:
    """One sample, eagerly: softmax over the causal (windowed) scores and the head's sink, the sink's column
    dropped (transformers' eager gpt-oss attention); [1, tokens, heads, dim]."""
    k, v = (x.repeat_interleave(HEADS // KV_HEADS, dim=1) for x in (k, v))
    scores = q @ k.transpose(-1, -2) * attn.scaling
    n = q.shape[-2]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    allowed = (i >= j) & ((i - j < window) if window else True)
    scores = scores.masked_fill(~allowed, float("-inf"))
    sinks = attn.sinks.reshape(1, -1, 1, 1).expand(1, HEADS, n, 1)
    probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
    return (probs @ v).transpose(1, 2)


def _flex(*args, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the eager flex attention says it is slow
        return flex_attention(*args, **kwargs)


@pytest.fixture(autouse=True)
def _no_documents():
    sink_attention._Documents.set(None)
    yield
    sink_attention._Documents.set(None)


def test_document_ids_restart_where_positions_do():
    positions = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2, 3]])
    assert document_ids(positions).tolist() == [[1, 1, 1, 2, 2, 3, 3, 3, 3]]


@pytest.mark.parametrize("window", [None, 3])
def test_the_mask_is_causal_within_each_sample_and_the_window(window):
    documents = document_ids(torch.tensor([[0, 1, 2, 3, 4, 0, 1, 2]]))
    mod = document_mask_mod(documents, window)
    n = documents.shape[-1]
    dense = torch.tensor([[bool(mod(0, 0, torch.tensor(i), torch.tensor(j))) for j in range(n)] for i in range(n)])
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    same = documents[0][:, None] == documents[0][None, :]
    expected = (i >= j) & same & ((i - j < window) if window else True)
    assert torch.equal(dense, expected)
    assert not dense[5, 4] and dense[4, 0] == (window is None)  # the second sample never sees the first


@pytest.mark.parametrize("window", [None, 5])
def test_a_packed_sample_gets_what_it_gets_alone(window):
    torch.manual_seed(0)
    attn = _Attention(window).train()
    lengths = [11, 7, 14]
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    tokens = positions.shape[-1]
    q, k, v = torch.randn(1, HEADS, tokens, DIM), torch.randn(1, KV_HEADS, tokens, DIM), torch.randn(1, KV_HEADS,
                                                                                                       tokens, DIM)
    leaky = []
    original = lambda *args, **kwargs: leaky.append(args) or torch.zeros(1)  # noqa: E731 - Unsloth's, never reached
    wrapped = packed_sink_attention(original, flex=_flex, create_block_mask=create_block_mask, lse_kwargs=LSE,
                                    output_and_lse=_output_and_lse)
    sink_attention._Documents.set(document_ids(positions))
    packed = wrapped(attn, q, k, v)
    assert not leaky and packed.shape == (1, tokens, HEADS, DIM)
    start = 0
    for n in lengths:
        part = slice(start, start + n)
        alone = _alone(attn, q[:, :, part], k[:, :, part], v[:, :, part], window)
        torch.testing.assert_close(packed[:, part], alone, rtol=1e-5, atol=1e-5)
        start += n


def test_every_other_call_goes_to_unsloths_function():
    torch.manual_seed(0)
    attn = _Attention(None)
    q, k, v = torch.randn(1, HEADS, 6, DIM), torch.randn(1, KV_HEADS, 6, DIM), torch.randn(1, KV_HEADS, 6, DIM)
    calls = []

    def original(self_attn, query, key, value, attention_mask=None, **kwargs):
        calls.append(query.shape[-2])
        return torch.zeros(1)

    wrapped = packed_sink_attention(original, flex=_flex, create_block_mask=create_block_mask, lse_kwargs=LSE,
                                    output_and_lse=_output_and_lse)
    assert wrapped.hypersloth_packed
    wrapped(attn.train(), q, k, v)  # no documents recorded
    sink_attention._Documents.set(document_ids(torch.tensor([[0, 1, 2, 0, 1, 2]])))
    wrapped(attn.eval(), q, k, v)  # not training (Unsloth's eval path)
    wrapped(attn.train(), q[:, :, :4], k[:, :, :4], v[:, :, :4])  # not the recorded row
    assert calls == [6, 6, 4]


def test_the_decoders_pre_hook_records_packed_rows_only(monkeypatch, tmp_path):
    import transformers

    from HyperSloth.train.tiny_architectures import tiny_config

    config = tiny_config("gpt_oss", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4,
                         num_kv_heads=2, head_dim=8, max_position_embeddings=64, initializer_range=0.02,
                         pad_token_id=0, eos_token_id=1)
    model = transformers.AutoModelForCausalLM.from_config(config)
    zoo = types.ModuleType("unsloth_zoo.flex_attention")
    zoo.flex_attention_with_sink = lambda *args, **kwargs: None  # Unsloth's, not wrapped
    monkeypatch.setitem(sys.modules, "unsloth_zoo", types.ModuleType("unsloth_zoo"))
    monkeypatch.setitem(sys.modules, "unsloth_zoo.flex_attention", zoo)
    assert document_masks_for_sink_attention(model) is None  # nothing to switch on
    zoo.flex_attention_with_sink = packed_sink_attention(zoo.flex_attention_with_sink, flex=_flex,
                                                         create_block_mask=create_block_mask, lse_kwargs=LSE,
                                                         output_and_lse=_output_and_lse)
    remove = document_masks_for_sink_attention(model)
    assert remove is not None
    ids = torch.randint(2, 64, (1, 7))
    with torch.no_grad():
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))
        assert sink_attention._Documents.ids.tolist() == [[1, 1, 1, 2, 2, 2, 2]]
        model(input_ids=ids, position_ids=torch.arange(7)[None])  # one sample: nothing to keep apart
        assert sink_attention._Documents.ids is None
        model(input_ids=ids, position_ids=torch.tensor([[0, 1, 2, 0, 1, 2, 3]]))
    remove()
    assert sink_attention._Documents.ids is None
    qwen = transformers.AutoModelForCausalLM.from_config(tiny_config(
        "qwen3", vocab_size=64, hidden_size=32, intermediate_size=64, num_layers=1, num_heads=4, num_kv_heads=2,
        head_dim=8, max_position_embeddings=64, initializer_range=0.02, pad_token_id=0, eos_token_id=1))
    assert document_masks_for_sink_attention(qwen) is None  # no attention with sinks
