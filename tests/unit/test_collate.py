"""Collation: packed rows must give exactly the loss of the same samples run one by one."""

import numpy as np
import pytest
import torch
from transformers import Qwen3Config, Qwen3ForCausalLM

from HyperSloth.train.collate import IGNORE_INDEX, collate_packed, collate_sorted_pad, count_trainable


@pytest.fixture(scope="module")
def tiny_model():
    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
    )
    return Qwen3ForCausalLM(config).eval()


def _samples(seed=0, lengths=(5, 17, 9, 30)):
    rng = np.random.default_rng(seed)
    out = []
    for n in lengths:
        ids = rng.integers(3, 97, size=n)
        labels = ids.copy()
        labels[: n // 3] = IGNORE_INDEX  # a "prompt" part that is not trained
        out.append((ids, labels))
    return out


def _sum_loss(model, batch):
    targets = count_trainable(batch["labels"])
    with torch.no_grad():
        # use_cache=False: with a KV cache transformers skips packed-sequence detection (cross-talk).
        out = model(**batch, num_items_in_batch=1, use_cache=False)
    return float(out.loss), targets


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_loss_equals_one_by_one(tiny_model, attn):
    tiny_model.config._attn_implementation = attn
    samples = _samples()
    packed_sum, packed_targets = _sum_loss(tiny_model, collate_packed(samples))
    single = [_sum_loss(tiny_model, collate_packed([s])) for s in samples]
    assert packed_targets == sum(t for _, t in single)
    assert packed_sum == pytest.approx(sum(l for l, _ in single), rel=1e-5)


def test_packed_layout():
    samples = _samples(lengths=(3, 4))
    batch = collate_packed(samples)
    assert batch["position_ids"].tolist() == [[0, 1, 2, 0, 1, 2, 3]]
    assert batch["labels"][0, 3].item() == IGNORE_INDEX  # first token of the 2nd sample is never a target
    assert "attention_mask" not in batch


def test_sorted_pad_matches_packed(tiny_model):
    tiny_model.config._attn_implementation = "sdpa"
    samples = _samples(seed=1)
    padded = collate_sorted_pad(samples, pad_token_id=0)
    assert padded["input_ids"].shape == (4, 30)
    assert padded["labels"][0, 5:].eq(IGNORE_INDEX).all()
    assert padded["attention_mask"].sum().item() == sum(len(i) for i, _ in samples)
    padded_sum, padded_targets = _sum_loss(tiny_model, padded)
    packed_sum, packed_targets = _sum_loss(tiny_model, collate_packed(samples))
    assert padded_targets == packed_targets
    assert padded_sum == pytest.approx(packed_sum, rel=1e-5)


def test_bucket_tokens_are_few_and_waste_little():
    from HyperSloth.train.collate import bucket_tokens

    assert [bucket_tokens(n) for n in (1, 64, 65, 11000, 16384, 16385)] == [64, 64, 128, 11264, 16384, 18432]
    lengths = np.arange(4096, 65536)
    buckets = np.array([bucket_tokens(int(n)) for n in lengths])
    assert (buckets >= lengths).all() and ((buckets - lengths) / lengths).max() <= 1 / 8
    assert len(set(buckets.tolist())) <= 8 * 4 + 1  # about 8 lengths per doubling
    with pytest.raises(ValueError, match="positive"):
        bucket_tokens(0)


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_bucketed_row_gives_the_same_loss_and_gradients(attn):
    """A padding segment changes nothing: same loss, same targets, same LoRA-free gradients (fp32, 1e-7)."""
    from HyperSloth.train.collate import collate

    torch.manual_seed(0)
    config = Qwen3Config(
        vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=256, tie_word_embeddings=True,
    )
    model = Qwen3ForCausalLM(config).train()
    model.config._attn_implementation = attn
    samples = _samples(lengths=(5, 17, 9, 30))

    def loss_and_grads(batch):
        model.zero_grad(set_to_none=True)
        loss = model(**batch, num_items_in_batch=count_trainable(batch["labels"]), use_cache=False).loss
        loss.backward()
        return loss.detach(), [p.grad.clone() for p in model.parameters()]

    plain = collate(samples, "packed", pad_token_id=0)
    bucketed = collate(samples, "packed", pad_token_id=0, bucket=True, with_lengths=True)
    assert bucketed["input_ids"].shape[1] == 64 and plain["input_ids"].shape[1] == 61
    assert bucketed["packed_seq_lengths"].tolist() == [5, 17, 9, 30, 3]
    assert bucketed["position_ids"][0, 61:].tolist() == [0, 1, 2]
    assert count_trainable(bucketed["labels"]) == count_trainable(plain["labels"])
    bucketed.pop("packed_seq_lengths")
    loss_a, grads_a = loss_and_grads(plain)
    loss_b, grads_b = loss_and_grads(bucketed)
    torch.testing.assert_close(loss_b, loss_a, rtol=1e-7, atol=1e-7)
    for a, b in zip(grads_a, grads_b):
        torch.testing.assert_close(b, a, rtol=1e-6, atol=1e-7)


def test_bucketing_never_pads_past_the_budget():
    from HyperSloth.train.collate import collate

    samples = _samples(lengths=(600, 400, 33))  # 1,033 tokens: the bucket would be 1,152
    assert collate(samples, "packed", 0, bucket=True)["input_ids"].shape[1] == 1152
    assert collate(samples, "packed", 0, bucket=True, bucket_limit=1100)["input_ids"].shape[1] == 1100
    assert collate(samples, "packed", 0, bucket=True, bucket_limit=1000)["input_ids"].shape[1] == 1033


def test_long_rows_are_not_bucketed():
    """A row past LONG_ROW_TOKENS keeps its length: its bucket would add up to 1/8 of a row that costs seconds,
    more than the new shape costs (the packed long sample then pads nothing, so packing it is never dearer)."""
    from HyperSloth.train.collate import LONG_ROW_TOKENS, collate

    long_row = _samples(lengths=(LONG_ROW_TOKENS - 4000, 5000))  # 66,536 tokens: the bucket would be 73,728
    assert collate(long_row, "packed", 0, bucket=True, bucket_limit=10**6)["input_ids"].shape[1] == LONG_ROW_TOKENS + 1000
    below = _samples(lengths=(LONG_ROW_TOKENS - 4000, 3000))  # 64,536 tokens: bucketed to 65,536
    assert collate(below, "packed", 0, bucket=True, bucket_limit=10**6)["input_ids"].shape[1] == LONG_ROW_TOKENS


@pytest.mark.parametrize("loss_type", ["all", "response_only"])
@pytest.mark.parametrize("mode", ["packed", "sorted-pad"])
def test_collate_rows_is_collate_of_the_rows_labels(mode, loss_type):
    """The one path from planned rows of a built dataset to model inputs (training and evaluation)."""
    from HyperSloth.train.collate import collate, collate_rows, sample_labels

    samples = _samples()
    dataset = {"input_ids": [ids for ids, _ in samples], "labels": [lab for _, lab in samples]}

    class Rows:  # a numpy-formatted dataset: rows by index list
        def __getitem__(self, indices):
            return {k: [v[i] for i in indices] for k, v in dataset.items()}

    picked = [3, 1]
    got = collate_rows(Rows(), picked, mode, loss_type, pad_token_id=0, with_lengths=True)
    chosen = [(samples[i][0], sample_labels(*samples[i], loss_type)) for i in picked]
    want = collate(chosen, mode, 0, with_lengths=True)
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    if loss_type == "all":  # every token but each sample's first is a target: the planner's count
        assert count_trainable(got["labels"]) == sum(len(samples[i][0]) - 1 for i in picked)
