"""The launcher with real processes: fake workers (scripts written here) stand in for HyperSloth.train.worker."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest

import HyperSloth.train
import HyperSloth.cli.train as train_cli
import HyperSloth.launch.local as launch_mod
import HyperSloth.launch.tmux as tmux_mod
from HyperSloth.launch.local import TORCHRUN_VARS, build_worker_specs, launch, worker_env
from HyperSloth.outputs.startup import StartupTimeline

# A fake worker: records its environment and pid (and a grandchild's pid), then acts out `mode`.
FAKE_WORKER = textwrap.dedent('''
    import json, os, socket, subprocess, sys, time
    STARTED = time.time()
    out, mode = sys.argv[1], sys.argv[2]
    rank = int(os.environ["HYPERSLOTH_RANK"])
    addr, port = os.environ["HYPERSLOTH_MASTER_ADDR"], int(os.environ["HYPERSLOTH_MASTER_PORT"])
    try:  # the launcher must already own the rendezvous port: nobody else can bind it ...
        socket.socket().bind((addr, port))
        port_owned = False
    except OSError:
        port_owned = True
    socket.create_connection((addr, port), timeout=5).close()  # ... and it answers
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) if mode != "ok" else None
    record = {"pid": os.getpid(), "child_pid": child.pid if child else None, "env": dict(os.environ),
              "port_owned": port_owned, "started": STARTED}
    with open(os.path.join(out, f"rank{rank}.json.tmp"), "w") as f:
        json.dump(record, f)
    os.replace(os.path.join(out, f"rank{rank}.json.tmp"), os.path.join(out, f"rank{rank}.json"))
    print(f"rank {rank} says hello on stderr", file=sys.stderr, flush=True)
    if mode == "fail" and rank == 1:
        time.sleep(0.5)
        raise RuntimeError("boom from rank 1: CUDA out of memory (pretend)")
    time.sleep({"ok": 0.5, "fail": 60, "sleep": 60}[mode])
''')


def alive(pid: int) -> bool:
    """True if `pid` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state not in ("Z", "X")
    except (FileNotFoundError, ProcessLookupError):
        return False


def wait_for(predicate, timeout: float = 60.0) -> None:  # polls: generous costs nothing when it happens
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


@pytest.fixture
def fake(tmp_path: Path):
    """Returns (worker_argv(mode), records_dir, read_records(world))."""
    script, records = tmp_path / "fake_worker.py", tmp_path / "records"
    script.write_text(FAKE_WORKER)
    records.mkdir()

    def argv(mode: str) -> list[str]:
        return [sys.executable, str(script), str(records), mode]

    def read(world: int) -> list[dict]:
        return [json.loads((records / f"rank{r}.json").read_text()) for r in range(world)]

    return types.SimpleNamespace(argv=argv, records=records, read=read)


