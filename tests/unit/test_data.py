"""The DESIGN §8 data order and its readers (hetpipe/data.py), a factory's datasets and their
draws, the held-out split, and the check of the data against the model (hetpipe/data_check.py)."""

from __future__ import annotations

import random
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from conftest import BASE_JOB, deep_update, npz_job
from hetpipe.config import ConfigError, JobConfig, parse_job, with_overrides
from hetpipe import data_check
from hetpipe.optim import IGNORED_LABEL
from hetpipe.data import Minibatches, eval_batches, minibatch_rows, read_rows
from hetpipe.datasets import ArrayDataset, held_out_set, training_set
from hetpipe.draws import EVAL_DRAW
from hetpipe.data_check import check
from hetpipe.reference import minibatch


def rows(p: int, vw: int, *, n_vw: int, b: int, n: int, shuffle: bool = False, seed: int = 0) -> list[int]:
    out = minibatch_rows(p, vw, virtual_workers=n_vw, batch_size=b, rows=n, shuffle=shuffle, seed=seed)
    assert out.dtype == np.int64 and out.shape == (b,)
    return out.tolist()


# ---- order without shuffle -------------------------------------------------------------------


def test_one_vw_reads_consecutive_batches() -> None:
    assert rows(1, 0, n_vw=1, b=4, n=100) == [0, 1, 2, 3]
    assert rows(2, 0, n_vw=1, b=4, n=100) == [4, 5, 6, 7]
    assert rows(25, 0, n_vw=1, b=4, n=100) == [96, 97, 98, 99]
    assert rows(26, 0, n_vw=1, b=4, n=100) == [0, 1, 2, 3], "the next epoch starts over"


def test_vws_interleave_global_batches_and_wrap() -> None:
    # N=2, B=3, n=10: j = (p-1)*2 + v takes rows 3j .. 3j+2 mod 10.
    assert rows(1, 0, n_vw=2, b=3, n=10) == [0, 1, 2]      # j=0
    assert rows(1, 1, n_vw=2, b=3, n=10) == [3, 4, 5]      # j=1
    assert rows(2, 0, n_vw=2, b=3, n=10) == [6, 7, 8]      # j=2
    assert rows(2, 1, n_vw=2, b=3, n=10) == [9, 0, 1]      # j=3 wraps inside the batch
    assert rows(3, 0, n_vw=2, b=3, n=10) == [2, 3, 4]      # j=4: rows 12..14 mod 10
    assert rows(3, 1, n_vw=3, b=3, n=10) == [1, 2, 3]      # N=3: j=7, rows 21..23 mod 10


def test_batch_larger_than_dataset_wraps_repeatedly() -> None:
    assert rows(1, 0, n_vw=1, b=7, n=3) == [0, 1, 2, 0, 1, 2, 0]
    assert rows(2, 0, n_vw=1, b=7, n=3) == [1, 2, 0, 1, 2, 0, 1]


@settings(max_examples=200, deadline=None)
@given(n_vw=st.integers(1, 4), b=st.integers(1, 9), n=st.integers(1, 40), p=st.integers(1, 30), data=st.data())
def test_order_formula(n_vw: int, b: int, n: int, p: int, data: st.DataObject) -> None:
    vw = data.draw(st.integers(0, n_vw - 1))
    j = (p - 1) * n_vw + vw
    assert rows(p, vw, n_vw=n_vw, b=b, n=n) == [r % n for r in range(j * b, (j + 1) * b)]


@pytest.mark.parametrize(("p", "vw", "n_vw"), [(0, 0, 1), (-1, 0, 2), (1, 2, 2), (1, -1, 2)])
def test_minibatch_outside_the_job(p: int, vw: int, n_vw: int) -> None:
    with pytest.raises(ValueError, match=f"minibatch {p} of vw {vw}"):
        minibatch_rows(p, vw, virtual_workers=n_vw, batch_size=4, rows=10, shuffle=False, seed=0)


# ---- shuffle ---------------------------------------------------------------------------------


def global_stream(n_vw: int, b: int, n: int, steps: int, seed: int, shuffle: bool = True) -> list[int]:
    """Every VW's minibatches in global batch order j = 0, 1, ..."""
    out: list[int] = []
    for p in range(1, steps + 1):
        for vw in range(n_vw):
            out += rows(p, vw, n_vw=n_vw, b=b, n=n, shuffle=shuffle, seed=seed)
    return out


