"""Pal et al.'s projection of data vs hybrid data-and-model parallelism ("Optimizing Multi-GPU
Parallelization Strategies for Deep Learning Training", 2019, §3): growing from N to M×N devices,
is N-way DP of M-way model-parallel workers faster end to end than M×N-way DP alone?

    SU_N   = SE_N · N · E_1/E_N              (Eq. 3; Eq. 4 at M×N)   DP only
    SU_N^M = SU^M · SE_N · N · E_1/E_N       (Eq. 5)                 hybrid
    hybrid beats DP iff SU^M > M · SE_{M×N}/SE_N · E_N/E_{M×N}        (Eq. 6)

SE_N = T_1/T_N is DP's scaling efficiency, E_N the epochs to the target accuracy at the global
batch N · mini_batch, SU^M the per-step speedup of one M-way model-parallel worker. The mini-batch
per device stays fixed (the paper's setting): the hybrid keeps N-way DP's global batch, so its
E_N; DP at M×N devices pays E_{M×N}. Pure: no I/O, no gRPC, no threads.
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from hetpipe.validate import ConfigError, Section, fail, is_number

__all__ = ["EpochCurve", "Inputs", "Recommendation", "Scaling", "hybrid_over_dp", "parse_inputs", "project",
           "recommend", "su_dp", "su_hybrid"]


def _positive_int(key: str, value: Any, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise fail(key, value, f"an integer >= {minimum}")
    return value


def _positive(key: str, value: Any) -> float:
    if not is_number(value) or value <= 0:
        raise fail(key, value, "a finite number > 0")
    return float(value)


@dataclass(frozen=True, slots=True)
class EpochCurve:
    """E(B): epochs to the target accuracy at global batch B (§4.2, Figure 4), from measured
    points. Between two points, linear in log2(B): batches double with the device count, so each
    doubling of the devices is one straight segment. A batch outside the points is refused, never
    extrapolated: the paper's point is that E grows sharply past some batch."""

    points: Mapping[int, float]  # global batch -> epochs

    def __post_init__(self) -> None:
        if not isinstance(self.points, Mapping) or not self.points:
            raise fail("epochs", self.points, "a mapping of global batch -> epochs with at least one point")
        for batch, epochs in self.points.items():
            _positive_int(f"epochs.{batch}", batch)
            _positive(f"epochs.{batch}", epochs)

    def epochs(self, batch: int, *, source: str = "") -> float:
        """E at this global batch; `source` says where the batch comes from, for the message."""
        batches = sorted(self.points)
        if batch in self.points:
            return float(self.points[batch])
        if not batches[0] < batch < batches[-1]:
            raise ConfigError(f"epochs: no epoch count for global batch {batch}{source}: the points cover "
                              f"{batches[0]}..{batches[-1]}, and the projection does not extrapolate")
        hi = bisect.bisect(batches, batch)
        b0, b1 = batches[hi - 1], batches[hi]
        e0, e1 = self.points[b0], self.points[b1]
        t = (math.log2(batch) - math.log2(b0)) / (math.log2(b1) - math.log2(b0))
        return e0 + t * (e1 - e0)


@dataclass(frozen=True, slots=True)
class Scaling:
    """SE_N = T_1/T_N of N-way DP (§3.1), per device count N; `uniform` for every N not listed
    (§4.3 assumes SE_N = 1 throughout). SE_1 is 1 by definition."""

    se: Mapping[int, float] = field(default_factory=dict)
    uniform: float | None = None

    def __post_init__(self) -> None:
        for n, value in self.se.items():
            _positive_int(f"se.{n}", n)
            if not is_number(value) or not 0 < value <= 1:
                raise fail(f"se.{n}", value, "a number in (0, 1]: T_1/T_N, which communication only lowers")
        if self.uniform is not None and (not is_number(self.uniform) or not 0 < self.uniform <= 1):
            raise fail("se", self.uniform, "a number in (0, 1]: T_1/T_N, which communication only lowers")

    def at(self, n: int) -> float:
        """SE_N."""
        if n in self.se:
            return float(self.se[n])
        if n == 1:
            return 1.0
        if self.uniform is None:
            raise ConfigError(f"se: no scaling efficiency for N = {n} devices (give se.{n} or speedup.{n}, "
                              f"or one se for every N)")
        return self.uniform


@dataclass(frozen=True, slots=True)
class Inputs:
    """What the projection needs (§4): the mini-batch per device, SE_N, E(B), SU^M per M, and the
    device counts M×N to project."""

    mini_batch: int
    scaling: Scaling
    epochs: EpochCurve
    su_mp: Mapping[int, float]  # M -> SU^M, the per-step speedup of an M-way model-parallel worker
    devices: tuple[int, ...] = ()
    model: str = ""

    def __post_init__(self) -> None:
        _positive_int("mini_batch", self.mini_batch)
        for m, su in self.su_mp.items():
            _positive_int(f"su_mp.{m}", m, minimum=2)
            _positive(f"su_mp.{m}", su)
        for i, n in enumerate(self.devices):
            _positive_int(f"devices[{i}]", n, minimum=2)

    def e(self, n: int) -> float:
        """E_N: epochs at N-way DP's global batch."""
        # The message names where the batch comes from: a missing E_1 is the usual surprise.
        return self.epochs.epochs(n * self.mini_batch, source=f" ({n} device{'s' * (n != 1)} x mini_batch {self.mini_batch})")

    def su_m(self, m: int) -> float:
        """SU^M."""
        if m not in self.su_mp:
            raise ConfigError(f"su_mp: no model-parallel speedup for M = {m} (given for M in "
                              f"{sorted(self.su_mp) or 'none'})")
        return float(self.su_mp[m])