def test_env_contract_on_cuda_maps_gpus_and_strips_torchrun_vars(fake, tmp_path, monkeypatch, capfd):
    for name in TORCHRUN_VARS:
        monkeypatch.setenv(name, "7")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    monkeypatch.setenv("NCCL_DEBUG", "INFO")
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
    out = tmp_path / "out"
    assert launch("cfg.py", [2, 5], out, worker_argv=fake.argv("ok"), cuda=True) == 0
    rank0, rank1 = (record["env"] for record in fake.read(2))
    for rank, env, gpu in ((0, rank0, "2"), (1, rank1, "5")):
        assert env["HYPERSLOTH_RANK"] == env["HYPERSLOTH_LOCAL_RANK"] == str(rank)
        assert env["HYPERSLOTH_WORLD_SIZE"] == "2"
        assert env["CUDA_VISIBLE_DEVICES"] == gpu
        assert env["HYPERSLOTH_MASTER_ADDR"] == "127.0.0.1"
        # Nothing the worker never reads: it learns its GPU from CUDA_VISIBLE_DEVICES, its folder from run.json.
        assert "HYPERSLOTH_GPU" not in env and "HYPERSLOTH_RUN_DIR" not in env
        assert env["NCCL_DEBUG"] == "INFO" and env["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
        assert not set(TORCHRUN_VARS) & set(env)
    assert rank0["HYPERSLOTH_MASTER_PORT"] == rank1["HYPERSLOTH_MASTER_PORT"]
    assert 1024 < int(rank0["HYPERSLOTH_MASTER_PORT"]) < 65536
    assert all(record["port_owned"] for record in fake.read(2))
    # Every rank's stderr lands in its file; rank 0's is also on the terminal.
    assert "rank 1 says hello" in (out / "logs" / "rank1.stderr").read_text()
    assert "rank 0 says hello" in (out / "logs" / "rank0.stderr").read_text()
    err = capfd.readouterr().err
    assert "rank 0 says hello" in err and "rank 1 says hello" not in err
    assert f"output in {out.resolve()}" in err


def test_the_launcher_hands_its_start_up_stamps_to_every_worker(fake, tmp_path):
    launched = time.time() - 1.0
    timeline = StartupTimeline(launched, [("launcher_start", launched + 0.25), ("launcher_checks", launched + 0.5)])
    assert launch("cfg.py", [0, 1], tmp_path / "out", worker_argv=fake.argv("ok"), cuda=False, timeline=timeline) == 0
    # Marked once the store is bound, before the first worker is started; every worker gets the same stamps.
    assert [phase for phase, _ in timeline.marks] == ["launcher_start", "launcher_checks", "rendezvous"]
    received = [StartupTimeline.from_env(record["env"]) for record in fake.read(2)]
    assert received == [timeline, timeline]
    assert min(record["started"] for record in fake.read(2)) >= timeline.marks[-1][1]


# The launcher in a fresh process: has torch been imported when each worker is started?
NO_TORCH_BEFORE_SPAWN = textwrap.dedent('''
    import json, subprocess, sys
    from HyperSloth.launch import local
    seen, popen = [], subprocess.Popen
    def recording_popen(*args, **kwargs):
        seen.append("torch" in sys.modules)
        return popen(*args, **kwargs)
    local.subprocess.Popen = recording_popen
    code = local.launch("cfg.py", [0, 1], sys.argv[1], worker_argv=json.loads(sys.argv[2]))
    print(json.dumps({"code": code, "torch_before_spawn": seen, "torch_after": "torch" in sys.modules}))
''')


def test_the_launcher_starts_the_workers_before_it_imports_torch(fake, tmp_path):
    """Counting the GPUs needs no torch on this machine, and the store's torch import comes once the workers
    run (it overlaps theirs): no worker waits for it. The store still serves them (the fake worker connects)."""
    argv = [sys.executable, "-c", NO_TORCH_BEFORE_SPAWN, str(tmp_path / "out"), json.dumps(fake.argv("ok"))]
    out = subprocess.run(argv, capture_output=True, text=True, check=True)
    assert json.loads(out.stdout.splitlines()[-1]) == {"code": 0, "torch_before_spawn": [False, False],
                                                       "torch_after": True}
    assert all(record["port_owned"] for record in fake.read(2))


def test_cpu_env_hides_gpus_and_splits_threads(monkeypatch):
    base = {"PATH": "/bin", "RANK": "3"}
    env = worker_env(base, rank=1, gpus=[0, 1], port=1234, cuda=False)
    assert env["CUDA_VISIBLE_DEVICES"] == ""
    assert env["OMP_NUM_THREADS"] == str(max(1, len(os.sched_getaffinity(0)) // 2))
    assert "RANK" not in env and env["PATH"] == "/bin"
    user_set = worker_env({**base, "OMP_NUM_THREADS": "3"}, rank=0, gpus=[0, 1], port=1, cuda=False)
    assert user_set["OMP_NUM_THREADS"] == "3"


def test_gpu_ids_count_within_parent_cuda_visible_devices():
    base = {"CUDA_VISIBLE_DEVICES": "4,6,7"}
    envs = [worker_env(base, rank=r, gpus=[1, 2], port=1, cuda=True) for r in range(2)]
    assert [e["CUDA_VISIBLE_DEVICES"] for e in envs] == ["6", "7"]


def test_specs_use_python_m_worker_by_default(tmp_path):
    specs = build_worker_specs(tmp_path / "c.py", [0], tmp_path, port=4321, cuda=False, base_env={})
    assert specs[0].argv == (sys.executable, "-m", "HyperSloth.train.worker", str(tmp_path / "c.py"))
    assert specs[0].env["HYPERSLOTH_MASTER_PORT"] == "4321"


# A worker that only meets its peer: the real rendezvous (dist.setup) and one all-reduce over gloo.
RENDEZVOUS_WORKER = textwrap.dedent('''
    import json, sys
    import torch
    from HyperSloth.train import dist
    info = dist.DistInfo.from_env()
    dist.setup(info, backend="gloo", timeout_s=60)
    total = torch.tensor([float(info.rank + 1)])
    torch.distributed.all_reduce(total)
    dist.teardown()
    with open(f"{sys.argv[1]}/rank{info.rank}.json", "w") as f:
        json.dump({"sum": total.item(), "port": info.master_port}, f)
''')


# slow tier (make test-slow; CI runs it): 8 worker processes importing torch, ~13 s
@pytest.mark.slow
def test_four_runs_at_once_all_meet_their_own_peers(tmp_path):
    # Four launches on one machine at the same time, 2 workers each: every launcher owns its port
    # from the moment it is chosen, so no run can take another's or end up in another's group.
    script = tmp_path / "rendezvous_worker.py"
    script.write_text(RENDEZVOUS_WORKER)
    runs = [tmp_path / f"run{i}" for i in range(4)]
    codes: dict[int, int] = {}

    def run(i: int) -> None:
        runs[i].mkdir()
        codes[i] = launch("c.py", [0, 1], runs[i] / "out", worker_argv=[sys.executable, str(script), str(runs[i])],
                          cuda=False, grace_s=2)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=120)
    assert codes == {0: 0, 1: 0, 2: 0, 3: 0}
    records = [[json.loads((run / f"rank{r}.json").read_text()) for r in range(2)] for run in runs]
    assert all(record["sum"] == 3.0 for pair in records for record in pair)  # 1 + 2: exactly its own peer
    ports = [pair[0]["port"] for pair in records]
    assert len(set(ports)) == 4 and all(pair[0]["port"] == pair[1]["port"] for pair in records)


def test_failing_rank_stops_the_others_and_is_reported(fake, tmp_path, capfd):
    start = time.monotonic()
    code = launch("cfg.py", [0, 3], tmp_path / "out", worker_argv=fake.argv("fail"), cuda=False)
    elapsed = time.monotonic() - start
    assert code == 1
    # The other rank sleeps 60 s: ending well before that is stopping it, on a loaded machine too.
    assert elapsed < 45, f"took {elapsed:.1f}s to notice a failed rank and stop the other"
    err = capfd.readouterr().err
    assert "rank 1 (gpu 3) failed with exit code 1" in err
    assert "RuntimeError: boom from rank 1: CUDA out of memory (pretend)" in err
    assert "stopped the other 1 worker(s)" in err
    for record in fake.read(2):  # the sleeping rank 0 and every grandchild are gone
        assert not alive(record["pid"]) and not alive(record["child_pid"])


# Rank 0 raises (it stamps its failure record, as HyperSloth.worker does) and is still tearing down when its
# peer, which lost its collective, exits first: the launcher then stops rank 0 with SIGTERM.
RAISING_RANK0 = textwrap.dedent('''
    import json, os, sys, time
    logs, rank = sys.argv[1], int(os.environ["HYPERSLOTH_RANK"])
    if rank == 0:
        record = {"rank": 0, "time": time.time(),
                  "error": "ModuleNotFoundError: No module named 'wandb'\\nreport_to='wandb' needs it"}
        with open(os.path.join(logs, "rank0.failure.json"), "w") as f:
            json.dump(record, f)
        print("[rank 0] ModuleNotFoundError: No module named 'wandb'", file=sys.stderr, flush=True)
        time.sleep(60)
    time.sleep(0.5)
    print("RuntimeError: Connection closed by peer", file=sys.stderr, flush=True)
    sys.exit(1)
''')


def test_the_first_failing_rank_is_named_with_its_own_error_in_a_few_lines(tmp_path, capfd):
    script, out = tmp_path / "raising.py", tmp_path / "out"
    script.write_text(RAISING_RANK0)
    argv = [sys.executable, str(script), str(out / "logs")]
    assert launch("cfg.py", [0, 1], out, worker_argv=argv, cuda=False, grace_s=1.0) == 1
    lines = [line for line in capfd.readouterr().err.splitlines() if line.startswith(("hypersloth-train", "    "))]
    assert lines[1] == ("hypersloth-train: rank 0 (gpu 0) failed with ModuleNotFoundError: No module named 'wandb'; "
                        "stopped the other 1 worker(s).")
    assert lines[2:] == ["    report_to='wandb' needs it",
                         f"hypersloth-train: full traceback: {out / 'logs' / 'rank0.log'} "
                         f"(stderr: {out / 'logs' / 'rank0.stderr'})"]
    assert "SIGTERM" not in "\n".join(lines) and "Connection closed" not in "\n".join(lines)


# A rank that records its failure (as HyperSloth.worker does) and then does not leave Python (a teardown that
# hangs). Its stamp from an earlier run is ignored.
HANGING_AFTER_FAILURE = textwrap.dedent('''
    import json, os, sys, time
    logs, mode = sys.argv[1], sys.argv[2]
    if mode == "fail":
        with open(os.path.join(logs, "rank0.failure.json"), "w") as f:
            json.dump({"rank": 0, "time": time.time(), "error": "RuntimeError: size mismatch"}, f)
        print("[rank 0] RuntimeError: size mismatch", file=sys.stderr, flush=True)
        time.sleep(60)
    time.sleep(2.5)
''')


def test_a_rank_that_recorded_its_failure_but_does_not_exit_is_stopped(tmp_path, capfd, monkeypatch):
    monkeypatch.setattr(launch_mod, "FAILED_EXIT_GRACE_S", 1.0)
    script, out = tmp_path / "hanging.py", tmp_path / "out"
    script.write_text(HANGING_AFTER_FAILURE)
    start = time.monotonic()
    assert launch("cfg.py", [0], out, worker_argv=[sys.executable, str(script), str(out / "logs"), "fail"],
                  cuda=False, grace_s=1.0) == 1
    assert time.monotonic() - start < 30  # not the 60 s it would hang
    err = capfd.readouterr().err
    assert "rank 0 recorded its failure 1 s ago and has not exited; stopping it" in err
    assert "rank 0 (gpu 0) failed with RuntimeError: size mismatch" in err
    # the stale record of that run does not stop the next one, which outlives the grace
    assert launch("cfg.py", [0], out, worker_argv=[sys.executable, str(script), str(out / "logs"), "ok"],
                  cuda=False, grace_s=1.0) == 0


def test_launcher_raising_mid_spawn_leaves_no_worker(fake, tmp_path, monkeypatch):
    real_popen, started = subprocess.Popen, []

    def popen_then_fail(*args, **kwargs):
        if started:
            raise OSError("pretend fork failed for rank 1")
        started.append(real_popen(*args, **kwargs))
        return started[-1]

    monkeypatch.setattr(launch_mod.subprocess, "Popen", popen_then_fail)
    with pytest.raises(OSError, match="pretend fork failed"):
        launch("cfg.py", [0, 1], tmp_path / "out", worker_argv=fake.argv("sleep"), cuda=False, grace_s=2)
    assert started[0].returncode is not None  # stopped and reaped
    if (fake.records / "rank0.json").exists():
        assert not alive(fake.read(1)[0]["child_pid"])


DRIVER = textwrap.dedent('''
    import sys
    from HyperSloth.launch.local import launch
    sys.exit(launch("cfg.py", [0, 1], sys.argv[1], worker_argv=sys.argv[2:], cuda=False))
''')


def start_driver(fake, tmp_path: Path) -> subprocess.Popen:
    """A launcher process whose 2 fake workers are in a silent phase (sleeping, writing nothing)."""
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    proc = subprocess.Popen([sys.executable, str(driver), str(tmp_path / "out"), *fake.argv("sleep")],
                            stderr=subprocess.PIPE, text=True)
    wait_for(lambda: all((fake.records / f"rank{r}.json").exists() for r in range(2)), timeout=30)
    return proc


# SIGHUP is what a closed terminal or a dropped ssh sends: handled like SIGTERM.
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGHUP])
def test_signal_to_launcher_stops_every_worker(fake, tmp_path, sig):
    proc = start_driver(fake, tmp_path)
    try:
        proc.send_signal(sig)
        _, err = proc.communicate(timeout=120)  # generous: a loaded machine, not a hang, is what a timeout meant
    finally:
        proc.kill()
    assert proc.returncode == 128 + sig
    lines = [line for line in err.splitlines() if "says hello" not in line and "starting 2 worker" not in line]
    assert lines == [f"hypersloth-train: received {sig.name}; stopping 2 worker(s)",  # no traceback
                     "hypersloth-train: no checkpoint was saved yet: run the same command again to start over "
                     "(no --overwrite needed)"]  # how to go on
    for record in fake.read(2):
        assert not alive(record["pid"]) and not alive(record["child_pid"])


