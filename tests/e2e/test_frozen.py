"""Frozen parameters (requires_grad False, as a fine-tune freezes an embedding): held by the stages
as buffers are, never stepped, pushed or pulled, and written out as built; the rest trains as the
single-process reference does (float64, 1e-9): O1 with one VW, O2 with two under WSP."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from launch.local import run_local
from hetpipe import weight_files
from hetpipe.reference import initial_model, train_reference

pytestmark = pytest.mark.timeout(150)

# The mlp's layers: 0 Linear, 1 ReLU, 2 Linear, 3 ReLU, 4 Linear, 5 ReLU, 6 Linear. Layer 2 is
# frozen whole, between trained layers (its input's gradient still flows back); layer 4 keeps a
# frozen weight beside a trained bias.
FACTORY = '''
from hetpipe import zoo

def mlp(**args):
    model = zoo.mlp(**args)
    model[2].requires_grad_(False)
    model[4].weight.requires_grad_(False)
    return model
'''
FROZEN = ("2.weight", "2.bias", "4.weight")


@pytest.mark.parametrize(("n", "k", "training"), [
    (1, 3, {"optimizer": {"name": "adam", "lr": 0.01, "weight_decay": 0.01}}),
    (2, 2, {"optimizer": {"name": "sgd", "lr": 0.02}}),
], ids=["O1-adam", "O2-wsp"])
def test_frozen_parameters_keep_their_values_and_the_rest_trains_as_one_process(
        make_job, capfd: pytest.CaptureFixture[str], tmp_path: Path, n: int, k: int, training: dict) -> None:
    (tmp_path / "frozen_mlp.py").write_text(FACTORY)
    job = make_job({
        "model": {"name": None, "factory": "frozen_mlp:mlp"},
        "train": {"dtype": "float64", "steps": 15, **training},
        "parallel": {"virtual_workers": n, "stages_per_vw": k, "nm": 1, "D": 0, "ps_shards": 2},
        "output": {"trace": False},
    })
    summary = run_local(job, quiet=True)
    assert len(summary["plan"]) == n * k
    assert ("hetpipe: warning: model: 2.weight, 2.bias, 4.weight frozen, and no model.init: they stay as their "
            "layers' reset_parameters() draw them") in capfd.readouterr().err, "a frozen random draw is named"
    got = weight_files.read_weights(tmp_path / "out")
    want = train_reference(job).state_dict()
    w0 = initial_model(job).state_dict()
    assert sorted(got) == sorted(want), "frozen parameters are written out with the rest"
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
    for key in FROZEN:
        assert torch.equal(got[key], w0[key]), f"{key} is frozen, yet it changed"
    moved = min(float((want[key] - w0[key]).abs().max()) for key in want if key not in FROZEN)
    assert moved > 1e-4, "every trained parameter must move, the layers before the frozen ones too"


def test_a_linear_probe_whose_first_stage_trains_nothing_passes_its_checkpoints(make_job, tmp_path: Path) -> None:
    """Every layer but the head frozen, as a linear probe is: stage 0 has no trained parameter,
    so it pushes nothing, and a checkpoint's cut must not wait for its pushes' acknowledgements."""
    (tmp_path / "probe.py").write_text('''
from hetpipe import zoo

def mlp(**args):
    model = zoo.mlp(**args)
    for layer in list(model)[:-1]:
        layer.requires_grad_(False)
    return model
''')
    job = make_job({
        "model": {"name": None, "factory": "probe:mlp"},
        "train": {"dtype": "float64", "steps": 12, "checkpoint_every": 2, "stall_timeout_s": 10},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 1, "D": 0, "ps_shards": 1},
        "output": {"trace": False},
    })
    summary = run_local(job, quiet=True)
    head = 6   # the mlp's last Linear
    assert all(p["layers"][1] <= head for p in summary["plan"] if p["stage"] == 0), "stage 0 must train nothing"
    assert (tmp_path / "out" / "checkpoints" / "cut000010").is_dir()
    got, want = weight_files.read_weights(tmp_path / "out"), train_reference(job).state_dict()
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")


TIED = '''
import torch
from torch import nn


class Tied(nn.Module):
    """Two linear maps sharing one weight, inside one layer (ties across layers are refused)."""

    def __init__(self, width):
        super().__init__()
        self.a = nn.Linear(width, width)
        self.b = nn.Linear(width, width)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(torch.tanh(self.a(x)))


def mlp(in_features, hidden, num_classes):
    return nn.Sequential(nn.Linear(in_features, hidden[0]), Tied(hidden[0]), nn.Linear(hidden[0], num_classes))
'''


def test_a_weight_tied_within_a_layer_is_written_as_w_global_under_both_keys(make_job, tmp_path: Path) -> None:
    """Its second state_dict key is no shard key (named_parameters names it once): it was taken
    from the lead VW's stage, whose local copy lags w_global where no final evaluation merged it,
    so the file held two values for one tensor."""
    (tmp_path / "tied_mlp.py").write_text(TIED)
    job = make_job({
        "model": {"name": None, "factory": "tied_mlp:mlp"},
        "train": {"dtype": "float64", "steps": 15, "optimizer": {"name": "sgd", "lr": 0.02}},
        "parallel": {"virtual_workers": 2, "stages_per_vw": 2, "nm": 1, "D": 0, "ps_shards": 2},
        "output": {"trace": False},
    })
    run_local(job, quiet=True)
    got = weight_files.read_weights(tmp_path / "out")
    want = train_reference(job).state_dict()
    assert sorted(got) == sorted(want)
    assert torch.equal(got["1.a.weight"], got["1.b.weight"]), "one tensor, written twice alike"
    for key in want:
        torch.testing.assert_close(got[key], want[key], rtol=0, atol=1e-9, msg=f"{key} differs")
