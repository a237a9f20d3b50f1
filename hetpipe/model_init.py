"""model.init: a job's initial weights read from a file (safetensors, the index of a sharded
safetensors model, or a plain state_dict loaded with weights_only), one tensor at a time, so that
a stage reads only its own layers and the launcher checks the file without holding the model."""

from __future__ import annotations

import contextlib
import pickle
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from hetpipe import outputs
from hetpipe.config import JobConfig
from hetpipe.errors import first_line
from hetpipe.validate import ConfigError


def initialise(job: JobConfig, layers: nn.Sequential) -> None:
    """Copies model.init's values for these layers (keys as in the whole model) into them."""
    initialise_from(layers, load_init(job, list(layers.state_dict())), "model.init")


class _InitFile:
    """model.init, read one tensor at a time: a safetensors file, or a state_dict (memory-mapped)."""

    def __init__(self, path: Path, reader: Any) -> None:
        self.path, self._reader = path, reader
        self.keys: set[str] = set(reader.keys())

    def shape(self, key: str) -> tuple[int, ...]:
        if isinstance(self._reader, Mapping):
            return tuple(self.tensor(key).shape)
        return tuple(self._reader.get_slice(key).get_shape())

    def tensor(self, key: str) -> torch.Tensor:
        if not isinstance(self._reader, Mapping):
            return self._reader.get_tensor(key)  # type: ignore[no-any-return]
        value = self._reader[key]
        if not isinstance(value, torch.Tensor):
            raise ConfigError(f"model.init: {self.path}: {key} is a {type(value).__name__}, not a tensor")
        return value

    def lacking(self, keys: list[str]) -> None:
        missing = [k for k in keys if k not in self.keys]
        if missing:
            held = sorted(self.keys)
            hint = (": its keys start with 'module.', as a DistributedDataParallel model's state_dict does; save "
                    "the wrapped model's (model.module.state_dict())" if held and all(k.startswith("module.") for k in held)
                    else f" (it holds {held[:5]}{', ...' if len(held) > 5 else ''})")
            raise ConfigError(f"model.init: {self.path} lacks {missing[:5]}{hint}")


class _Sharded:
    """A sharded safetensors model, opened by its index (a run's model.safetensors.index.json),
    read as one safetensors file: each key from the file the index names for it."""

    def __init__(self, index: Path, stack: contextlib.ExitStack) -> None:
        from safetensors import safe_open

        weight_map = outputs.read_weight_map(index)
        names = sorted(set(weight_map.values()))
        for name in names:
            if not (index.parent / name).is_file():
                raise ConfigError(f"model.init: {index.parent / name}, which the index {index.name} names, does not exist")
        files = {name: stack.enter_context(safe_open(str(index.parent / name), framework="pt")) for name in names}
        held = {name: set(f.keys()) for name, f in files.items()}
        for key, name in weight_map.items():
            if key not in held[name]:   # else safetensors' own error, raised where nothing names the index
                raise ConfigError(f"model.init: the index {index.name} puts {key} in {name}, which does not hold it")
        self._where = {key: files[name] for key, name in weight_map.items()}

    def keys(self) -> Iterator[str]:
        return iter(self._where)

    def get_slice(self, key: str) -> Any:
        return self._where[key].get_slice(key)

    def get_tensor(self, key: str) -> torch.Tensor:
        return self._where[key].get_tensor(key)  # type: ignore[no-any-return]


