"""A worker that fails: one line naming its error on the console, the traceback once, in its own log."""

from __future__ import annotations

import sys
import types

import pytest
from loguru import logger

from HyperSloth.outputs import logs
from HyperSloth.outputs.startup import StartupTimeline
from HyperSloth.train import worker


@pytest.fixture
def restore_loguru():
    yield
    logger.remove()
    # loguru's default handler, as other tests expect it; writing to whatever sys.stderr is when a message comes,
    # not to this test's captured stream (closed after it: the next test's messages would be lost with an error)
    logger.add(lambda message: sys.stderr.write(message))


def test_a_failing_worker_prints_its_error_in_two_lines_and_logs_the_traceback(tmp_path, monkeypatch, capfd,
                                                                               restore_loguru):
    def failing_run(description, info, timeline):
        logs.configure(info.rank, tmp_path)

        def load_model():
            raise ValueError(f"{tmp_path / 'model'} holds no config.json")

        load_model()

    monkeypatch.setattr(worker, "run", failing_run)
    with pytest.raises(SystemExit) as exit_info:
        worker.main(types.SimpleNamespace(output_dir=str(tmp_path)), types.SimpleNamespace(rank=0))
    assert exit_info.value.code == 1
    log = tmp_path / "logs" / "rank0.log"
    err = capfd.readouterr().err.splitlines()
    assert err == [f"[rank 0] ValueError: {tmp_path / 'model'} holds no config.json", f"[rank 0] traceback in {log}"]
    text = log.read_text()
    # Once, without loguru's variable dumps (its "└" annotations).
    assert text.count("Traceback") == 1 and "in load_model" in text and "└" not in text


def test_a_cuda_kernel_error_says_what_to_do_instead_of_torchs_advice(tmp_path):
    """The tiny Qwen3.5-MoE on Unsloth stopped so on an H200 (2026-12-03): torch's five lines, of which only the
    first says what happened, became the launcher's report. The record keeps that line and says what to try."""
    cuda = RuntimeError("CUDA error: an illegal memory access was encountered\n"
                        "Search for `cudaErrorIllegalAddress' in https://docs.nvidia.com/cuda/ for more information.\n"
                        "CUDA kernel errors might be asynchronously reported at some other API call, so the stacktrace "
                        "below might be incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1\n"
                        "Compile with `TORCH_USE_CUDA_DSA` to enable device-side assertions.\n")
    assert worker.describe_error(cuda).splitlines() == [
        "RuntimeError: CUDA error: an illegal memory access was encountered", worker.CUDA_ERROR_HINT]
    assert "CUDA_LAUNCH_BLOCKING=1" in worker.CUDA_ERROR_HINT and "backend='transformers'" in worker.CUDA_ERROR_HINT
    other = ValueError("the CUDA error count is 3\nFor debugging consider passing nothing")
    assert worker.describe_error(other) == "ValueError: the CUDA error count is 3\nFor debugging consider passing nothing"
    worker._record_failure(tmp_path, 0, cuda)
    import json

    from HyperSloth.outputs import run_files

    recorded = json.loads(run_files.rank_file(tmp_path, 0, "failure.json").read_text())["error"]
    assert recorded == worker.describe_error(cuda)


def test_an_error_in_compiled_code_says_how_to_train_uncompiled():
    """Granite 4.0-H through Unsloth stopped so on an H200 (2026-12-05): an assertion raised in inductor's generated
    code, then torch's three lines for custom-op authors. The report keeps the first line and says what to try."""
    message = ("expected size 32==32, stride 266800==784160 at dim=0\nThis error most often comes from a incorrect "
               "fake (aka meta) kernel for a custom op.\nUse torch.library.opcheck to test your custom op.")
    generated = compile(f"def call():\n    raise AssertionError({message!r})\n",
                        "/tmp/torchinductor_root/oj/cojwzttx.py", "exec")
    namespace: dict = {}
    exec(generated, namespace)
    try:
        namespace["call"]()
    except AssertionError as raised:
        err = raised
    assert worker.describe_error(err).splitlines() == [
        "AssertionError: expected size 32==32, stride 266800==784160 at dim=0", worker.COMPILED_ERROR_HINT]
    assert "UNSLOTH_COMPILE_DISABLE=1" in worker.COMPILED_ERROR_HINT
    oom = "CUDA out of memory. Tried to allocate 2.00 GiB.\nOf the allocated memory 70 GiB is allocated by PyTorch"
    exec(compile(f"def oom():\n    raise RuntimeError({oom!r})\n", "/tmp/torchinductor_root/ab.py", "exec"), namespace)
    try:
        namespace["oom"]()
    except RuntimeError as raised:
        assert worker.describe_error(raised) == f"RuntimeError: {oom}"  # its lines on memory kept
    try:
        raise AssertionError(message)  # the same text from our own code: left as it is
    except AssertionError as raised:
        assert worker.describe_error(raised) == f"AssertionError: {message}"