def test_sigkill_of_launcher_kills_silent_workers(fake, tmp_path):
    # The launcher gets no chance to stop anything; the workers write nothing, so no broken pipe
    # tells them either: only the parent-death signal they set at start does.
    proc = start_driver(fake, tmp_path)
    try:
        proc.kill()
        proc.wait(timeout=60)
        for record in fake.read(2):
            wait_for(lambda: not alive(record["pid"]), timeout=60)
    finally:
        for record in fake.read(2):
            for pid in (record["pid"], record["child_pid"]):
                if alive(pid):
                    os.kill(pid, signal.SIGKILL)


def test_child_whose_launcher_died_before_it_set_the_signal_kills_itself(monkeypatch):
    # The race the hook closes: the launcher dies between fork and prctl, the child is reparented and
    # would never get the signal. Pretend the launcher is another pid: the child must end at once.
    monkeypatch.setattr(launch_mod.os, "getpid", lambda: 1)  # pid 1 is never this test's parent
    hook = launch_mod.die_with_parent_hook()
    monkeypatch.undo()
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"], preexec_fn=hook)
    assert proc.wait(timeout=60) == -signal.SIGKILL


def test_child_of_a_live_launcher_keeps_running():
    proc = subprocess.Popen([sys.executable, "-c", "print('alive')"], preexec_fn=launch_mod.die_with_parent_hook(),
                            stdout=subprocess.PIPE, text=True)
    assert proc.communicate(timeout=30)[0] == "alive\n" and proc.returncode == 0


