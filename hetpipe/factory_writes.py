"""Whether a model factory does what a stage's own build would lose: each stage gives its layers
memory and initialises them with their modules' reset methods alone, so a factory's own writes to
its parameters (an nn.init loop, a load_state_dict) and parameters tied across layers would be
silently dropped. Seen while the factory runs on the meta device, by a dispatch mode (and the
nn.init calls that skip a meta tensor, by a function mode): at plan time only (a process's first
dispatch mode imports about 300 modules, 0.75 s here)."""

from __future__ import annotations

import sys
from types import FrameType
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from hetpipe.validate import ConfigError


def reset_of(module: nn.Module) -> Any:
    """The method a stage calls to initialise module (models._reset), None where it has none."""
    return getattr(module, "reset_parameters", None) or getattr(module, "_reset_parameters", None)


def _in_reset(frame: FrameType | None) -> bool:
    """Whether frame runs inside a module's reset method, the one models._reset calls (a factory's own
    function of that name is not one: its writes would be lost as well)."""
    while frame is not None:
        owner = frame.f_locals.get("self") if frame.f_code.co_name in ("reset_parameters", "_reset_parameters") else None
        reset = reset_of(owner) if isinstance(owner, nn.Module) else None
        if reset is not None and getattr(reset, "__code__", None) is frame.f_code:
            return True
        frame = frame.f_back
    return False


_INIT_FILE = torch.nn.init.__file__
_IS_META = torch.Tensor.is_meta   # the property: a mode is called with its __get__, made anew each time


class _InitsSkipped(TorchFunctionMode):
    """Records the nn.init calls that write nothing on the meta device, so no dispatch mode sees
    them (trunc_normal_, orthogonal_, sparse_ and dirac_ ask is_meta and return): a stage would
    lose them as any other write. Seen as their question, asked from torch.nn.init's own file."""

    def __init__(self, writes: list[tuple[str, Any]]) -> None:
        super().__init__()
        self.writes = writes

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        target = args[0] if args else None
        if getattr(func, "__self__", None) is _IS_META and isinstance(target, torch.Tensor) \
                and target.device.type == "meta":
            frame = sys._getframe(1)
            if frame.f_code.co_filename == _INIT_FILE and not _in_reset(frame):
                while frame.f_back is not None and frame.f_back.f_code.co_filename == _INIT_FILE:
                    frame = frame.f_back   # trunc_normal_, not its helper _no_grad_trunc_normal_
                self.writes.append((frame.f_code.co_name, target.untyped_storage()))
        return func(*args, **(kwargs or {}))


class FactoryWrites(TorchDispatchMode):
    """Records each write to a meta tensor that no module's reset method makes while the factory
    runs (the tensors written, held so that their storage is not reused): where they are the
    model's parameters, an initialisation of the factory's own (nn.init.normal_ in a loop over the
    modules, a load_state_dict), which no stage would see: each builds its layers with their
    resets alone."""

    def __init__(self) -> None:
        super().__init__()
        self.writes: list[tuple[str, Any]] = []   # (op, the untyped storage written)
        self._skipped = _InitsSkipped(self.writes)

    def __enter__(self) -> FactoryWrites:
        self._skipped.__enter__()
        try:
            super().__enter__()
        except BaseException:
            self._skipped.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        try:
            super().__exit__(*exc)
        finally:
            self._skipped.__exit__(*exc)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func._schema.is_mutable:
            for i, argument in enumerate(func._schema.arguments):
                if argument.alias_info is None or not argument.alias_info.is_write:
                    continue
                target = args[i] if i < len(args) else kwargs.get(argument.name)
                if isinstance(target, torch.Tensor) and target.device.type == "meta" \
                        and not _in_reset(sys._getframe(1)):
                    self.writes.append((func.__name__.split(".")[0], target.untyped_storage()))
        return func(*args, **kwargs)


def check_parameters(what: str, model: nn.Sequential, writes: list[tuple[str, Any]]) -> None:
    """ConfigError for what a stage's own build would silently lose: parameters tied across layers
    (each stage materialises its layers apart) and the factory's own writes to its parameters
    (FactoryWrites.writes); and for a model without a parameter to train (none, or every one
    frozen). what: "model: <the factory>", for the message."""
    owners: dict[int, list[str]] = {}
    for name, p in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(p), []).append(name)
    for names in owners.values():
        if len({n.split(".", 1)[0] for n in names}) > 1:
            raise ConfigError(f"{what} ties {names[0]} and {names[1]} (one parameter in two layers): "
                              "each stage builds its layers apart, so they would train as two; give each layer its "
                              "own parameter, or keep both uses in one layer")
    if not any(True for _ in model.parameters()):
        raise ConfigError(f"{what} has no parameters: there is nothing to train")
    if not any(p.requires_grad for p in model.parameters()):
        raise ConfigError(f"{what} freezes every parameter (requires_grad False): there is nothing to train")
    named = {p.untyped_storage()._cdata: name for name, p in model.named_parameters()}
    found = list(dict.fromkeys(f"{op} on {named[storage._cdata]}" for op, storage in writes
                               if storage._cdata in named))
    if found:
        raise ConfigError(f"{what} writes parameters itself ({', '.join(found[:3])}"
                          f"{', ...' if len(found) > 3 else ''}), outside any reset_parameters(): each stage "
                          "initialises its layers with their modules' reset_parameters() alone, so that would be "
                          "lost; move it into the module's reset_parameters(), or save the initialised model "
                          "and give it as model.init")
