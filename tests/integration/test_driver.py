"""coordinator/driver.py: a job driven over gRPC on in-process stage servers, and failures that name
the stage, where it is and how far it got."""

from __future__ import annotations

import re
import time
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from coordinator import results
from coordinator import driver as driver_module
from coordinator.driver import JobDriver
from coordinator.planner import make_plan
from hetpipe import rpc, weight_files
from hetpipe.errors import JobFailed
from hetpipe.reference import train_reference
from hetpipe.rpc import handler
from hetpipe.v1 import stage_pb2, wire_pb2
from stage_worker.runtime import StageRuntime
from stage_worker.servicer import StageServicer

pytestmark = pytest.mark.timeout(60)
State = stage_pb2.StageStatus.State


def _serve(servicer: Any) -> rpc.Server:
    server = rpc.Server("127.0.0.1", 0, workers=8)
    server.add("Stage", servicer)
    server.start()
    return server


@pytest.fixture
def stages() -> Iterator[list[rpc.Server]]:
    runtimes = [StageRuntime(), StageRuntime()]
    servers = [_serve(StageServicer(rt, on_stop=lambda: None)) for rt in runtimes]
    yield servers
    for rt, server in zip(runtimes, servers):
        rt.stop()
        server.stop(grace=0)


def test_the_driver_runs_a_job_and_collects_the_trained_weights(make_job, stages: list[rpc.Server]) -> None:
    job = make_job({"train": {"dtype": "float64", "steps": 12}, "parallel": {"stages_per_vw": 2, "nm": 1},
                    "output": {"trace": False}})
    plan = make_plan(job)
    driver = JobDriver(job, plan, [s.address for s in stages])
    seen: list[int] = []
    try:
        driver.setup()
        wall = driver.run(lambda p: seen.append(p.samples), interval=0.01)
        files = results.write_weights(driver)
    finally:
        driver.close()
    assert [f.name for f in files] == ["model.safetensors"]
    weights = weight_files.read_weights(files[0].parent)
    assert wall > 0 and seen[-1] == 12 * job.data.batch_size and seen == sorted(seen)
    want = train_reference(job).state_dict()
    assert sorted(weights) == sorted(want)
    for key in want:
        torch.testing.assert_close(weights[key], want[key], rtol=0, atol=1e-9)


def test_a_final_evaluation_that_fails_leaves_the_trained_weights_written(make_job, stages: list[rpc.Server]) -> None:
    """It ran before the weights were written: out of memory on a large held-out set, say, and a
    whole run's training was gone with it. The failure names where the weights are."""
    job = make_job({"train": {"dtype": "float64", "steps": 6}, "parallel": {"stages_per_vw": 2, "nm": 1},
                    "output": {"trace": False}})
    driver = JobDriver(job, make_plan(job), [s.address for s in stages])

    def fails() -> None:
        raise JobFailed("stage 1 of vw 0 ran out of memory in the final evaluation")

    try:
        driver.setup()
        wall = driver.run(interval=0.01)
        driver.final_evaluation = fails   # type: ignore[method-assign]
        with pytest.raises(JobFailed, match=r"out of memory in the final evaluation \(the trained weights are in "):
            results.write_outputs(driver, wall)
    finally:
        driver.close()
    weights = weight_files.read_weights(Path(driver.out_dir))
    for key, value in train_reference(job).state_dict().items():
        torch.testing.assert_close(weights[key], value, rtol=0, atol=1e-9)


def test_each_stage_times_its_minibatches_after_its_first_wave_until_done(make_job, stages: list[rpc.Server]) -> None:
    """StageStatus.steady_*: a stage's window holds the steps - nm minibatches after its first
    wave, and closes at DONE (a status polled later reads the same)."""
    job = make_job({"train": {"steps": 10}, "parallel": {"stages_per_vw": 2, "nm": 2}, "output": {"trace": False}})
    driver = JobDriver(job, make_plan(job), [s.address for s in stages])
    try:
        driver.setup()
        wall = driver.run(interval=0.01)
        windows = [(h.last.steady_minibatches, h.last.steady_seconds) for h in driver.stages]
        time.sleep(0.3)
        later = [h.stub.Status(stage_pb2.StatusRequest(), timeout=rpc.STATUS_DEADLINE_S) for h in driver.stages]
    finally:
        driver.close()
    assert [n for n, _ in windows] == [8, 8] and all(0 < s < wall for _, s in windows), windows
    assert [(s.steady_minibatches, s.steady_seconds) for s in later] == windows, "the window stayed open after DONE"
    assert results.steady_samples_per_second(later, 1) == pytest.approx(8 / max(s for _, s in windows))