# ------------------------------------------------------------------ CLI: checks before any spawn


def write_config(tmp_path: Path, **overrides: str) -> Path:
    """A complete config file whose dataset, model folder and output dir exist, with fields overridden."""
    data_dir, model_dir = tmp_path / "data", tmp_path / "model"
    folder = data_dir / "built_dataset" / "chat"  # what save_to_disk leaves (metadata; no rows are read)
    folder.mkdir(parents=True, exist_ok=True)
    features = {c: {} for c in ("input_ids", "labels", "length", "num_trainable", "text")}
    (folder / "dataset_info.json").write_text(json.dumps({"features": features}))
    (folder / "state.json").write_text(json.dumps({"_fingerprint": "f"}))
    model_dir.mkdir(exist_ok=True)
    entry = {"name": "chat", "path": "built_dataset/chat", "num_samples": 3, "stats": {"max_tokens": 100}}
    registry = {"version": 1, "datasets": {"chat": entry}}
    (data_dir / "data_config.json").write_text(json.dumps(registry))
    fields = {
        "dataset_name": "'chat'", "model_name": repr(str(model_dir)), "load_in_4bit": "False",
        "output_dir": repr(str(tmp_path / "out")), "gpus": "[0, 1]", "extra": "",
    } | overrides
    path = tmp_path / "config.py"
    path.write_text(textwrap.dedent(f'''
        from HyperSloth.config import DataConfig, FastModelArgs, HyperConfig, TrainingArgsConfig, TrainingConfig
        hyper_config_model = HyperConfig(
            data=DataConfig(dataset_name={fields["dataset_name"]}, data_dir={str(data_dir)!r}),
            training=TrainingConfig(gpus={fields["gpus"]}{fields["extra"]}),
            fast_model_args=FastModelArgs(model_name={fields["model_name"]}, backend="transformers",
                                          dtype="float32", load_in_4bit={fields["load_in_4bit"]}),
        )
        training_config_model = TrainingArgsConfig(output_dir={fields["output_dir"]}, optim="adamw_torch")
    '''))
    return path