def test_a_config_problem_found_by_a_worker_exits_2_with_its_message(tmp_path, monkeypatch, capfd, restore_loguru):
    from HyperSloth.config import ConfigError

    def refusing_run(description, info, timeline):
        raise ConfigError("lora_args.target_modules ['nope'] match no module of this model")

    monkeypatch.setattr(worker, "run", refusing_run)
    with pytest.raises(SystemExit) as exit_info:
        worker.main(types.SimpleNamespace(output_dir=str(tmp_path)), types.SimpleNamespace(rank=1))
    assert exit_info.value.code == 2
    assert capfd.readouterr().err.splitlines() == ["[rank 1] lora_args.target_modules ['nope'] match no module of "
                                                  "this model"]


def test_ranks_that_end_with_different_weights_are_named():
    assert worker.weights_mismatch(["a", "a", "b", "a"]).startswith(
        "rank(s) [2] ended with trained weights that differ from rank(s) [0, 1, 3]")
    # Rank 0 is the odd one out: the majority names it; on a tie rank 0's digest is the reference.
    assert worker.weights_mismatch(["x", "a", "a"]).startswith("rank(s) [0] ended")
    assert worker.weights_mismatch(["a", "b"]).startswith("rank(s) [1] ended")


def test_one_process_exchanges_with_itself():
    from HyperSloth.train import dist

    assert dist.exchange("weights_sha256", "ab" * 32) == ["ab" * 32]


def test_the_digest_is_written_before_it_is_compared(tmp_path):
    import json

    import torch

    model = torch.nn.Linear(3, 2)
    model.bias.requires_grad_(False)
    timeline = StartupTimeline(100.0, [("dist_init", 101.5)])
    digest = worker._write_weight_digest(model, tmp_path, 1, timeline)
    record = json.loads((tmp_path / "logs" / "rank1.final.json").read_text())
    assert record["sha256"] == digest and record["trainable_params"] == 6 and record["rank"] == 1
    assert record["startup"]["phase_s"] == {"dist_init": 1.5}  # each rank's own start-up, beside its digest


def test_a_reload_for_checkpointing_puts_the_first_probe_between_the_two_loads(monkeypatch):
    """budget.settle loads, probes, and may load again with checkpointing: the timeline keeps them apart. Each
    load of a packed run is checked to keep packed samples apart (packing_check), before the probe uses it."""
    import time

    from HyperSloth.config import FastModelArgs
    from HyperSloth.train import model as model_lib
    from HyperSloth.train.packing import check as packing_check

    loads, checks = [], []

    def fake_load(fast, lora, **kwargs):
        loads.append(fast.use_gradient_checkpointing)
        return types.SimpleNamespace(model=f"model {len(loads)}", backend="transformers", packing=None,
                                     stamps={"model_load": time.time(), "adapter": time.time()})

    def fake_check(model, backend):
        checks.append((model, backend))
        return packing_check.PackingCheck(packed=0.0, rounding=0.0, leaked=1.0, layers=2)

    monkeypatch.setattr(model_lib, "load_model", fake_load)
    monkeypatch.setattr(packing_check, "settle_packing", fake_check)
    hyper = types.SimpleNamespace(fast_model_args=FastModelArgs(model_name="m"), lora_args=None)
    description = types.SimpleNamespace(gradient_checkpointing=False, hyper_config=hyper, lora_passes=False,
                                        expert_lora="auto", batching="packed", method="dpo")
    timeline = StartupTimeline(time.time())
    load = worker._loader(description, timeline)
    assert load(None).packing == {"packed": 0.0, "rounding": 0.0, "leaked": 1.0, "layers": 2, "leaking": 0, "fix": None,
                                  "exact": True}
    load(True)
    assert loads == [False, True]
    assert checks == [("model 1", "transformers"), ("model 2", "transformers")]
    assert [phase for phase, _ in timeline.marks] == ["model_load", "adapter", "packing_check", "budget_probe",
                                                      "model_load", "adapter", "packing_check"]
    stamps = [at for _, at in timeline.marks]
    assert stamps == sorted(stamps)


