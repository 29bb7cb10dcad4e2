"""probe_cache.py: the budget probe's measurements cached per model, setup and GPU (no GPU needed)."""

import json
import types

import pytest
import torch

from HyperSloth.outputs import run_files
from HyperSloth.train.budget import choice as budget_choice
from HyperSloth.train.budget import probe as budget_probe
from HyperSloth.train.budget import cache as probe_cache

GIB = 2**30
DEVICE = {"gpu": "NVIDIA H200", "total_bytes": 150 * GIB, "capability": "9.0"}


def _key(**change):
    fields = dict(fast={"model_name": "unsloth/Qwen3-8B", "dtype": "bfloat16", "load_in_4bit": True,
                        "max_seq_length": 131072},
                  lora={"r": 16, "lora_alpha": 16, "target_modules": ["q_proj"]}, gradient_checkpointing=False,
                  backend="unsloth", with_lengths=True, probe_rows={32768: [32768]}, device=DEVICE,
                  versions={"torch": "2.11.0", "unsloth": "2026.10.9"})
    fields.update(change)
    return probe_cache.probe_key(**fields)


def test_cache_dir_default_override_and_off(tmp_path):
    assert probe_cache.cache_dir({"XDG_CACHE_HOME": str(tmp_path)}) == tmp_path / "hypersloth"
    assert probe_cache.cache_dir({run_files.ENV_CACHE_DIR: str(tmp_path / "c")}) == tmp_path / "c"
    assert probe_cache.cache_dir({run_files.ENV_CACHE_DIR: "off"}) is None
    assert probe_cache.cache_dir({}).name == "hypersloth"


def test_every_field_of_the_key_matters():
    base = probe_cache.key_digest(_key())
    variants = [_key(gradient_checkpointing="unsloth"), _key(lora={"r": 32}), _key(backend="transformers"),
                _key(device={**DEVICE, "total_bytes": 80 * GIB}), _key(versions={"torch": "2.12.0"}),
                _key(probe_rows={32768: [4096] * 8}), _key(fast={"model_name": "unsloth/Qwen3-8B", "load_in_4bit": False})]
    digests = {probe_cache.key_digest(k) for k in variants}
    assert base not in digests and len(digests) == len(variants)


def test_a_local_model_is_named_by_its_config(tmp_path):
    (tmp_path / "config.json").write_text('{"hidden_size": 64}')
    first = probe_cache.model_identity(str(tmp_path))
    (tmp_path / "config.json").write_text('{"hidden_size": 128}')
    assert first["config_sha256"] != probe_cache.model_identity(str(tmp_path))["config_sha256"]
    assert probe_cache.model_identity("org/model")["config_sha256"] is None


def test_put_get_merge_and_exact_match(tmp_path):
    cache = probe_cache.ProbeCache(tmp_path)
    assert cache.get(_key()) is None
    cache.put(_key(), {2048: 10 * GIB, 8192: 12 * GIB})
    cache.put(_key(), {32768: 20 * GIB})
    assert cache.get(_key()) == {2048: 10 * GIB, 8192: 12 * GIB, 32768: 20 * GIB}
    assert cache.get(_key(gradient_checkpointing="unsloth")) is None
    data = json.loads(cache.path.read_text())
    (entry,) = data.values()
    entry["key"]["backend"] = "transformers"  # an entry whose stored key differs from its digest: never used
    cache.path.write_text(json.dumps(data))
    assert cache.get(_key()) is None
    assert probe_cache.ProbeCache(None).get(_key()) is None and not probe_cache.ProbeCache(None).enabled


def test_an_unreadable_or_unwritable_cache_never_fails(tmp_path):
    cache = probe_cache.ProbeCache(tmp_path)
    cache.path.write_text("{not json")
    assert cache.get(_key()) is None
    blocked = probe_cache.ProbeCache(tmp_path / "file")
    (tmp_path / "file").write_text("a file where the folder should be")
    blocked.put(_key(), {2048: GIB})  # warns, does not raise
    assert blocked.get(_key()) is None


def test_old_entries_are_dropped_beyond_the_limit(tmp_path, monkeypatch):
    monkeypatch.setattr(probe_cache, "MAX_ENTRIES", 3)
    cache = probe_cache.ProbeCache(tmp_path)
    for r in range(5):
        cache.put(_key(lora={"r": r}), {2048: GIB})
    assert [cache.get(_key(lora={"r": r})) is not None for r in range(5)] == [False, False, True, True, True]