@contextlib.contextmanager
def _open_init(job: JobConfig) -> Iterator[_InitFile]:
    """ConfigError names a missing file or one that is not a weights file."""
    assert job.model.init is not None
    path = Path(job.resolve(job.model.init))
    with contextlib.ExitStack() as stack:
        try:
            if path.name.endswith(outputs.INDEX_SUFFIX):   # a model written in several files
                reader: Any = _Sharded(path, stack)
            elif path.suffix == ".safetensors":
                from safetensors import safe_open

                reader = stack.enter_context(safe_open(str(path), framework="pt"))
            else:
                reader = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except FileNotFoundError:
            raise ConfigError(f"model.init: {path} does not exist") from None
        except ConfigError:
            raise
        except pickle.UnpicklingError:   # torch's own text says to load it with weights_only=False: not here
            raise ConfigError(f"model.init: {path} holds pickled objects besides tensors (a whole module, an "
                              "optimizer?), which are never loaded: save model.state_dict() with torch.save, or "
                              "safetensors") from None
        except Exception as exc:  # not a weights file: truncated, another format, ...
            raise ConfigError(f"model.init: {path} is not a safetensors file, the index of several, or a plain "
                              f"state_dict: {first_line(exc) or type(exc).__name__}") from None
        if not isinstance(reader, (Mapping, _Sharded)) and path.suffix != ".safetensors":
            raise ConfigError(f"model.init: {path} holds a {type(reader).__name__}, expected a state_dict")
        yield _InitFile(path, reader)


def load_init(job: JobConfig, keys: list[str]) -> dict[str, torch.Tensor]:
    """The named tensors of model.init (safetensors, or a state_dict saved with torch.save), read
    one at a time: only these keys are loaded. ConfigError names a missing key or a bad file."""
    with _open_init(job) as f:
        f.lacking(keys)
        return {k: f.tensor(k) for k in keys}


def check_init(job: JobConfig, model: nn.Sequential) -> None:
    """What the stages would find reading model.init, found before any process starts: every key
    of the model's state_dict there, of its shape, and finite. ConfigError names the file and the
    key. One tensor in memory at a time: the launcher never holds the model."""
    own = model.state_dict(keep_vars=True)  # the structure's: meta parameters, real buffers
    with _open_init(job) as f:
        f.lacking(list(own))
        for key, value in own.items():
            if f.shape(key) != tuple(value.shape):
                raise ConfigError(f"model.init: {f.path}: {key} has shape {list(f.shape(key))}, the model "
                                  f"{list(value.shape)}")
        dtype = getattr(torch, job.train.dtype)
        for key, value in own.items():
            tensor = f.tensor(key)
            if tensor.is_floating_point():
                _check_finite(f"model.init: {f.path}", key, tensor, dtype if value.is_floating_point() else tensor.dtype)


def _finite(tensor: torch.Tensor, dtype: torch.dtype | None = None, slice_elements: int = 1 << 22) -> bool:
    """Whether every element is finite, and stays finite once cast to dtype (float64 values past
    float32's range become Inf in a float32 stage), read in slices (a small temporary, whatever the size)."""
    flat = tensor.reshape(-1)
    limit = torch.finfo(dtype if dtype is not None and dtype.is_floating_point else tensor.dtype).max
    return all(bool((flat[i:i + slice_elements].abs() <= limit).all()) for i in range(0, flat.numel(), slice_elements))


def _check_finite(where: str, key: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
    """ConfigError for NaN or Inf in tensor, or values that dtype (the stage's) turns into Inf."""
    if _finite(tensor, dtype):
        return
    if not _finite(tensor):
        raise ConfigError(f"{where}: {key} holds NaN or Inf")
    raise ConfigError(f"{where}: {key} holds values past {str(dtype).removeprefix('torch.')}'s largest "
                      f"finite value (train.dtype): they would train as Inf")


def initialise_from(layers: nn.Sequential, values: Mapping[str, torch.Tensor], where: str) -> None:
    """Copies model.init's values into layers (keys, shapes and finiteness checked first)."""
    own = layers.state_dict()
    for key, value in values.items():
        if key not in own:
            raise ConfigError(f"{where}: {key} is not a key of these layers")
        if tuple(value.shape) != tuple(own[key].shape):
            raise ConfigError(f"{where}: {key} has shape {list(value.shape)}, the model {list(own[key].shape)}")
        if value.is_floating_point():
            _check_finite(where, key, value, own[key].dtype if own[key].is_floating_point() else value.dtype)
    with torch.no_grad():
        for key, value in values.items():
            own[key].copy_(value)