class _Failing:
    """A stage that accepts setup, then reports that it failed at minibatch 3. Its polls count
    from Start: before it, it is READY however often the driver asks while the other stages load."""

    def __init__(self) -> None:
        self.polls = 0
        self.started = False

    @handler
    def Assign(self, request: Any, context: grpc.ServicerContext) -> wire_pb2.Ack:
        return wire_pb2.Ack()

    @handler
    def LoadWeights(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> wire_pb2.Ack:
        for _ in request_iterator:
            pass
        return wire_pb2.Ack()

    @handler
    def Start(self, request: Any, context: grpc.ServicerContext) -> wire_pb2.Ack:
        self.started = True
        return wire_pb2.Ack()

    @handler
    def Forward(self, request_iterator: Iterator[bytes], context: grpc.ServicerContext) -> wire_pb2.Ack:
        return self.LoadWeights(request_iterator, context)

    @handler
    def ForwardLink(self, frames: Iterator[bytes], context: grpc.ServicerContext) -> Iterator[wire_pb2.Ack]:
        # Stage 0's activations arrive here (one-frame bundles on the link's stream) until the job
        # fails: without it stage 0 fails first, on UNIMPLEMENTED, and the race decides the message.
        for _ in frames:
            yield wire_pb2.Ack()

    @handler
    def Status(self, request: Any, context: grpc.ServicerContext) -> stage_pb2.StageStatus:
        if not self.started:
            return stage_pb2.StageStatus(state=State.READY)
        self.polls += 1
        if self.polls < 3:
            return stage_pb2.StageStatus(state=State.RUNNING, forwards_done=self.polls, backwards_done=self.polls - 1)
        return stage_pb2.StageStatus(state=State.FAILED, error="stage 1 of vw 0: RuntimeError: boom at minibatch 3",
                                     forwards_done=3, backwards_done=2)


class _Draining(_Failing):
    """A lone stage whose every minibatch is done while its last push is still on its way: DONE
    only at its sixth poll."""

    @handler
    def Status(self, request: Any, context: grpc.ServicerContext) -> stage_pb2.StageStatus:
        if not self.started:
            return stage_pb2.StageStatus(state=State.READY)
        self.polls += 1
        return stage_pb2.StageStatus(state=State.DONE if self.polls >= 6 else State.RUNNING,
                                     forwards_done=12, backwards_done=12)


def test_once_every_minibatch_is_done_the_driver_looks_often_for_the_end(make_job, monkeypatch: pytest.MonkeyPatch) -> None:
    """The run's wall ends when its last stage is seen DONE: after the last minibatch, the polls
    come every FINAL_POLL_S instead of every interval."""
    job = make_job({"train": {"steps": 12}, "parallel": {"stages_per_vw": 1, "nm": 1}, "output": {"trace": False}})
    draining = _serve(_Draining())
    driver = JobDriver(job, make_plan(job), [draining.address])
    slept: list[float] = []
    clock = types.SimpleNamespace(monotonic=time.monotonic, time=time.time, sleep=slept.append)   # no real waits
    try:
        driver.setup()
        monkeypatch.setattr(driver_module, "time", clock)
        driver.run(interval=5.0)
    finally:
        driver.close()
        draining.stop(grace=0)
    assert slept and all(s == driver_module.FINAL_POLL_S for s in slept), slept


def test_a_stage_that_fails_fails_the_job_naming_it_and_its_progress(make_job, stages: list[rpc.Server]) -> None:
    job = make_job({"parallel": {"stages_per_vw": 2, "nm": 1}, "output": {"trace": False}})
    failing = _serve(_Failing())
    driver = JobDriver(job, make_plan(job), [stages[0].address, failing.address])
    try:
        driver.setup()
        with pytest.raises(JobFailed) as info:
            driver.run(interval=0.01)
    finally:
        driver.close()
        failing.stop(grace=0)
    message = str(info.value)
    assert "stage 1 of vw 0: RuntimeError: boom at minibatch 3" in message
    assert "it had finished 3 forwards and 2 backwards" in message


def test_an_unreachable_stage_fails_setup_naming_it(make_job, stages: list[rpc.Server]) -> None:
    job = make_job({"parallel": {"stages_per_vw": 2, "nm": 1}, "output": {"trace": False}})
    checked: list[bool] = []
    driver = JobDriver(job, make_plan(job), [stages[0].address, "127.0.0.1:9"],
                       check_processes=lambda: checked.append(True))
    try:
        with pytest.raises(JobFailed, match=r"stage 1 of vw 0 at 127\.0\.0\.1:9: Assign failed: UNAVAILABLE"):
            driver.setup()
    finally:
        driver.close()
    assert checked, "the driver asks the launcher whether a process died before blaming the network"


@pytest.mark.parametrize("warmup", [0, 4000], ids=["constant", "warming-up"])
def test_a_loss_that_goes_nan_fails_the_job_as_diverged_before_it_ends(make_job, stages: list[rpc.Server],
                                                                       warmup: int) -> None:
    """A NaN loss in fp32 is divergence: the job fails as soon as a poll sees it, naming the VW, how
    far it got and the learning rate (during a warm-up, the one that minibatch trained at), instead
    of training on NaN weights and exiting 0."""
    steps = 8000
    job = make_job({"train": {"steps": steps, "optimizer": {"name": "sgd", "lr": 1e12},
                              "lr_schedule": {"warmup_steps": warmup}},
                    "parallel": {"stages_per_vw": 2, "nm": 1}, "output": {"trace": False}})
    driver = JobDriver(job, make_plan(job), [s.address for s in stages])
    lr = r"train.optimizer.lr is 1e\+12" if not warmup else \
        r"its learning rate is ([0-9.e+]+), of train.optimizer.lr 1e\+12 and train.lr_schedule"
    try:
        driver.setup()
        with pytest.raises(JobFailed, match=r"training diverged: the loss of vw 0 is nan at minibatch (\d+) "
                                            rf"\({lr}") as info:
            driver.run(interval=0.01)
    finally:
        driver.close()
    done = int(re.search(r"at minibatch (\d+)", str(info.value)).group(1))  # type: ignore[union-attr]
    assert 0 < done < steps
    if warmup:
        rate = float(re.search(r"its learning rate is ([0-9.e+]+),", str(info.value)).group(1))  # type: ignore[union-attr]
        assert rate == pytest.approx(1e12 * done / warmup, rel=1e-5)


class _Err(grpc.RpcError):
    def __init__(self, code: grpc.StatusCode) -> None:
        self._code = code

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._code.name


class _Waiting:
    """A stage's answers as the driver's stub sees them: waiting at the checkpoint of wave `cut`
    until continued; frozen: Status runs out of time; lost: Continue finds its process gone."""

    def __init__(self, cut: int) -> None:
        self.cut, self.frozen, self.lost = cut, False, False
        self.continued: list[int] = []
        self.evaluated = 0   # evaluation minibatches run

    def Status(self, request: Any, timeout: float) -> stage_pb2.StageStatus:
        if self.frozen:
            raise _Err(grpc.StatusCode.DEADLINE_EXCEEDED)
        return stage_pb2.StageStatus(state=State.RUNNING, cut=self.cut, recent_loss=1.0,
                                     eval_minibatches=self.evaluated)

    def Continue(self, request: Any, timeout: float) -> wire_pb2.Ack:
        if self.lost:
            raise _Err(grpc.StatusCode.UNAVAILABLE)
        self.continued.append(self.cut)
        self.cut = 0
        return wire_pb2.Ack()

    def Stop(self, request: Any, timeout: float) -> wire_pb2.Ack:
        return wire_pb2.Ack()


class _Cuts:
    """The driver's checkpoints, taken in no time (or slowly: streaming a large model's shards)."""

    def __init__(self, take_s: float = 0.0) -> None:
        self.taken, self.take_s = 0, take_s

    def take(self, wave: int, lead_vw: int, evicted: list[int], seconds: float) -> None:
        time.sleep(self.take_s)
        self.taken = wave

    def skip(self, wave: int) -> None:
        self.taken = wave


class _Shard:
    def __init__(self) -> None:
        self.evicted: list[int] = []

    def Evict(self, request: Any, timeout: float) -> wire_pb2.Ack:
        self.evicted.append(request.vw)
        return wire_pb2.Ack()


def _two_vws(make_job, cut: int, stall_s: float = 30.0) -> tuple[JobDriver, dict[int, _Waiting], _Shard]:
    """A driver of 2 VWs x 1 stage, which may go on without a VW, over in-memory stage stubs."""
    job = make_job({"train": {"steps": 20, "stall_timeout_s": stall_s, "checkpoint_every": 5},
                    "parallel": {"virtual_workers": 2, "stages_per_vw": 1, "nm": 1, "on_vw_failure": "continue"},
                    "output": {"trace": False}})
    plan = make_plan(job)
    driver = JobDriver(job, plan, [f"127.0.0.1:{9 + i}" for i in range(len(plan.stages))])
    stubs = {}
    for h in driver.stages:
        h.stub = stubs[h.plan.vw] = _Waiting(cut)
    shard = _Shard()
    driver.shards = [shard]   # type: ignore[list-item]
    driver.checkpoints = _Cuts()   # type: ignore[assignment]
    return driver, stubs, shard


def test_a_stage_whose_continue_was_lost_with_another_vw_gets_it_at_the_next_poll(make_job) -> None:
    """Every stage waits at the cut; Continue finds VW 0's process gone, so VW 0 leaves the job:
    VW 1, which the loop had not reached, must not wait at the cut for good."""
    driver, stubs, shard = _two_vws(make_job, cut=5)
    stubs[0].lost = True
    try:
        driver.poll()
        assert shard.evicted == [0] and stubs[1].continued == [5] and stubs[1].cut == 0
        driver.poll()   # nothing is continued twice
        assert stubs[1].continued == [5]
    finally:
        driver.close()


def _polled_until_stalled(driver: JobDriver) -> None:
    """Polls the stages as the driver's loop does until its progress check fails the job: within 5 s."""
    with pytest.raises(JobFailed, match="no progress"):
        deadline = time.monotonic() + 5
        while time.monotonic() < deadline:
            driver.poll()
            driver._check_progress()
            time.sleep(0.05)


def test_a_vw_evicted_while_silent_leaves_the_no_progress_check_on(make_job) -> None:
    """A frozen stage is silent, then lost with its VW: the stages left must still be watched for
    a job that stops moving although they answer."""
    driver, stubs, shard = _two_vws(make_job, cut=0, stall_s=1.0)
    stubs[1].frozen = True
    try:
        driver.poll()   # silent from now
        time.sleep(1.1)
        driver.poll()   # named, lost: VW 1 leaves
        assert shard.evicted == [1]
        _polled_until_stalled(driver)
    finally:
        driver.close()


def test_an_evaluation_that_takes_longer_than_the_stall_timeout_is_no_stall(make_job) -> None:
    """An evaluation moves no training counter: a held-out set whose minibatches together took
    longer than train.stall_timeout_s failed the job."""
    driver, stubs, _ = _two_vws(make_job, cut=0, stall_s=1.0)
    try:
        deadline = time.monotonic() + 1.5
        while time.monotonic() < deadline:
            for stub in stubs.values():
                stub.evaluated += 1
            driver.poll()
            driver._check_progress()
            time.sleep(0.05)
        _polled_until_stalled(driver)   # and once they stop, it is one
    finally:
        driver.close()


def test_a_checkpoint_that_takes_longer_than_the_stall_timeout_is_no_stall(make_job) -> None:
    driver, stubs, _ = _two_vws(make_job, cut=0, stall_s=1.0)
    driver.checkpoints = _Cuts(take_s=1.3)   # type: ignore[assignment]
    try:
        driver.poll()
        driver._check_progress()   # the counters as they stand
        for stub in stubs.values():
            stub.cut = 5   # both wait at the cut: no counter moves from here
        driver.poll()   # takes it, for longer than the stall timeout
        driver._check_progress()
        assert [s.continued for s in stubs.values()] == [[5], [5]]
    finally:
        driver.close()


class _Evaluating:
    """A lone stage, DONE, that runs the final evaluation's minibatches one per poll and reports
    the evaluation after `minibatches` of them (never, with moving False: it is stuck)."""

    def __init__(self, minibatches: int, moving: bool = True) -> None:
        self.asked, self.run, self.minibatches, self.moving = False, 0, minibatches, moving

    def Evaluate(self, request: Any, timeout: float) -> wire_pb2.Ack:
        self.asked = True
        return wire_pb2.Ack()

    def Status(self, request: Any, timeout: float) -> stage_pb2.StageStatus:
        if self.asked and self.moving:
            self.run += 1
        status = stage_pb2.StageStatus(state=State.DONE, eval_minibatches=self.run, recent_loss=1.0)
        if self.run >= self.minibatches:
            status.evals.add(id=1, minibatches=4, final=True, time=time.time(), rows=32, loss=0.5, accuracy=0.75)
        return status

    def Stop(self, request: Any, timeout: float) -> wire_pb2.Ack:
        return wire_pb2.Ack()


@pytest.mark.parametrize("moving", [True, False])
def test_a_final_evaluation_fails_the_job_only_once_it_stops_moving(make_job, monkeypatch: pytest.MonkeyPatch,
                                                                    moving: bool) -> None:
    """It had 600 s in all, however large the held-out set: past them the job failed, before its
    weights were written."""
    monkeypatch.setattr(driver_module, "FINAL_EVAL_TIMEOUT_S", 0.3)
    job = make_job({"data": {"eval_fraction": 0.2}, "eval": {"every": 0}, "train": {"steps": 4},
                    "parallel": {"virtual_workers": 1, "stages_per_vw": 1, "nm": 1}, "output": {"trace": False}})
    driver = JobDriver(job, make_plan(job), ["127.0.0.1:9"])
    stub = driver.stages[0].stub = _Evaluating(minibatches=40, moving=moving)   # type: ignore[assignment]
    Path(driver.out_dir).mkdir(parents=True, exist_ok=True)   # eval.jsonl's
    try:
        if moving:   # 40 polls of 50 ms: longer than the timeout, moving all along
            assert driver.final_evaluation().final and stub.run >= 40
        else:
            with pytest.raises(JobFailed, match=r"the final evaluation made no progress for 0\.3s"):
                driver.final_evaluation()
    finally:
        driver.close()


def test_a_stage_that_dies_while_its_weights_are_read_is_named_as_the_launcher_saw_it(
        make_job, stages: list[rpc.Server]) -> None:
    """The final weights of a lone VW come from its stages: one killed meanwhile fails the job with
    the launcher's report of its death (pid, signal, progress), as at any other time, not gRPC's
    words for the closed socket alone."""
    job = make_job({"parallel": {"stages_per_vw": 2, "nm": 1}, "output": {"trace": False}})
    dead: dict[str, str] = {}

    def check_processes() -> None:
        for h in driver.stages:
            if h.address in dead:
                raise JobFailed(f"{h.name} ({h.address}) {dead[h.address]}; {h.progress()}")

    driver = JobDriver(job, make_plan(job), [s.address for s in stages], check_processes=check_processes)
    try:
        driver.setup()
        driver.run(interval=0.01)
        stages[1].stop(grace=0)   # killed: its socket closes, then the launcher reports it
        dead[stages[1].address] = "(pid 4242) was killed by SIGKILL"
        with pytest.raises(JobFailed) as info:
            results.write_weights(driver)
    finally:
        driver.close()
    assert "stage 1 of vw 0" in str(info.value) and "(pid 4242) was killed by SIGKILL" in str(info.value), info.value


def test_a_shard_dead_for_good_while_the_final_weights_are_read_is_named_at_once(make_job) -> None:
    """A shard the launcher no longer restarts (its fourth death) fails the final write at once,
    named as the launcher saw it, instead of being read again for SHARD_RETURN_S."""
    from hetpipe import models

    driver, _, _ = _two_vws(make_job, cut=0)

    class _Gone:
        def Pull(self, request: Any, timeout: float) -> Any:
            raise _Err(grpc.StatusCode.UNAVAILABLE)

    def check_processes() -> None:
        raise JobFailed(f"ps shard 0 ({driver.ps_addresses[0]}) (pid 4242) was killed by SIGKILL")

    driver.ps_addresses = ["127.0.0.1:9"]
    driver.shards = [_Gone()]   # type: ignore[list-item]
    driver.model = models.structure(driver.job.model, driver.job.base_dir, dtype=driver.job.train.dtype)
    driver.check_processes = check_processes
    driver.out_dir.mkdir(parents=True)
    started = time.monotonic()
    try:
        with pytest.raises(JobFailed, match=r"ps shard 0 \(127\.0\.0\.1:9\) \(pid 4242\) was killed by SIGKILL"):
            results.write_weights(driver)
    finally:
        driver.close()
    assert time.monotonic() - started < 5.0


def test_a_full_disk_under_the_final_weights_fails_the_job_naming_output_dir(
        make_job, stages: list[rpc.Server], monkeypatch: pytest.MonkeyPatch) -> None:
    """ENOSPC while the weights are written is the job's failure, named with output.dir, not an
    OSError out of the job thread (a traceback and "coordinator error: OSError: ...")."""
    import errno
    import os

    job = make_job({"parallel": {"stages_per_vw": 2, "nm": 1}, "output": {"trace": False}})
    driver = JobDriver(job, make_plan(job), [s.address for s in stages])

    def full(self: Any, key: str, offset: int, piece: Any) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    try:
        driver.setup()
        driver.run(interval=0.01)
        monkeypatch.setattr(weight_files.WeightsWriter, "write", full)
        with pytest.raises(JobFailed) as info:
            results.write_weights(driver)
    finally:
        driver.close()
    assert str(info.value) == f"writing the final weights into output.dir {driver.out_dir}: No space left on device"
    assert not list(driver.out_dir.glob(".*partial")), "the partial file is removed"


def test_a_stage_frozen_while_its_weights_are_read_is_named_within_seconds(make_job) -> None:
    """SIGSTOP of a lone VW's stage as the final weights are read: no answer and no heartbeat. The
    driver's loop polls no one then; the read is cancelled once check_processes finds the stage
    silent, instead of waiting out its data deadline (two minutes)."""
    import threading

    job = make_job({"parallel": {"stages_per_vw": 2, "nm": 1}, "output": {"trace": False}})
    runtimes = [StageRuntime(), StageRuntime()]
    servers = [_serve(StageServicer(rt, on_stop=lambda: None)) for rt in runtimes]
    thawed, silent = threading.Event(), threading.Event()

    def check_processes() -> None:
        if silent.is_set():
            raise JobFailed("stage 1 of vw 0 (pid 4242) not responding: no heartbeat for 5.1s")

    def frozen(keys: list[str] | None = None) -> list[tuple[str, torch.Tensor]]:
        silent.set()
        thawed.wait(30)
        return []

    driver = JobDriver(job, make_plan(job), [s.address for s in servers], check_processes=check_processes)
    try:
        driver.setup()
        driver.run(interval=0.01)
        runtimes[1].weights = frozen   # type: ignore[method-assign]
        started = time.monotonic()
        with pytest.raises(JobFailed, match=r"stage 1 of vw 0 \(pid 4242\) not responding: no heartbeat"):
            results.write_weights(driver)
        assert time.monotonic() - started < 10.0
    finally:
        thawed.set()
        driver.close()
        for rt, server in zip(runtimes, servers):
            rt.stop()
            server.stop(grace=0)