def test_cached_peaks_reverify_one_pass_then_answer_from_the_entry():
    live_calls = []

    def live(tokens):
        live_calls.append(tokens)
        return GIB + 1000 * tokens

    peaks = probe_cache.CachedPeaks(live, {2048: GIB + 1000 * 2048, 8192: GIB + 1000 * 8192})
    peaks.reverify()
    assert peaks.status == "cached" and live_calls == [2048]
    out = budget_choice.measure(peaks, limit_bytes=GIB + 1000 * 20000, cap=10**6, verify_at_most=32768)
    assert live_calls == [2048, out["tokens"]]  # only the new size ran
    assert set(peaks.measured) == {2048, out["tokens"]}


def test_cached_peaks_that_do_not_reverify_are_all_measured_again():
    peaks = probe_cache.CachedPeaks(lambda t: 3 * GIB + t, {2048: GIB, 8192: 2 * GIB})
    peaks.reverify()
    assert peaks.status == "re-measured" and peaks(8192) == 3 * GIB + 8192
    fresh = probe_cache.CachedPeaks(lambda t: t, None)
    fresh.reverify()
    assert fresh.status == "measured" and fresh.measured == {}


def test_close_enough_allows_allocator_noise_only():
    assert probe_cache.close_enough(10 * GIB + 100 * 2**20, 10 * GIB)
    assert not probe_cache.close_enough(11 * GIB, 10 * GIB)


def test_cached_line_switches_checkpointing_on_before_loading(tmp_path, monkeypatch):
    """A cached line (without checkpointing) that cannot hold the longest sample even on the whole GPU."""
    props = types.SimpleNamespace(name="NVIDIA H200", total_memory=100 * GIB, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    setup = probe_cache.ProbeSetup(fast={"model_name": "m"}, lora=None, backend="unsloth",
                                   cache=probe_cache.ProbeCache(tmp_path))
    lengths = [131072] + [500] * 40
    assert not budget_probe.cached_needs_checkpointing(setup, lengths, 32)  # nothing cached yet
    longest = sorted(lengths, reverse=True)
    key = budget_probe._probe_key(setup, 0, False, True, longest, budget_choice.useful_cap(lengths, 32))
    setup.cache.put(key, {2048: 6 * GIB + 2048 * 2**20, 8192: 6 * GIB + 8192 * 2**20})  # 1 MiB per token
    assert budget_probe.cached_needs_checkpointing(setup, lengths, 32)  # ~86k tokens at most on 92 GiB
    short = [65536] + [500] * 40
    key = budget_probe._probe_key(setup, 0, False, True, sorted(short, reverse=True),
                                  budget_choice.useful_cap(short, 32))
    setup.cache.put(key, {2048: 6 * GIB + 2048 * 2**20, 8192: 6 * GIB + 8192 * 2**20})
    assert not budget_probe.cached_needs_checkpointing(setup, short, 32)  # it could fit: measure as usual


def test_measure_on_gpu_measures_once_then_reuses_the_cache(tmp_path, monkeypatch):
    """The wiring on a faked GPU: the first start measures and stores; the second runs one pass (the
    re-verification) and says "cached"; a GPU whose memory answers differently measures again."""
    props = types.SimpleNamespace(name="NVIDIA H200", total_memory=140 * GIB, major=9, minor=0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device: props)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (130 * GIB, 140 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device: 2 * GIB)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    passes, base = [], [6 * GIB]
    monkeypatch.setattr(budget_probe, "peak_of_forward_backward",
                        lambda model, longest, vocab, with_lengths: lambda t: passes.append(t) or base[0] + t * 2**20)
    setup = probe_cache.ProbeSetup(fast={"model_name": "m"}, lora={"r": 16}, backend="unsloth",
                                   cache=probe_cache.ProbeCache(tmp_path))
    model = torch.nn.Linear(4, 4)
    lengths = [500] * 64

    def run():
        passes.clear()
        return budget_probe.measure_on_gpu(model, lengths=lengths, vocab_size=100, cap=32000,
                                           gradient_checkpointing=False, setup=setup)

    first = run()
    assert first.cache == "measured" and first.probe_passes == len(passes) == 3  # 2,048, 8,192, 32,000
    again = run()
    assert again.cache == "cached" and passes == [2048] and again.tokens == first.tokens
    assert "budget probe: cached, 1 forward+backward pass(es)" in again.probe_line()
    base[0] = 9 * GIB  # another allocation on this GPU now: the cached pass does not re-verify
    third = run()
    assert third.cache == "re-measured" and third.probe_passes == len(passes) == 3  # the re-verify pass reused
    off = budget_probe.measure_on_gpu(model, lengths=lengths, vocab_size=100, cap=32000, gradient_checkpointing=False,
                                      setup=probe_cache.ProbeSetup(fast={"model_name": "m"}, lora=None, backend="unsloth",
                                                             cache=probe_cache.ProbeCache(None)))
    assert off.cache == "off"
