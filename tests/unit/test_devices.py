"""Which device a worker computes on, and that its threads reach that one."""

from __future__ import annotations

import threading
from collections.abc import Callable

import pytest
import torch

from hetpipe import devices, threads


def test_pick_names_the_device_asked_for_or_the_first_one() -> None:
    assert devices.pick("cpu").name == "cpu"
    assert devices.pick("").name == devices.local_devices()[0].name


def test_pick_of_a_device_this_machine_lacks_names_what_it_has() -> None:
    have = ", ".join(d.name for d in devices.local_devices())
    with pytest.raises(ValueError, match=rf"device 'cuda:99': this machine has {have}"):
        devices.pick("cuda:99")


def test_a_cpu_worker_never_starts_cuda() -> None:
    devices.make_current(devices.pick("cpu"))
    assert not torch.cuda.is_initialized()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_thread_made_current_on_a_gpu_computes_there_and_leaves_other_threads_alone() -> None:
    # CUDA's current device is per thread: the last GPU here, set on a new thread, is that
    # thread's and no other's (on a one-GPU machine the last is also the first).
    gpu = devices.local_devices()[-1]
    main_before = torch.cuda.current_device()
    seen: list[tuple[int, str]] = []

    def work() -> None:
        devices.make_current(gpu)
        seen.append((torch.cuda.current_device(), str(torch.zeros(1, device="cuda").device)))

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(60)
    assert seen == [(torch.device(gpu.name).index, gpu.name)]
    assert torch.cuda.current_device() == main_before


@pytest.fixture
def cores(monkeypatch: pytest.MonkeyPatch) -> Callable[[int], None]:
    monkeypatch.delenv(threads.THREADS_ENV, raising=False)
    monkeypatch.delenv(threads.PS_THREADS_ENV, raising=False)
    return lambda n: monkeypatch.setattr("os.cpu_count", lambda: n)


def test_beside_cpu_stages_the_stages_split_the_cores_and_a_shard_takes_one(cores: Callable[[int], None]) -> None:
    cores(16)
    assert threads.thread_split(4, 0, 2) == ("4", "1")
    assert threads.thread_split(2, 2, 1) == ("4", "1")   # one CPU stage is enough: the CPU computes


def test_beside_gpu_stages_the_shards_take_the_cores_the_stages_leave(cores: Callable[[int], None]) -> None:
    cores(16)
    assert threads.thread_split(0, 4, 2) == ("2", "4")   # the 2 VWs x 2 stages on one host
    assert threads.thread_split(0, 2, 1) == ("5", "6")
    assert threads.thread_split(0, 1, 0) == ("16", "1")  # no shard: one VW
    cores(2)
    assert threads.thread_split(0, 4, 2) == ("1", "1")   # fewer cores than processes: one each


def test_the_split_never_gives_more_threads_than_cores_unless_every_process_has_one(cores: Callable[[int], None]) -> None:
    for n in range(1, 33):
        cores(n)
        for cpu in range(0, 5):
            for gpu in range(0, 9):
                for shards in range(0, 5):
                    if cpu + gpu == 0:
                        continue
                    stage, shard = map(int, threads.thread_split(cpu, gpu, shards))
                    assert stage >= 1 and shard >= 1
                    if cpu:   # the stages split the cores; each shard has one of its own
                        assert shard == 1 and stage * (cpu + gpu) <= max(n, cpu + gpu), (n, cpu, gpu, shards)
                    else:
                        assert stage * gpu + shard * shards <= max(n, gpu + shards), (n, gpu, shards)


def test_the_users_thread_counts_win(cores: Callable[[int], None], monkeypatch: pytest.MonkeyPatch) -> None:
    cores(16)
    monkeypatch.setenv(threads.THREADS_ENV, "3")
    monkeypatch.setenv(threads.PS_THREADS_ENV, "5")
    assert threads.thread_split(0, 4, 2) == ("3", "5")
    assert threads.thread_split(4, 0, 2) == ("3", "5")
