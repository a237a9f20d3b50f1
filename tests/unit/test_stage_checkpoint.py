"""A stage's part of a cut (stage_worker/checkpoint.py): captured, written, read back with
weights_only and restored into a fresh stage, it trains on exactly as the stage it came from,
whatever the optimizer's state (sgd's momentum, adam's and adamw's moments and step counts)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from hetpipe.training import LrSchedule, OptimizerConfig, TrainConfig, learning_rate
from stage_worker import checkpoint
from stage_worker.stage import StageCompute
from stage_worker.sync import LocalSync


def _stage(cfg: OptimizerConfig) -> StageCompute:
    torch.manual_seed(0)
    layers = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2)).double()
    return StageCompute(layers, cfg, loss="mse", device="cpu", track_updates=False)


def _train(stage: StageCompute, train: TrainConfig, minibatches: range) -> None:
    for p in minibatches:
        gen = torch.Generator().manual_seed(p)
        x, y = torch.randn(3, 4, generator=gen, dtype=torch.float64), torch.randn(3, 2, generator=gen, dtype=torch.float64)
        *_, grads, _ = stage.forward_backward(p, x, y)
        stage.commit(grads, lr=learning_rate(train, p))


@pytest.mark.parametrize("cfg", [
    OptimizerConfig(name="sgd", lr=0.05, momentum=0.9),
    OptimizerConfig(name="adam", lr=0.01),
    OptimizerConfig(name="adamw", lr=0.01, weight_decay=0.1),
], ids=["sgd-momentum", "adam", "adamw"])
def test_a_restored_stage_trains_on_bit_for_bit(cfg: OptimizerConfig, tmp_path: Path) -> None:
    train = TrainConfig(steps=8, optimizer=cfg, lr_schedule=LrSchedule(warmup_steps=2, decay="cosine"))
    whole, first = _stage(cfg), _stage(cfg)
    _train(whole, train, range(1, 9))
    _train(first, train, range(1, 5))
    torch.save(checkpoint.capture(first, LocalSync()), tmp_path / "stage.pt")
    resumed = _stage(cfg)
    checkpoint.restore(resumed, LocalSync(), checkpoint.load(tmp_path / "stage.pt"))
    _train(resumed, train, range(5, 9))
    assert resumed.version == whole.version == 8
    for key, value in whole.module.state_dict().items():
        assert torch.equal(resumed.module.state_dict()[key], value), key
    # Without the optimizer's state, the same four steps end elsewhere: the state is what is tested.
    fresh = _stage(cfg)
    fresh.module.load_state_dict(first.module.state_dict())
    _train(fresh, train, range(5, 9))
    assert not all(torch.equal(fresh.module.state_dict()[k], v) for k, v in whole.module.state_dict().items())


def test_a_damaged_part_is_refused_in_our_words_never_torchs(tmp_path: Path) -> None:
    """Random bytes, a pickled object besides tensors, zeros: each a ValueError naming what to do.
    torch's own text for such a file says to load it with weights_only=False, which would run
    whatever the file holds."""
    import os
    import datetime

    random, pickled, zeros = tmp_path / "random.pt", tmp_path / "pickled.pt", tmp_path / "zeros.pt"
    random.write_bytes(os.urandom(4096))
    torch.save({"module": datetime.date(2026, 1, 1)}, pickled)   # an object weights_only refuses
    zeros.write_bytes(b"\0" * 4096)
    for path in (random, pickled, zeros):
        with pytest.raises(ValueError, match=r"^damaged: not a stage's part of a cut that loads with weights_only "
                                             r"\(\w+\); start again with --fresh, or put back a whole copy") as err:
            checkpoint.load(path)
        assert "weights_only=False" not in str(err.value) and "weights_only set to False" not in str(err.value)
    torch.save([torch.ones(1)], tmp_path / "list.pt")
    with pytest.raises(ValueError, match="^not a stage's part of a cut$"):
        checkpoint.load(tmp_path / "list.pt")


@pytest.mark.parametrize("change, message", [
    (lambda state: state.pop("optimizer"), r"^not a stage's part of a cut: it holds no 'optimizer'$"),
    (lambda state: state.update(module=7), r"^not a stage's part of a cut \(TypeError"),
    (lambda state: state["optimizer"].update(exp_avg=7), r"^not a stage's part of a cut \(TypeError"),
], ids=["no optimizer", "module a number", "moments a number"])
def test_a_loadable_part_of_another_structure_is_refused_as_one(change, message: str, tmp_path: Path) -> None:
    """A file that loads with weights_only but holds another structure: a ValueError that its
    loader names (the stage's LoadError), where a TypeError or a bare KeyError ended it in a traceback."""
    cfg = OptimizerConfig(name="adam", lr=0.01)
    state = checkpoint.capture(_stage(cfg), LocalSync())
    change(state)
    torch.save(state, tmp_path / "stage.pt")
    with pytest.raises(ValueError, match=message):
        checkpoint.restore(_stage(cfg), LocalSync(), checkpoint.load(tmp_path / "stage.pt"))