@pytest.fixture
def cli(monkeypatch):
    """Run the CLI in-process on a CPU machine; returns (run(argv) -> exit code, calls to launch)."""
    calls = []
    monkeypatch.setattr(train_cli, "cuda_device_count", lambda: 0)
    monkeypatch.setattr(train_cli, "launch", lambda *a, **k: calls.append(("launch", a, k)) or 0)
    monkeypatch.setattr(train_cli, "launch_tmux", lambda *a, **k: calls.append(("tmux", a, k)) or "tmux attach")
    monkeypatch.setattr(train_cli, "check_tmux_session", lambda session, replace=False: None)  # a free session
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)

    def run(argv: list[str]) -> int:
        with pytest.raises(SystemExit) as exit_info:
            train_cli.main(argv)
        return exit_info.value.code

    return types.SimpleNamespace(run=run, calls=calls)


def test_the_checks_before_the_spawn_import_no_model_library(tmp_path):
    """Config, GPU count, dataset, model folder, output folder, plan and run.json: none needs torch, which the
    workers import anyway (it kept them waiting 0.75 s on the 2-core CPU machine, more with CUDA)."""
    code = ("import sys; from HyperSloth.cli.train import check_run; run = check_run(sys.argv[1]); "
            "print(run.run_path.is_file(), sorted(m for m in ('torch', 'transformers', 'unsloth') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code, str(write_config(tmp_path))], capture_output=True, text=True,
                         check=True)
    assert out.stdout.split("\n")[-2] == "True []"


