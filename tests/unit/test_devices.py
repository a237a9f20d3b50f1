"""Which device a worker computes on, and that its threads reach that one."""

from __future__ import annotations

import threading

import pytest
import torch

from hetpipe import devices


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