def _leaking_run(monkeypatch, method: str, from_config: bool):
    """A packed run (SimpleNamespace description) whose model's packed rows leak: load_model and the check faked,
    budget.settle faked to load once and return what it was given."""
    import time

    from HyperSloth.config import FastModelArgs
    from HyperSloth.train import model as model_lib
    from HyperSloth.train.packing import check as packing_check
    from HyperSloth.train.budget import settle as budget_settle

    loads, settled = [], []

    def fake_load(fast, lora, **kwargs):
        loads.append(fast.use_gradient_checkpointing)
        return types.SimpleNamespace(model=types.SimpleNamespace(config=types.SimpleNamespace(model_type="gpt_oss")),
                                     backend="unsloth", packing=None, stamps={"model_load": time.time()})

    def fake_settle(description, load, lengths, setup, local_ranks=1):
        settled.append(description.batching)
        return description, load(None), "decision"

    leaking = packing_check.PackingCheck(packed=0.9, rounding=0.0, leaked=1.0, layers=2, leaking=2)
    monkeypatch.setattr(model_lib, "load_model", fake_load)
    monkeypatch.setattr(packing_check, "settle_packing", lambda model, backend: leaking)
    monkeypatch.setattr(budget_settle, "settle", fake_settle)
    hyper = types.SimpleNamespace(fast_model_args=FastModelArgs(model_name="m"), lora_args=None)

    def described(batching):
        return types.SimpleNamespace(gradient_checkpointing=False, hyper_config=hyper, lora_passes=False,
                                     expert_lora="auto", batching=batching, method=method,
                                     batching_from_config=from_config, with_batching=described)

    info = types.SimpleNamespace(local_world_size=1)
    return lambda: worker._settle(described("packed"), StartupTimeline(time.time()), [10], None, info), loads, settled


def test_an_sft_run_with_batching_unset_trains_sorted_pad_on_the_model_already_loaded(monkeypatch):
    settle, loads, settled = _leaking_run(monkeypatch, "sft", from_config=False)
    description, loaded, decision = settle()
    assert description.batching == "sorted-pad" and decision == "decision"
    assert settled == ["packed", "sorted-pad"] and loads == [False]  # loaded once, kept for the sorted-pad run
    assert loaded.packing == {"packed": 0.9, "rounding": 0.0, "leaked": 1.0, "layers": 2, "leaking": 2, "fix": None,
                              "exact": False, "switched_to": "sorted-pad"}


@pytest.mark.parametrize("method, from_config, says", [
    ("sft", True, "set training.batching='sorted-pad'"),
    ("dpo", False, "cannot be trained with DPO here (fast_model_args.backend='transformers' may keep them apart)")])
def test_a_leaking_run_that_asked_for_packed_rows_or_needs_them_is_refused(monkeypatch, method, from_config, says):
    from HyperSloth.train.packing.check import PackedRowsLeak

    settle, loads, settled = _leaking_run(monkeypatch, method, from_config=from_config)
    with pytest.raises(PackedRowsLeak, match="gpt_oss on the unsloth backend lets the samples") as err:
        settle()
    assert says in str(err.value) and settled == ["packed"]


@pytest.mark.parametrize("enabled", [True, False])
def test_imports_run_without_the_garbage_collector_and_are_frozen_after(enabled):
    """The worker's imports: the collector off inside, what they built frozen (skipped by every later collection),
    and the collector as it was before, also when the import raises."""
    import gc

    was_enabled = gc.isenabled()
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(ImportError):
            with worker._imports_without_gc():
                assert not gc.isenabled()
                kept = [[]]  # tracked by the collector: it must be in the permanent generation after
                raise ImportError("a module that is not there")
        assert gc.isenabled() == enabled
        assert not any(obj is kept for obj in gc.get_objects())  # frozen objects are no longer listed
    finally:
        gc.unfreeze()
        (gc.enable if was_enabled else gc.disable)()


@pytest.mark.parametrize("collect", [False, True])
def test_garbage_the_imports_leave_is_collected_before_the_freeze_only_when_asked(collect):
    """collect=True (Unsloth's import, which initialises CUDA): a cycle left as garbage is freed, not frozen."""
    import gc
    import weakref

    class Node:
        pass

    was_enabled = gc.isenabled()
    try:
        with worker._imports_without_gc(collect=collect):
            node = Node()
            node.cycle = node
            alive = weakref.ref(node)
            del node
        gc.collect()  # frozen objects are skipped: a frozen cycle survives this
        assert (alive() is None) == collect
    finally:
        gc.unfreeze()
        gc.collect()
        (gc.enable if was_enabled else gc.disable)()
