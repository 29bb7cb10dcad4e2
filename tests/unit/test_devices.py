"""The launcher's GPU count without torch (launch/devices.py) gives torch.cuda.device_count()'s answer, and
the reserved rendezvous port takes clients before its store serves (launch/rendezvous.py)."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest
import torch

from HyperSloth.launch import devices
from HyperSloth.launch.rendezvous import host_store, reserve_port

CUDA_BUILD = {"cuda": "12.8", "hip": None}


def test_the_installed_torch_build_is_read_without_importing_torch():
    code = ("import sys; from HyperSloth.launch.devices import cuda_device_count, torch_build; "
            "print(torch_build(), cuda_device_count(), 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split(" ")
    assert devices.torch_build() == {"cuda": torch.version.cuda, "hip": torch.version.hip}
    if torch.version.cuda is None:  # this machine's CPU build: certain without torch
        assert out[-1].strip() == "False" and devices.cuda_device_count() == 0 == torch.cuda.device_count()


VISIBLE = [None, "", "0", "1", "0,1", "1,0", "2,3", "0,5,1", "3", "0,0", "1,1,2", " 1, 0", "GPU-1234", "MIG-1",
           "1,GPU-2", "-1", "0,-1,1", "+1", "1a", "0,x"]


@pytest.mark.parametrize("visible", VISIBLE)
@pytest.mark.parametrize("raw", [0, 1, 2, 4])
def test_the_count_without_torch_is_torchs_own(monkeypatch, visible, raw):
    """Where count_without_torch answers, it is what torch's NVML count answers (torch.cuda._device_count_nvml
    with the same NVML count and CUDA_VISIBLE_DEVICES); torch is asked in the other cases."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(torch.cuda, "_raw_device_count_nvml", lambda: raw)
    monkeypatch.setattr(torch.cuda, "_raw_device_uuid_nvml", lambda: None)  # UUIDs: torch initialises CUDA
    env = {} if visible is None else {"CUDA_VISIBLE_DEVICES": visible}
    ours = devices.count_without_torch(env, CUDA_BUILD, nvml_count=lambda: raw)
    if ours is not None:
        assert ours == torch.cuda._device_count_nvml()
    if visible in (None, "", "0", "0,1", "2,3", "0,0"):
        assert ours is not None  # the common cases never import torch


def test_torch_is_asked_when_the_build_or_nvml_leaves_doubt():
    assert devices.count_without_torch({}, {"cuda": None, "hip": None}, nvml_count=lambda: 8) == 0  # CPU build
    assert devices.count_without_torch({}, {"cuda": None, "hip": "6.2"}, nvml_count=lambda: 8) is None  # ROCm
    assert devices.count_without_torch({}, None, nvml_count=lambda: 8) is None  # torch's version file unread
    assert devices.count_without_torch({}, CUDA_BUILD, nvml_count=lambda: None) is None  # NVML failed
    assert devices.count_without_torch({"CUDA_VISIBLE_DEVICES": ""}, CUDA_BUILD, nvml_count=lambda: None) == 0


def test_nvml_on_a_machine_without_the_driver_counts_nothing_known():
    try:
        import ctypes

        ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        assert devices.nvml_device_count() is None
    else:
        assert devices.nvml_device_count() is None or devices.nvml_device_count() >= 0


CLIENT = """
import datetime, sys
import torch.distributed as d
store = d.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=datetime.timedelta(seconds=60))
store.set("from_client", "hello")
print(store.get("from_host").decode())
"""


def test_a_worker_that_connects_before_the_store_serves_waits_for_it():
    """The launcher reserves the port, starts the workers, and only then imports torch and serves the store."""
    listener = reserve_port()
    port = listener.getsockname()[1]
    client = subprocess.Popen([sys.executable, "-c", CLIENT, str(port)], stdout=subprocess.PIPE, text=True)
    time.sleep(1.0)  # the client is connected (the socket's backlog) or connecting; nothing serves yet
    store = host_store(listener=listener)
    assert store.port == port
    store.set("from_host", "welcome")
    store.wait(["from_client"])
    assert store.get("from_client") == b"hello"
    out, _ = client.communicate(timeout=60)
    assert client.returncode == 0 and out.strip() == "welcome"
    listener.close()  # the store took the socket over: closing the Python object changes nothing
    store.set("still", "serving")


def test_the_tmux_monitor_publishes_the_port_before_it_serves_the_store(tmp_path, monkeypatch):
    """The launcher creates the rank windows once the port file exists: the monitor's torch import for the
    store must come after it, overlapping the ranks' imports."""
    import HyperSloth.launch.rendezvous as rendezvous
    from HyperSloth.launch import tmux

    port_file = tmp_path / "rendezvous.port"
    published = []

    def serving(addr, listener):
        published.append((port_file.read_text().strip(), str(listener.getsockname()[1])))
        return host_store(addr, listener)

    monkeypatch.setattr(rendezvous, "host_store", serving)
    store = tmux._hold_rendezvous(port_file)
    [(in_file, reserved)] = published
    assert in_file == reserved == str(store.port)