@settings(max_examples=150, deadline=None)
@given(n_vw=st.integers(1, 3), b=st.integers(1, 8), n=st.integers(1, 30), seed=st.integers(0, 2**32 - 1))
def test_shuffle_is_a_permutation_per_epoch(n_vw: int, b: int, n: int, seed: int) -> None:
    steps = -(-3 * n // (n_vw * b))  # at least three epochs
    stream = global_stream(n_vw, b, n, steps, seed)
    for e in range(3):
        epoch = stream[e * n:(e + 1) * n]
        assert sorted(epoch) == list(range(n)), f"epoch {e} reads every row exactly once"
    assert stream == global_stream(n_vw, b, n, steps, seed), "deterministic per seed"


def test_shuffle_with_batches_dividing_the_dataset() -> None:
    # n a multiple of B: each epoch is a whole number of minibatches covering each row once.
    n, b = 48, 8
    per_epoch = n // b
    batches = [rows(p, 0, n_vw=1, b=b, n=n, shuffle=True, seed=5) for p in range(1, 3 * per_epoch + 1)]
    epochs = [sum(batches[e * per_epoch:(e + 1) * per_epoch], []) for e in range(3)]
    for epoch in epochs:
        assert sorted(epoch) == list(range(n))
    assert epochs[0] != list(range(n)), "shuffled, not the plain order"
    assert epochs[0] != epochs[1], "each epoch has its own permutation"


def test_shuffle_depends_on_seed_and_off_means_plain_order() -> None:
    a = global_stream(2, 4, 32, 8, seed=0)
    assert a != global_stream(2, 4, 32, 8, seed=1)
    assert global_stream(2, 4, 32, 8, seed=0, shuffle=False) == list(range(32)) * 2


# ---- user datasets, the held-out split, and the readers -----------------------------------------


DATA_MODULE = """
import torch
from torch.utils.data import Dataset

class Squares(Dataset):
    def __init__(self, rows):
        self.rows = rows
    def __len__(self):
        return self.rows
    def __getitem__(self, i):
        return torch.tensor([float(i), float(i) ** 2]), torch.tensor(i % 3)

def train_set(rows=20):
    return Squares(rows)

def not_a_dataset(rows=20):
    return [1, 2, 3]


def broken(rows=20):
    raise RuntimeError("disk on fire")


def exits(rows=20):
    raise SystemExit(0)


class Items(torch.utils.data.Dataset):
    def __init__(self, item, rows=20):
        self.item, self.rows = item, rows

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        return self.item


def pairs_of_inputs(rows=20):
    return Items(((torch.zeros(4), torch.ones(4)), 1))


def list_inputs(rows=20):
    return Items(([0.0, 1.0, 2.0, 3.0], 1))


def string_targets(rows=20):
    return Items((torch.zeros(4), "cat"))


def negative_length(rows=20):
    return Items((torch.zeros(4), 1), rows=-1)


class Augmented(torch.utils.data.Dataset):
    # Each read draws: the target from torch, the input's noise from numpy and Python (mixup-like).
    def __init__(self, rows=20):
        self.rows = rows

    def __len__(self):
        return self.rows

    def __getitem__(self, i):
        import random
        import numpy as np
        y = int(torch.randint(0, 3, ()))
        return torch.tensor([float(y), float(np.random.rand()), random.random(), float(i)]), y


def augmented(rows=20):
    return Augmented(rows)


def with_a_lambda(rows=20):
    squares = Squares(rows)
    squares.square = lambda v: v * v
    return squares


def shuffled(rows=20):
    # Rows in an order drawn as the dataset is built, from all three global generators.
    import random
    import numpy as np
    order = [int(i) for i in torch.randperm(rows)]
    random.shuffle(order)
    order = [order[i] for i in np.random.permutation(rows)]
    return [(torch.tensor([float(i), 0.0, 0.0, 0.0]), i % 3) for i in order]
"""


def factory_job(tmp_path: Path, **data: Any) -> JobConfig:
    (tmp_path / "mydata.py").write_text(DATA_MODULE)
    raw = {"model": {"name": "mlp"}, "data": {"factory": "mydata:train_set", "args": {"rows": 20},
                                              "batch_size": 4, **data},
           **({"eval": {"every": 0}} if data.get("eval_fraction") or data.get("eval_factory") else {})}   # for an eval
    return parse_job(raw, base_dir=str(tmp_path))


def test_a_data_factory_is_read_in_the_design_order(tmp_path: Path) -> None:
    job = factory_job(tmp_path)
    dataset = training_set(job)
    x, y = minibatch(job, dataset, 2, 0)  # rows 4..7
    assert x.dtype == torch.float32 and x[:, 0].tolist() == [4.0, 5.0, 6.0, 7.0]
    assert y.tolist() == [1, 2, 0, 1]
    reader = Minibatches(job, dataset, 0, steps=3)
    for p in (1, 2, 3):
        rx, ry = reader.next()
        ex, ey = minibatch(job, dataset, p, 0)
        assert torch.equal(rx, ex) and torch.equal(ry, ey)


def test_a_factory_that_draws_as_it_builds_builds_the_same_rows_in_every_process(tmp_path: Path) -> None:
    """Each stage builds the dataset itself, its generators in whatever state its own work left
    them: a factory that shuffles or splits its rows as it builds them builds the same in each
    (stage 0's inputs, the last stage's targets), and leaves the generators as they were."""
    job = factory_job(tmp_path, factory="mydata:shuffled", eval_factory="mydata:shuffled")
    built = []
    for seed in (1, 2):
        torch.manual_seed(seed)
        np.random.seed(seed)
        random.seed(seed)
        states = torch.get_rng_state(), np.random.get_state()[1].copy(), random.getstate()
        built.append([training_set(job)[i] for i in range(20)] + [held_out_set(job)[i] for i in range(20)])
        assert torch.equal(torch.get_rng_state(), states[0]) and (np.random.get_state()[1] == states[1]).all()
        assert random.getstate() == states[2]
    assert all(torch.equal(torch.as_tensor(a[0]), torch.as_tensor(b[0])) and a[1] == b[1] for a, b in zip(*built))
    assert [float(x[0]) for x, _ in built[0][:20]] != sorted(float(x[0]) for x, _ in built[0][:20]), "not shuffled"


@pytest.mark.parametrize("workers", [0, 1])
def test_a_datasets_random_draws_are_the_same_for_stage_0_and_the_last_stage(tmp_path: Path, workers: int,
                                                                              request: pytest.FixtureRequest) -> None:
    """Stage 0 reads a minibatch's inputs and the last stage its targets, each on its own: a
    dataset that draws at random (an augmentation) must draw the same for both, whatever else
    used the generators in between (a dropout on stage 0), and the same again on --resume, or
    inputs train against other draws' targets. Evaluation minibatches too. The generators are
    left as they were."""
    if workers:
        request.getfixturevalue("host_wide")   # DataLoader workers make semaphores, which test_data_workers counts
    job = factory_job(tmp_path, factory="mydata:augmented", workers=workers, eval_fraction=0.25)
    train = training_set(job)
    first, last = (Minibatches(job, train, 0, steps=4) for _ in range(2))
    resumed = Minibatches(job, train, 0, steps=4, start=3)
    torch.manual_seed(5)
    for p in range(1, 5):
        x, _ = first.next()
        torch.rand(7)                                            # stage 0's dropout
        _, y = last.next()
        assert torch.equal(x[:, 0], y.float()), f"minibatch {p}: inputs drawn against other targets"
        if p >= 3:
            assert torch.equal(resumed.next()[0], x), f"minibatch {p} drawn otherwise after --resume"
        assert torch.equal(x, minibatch(job, train, p, 0)[0]), "the reference reads other draws"
    after = torch.get_rng_state()
    for reader in (first, last, resumed):
        reader.close()
    torch.manual_seed(5)
    for _ in range(4):
        torch.rand(7)
    assert torch.equal(after, torch.get_rng_state()), "reading moved torch's global generator"
    held = held_out_set(job)
    assert held is not None
    ex, _ = read_rows(job, held, [0, 1, 2], (EVAL_DRAW, 1))
    torch.rand(3)
    _, ey = read_rows(job, held, [0, 1, 2], (EVAL_DRAW, 1))
    assert torch.equal(ex[:, 0], ey.float()), "an evaluation's inputs drawn against other targets"
    unseeded = [read_rows(job, held, [0, 1, 2])[1] for _ in range(8)]
    assert any(not torch.equal(unseeded[0], u) for u in unseeded), "the dataset draws: the test means something"


def test_a_seeded_read_leaves_the_gpus_generators_alone(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """torch.manual_seed would reseed every GPU's generator too, and nothing would put it back: a
    stage's dropout on a GPU would restart from the minibatch's seed each time."""
    job = factory_job(tmp_path, factory="mydata:augmented")
    reseeded: list[int] = []
    monkeypatch.setattr(torch.cuda, "manual_seed_all", reseeded.append)
    reader = Minibatches(job, training_set(job), 0, steps=2)
    reader.next()
    reader.close()
    assert reseeded == []


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_minibatches_for_a_gpu_stage_arrive_in_pinned_memory(tmp_path: Path) -> None:
    job = factory_job(tmp_path)
    x, y = Minibatches(job, training_set(job), 0, steps=3, pin=True).next()
    assert x.is_pinned() and y.is_pinned()
    # float64 rows, cast to float32 after the loader pinned them: pinned again.
    rows = ArrayDataset(np.random.default_rng(0).random((64, 4)), np.zeros(64, dtype=np.int64))
    x, y = Minibatches(job, rows, 0, steps=3, pin=True).next()
    assert x.dtype == torch.float32 and x.is_pinned() and y.is_pinned()


def test_reading_minibatches_draws_nothing_from_torchs_global_generator(tmp_path: Path) -> None:
    # Stage 0 opens its data while another stage of the process may be initialising its layers
    # under a seed of the global generator: one draw there and that layer starts elsewhere.
    job = factory_job(tmp_path)
    torch.manual_seed(11)
    before = torch.get_rng_state()
    reader = Minibatches(job, training_set(job), 0, steps=3)
    reader.next()
    assert torch.equal(torch.get_rng_state(), before)


@pytest.mark.parametrize(("spec", "match"), [
    ("nowhere:train_set", r"data\.factory: cannot import module 'nowhere'"),
    ("mydata:missing", r"data\.factory: module 'mydata' has no attribute 'missing'"),
    ("mydata:not_a_dataset", r"data\.factory: mydata:not_a_dataset's items are ints, expected \(input, target\)"),
    ("mydata:broken", r"data\.factory: mydata:broken\(\*\*data\.args\) failed: RuntimeError: disk on fire"),
    ("mydata:exits", r"data\.factory: mydata:exits\(\*\*data\.args\) failed: SystemExit: 0"),
    ("mydata:pairs_of_inputs", r"data\.factory: mydata:pairs_of_inputs's inputs are tuples, expected one tensor"),
    ("mydata:list_inputs", r"data\.factory: mydata:list_inputs's inputs are lists, expected one tensor"),
    ("mydata:string_targets", r"data\.factory: mydata:string_targets's targets are strs, expected a tensor"),
    ("mydata:negative_length", r"data\.factory: len\(\) of mydata:negative_length's dataset failed: ValueError"),
    ("mydata", r"data\.factory: expected 'package\.module:function'"),
])
def test_bad_data_factories_say_what_is_wrong(tmp_path: Path, spec: str, match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        training_set(factory_job(tmp_path, factory=spec))
    with pytest.raises(ConfigError, match=r"data\.args: mydata:train_set: .*unexpected keyword argument 'nope'"):
        training_set(factory_job(tmp_path, args={"nope": 1}))


def test_eval_fraction_holds_out_the_same_rows_every_time(tmp_path: Path) -> None:
    job = factory_job(tmp_path, eval_fraction=0.25)
    train, held = training_set(job), held_out_set(job)
    assert held is not None and (len(train), len(held)) == (15, 5)
    rows = lambda ds: {int(ds[i][0][0]) for i in range(len(ds))}  # noqa: E731
    assert rows(train).isdisjoint(rows(held)) and rows(train) | rows(held) == set(range(20))
    assert rows(held_out_set(factory_job(tmp_path, eval_fraction=0.25))) == rows(held)  # type: ignore[arg-type]
    assert held_out_set(factory_job(tmp_path)) is None
    # An evaluation reads whole minibatches of its first rows.
    assert eval_batches(job, held, rows=100) == [[0, 1, 2, 3]]
    # 10 held-out rows: as many whole minibatches of 4 as the rows limit and the set allow, and
    # one minibatch however few rows are asked for.
    half = factory_job(tmp_path, eval_fraction=0.5)
    wide = held_out_set(half)
    assert wide is not None and len(wide) == 10
    assert eval_batches(half, wide, rows=100) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert eval_batches(half, wide, rows=8) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert eval_batches(half, wide, rows=7) == [[0, 1, 2, 3]]
    assert eval_batches(half, wide, rows=1) == [[0, 1, 2, 3]]
    with pytest.raises(ConfigError, match="leaves none to train on"):
        training_set(factory_job(tmp_path, eval_fraction=0.9, args={"rows": 1}))


# ---- the check before any process starts (the refusals: tests/e2e/test_refused_before_start.py)


def test_the_check_accepts_what_training_takes(tmp_path: Path) -> None:
    """No false refusals: cross_entropy's ignored label (-100), tokens against per-token logits,
    and the finite rows beyond a slice of the scan."""
    x = np.zeros((6, 2))
    np.savez(tmp_path / "data.npz", x=x, y=np.array([0, 1, 2, IGNORED_LABEL, 2, 1]))
    check(npz_job(tmp_path), lambda x: (x[0][0], 3))
    with pytest.raises(ConfigError, match=r"y\[1\] is 1, not a class of the model's output \(0 to 0\)"):
        check(npz_job(tmp_path), lambda x: (x[0][0], 1))
    gpt = parse_job({"model": {"name": "gpt", "args": {"vocab": 16, "context": 4}},
                     "data": {"name": "synthetic", "batch_size": 4, "args": {"rows": 8}}})
    check(gpt, lambda x: (*x[0], 16))  # (B, T) tokens, (B, T, vocab) logits
    with pytest.raises(ConfigError, match=r"data\.name: synthetic: y\[\d+, \d+\] is \d+, not a class"):
        check(gpt, lambda x: (*x[0], 2))


def test_a_training_set_smaller_than_a_minibatch_is_warned_of(tmp_path: Path) -> None:
    np.savez(tmp_path / "data.npz", x=np.zeros((3, 2)), y=np.zeros(3, dtype=np.int64))
    assert check(npz_job(tmp_path), lambda x: (x[0][0], 3)) == [
        "data: the training set has 3 rows, fewer than one minibatch of data.batch_size 4: each minibatch reads some "
        "rows more than once"]
    np.savez(tmp_path / "data.npz", x=np.zeros((4, 2)), y=np.zeros(4, dtype=np.int64))
    assert check(npz_job(tmp_path), lambda x: (x[0][0], 3)) == []


def test_a_model_that_reads_values_is_told_it_ran_on_the_meta_device(tmp_path: Path) -> None:
    """The planner's shape-only pass has no values: a layer calling .item() fails there, and the
    refusal says so rather than leaving the data to blame."""
    np.savez(tmp_path / "data.npz", x=np.zeros((6, 2)), y=np.zeros(6, dtype=np.int64))

    def reads_values(x: tuple[tuple[int, ...], torch.dtype]) -> tuple[int, ...]:
        return (torch.empty(x[0], device="meta").sum().item(),)

    with pytest.raises(ConfigError, match=r"cannot be called on meta tensors \(the planner runs the model on the "
                                          r"meta device, shapes without values: a layer that reads values"):
        check(npz_job(tmp_path), reads_values)


def test_the_check_finds_the_first_bad_element_past_the_first_slice(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(data_check, "CHECK_SLICE_BYTES", 64)  # 4 rows of 2 float64 per slice
    x = np.zeros((40, 2))
    x[37, 1] = np.inf
    np.savez(tmp_path / "data.npz", x=x, y=np.zeros(40, dtype=np.int64))
    with pytest.raises(ConfigError, match=r"data\.path: .*data\.npz: x\[37, 1\] is inf$"):
        check(npz_job(tmp_path), lambda x: (x[0][0], 3))


def test_a_dataset_data_workers_cannot_be_sent_is_refused(tmp_path: Path) -> None:
    """The workers are spawned and get the dataset pickled: one that cannot be is refused before any
    process starts, naming data.workers, rather than failing every stage once they have."""
    with pytest.raises(ConfigError, match=r"^data\.workers: 2: data\.factory: mydata:with_a_lambda's dataset cannot "
                                          r"be pickled for its worker processes \(.*lambda.*\): .* or set data\.workers: 0$"):
        check(factory_job(tmp_path, factory="mydata:with_a_lambda", workers=2), lambda x: (x[0][0], 3))
    check(factory_job(tmp_path, factory="mydata:with_a_lambda"), lambda x: (x[0][0], 3))
    baseline = with_overrides(factory_job(tmp_path, factory="mydata:with_a_lambda", workers=2), parallel={"mode": "ddp"})
    check(baseline, lambda x: (x[0][0], 3))   # a baseline reads without workers
    # Arrays go as protocol 5's out-of-band buffers: sent, not refused.
    digits = parse_job({"model": {"name": "mlp"}, "data": {"name": "digits", "batch_size": 16, "workers": 2}})
    check(digits, lambda x: (x[0][0], 10))


def test_values_that_overflow_the_training_dtype_are_refused(tmp_path: Path) -> None:
    """Finite as stored, Inf once cast to train.dtype: the first float32 step would diverge."""
    x = np.zeros((6, 2))
    x[4, 1] = 1e39
    np.savez(tmp_path / "data.npz", x=x, y=np.zeros(6, dtype=np.int64))
    with pytest.raises(ConfigError, match=r"data\.npz: x\[4, 1\] is 1e\+39, past float32's largest finite value"):
        check(npz_job(tmp_path), lambda x: (x[0][0], 3))
    check(npz_job(tmp_path, dtype="float64"), lambda x: (x[0][0], 3))
    targets = np.zeros((6, 1))
    targets[2, 0] = -4e38
    np.savez(tmp_path / "data.npz", x=np.zeros((6, 2)), y=targets)
    with pytest.raises(ConfigError, match=r"y\[2, 0\] is -4e\+38, past float32's"):
        check(npz_job(tmp_path, loss="mse"), lambda x: (x[0][0], 1))


def test_minibatches_are_ordered_as_they_are_read_not_all_up_front() -> None:
    """A stage's reader works out each minibatch's rows when it reaches it: a job of 10**12 steps
    (an order list up front would never be built) opens at once and reads the rows DESIGN §8
    gives, shuffled through each epoch's permutation, from the minibatch it starts at."""
    raw = {"model": {"name": "mlp"}, "data": {"name": "synthetic", "args": {"rows": 10}, "batch_size": 4,
                                              "shuffle": True},
           "parallel": {"virtual_workers": 2}, "train": {"dtype": "float64", "seed": 5}}
    job = parse_job(raw)
    dataset = training_set(job)
    x_all, _ = read_rows(job, dataset, range(len(dataset)))
    reader = Minibatches(job, dataset, 1, steps=10**12, start=7)
    for p in (7, 8, 9):
        x, _ = reader.next()
        expected = minibatch_rows(p, 1, virtual_workers=2, batch_size=4, rows=10, shuffle=True, seed=5)
        assert torch.equal(x, x_all[torch.from_numpy(expected)]), p


@pytest.mark.parametrize("rows, held_out, given, note", [
    (352, 359, True, None),
    (400, 359, True, "eval.rows 400: each evaluation reads 352 held-out rows (the held-out set has 359 rows, of "
                     "data.batch_size 32)"),
    (100, 359, True, "eval.rows 100: each evaluation reads 96 held-out rows (whole minibatches, of data.batch_size 32)"),
    (1024, 359, False, None),   # the default asks for up to 1024
    (1024, 20, False, "the held-out set has 20 rows, fewer than one minibatch of data.batch_size 32: each "
                      "evaluation reads 32, some rows twice"),   # not the default eval.rows, which the user never set
    (64, 20, True, "eval.rows 64: the held-out set has 20 rows, fewer than one minibatch of data.batch_size 32: each "
                   "evaluation reads 32, some rows twice"),
])
def test_eval_rows_other_than_an_evaluation_reads_are_named(rows: int, held_out: int, given: bool, note: str | None) -> None:
    assert data_check.eval_rows_note(rows, held_out, 32, given=given) == note
    job = parse_job(deep_update(BASE_JOB, {"data": {"batch_size": 32}}))
    read = eval_batches(job, ArrayDataset(np.zeros((held_out, 1)), np.zeros(held_out)), rows)
    assert note is None or f"reads {len(read) * 32}" in note   # what the stages will read


COUNTED_MODULE = """
import torch

BUILT = []


def rows(features=2, rows=20):
    BUILT.append(("train", features))
    return [(torch.full((features,), float(i)), i % 3) for i in range(rows)]


def held(features=2, rows=20):
    BUILT.append(("held", features))
    return [(torch.full((features,), float(i)), i % 3) for i in range(rows)]
"""


def test_a_launcher_builds_each_dataset_once_for_its_checks_plan_and_driver(tmp_path: Path) -> None:
    """A factory may take minutes (a download, a tokenizer): the launcher's checks, its plan and
    its driver share one build of each set, and a job with other data.args gets its own shapes."""
    from hetpipe import data
    from hetpipe.models import resolve
    from launch.local import preflight

    (tmp_path / "counted.py").write_text(COUNTED_MODULE)
    job = parse_job({"model": {"name": "mlp", "args": {"in_features": 2, "hidden": [8]}},
                     "data": {"factory": "counted:rows", "eval_factory": "counted:held", "batch_size": 4},
                     "train": {"steps": 2}, "eval": {"every": 0}, "output": {"dir": str(tmp_path / "out")}},
                    base_dir=str(tmp_path))
    built = resolve("counted:rows", "data.factory", str(tmp_path)).__globals__["BUILT"]
    preflight(job)
    assert data.batch_shapes(job) == (((4, 2), torch.float32), ((4,), torch.int64)), "the driver's shapes"
    assert built == [("train", 2), ("held", 2)]
    other = with_overrides(job, data={"args": {"features": 3}})
    assert data.batch_shapes(other)[0] == ((4, 3), torch.float32)
    assert built[2:] == [("train", 3)]
    # The set as built now (the data check's) is read again; a coordinator's next job reads it anew.
    assert data.batch_shapes(job, [(torch.zeros(5), 1)] * 3)[0] == ((4, 5), torch.float32)
    data.forget_batch_shapes()
    assert data.batch_shapes(job)[0] == ((4, 2), torch.float32) and built[3:] == [("train", 2)]


def test_token_ids_outside_the_first_embedding_are_refused_before_the_run(tmp_path: Path) -> None:
    """Else stage 0 fails at the first minibatch holding one, with torch's "index out of range in self"."""
    job = parse_job({"model": {"name": "mlp"}, "data": {"name": "npz", "path": "tokens.npz", "batch_size": 2}},
                    base_dir=str(tmp_path))
    x = np.arange(12, dtype=np.int64).reshape(4, 3)
    np.savez(tmp_path / "tokens.npz", x=x, y=np.zeros(4, dtype=np.int64))
    output = lambda flow: (flow[0][0], 3)   # noqa: E731
    check(job, output, ids=12)
    with pytest.raises(ConfigError, match=r"x\[3, 2\] is 11, not an id the model's first layer, an nn\.Embedding "
                                          r"of 11, takes \(0 to 10\)"):
        check(job, output, ids=11)
    np.savez(tmp_path / "tokens.npz", x=x - 1, y=np.zeros(4, dtype=np.int64))
    with pytest.raises(ConfigError, match=r"x\[0, 0\] is -1, not an id"):
        check(job, output, ids=12)


def test_a_minibatch_read_ahead_is_the_one_next_returns_and_a_failed_read_raises_there(tmp_path: Path) -> None:
    """A stage reads the next minibatch while it waits for a neighbour: next() returns that one,
    in order, and a read that failed ahead fails the minibatch's own next(), not the task before."""
    class Failing(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 16

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            if i >= 8:   # minibatch 3's rows (batch_size 4)
                raise RuntimeError(f"row {i} is on a dead disk")
            return torch.full((4,), float(i)), 0

    job = factory_job(tmp_path)
    reader = Minibatches(job, Failing(), 0, steps=4)
    reader.read_ahead()
    reader.read_ahead()   # one ahead at most: this reads nothing
    assert reader.next()[0][:, 0].tolist() == [0.0, 1.0, 2.0, 3.0]
    reader.read_ahead()
    reader.read_ahead()
    assert reader.next()[0][:, 0].tolist() == [4.0, 5.0, 6.0, 7.0]
    reader.read_ahead()   # minibatch 3 fails, here quietly
    with pytest.raises(RuntimeError, match="row 8 is on a dead disk"):
        reader.next()
    reader.close()
    job = factory_job(tmp_path)
    reader = Minibatches(job, training_set(job), 0, steps=2)
    for _ in range(2):
        reader.read_ahead()
        reader.next()
    reader.read_ahead()   # none is left: nothing read, nothing raised
    with pytest.raises(StopIteration):
        reader.next()
    reader.close()


def test_a_reader_says_since_when_it_waits_for_the_dataset(tmp_path: Path) -> None:
    """A stall's report names a stage stuck reading its data (a dataset's __getitem__ that hangs)."""
    import threading

    release = threading.Event()

    class Held(torch.utils.data.Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return 8

        def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
            release.wait(10)
            return torch.zeros(4), 0

    reader = Minibatches(factory_job(tmp_path), Held(), 0, steps=2)
    assert reader.reading is None
    done = threading.Thread(target=reader.next)
    done.start()
    deadline = time.monotonic() + 5
    while reader.reading is None and time.monotonic() < deadline:
        time.sleep(0.01)
    reading = reader.reading
    assert reading is not None and reading[0] == 1 and reading[1] <= time.monotonic()
    release.set()
    done.join(10)
    assert reader.reading is None
    reader.close()


EMBEDDINGS = """
import torch
from torch import nn


class Hashed(nn.Embedding):
    # Its own forward takes any id: it hashes them into its rows first.
    def forward(self, x):
        return super().forward(x % self.num_embeddings)


def plain():
    return nn.Sequential(nn.Embedding(16, 4), nn.Flatten(), nn.Linear(12, 3))


def hashed():
    return nn.Sequential(Hashed(16, 4), nn.Flatten(), nn.Linear(12, 3))


def ids(top=100):
    return [(torch.tensor([top - 1, 1, 2]), i % 3) for i in range(8)]
"""


def test_only_torchs_own_embedding_forward_has_its_ids_checked(tmp_path: Path) -> None:
    from launch.local import checked_inputs

    (tmp_path / "emb.py").write_text(EMBEDDINGS)
    def job(model: str, top: int) -> JobConfig:
        return parse_job({"model": {"factory": f"emb:{model}"}, "data": {"factory": "emb:ids", "args": {"top": top},
                                                                       "batch_size": 2},
                          "output": {"dir": str(tmp_path / "out")}}, base_dir=str(tmp_path))
    checked_inputs(job("plain", 16))
    checked_inputs(job("hashed", 1000))
    with pytest.raises(ConfigError, match=r"x\[0, 0\] is 999, not an id the model's first layer"):
        checked_inputs(job("plain", 1000))



SEGMENTATION = """
import torch
from torch import nn


def net(classes=4):   # torch's layout: classes on dim 1
    return nn.Sequential(nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, classes, 1))


def images():
    return [(torch.randn(3, 8, 8), torch.randint(0, 4, (8, 8))) for _ in range(8)]
"""


def test_classes_on_dim_1_as_torch_has_them_are_named_with_the_way_out(tmp_path: Path) -> None:
    """cross_entropy here takes the classes last; a (B, C, H, W) model against (B, H, W) labels,
    torch's own layout, was told to reshape its labels to [4, 8], which would not help."""
    from launch.local import checked_inputs

    (tmp_path / "seg.py").write_text(SEGMENTATION)
    job = parse_job({"model": {"factory": "seg:net"}, "data": {"factory": "seg:images", "batch_size": 2},
                     "output": {"dir": str(tmp_path / "out")}}, base_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"rows of y of shape \[8, 8\], the model's output \[2, 4, 8, 8\] needs rows "
                                          r"of shape \[4, 8\] for cross_entropy \(cross_entropy takes the classes on "
                                          r"the output's last dimension, where torch's F.cross_entropy takes them on "
                                          r"dim 1: .*x.movedim\(1, -1\)\)$"):
        checked_inputs(job)


CLEANS_UP = '''
import atexit
import tempfile
from pathlib import Path

import torch


class Rows(torch.utils.data.Dataset):
    """Unpacks into a temporary folder of its own in each worker, as a dataset of archives may."""

    def __init__(self, log):
        self.log, self.unpacked = log, None

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if torch.utils.data.get_worker_info() is None:   # the check's read, in this process
            return torch.zeros(4), 0
        if self.unpacked is None:
            self.unpacked = tempfile.TemporaryDirectory()
            atexit.register(lambda: Path(self.log, f"exit-{Path(self.unpacked.name).name}").touch())
            with open(Path(self.log, "unpacked"), "a") as f:
                f.write(self.unpacked.name + "\\n")
        return torch.zeros(4), 0


def rows(log):
    return Rows(log)
'''


def test_a_data_worker_runs_its_exit_handlers(tmp_path: Path, request: pytest.FixtureRequest) -> None:
    """data.workers' processes skip torch's teardown (seconds, under load, that close waited for)
    but not the dataset's own exit handlers and finalizers."""
    request.getfixturevalue("host_wide")   # DataLoader workers make semaphores, which test_data_workers counts
    (tmp_path / "cleans_up.py").write_text(CLEANS_UP)
    log = tmp_path / "log"
    log.mkdir()
    job = parse_job({"model": {"name": "mlp"}, "data": {"factory": "cleans_up:rows", "batch_size": 2, "workers": 2,
                                                        "args": {"log": str(log)}}}, base_dir=str(tmp_path))
    reader = Minibatches(job, training_set(job), 0, steps=4)
    for _ in range(4):
        reader.next()
    reader.close()
    unpacked = (log / "unpacked").read_text().split()
    assert len(unpacked) == 2, "each worker unpacked once"
    assert not any(Path(u).exists() for u in unpacked), "a worker's temporary folder outlived it"
    assert sorted(p.name for p in log.glob("exit-*")) == sorted(f"exit-{Path(u).name}" for u in unpacked)


FLAT_OUTPUT = '''
import torch
from torch import nn


def net():
    return nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1), nn.Flatten(0))


def rows():
    return torch.utils.data.TensorDataset(torch.randn(32, 4), torch.randint(0, 3, (32,)))
'''


def test_cross_entropy_on_an_output_without_a_class_dimension_is_refused(tmp_path: Path) -> None:
    """An output of shape [B]: its last dimension is the batch, which the label check took for the
    classes (labels below B passed), and the last stage failed at minibatch 1."""
    from launch.local import checked_inputs

    (tmp_path / "flat.py").write_text(FLAT_OUTPUT)
    job = parse_job({"model": {"factory": "flat:net"}, "data": {"factory": "flat:rows", "batch_size": 8},
                     "output": {"dir": str(tmp_path / "out")}}, base_dir=str(tmp_path))
    with pytest.raises(ConfigError, match=r"the model's output \[8\] has no class dimension; cross_entropy takes"):
        checked_inputs(job)
