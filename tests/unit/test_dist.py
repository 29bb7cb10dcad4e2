"""dist.py: who-am-I from the environment, torchrun isolation, and the bucketed gradient SUM."""

import pytest
import torch
import torch.multiprocessing as mp

from HyperSloth.launch.rendezvous import host_store
from HyperSloth.train import dist


def test_dist_info_from_launcher_env():
    env = {"HYPERSLOTH_RANK": "1", "HYPERSLOTH_WORLD_SIZE": "4", "HYPERSLOTH_MASTER_PORT": "1234"}
    info = dist.DistInfo.from_env(env)
    assert (info.rank, info.world_size, info.local_rank, info.master_port) == (1, 4, 1, 1234)
    assert info.launched_by == "hypersloth" and not info.is_main
    assert info.local_world_size == 4  # HyperSloth's launcher starts every rank on this host


def test_dist_info_from_torchrun_env_and_default():
    env = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29400"}
    info = dist.DistInfo.from_env(env)
    assert (info.rank, info.world_size, info.local_rank, info.master_addr) == (3, 8, 1, "10.0.0.1")
    assert info.launched_by == "torchrun" and info.local_world_size == 1  # torchrun did not say: alone here
    assert dist.DistInfo.from_env({**env, "LOCAL_WORLD_SIZE": "4"}).local_world_size == 4  # 2 hosts x 4 GPUs
    assert dist.DistInfo.from_env({}) == dist.DistInfo()
    with pytest.raises(ValueError, match="outside world size"):
        dist.DistInfo(rank=2, world_size=2)


@pytest.mark.parametrize(("visible", "expected"), [("4,6,7", "6"), (None, "1")])
def test_isolate_process_narrows_gpus_and_drops_torchrun_vars(visible, expected):
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "MASTER_ADDR": "h", "MASTER_PORT": "1", "KEEP": "x"}
    if visible is not None:
        env["CUDA_VISIBLE_DEVICES"] = visible
    dist.isolate_process(dist.DistInfo.from_env(env), env)
    assert env == {"CUDA_VISIBLE_DEVICES": expected, "KEEP": "x"}


def _rank_grads(rank: int) -> list[torch.Tensor | None]:
    # Three fp32 parameters and one bf16 one; rank 1 never touched the second (grad None).
    torch.manual_seed(rank)
    grads = [torch.randn(5, 3), torch.randn(7), torch.randn(2, 2), torch.randn(3).bfloat16()]
    if rank == 1:
        grads[1] = None
    return grads


def _worker(rank: int, port: int, queue) -> None:
    info = dist.DistInfo(rank=rank, world_size=2, master_port=port, launched_by="hypersloth")
    dist.setup(info, backend="gloo", timeout_s=60)
    try:
        params = []
        for g, like in zip(_rank_grads(rank), _rank_grads(0)):
            p = torch.nn.Parameter(torch.zeros_like(like))
            p.grad = None if g is None else g.clone()
            params.append(p)
        sync = dist.GradientSync(params, world_size=2, bucket_mb=0)  # 0 MB: one parameter per bucket
        loss = sync.all_reduce(torch.tensor([float(rank + 1)]))
        # Plain lists: a tensor on the queue is passed as a shared-memory fd, which fails when this
        # process has exited before the parent unpickles it (ConnectionResetError).
        sums = [p.grad.float().tolist() for p in params]
        # One bucket: afterwards the fp32 gradients are views of one reduced buffer (assigned, not copied).
        dist.GradientSync(params, world_size=2).all_reduce(torch.tensor([0.0]))
        storages = {p.grad.untyped_storage().data_ptr() for p in params if p.dtype == torch.float32}
        # The end-of-run weight check: every rank gets every rank's digest, by rank.
        agreed = tuple(dist.exchange("weights_sha256", f"digest of rank {rank}"))
        queue.put((rank, sums, float(loss[0]), len(storages), agreed))
    finally:
        dist.teardown()


# slow tier (make test-slow; CI runs it): spawned gloo processes, ~18 s
@pytest.mark.slow
def test_gradient_sync_sums_every_bucket_and_fills_missing_grads():
    ctx = mp.get_context("spawn")
    store = host_store()  # as the launcher does: held here, both ranks join as clients
    queue, port = ctx.Queue(), store.port
    procs = [ctx.Process(target=_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    got = [queue.get(timeout=120) for _ in procs]
    results = {rank: (grads, loss) for rank, grads, loss, _, _ in got}
    assert [storages for *_, storages, _ in got] == [1, 1]
    assert [agreed for *_, agreed in got] == [("digest of rank 0", "digest of rank 1")] * 2
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    expected = [sum(g.float() for g in gs if g is not None) for gs in zip(_rank_grads(0), _rank_grads(1))]
    for rank in (0, 1):
        grads, loss = [torch.tensor(g) for g in results[rank][0]], results[rank][1]
        assert loss == 3.0  # the scalars are summed too (1 + 2)
        for got, want in zip(grads, expected):
            bf16 = got.shape == (3,)  # the bf16 parameter: summed in bf16, one rounding
            torch.testing.assert_close(got, want, rtol=1e-2 if bf16 else 0, atol=1e-2 if bf16 else 0)
    assert results[0][0] == results[1][0]  # identical on every rank


def test_gradient_sync_is_a_no_op_for_one_process():
    p = torch.nn.Parameter(torch.zeros(3))
    p.grad = torch.ones(3)
    out = dist.GradientSync([p], world_size=1).all_reduce(torch.tensor([2.5]))
    assert float(out[0]) == 2.5 and torch.equal(p.grad, torch.ones(3))


def test_worker_start_up_imports_no_transformers_before_unsloth(tmp_path):
    """Unsloth must be imported before transformers/trl/peft in a worker; everything the worker runs
    before `_prepare_unsloth` (config, dist, logs of a rank > 0, model) must leave them unimported."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "from HyperSloth.outputs import logs\n"
        "from HyperSloth.train import model, worker\n"
        f"logs.configure(1, {str(tmp_path)!r})\n"
        "print(sorted(m for m in ('transformers', 'trl', 'peft', 'datasets') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
