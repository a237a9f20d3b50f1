"""parallel.sync quorum and elastic end to end (real processes): quorum of all VWs equals synchronous
summed data parallelism (O2's reference); a solo quorum with a straggler runs ahead of it and still
puts every acknowledged push in the final model exactly once (O3); elastic averaging learns, and
what it writes out is the shards' master, w0 plus every acknowledged delta."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hetpipe import data, datasets, elastic, weight_files
from hetpipe.optim import compute_loss
from hetpipe.reference import initial_model, train_reference
from hetpipe.wsp import total_waves
from launch.local import run_local
from ps_server.durability import Durability
from ps_server.shard import Shard
from conftest import run_beside
from tests.e2e.test_vw_failure import _kill_when_busy
from tests.trace_rules import check_conservation

pytestmark = pytest.mark.timeout(120)


def final_shards(out: Path, shards: int) -> list[Shard]:
    """Each shard as it stopped: its checkpoint (written at SIGTERM) and push log."""
    restored = []
    for i in range(shards):
        shard = Shard()
        Durability(str(out / "ps" / f"shard{i}")).restore(shard)
        restored.append(shard)
    return restored


def test_quorum_of_all_equals_summed_sync_dp(make_job, tmp_path: Path) -> None:
    job = make_job({
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02}, "steps": 20},
        "parallel": {"virtual_workers": 3, "stages_per_vw": 2, "nm": 1, "D": 0, "ps_shards": 2,
                     "sync": "quorum", "sync_args": {"quorum": "all"}},
    })
    summary = run_local(job, quiet=True)
    got = weight_files.read_weights(tmp_path / "out")
    want = train_reference(job).state_dict()
    w0 = initial_model(job).state_dict()
    assert list(got) == list(want)
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
    assert max(float((want[k] - w0[k]).abs().max()) for k in want) > 1e-3
    assert summary["max_clock_distance"] <= 1
    assert {s.rule.mode for s in final_shards(tmp_path / "out", 2)} == {"quorum"}


def test_solo_quorum_with_a_straggler_runs_ahead_and_conserves(make_job, inject_faults, tmp_path: Path) -> None:
    inject_faults(task_delay=(0.0, 0.002), slow_vw=2, slow_factor=6.0, repeat_push=0.3)
    steps, nm = 24, 2
    job = make_job({
        "output": {"ledger": True},   # O3 reads it (check_conservation)
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02, "momentum": 0.5}, "steps": steps},
        "parallel": {"virtual_workers": 3, "stages_per_vw": 2, "nm": nm, "D": 0, "ps_shards": 2,
                     "sync": "quorum", "sync_args": {"quorum": "solo"}},
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 6}]}],
                    "emulate": {"forward_seconds": 0.02, "backward_seconds": 0.02}},
    })
    summary = run_local(job, quiet=True)
    out = tmp_path / "out"
    # Under WSP with D 0 no VW gets more than one clock ahead; solo rounds do not wait for the straggler.
    assert summary["max_clock_distance"] >= 4, summary["max_clock_distance"]
    check_conservation(job, out, ledgers=3 * 2)   # O3: every acknowledged push once, the late ones included
    waves = total_waves(steps, nm)
    for shard in final_shards(out, 2):
        assert shard.c_global() == waves
        for key in shard.values:
            assert shard.pull(0, [key]).own_clock == [waves], "the final flush applied everything"
            assert not shard.rounds[key].open


def test_quorum_goes_on_without_an_evicted_vw(make_job, tmp_path: Path) -> None:
    """parallel.on_vw_failure continue under a majority quorum: the VW that left no longer counts
    toward a round's quorum or the final flush, and its acknowledged pushes are in the model once."""
    steps, nm = 40, 2
    job = make_job({
        "output": {"ledger": True},   # O3 reads it (check_conservation)
        "train": {"dtype": "float64", "optimizer": {"name": "sgd", "lr": 0.02}, "steps": steps},
        "parallel": {"virtual_workers": 3, "stages_per_vw": 2, "nm": nm, "D": 0, "ps_shards": 2,
                     "sync": "quorum", "on_vw_failure": "continue"},
        "cluster": {"nodes": [{"name": "n0", "gpus": [{"type": "titan-v", "count": 6}]}],
                    "emulate": {"forward_seconds": 0.01, "backward_seconds": 0.01}},
    })
    out = tmp_path / "out"
    summary, killed = run_beside(job, _kill_when_busy)   # kill -9 of stage 1 of vw 1
    assert killed, "no stage was killed: the test proved nothing"
    assert [e["vw"] for e in summary["evicted"]] == [1]
    check_conservation(job, out, ledgers=3 * 2, left=[1])
    for shard in final_shards(out, 2):
        assert shard.evicted == {1} and shard.c_global() == total_waves(steps, nm)
        for key in shard.values:
            assert not shard.rounds[key].open, "the final flush waited for the VWs left only"
            assert [shard.rounds[key].applied[v] for v in (0, 2)] == [total_waves(steps, nm)] * 2


def test_elastic_learns_and_writes_the_master(make_job, tmp_path: Path) -> None:
    steps, nm, period = 60, 2, 2
    job = make_job({
        "output": {"ledger": True},   # O3 reads it (check_conservation)
        "train": {"dtype": "float64", "optimizer": {"name": "adam", "lr": 0.01}, "steps": steps},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": nm, "D": 0, "ps_shards": 2,
                     "sync": "elastic", "sync_args": {"alpha": 0.25, "period": period}},
    })
    run_local(job, quiet=True)
    out = tmp_path / "out"
    written = weight_files.read_weights(out)
    # What was written out is the shards' master after every VW's last exchange ...
    exchanges = elastic.total_exchanges(total_waves(steps, nm), period)
    for shard in final_shards(out, 2):
        assert shard.rule.mode == "elastic" and shard.rule.alpha == 0.25
        for key, value in shard.values.items():
            assert torch.equal(written[key], value), key
            assert shard.exchanges.count[key] == [exchanges, exchanges], key
    # ... which is w0 plus every delta the shards acknowledged (each stage's ledger sums its own).
    check_conservation(job, out, ledgers=2 * 2)
    # And it learned: the loss of the whole training set fell. By how much depends on how the two
    # VWs' exchanges interleave, since elastic VWs never wait for each other: 0.45-0.52 of the
    # loss at the start in runs alone, 0.81 in one run beside other load that starved one VW.
    model = initial_model(job)
    dataset = datasets.training_set(job)
    x, y = data.read_rows(job, dataset, range(len(dataset)))  # type: ignore[arg-type]
    with torch.no_grad():
        before = float(compute_loss(job.train.loss, model(x), y))
        model.load_state_dict(written)
        after = float(compute_loss(job.train.loss, model(x), y))
    assert after < 0.9 * before, (before, after)