def su_dp(inputs: Inputs, n: int) -> float:
    """SU_N = SE_N · N · E_1/E_N (Eq. 3): N-way DP over one device, end to end."""
    return inputs.scaling.at(n) * n * inputs.e(1) / inputs.e(n)


def su_hybrid(inputs: Inputs, n: int, m: int) -> float:
    """SU_N^M = SU^M · SE_N · N · E_1/E_N (Eq. 5): N-way DP of M-way MP workers on M×N devices."""
    return inputs.su_m(m) * su_dp(inputs, n)


def hybrid_over_dp(inputs: Inputs, n: int, m: int) -> float:
    """SU_N^M / SU_{M×N} = SU^M/M · SE_N/SE_{M×N} · E_{M×N}/E_N (Eq. 6 as a ratio; > 1: the hybrid
    wins). E_1 cancels, so this needs no epoch count at one device."""
    scaling = inputs.scaling
    return (inputs.su_m(m) / m * scaling.at(n) / scaling.at(m * n)
            * inputs.e(m * n) / inputs.e(n))


@dataclass(frozen=True, slots=True)
class Recommendation:
    """Growing from N to M×N devices: both speedups over one device and the better strategy."""

    n: int
    m: int
    su_dp: float      # SU_{M×N}, DP only on all M×N devices
    su_hybrid: float  # SU_N^M
    ratio: float      # su_hybrid / su_dp

    @property
    def devices(self) -> int:
        return self.m * self.n

    @property
    def strategy(self) -> str:
        # A tie goes to DP: the hybrid must be strictly faster to be worth splitting the model.
        if self.ratio > 1:
            return f"hybrid: {self.n}-way DP x {self.m}-way MP"
        return f"DP: {self.devices}-way"


def recommend(inputs: Inputs, n: int, m: int) -> Recommendation:
    """DP alone or the hybrid, for growing from N to M×N devices."""
    _positive_int("n", n)
    _positive_int("m", m, minimum=2)
    return Recommendation(n=n, m=m, su_dp=su_dp(inputs, m * n), su_hybrid=su_hybrid(inputs, n, m),
                          ratio=hybrid_over_dp(inputs, n, m))


def project(inputs: Inputs) -> list[Recommendation]:
    """A recommendation for every device count in inputs.devices and every M in su_mp that divides it."""
    if not inputs.su_mp:
        raise ConfigError("su_mp: no model-parallel speedup given (e.g. su_mp: {2: 1.32})")
    if not inputs.devices:
        raise ConfigError("devices: no device counts to project")
    rows = [recommend(inputs, total // m, m) for total in inputs.devices for m in sorted(inputs.su_mp)
            if total % m == 0]
    if not rows:
        raise ConfigError(f"devices: none of {list(inputs.devices)} is a multiple of an M in su_mp "
                          f"({', '.join(map(str, sorted(inputs.su_mp)))})")
    return rows


def _int_keyed(key: str, raw: Any) -> dict[int, Any]:
    if not isinstance(raw, Mapping):
        raise fail(key, raw, "a mapping with integer keys")
    for k in raw:
        if isinstance(k, bool) or not isinstance(k, int):
            raise fail(f"{key}.{k}", k, "an integer key")
    return dict(raw)


def parse_inputs(raw: Any) -> Inputs:
    """Inputs from a projection file's mapping, e.g. examples/projection-inception-v3.yaml.

    Keys: model (a name), mini_batch, devices (M×N counts to project), se (one number for every N,
    or N -> SE_N), speedup (N -> measured per-step speedup of N devices over one, N · SE_N),
    epochs (global batch -> epochs), su_mp (M -> SU^M; may be left out if the caller supplies it).
    Raises ConfigError naming the key, the value and what was expected."""
    known = ("model", "mini_batch", "devices", "se", "speedup", "epochs", "su_mp")
    if not isinstance(raw, Mapping):
        raise fail("projection file", raw, "a mapping with keys " + ", ".join(known))
    Section(raw, "").check_known(known)
    for key in ("mini_batch", "devices", "epochs"):
        if key not in raw:
            raise ConfigError(f"{key}: missing")
    if "se" not in raw and "speedup" not in raw:
        raise ConfigError("se: missing (one scaling efficiency for every N, N -> SE_N, or speedup: N -> N·SE_N)")
    devices = raw["devices"]
    if not isinstance(devices, list) or not devices:
        raise fail("devices", devices, "a non-empty list of device counts")
    se_raw = raw.get("se")
    uniform: Any = None
    per_n: dict[int, float] = {}
    if isinstance(se_raw, Mapping):
        per_n = _int_keyed("se", se_raw)
    else:
        uniform = se_raw  # Scaling checks it
    for n, speedup in _int_keyed("speedup", raw.get("speedup") or {}).items():
        _positive_int(f"speedup.{n}", n)
        if n in per_n:
            raise ConfigError(f"speedup.{n}: N = {n} also has se.{n}; give one of them")
        if not is_number(speedup) or not 0 < speedup <= n:
            raise fail(f"speedup.{n}", speedup, f"a number in (0, {n}]: N·SE_N, at most N")
        per_n[n] = speedup / n
    model = raw.get("model", "")
    if not isinstance(model, str):
        raise fail("model", model, "a name")
    return Inputs(
        mini_batch=raw["mini_batch"], scaling=Scaling(se=per_n, uniform=uniform),
        epochs=EpochCurve(_int_keyed("epochs", raw["epochs"])),
        su_mp=_int_keyed("su_mp", raw.get("su_mp") or {}), devices=tuple(devices), model=model,
    )