def test_valid_config_reaches_the_launcher(cli, tmp_path):
    config = write_config(tmp_path, gpus="[1, 3]")
    assert cli.run([str(config)]) == 0
    [(kind, args, kwargs)] = cli.calls
    assert [phase for phase, _ in kwargs["timeline"].marks] == ["launcher_start", "launcher_checks"]
    # The workers get the resolved run (run.json in the output dir), never the config file.
    out = (tmp_path / "out").resolve()
    assert (kind, args) == ("launch", (out / "run.json", [1, 3], out))
    described = json.loads((out / "run.json").read_text())
    assert (described["world_size"], described["gpus"], described["config_path"]) == (2, [1, 3], str(config.resolve()))


@pytest.mark.parametrize(
    ("overrides", "expected"),
    [
        ({"extra": ", gpu_typo=1"}, "gpu_typo"),
        ({"dataset_name": "'missing'"}, "dataset 'missing' is not registered"),
        ({"model_name": "'./no/such/model'"}, "model_name './no/such/model' looks like a local folder"),
        ({"load_in_4bit": "True"}, "load_in_4bit=True needs CUDA"),
    ],
)
def test_config_errors_exit_2_before_any_worker(cli, tmp_path, capsys, overrides, expected):
    assert cli.run([str(write_config(tmp_path, **overrides))]) == 2
    err = capsys.readouterr().err
    assert err.startswith("hypersloth-train: error:") and expected in err
    assert "Traceback" not in err and cli.calls == []


def test_a_bad_memory_snapshot_variable_exits_2_before_any_worker(cli, tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("HYPERSLOTH_MEMORY_SNAPSHOT", "yes")
    assert cli.run([str(write_config(tmp_path))]) == 2
    err = capsys.readouterr().err
    assert "HYPERSLOTH_MEMORY_SNAPSHOT='yes': give the number of optimizer steps" in err
    assert cli.calls == [] and not (tmp_path / "out").exists()


def test_every_problem_the_launcher_checks_is_reported_at_once(cli, tmp_path, capsys):
    # An unregistered dataset and a missing model folder: both in one refusal, not on two successive runs.
    assert cli.run([str(write_config(tmp_path, dataset_name="'missing'", model_name="'./no/such/model'"))]) == 2
    err = capsys.readouterr().err
    assert "dataset 'missing' is not registered" in err and "model_name './no/such/model' looks like" in err
    assert "load_in_4bit" not in err and cli.calls == [] and not (tmp_path / "out").exists()


def test_dataset_folder_gone_exits_2(cli, tmp_path, capsys):
    config = write_config(tmp_path)
    shutil.rmtree(tmp_path / "data" / "built_dataset" / "chat")
    assert cli.run([str(config)]) == 2
    assert "dataset 'chat' is registered but its folder" in capsys.readouterr().err and cli.calls == []


def test_unwritable_output_dir_exits_2(cli, tmp_path, capsys):
    (tmp_path / "a_file").write_text("")
    # A path below a regular file cannot be created, even by root (chmod would not stop root).
    config = write_config(tmp_path, output_dir=repr(str(tmp_path / "a_file" / "out")))
    assert cli.run([str(config)]) == 2
    assert "is not writable" in capsys.readouterr().err and cli.calls == []


def test_missing_config_file_exits_2(cli, tmp_path, capsys):
    assert cli.run([str(tmp_path / "nope.py")]) == 2
    assert "config file not found" in capsys.readouterr().err


def test_missing_tmux_binary_exits_2_and_writes_nothing(cli, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(train_cli, "launch_tmux", tmux_mod.launch_tmux)
    monkeypatch.setattr(train_cli, "check_tmux_session", tmux_mod.check_tmux_session)
    monkeypatch.setattr(tmux_mod.shutil, "which", lambda name: None)
    config = write_config(tmp_path)
    assert cli.run([str(config), "--tmux", "train"]) == 2
    assert "--tmux needs the tmux program" in capsys.readouterr().err
    # A refused command writes nothing: no run.json that would refuse the retry as "an earlier run".
    assert not (tmp_path / "out").exists()
    monkeypatch.setattr(train_cli, "launch_tmux", lambda *a, **k: "tmux attach -t train")
    monkeypatch.setattr(train_cli, "check_tmux_session", lambda session, replace=False: None)
    assert cli.run([str(config), "--tmux", "train"]) == 0  # tmux installed: the retry starts


def test_tmux_flag_goes_to_launch_tmux(cli, tmp_path, capsys):
    assert cli.run([str(write_config(tmp_path)), "--tmux", "train", "--y"]) == 0
    [(kind, args, kwargs)] = cli.calls
    assert kind == "tmux" and args[3] == "train" and kwargs.pop("replace") is True and kwargs.pop("cuda") is False
    # The launcher's start-up stamps so far go to the rank windows (launch_tmux adds the rendezvous).
    assert [phase for phase, _ in kwargs.pop("timeline").marks] == ["launcher_start", "launcher_checks"] and not kwargs
    assert "attach with: tmux attach" in capsys.readouterr().out


def test_real_entry_point_prints_no_traceback(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text("hyper_config_model = 3\n")
    result = subprocess.run([sys.executable, "-m", "HyperSloth.cli.train", str(bad)], capture_output=True, text=True,
                            timeout=60, env={k: v for k, v in os.environ.items() if k not in TORCHRUN_VARS})
    assert result.returncode == 2
    assert "invalid HyperConfig" in result.stderr and "Traceback" not in result.stderr


def test_help_lists_flags_and_examples(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train_cli.main(["--help"])
    out = capsys.readouterr().out
    assert exit_info.value.code == 0
    for text in ("--tmux SESSION", "--y", "--dry-run", "hypersloth-train examples/tiny_cpu_demo.py",
                 "torchrun --nnodes 2", "-m HyperSloth.cli.train"):
        assert text in out


def test_dry_run_prints_the_plan_and_spawns_nothing(cli, tmp_path, capsys, monkeypatch):
    plan = types.ModuleType("HyperSloth.cli.plan")
    plan.preview = lambda path: {"config": path}
    plan.format_summary = lambda summary: f"PLAN for {summary['config']}"
    monkeypatch.setitem(sys.modules, "HyperSloth.cli.plan", plan)
    assert cli.run(["cfg.py", "--dry-run"]) == 0
    assert "PLAN for cfg.py" in capsys.readouterr().out and cli.calls == []


def test_under_torchrun_the_worker_runs_in_process(cli, tmp_path, monkeypatch):
    seen = []
    worker = types.ModuleType("HyperSloth.train.worker")
    worker.main = lambda description, info, timeline: seen.append(
        (description.world_size, info.rank, os.getpid(), [phase for phase, _ in timeline.marks]))
    monkeypatch.setitem(sys.modules, "HyperSloth.train.worker", worker)
    # `from HyperSloth.train import worker` finds the package attribute first, set once any test imported the
    # real one.
    monkeypatch.setattr(HyperSloth.train, "worker", worker, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_RANK", "1")
    config = write_config(tmp_path)
    # The world size comes from torchrun (4), not from len(gpus) (2); only rank 0 writes run.json.
    assert cli.run([str(config)]) == 0
    # The start-up timeline goes on in this process: the CLI's stamps, then the worker's.
    assert seen == [(4, 1, os.getpid(), ["launcher_start", "worker_imports", "launcher_checks"])] and cli.calls == []
    assert not (tmp_path / "out" / "run.json").exists()


def test_partial_torchrun_env_is_not_torchrun():
    assert launch_mod.is_torchrun_env({"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0"})
    assert not launch_mod.is_torchrun_env({"RANK": "0", "WORLD_SIZE": "2"})


@pytest.mark.parametrize(("answer", "code"), [("y", 0), ("n", 2)])
def test_existing_tmux_session_asks_on_a_tty(cli, tmp_path, monkeypatch, capsys, answer, code):
    def taken(session, replace=False):
        cli.calls.append(("check", (session,), {"replace": replace}))
        if not replace:
            raise launch_mod.TmuxSessionExists("tmux session 'train' already exists: pass --y to replace it")

    monkeypatch.setattr(train_cli, "check_tmux_session", taken)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: True, raising=False)
    monkeypatch.setattr("builtins.input", lambda prompt: answer)
    assert cli.run([str(write_config(tmp_path)), "--tmux", "train"]) == code
    started = [(kind, kwargs["replace"]) for kind, _, kwargs in cli.calls]
    assert started == ([("check", False), ("tmux", True)] if answer == "y" else [("check", False)])
    if answer == "n":
        assert "left tmux session 'train' as it is" in capsys.readouterr().err
        assert not (tmp_path / "out").exists()  # refused before anything was written


def test_existing_tmux_session_without_tty_needs_y_and_writes_nothing(cli, tmp_path, monkeypatch, capsys):
    def refuse(session, replace=False):
        if not replace:
            raise launch_mod.TmuxSessionExists("tmux session 'train' already exists: pass --y to replace it")

    monkeypatch.setattr(train_cli, "check_tmux_session", refuse)
    monkeypatch.setattr(sys.stdin, "isatty", lambda: False, raising=False)
    assert cli.run([str(write_config(tmp_path)), "--tmux", "train"]) == 2
    assert "pass --y to replace it" in capsys.readouterr().err
    assert not (tmp_path / "out").exists() and cli.calls == []
    assert cli.run([str(write_config(tmp_path)), "--tmux", "train", "--y"]) == 0


def test_unknown_flag_is_refused_before_anything_runs(cli, tmp_path, capsys):
    # fire alone would call train() first and complain about the extra flag only after training.
    assert cli.run([str(write_config(tmp_path)), "--dryrun"]) == 2
    assert "unknown option --dryrun" in capsys.readouterr().err and cli.calls == []


def test_dataset_built_with_another_tokenizer_exits_2(cli, tmp_path, capsys):
    from HyperSloth.train.tiny_model import build_tiny_tokenizer

    texts = [f"hello world number {i} and some more words" for i in range(50)]
    build_tiny_tokenizer(texts, vocab_size=300).save_pretrained(tmp_path / "model")  # the model's tokenizer
    build_tiny_tokenizer(texts[:10], vocab_size=280).save_pretrained(tmp_path / "other")
    config = write_config(tmp_path)
    registry_path = tmp_path / "data" / "data_config.json"
    registry = json.loads(registry_path.read_text())
    registry["datasets"]["chat"]["tokenizer"] = str(tmp_path / "other")
    registry_path.write_text(json.dumps(registry))
    assert cli.run([str(config)]) == 2
    err = capsys.readouterr().err
    assert "dataset 'chat' was tokenised with" in err and "--tokenizer" in err and cli.calls == []
    registry["datasets"]["chat"]["tokenizer"] = str(tmp_path / "model")  # the same folder: accepted
    registry_path.write_text(json.dumps(registry))
    assert cli.run([str(config)]) == 0


def test_a_copy_of_the_models_tokenizer_is_accepted_without_loading_either(cli, tmp_path, capsys, monkeypatch):
    """Byte-identical tokenizer files in another folder are the same tokenizer: accepted from the files alone.
    Files that differ while the vocabulary is the same (another chat template) are compared by loading both."""
    import shutil

    import transformers

    from HyperSloth.data.tokenizer_check import TOKENIZER_FILES
    from HyperSloth.train.tiny_model import build_tiny_tokenizer

    texts = [f"hello world number {i} and some more words" for i in range(50)]
    build_tiny_tokenizer(texts, vocab_size=300).save_pretrained(tmp_path / "model")
    shutil.copytree(tmp_path / "model", tmp_path / "copy")
    config = write_config(tmp_path)
    registry_path = tmp_path / "data" / "data_config.json"
    registry = json.loads(registry_path.read_text())
    registry["datasets"]["chat"]["tokenizer"] = str(tmp_path / "copy")
    registry_path.write_text(json.dumps(registry))
    loads = []
    real_load = transformers.AutoTokenizer.from_pretrained
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained",
                        lambda source, *a, **k: loads.append(str(source)) or real_load(source, *a, **k))
    assert cli.run([str(config)]) == 0, capsys.readouterr().err
    assert loads == [] and any((tmp_path / "copy" / name).is_file() for name in TOKENIZER_FILES)
    settings = json.loads((tmp_path / "copy" / "tokenizer_config.json").read_text())
    settings["chat_template"] = "{{ messages[0]['content'] }}"  # another file, the same vocabulary
    (tmp_path / "copy" / "tokenizer_config.json").write_text(json.dumps(settings))
    assert cli.run([str(config), "--overwrite"]) == 0, capsys.readouterr().err
    assert sorted(loads) == sorted([str(tmp_path / "copy"), str(tmp_path / "model")])
