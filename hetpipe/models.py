"""A job's model: its factory (a zoo name or the user's "package.module:function"), its structure
on the meta device, and the layers of one stage built alone.

A stage never materialises the whole model. The factory runs with every parameter on the meta
device (buffers are kept: they are small and may hold constants); then each of the stage's
layers gets real memory and is initialised by its modules' reset_parameters() under a seed of
its own, (train.seed, layer index), on the CPU, whatever device it then moves to. So any stage,
and the single-process reference, builds bit for bit the same layer, and a layer's initial
values do not depend on the device or on which other layers a process holds. A parameter that no
reset_parameters() covers is an error, not garbage: give such a model a `model.init` file.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import sys
import threading
import warnings
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from hetpipe import wire, zoo
from hetpipe.factory_writes import FactoryWrites, check_parameters, reset_of
from hetpipe.config import JobConfig, ModelConfig
from hetpipe.errors import closest, user_frame
from hetpipe.validate import ConfigError


def resolve(spec: str, key: str, base_dir: str) -> Callable[..., Any]:
    """The function `package.module:function` names, importable from base_dir (the job file's
    folder) or the environment. ConfigError names what is missing."""
    module_name, _, attribute = spec.partition(":")
    if not module_name or not attribute:
        raise ConfigError(f"{key}: expected 'package.module:function', got {spec!r}")
    if base_dir in sys.path:
        sys.path.remove(base_dir)
    sys.path.insert(0, base_dir)  # first: another job's base_dir may hold a module of the same name
    top = module_name.partition(".")[0]
    # Only a module of the job's own folder can be another job's or edited between jobs; an
    # installed package (torchvision, with hundreds of submodules) is neither watched nor statted.
    local = (Path(base_dir) / top).is_dir() or (Path(base_dir) / f"{top}.py").is_file()
    if local:
        _forget_stale(top, Path(base_dir))
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        if exc.name is not None and exc.name != module_name and not module_name.startswith(exc.name + "."):
            # Found, but what it imports is not: name that, not the module.
            raise ConfigError(f"{key}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
        raise ConfigError(f"{key}: cannot import module {module_name!r} (from {base_dir} or the installed "
                          f"packages): {exc}") from None
    except Exception as exc:  # the module's own code failed while importing
        raise ConfigError(f"{key}: importing {module_name!r} failed: {type(exc).__name__}: {exc}") from None
    if local:
        _remember_files(top)
    target = getattr(module, attribute, None)
    if target is None:
        meant = closest(attribute, (n for n in dir(module) if not n.startswith("_")))
        raise ConfigError(f"{key}: module {module_name!r} has no attribute {attribute!r}"
                          + (f" (did you mean {meant}?)" if meant else ""))
    if not callable(target):
        raise ConfigError(f"{key}: {spec} is a {type(target).__name__}, not a function")
    return target  # type: ignore[no-any-return]


def call_factory(make: Callable[..., Any], args: Mapping[str, Any], key: str, spec: str, args_key: str,
                 base_dir: str | None) -> Any:
    """make(**args), a factory of the job's: ConfigError naming what args_key gives that it does
    not take (with a close spelling of one it does), or what failed in it and where in the job
    folder's code."""
    try:
        return make(**args)
    except ConfigError:
        raise
    except (Exception, SystemExit) as exc:   # a factory that exits (an argparse in it) ends nothing but itself
        # A TypeError of the call itself, before any of the factory ran: the arguments'.
        if isinstance(exc, TypeError) and exc.__traceback__ is not None and exc.__traceback__.tb_next is None:
            raise ConfigError(f"{args_key}: {spec}: {exc}{_meant(make, args, str(exc))}") from None
        raise ConfigError(f"{key}: {spec}(**{args_key}) failed: {type(exc).__name__}: {exc}"
                          f"{user_frame(exc, base_dir)}") from None


def _meant(make: Callable[..., Any], args: Mapping[str, Any], said: str) -> str:
    """" (widht: did you mean width?)" for a given argument make does not take, close to one it
    does ("widht: " left out where said, the error, names it)."""
    try:
        taken = inspect.signature(make).parameters
    except Exception:   # no signature to read (a builtin), or one that fails
        return ""
    named = [name for name, p in taken.items() if p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]
    for given in args:
        meant = None if given in named else closest(given, named)
        if meant is not None:
            return f" ({'' if repr(given) in said else given + ': '}did you mean {meant}?)"
    return ""


# The file of each factory module as it was when imported: (mtime_ns, size), to see it edited since.
_IMPORTED: dict[str, tuple[int, int] | None] = {}


def _family(top: str) -> list[str]:
    return [name for name in sys.modules if name == top or name.startswith(f"{top}.")]


def _file_state(module: str) -> tuple[int, int] | None:
    origin = getattr(sys.modules.get(module), "__file__", None)
    try:
        st = Path(origin).stat() if origin else None
    except OSError:
        return None
    return (st.st_mtime_ns, st.st_size) if st else None


def _remember_files(top: str) -> None:
    for name in _family(top):
        if name not in _IMPORTED:   # as first imported, not as now
            _IMPORTED[name] = _file_state(name)


def _forget_stale(top: str, base_dir: Path) -> None:
    """Drops package or module `top` of base_dir, and its submodules, from the import cache when
    the cached one came from elsewhere, or one of its files was edited since it was imported: a
    long-lived coordinator or stage worker builds job after job, and a job's `mymodel` must be the
    one in its own folder as it is now, not the first one imported."""
    if top not in sys.modules:
        return
    origin = getattr(sys.modules[top], "__file__", None)
    elsewhere = origin is None or not Path(origin).resolve().is_relative_to(base_dir.resolve())
    edited = any(name in _IMPORTED and _IMPORTED[name] != _file_state(name) for name in _family(top))
    if elsewhere or edited:
        for name in _family(top):
            del sys.modules[name]
            _IMPORTED.pop(name, None)
        importlib.invalidate_caches()


def factory(cfg: ModelConfig, base_dir: str) -> Callable[..., Any]:
    if cfg.factory is not None:
        return resolve(cfg.factory, "model.factory", base_dir)
    try:
        return zoo.MODELS[cfg.name or ""]
    except KeyError:
        raise ConfigError(f"model.name: expected one of {', '.join(zoo.MODELS)}, got {cfg.name!r}") from None


def describe(cfg: ModelConfig) -> str:
    return cfg.factory or f"hetpipe.zoo:{cfg.name}"


# Both ways a model is built change process-wide state: the patched register_parameter below, and
# torch's one global generator, which reset_parameters() draws from. Two threads building at once
# (two stages of one process, each loading in the background) would otherwise undo each other's
# patch or draw each other's numbers: a layer then starts from another layer's values.
GLOBAL_STATE = threading.RLock()   # also held by draws.seeded, which may run inside


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """While inside, every registered parameter is moved to the meta device: the factory's
    own initialisation touches no memory and draws no random numbers."""
    with GLOBAL_STATE:   # held from reading the original to putting it back
        register = nn.Module.register_parameter

        def on_meta(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
            if param is not None and param.device.type != "meta":
                param = nn.Parameter(torch.empty(param.shape, dtype=param.dtype, device="meta"),
                                     requires_grad=param.requires_grad)
            register(module, name, param)

        nn.Module.register_parameter = on_meta  # type: ignore[method-assign,assignment]
        try:
            yield
        finally:
            nn.Module.register_parameter = register  # type: ignore[method-assign]


class _MetaDrawsSkipped(TorchFunctionMode):
    """Skips the initialisers' draws on meta tensors, which hold no values to draw. torch runs
    these ops on the meta device through their Python references, and the first such call
    imports torch._dynamo: 0.9 s of a stage's start here, about 5 s where torch has no bytecode
    cache (py-spy on the H200: most of a stage's load)."""

    DRAWS = frozenset({"normal_", "log_normal_", "exponential_", "cauchy_", "geometric_", "erfinv_",
                       "clamp_", "clamp_min_", "clamp_max_"})

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in self.DRAWS:   # Tensor.normal_(t, ...), nn.init.normal_(tensor=t, ...)
            target = args[0] if args else kwargs.get("tensor")
            if isinstance(target, torch.Tensor) and target.is_meta:
                return target
        return func(*args, **kwargs)


def structure(cfg: ModelConfig, base_dir: str, args: Mapping[str, Any] | None = None, *,
              check_writes: bool = True, dtype: str | None = None) -> nn.Sequential:
    """The model with every parameter on the meta device (no memory): names, shapes, layers.
    args: instead of model.args (the planner sizes an emulated model this way). check_writes:
    refuse a factory that writes its parameters (the plan does; a stage, planned, need not: a
    process's first dispatch mode imports about 300 modules, 0.7 s here and several seconds where
    torch has no bytecode cache; without the check, the initialisers' draws on the meta device
    are skipped too, which FactoryWrites would have seen). A zoo model (model.name) is ours, and
    checked once by the tests (tests/unit/test_models.py), not in every run's plan. dtype
    (train.dtype): its floating tensors in it, as the stages hold them (build_layers), whatever
    dtype the factory gave them: what the planner sizes and the written weights declare."""
    build = factory(cfg, base_dir)
    kwargs = dict(cfg.args if args is None else args)
    watch = FactoryWrites()
    check_writes = check_writes and cfg.factory is not None
    with _parameters_on_meta(), watch if check_writes else _MetaDrawsSkipped(), warnings.catch_warnings():
        # load_state_dict into the meta parameters is recorded as the write it is; torch's own
        # warning that it does nothing would only repeat the refusal, once per key.
        warnings.filterwarnings("ignore", message=".*copying from a non-meta parameter.*")
        model = call_factory(build, kwargs, "model", describe(cfg), "model.args", base_dir)
    if not isinstance(model, nn.Sequential):
        raise ConfigError(f"model: {describe(cfg)} returned a {type(model).__name__}, expected an nn.Sequential "
                          f"whose children are the layers the pipeline is cut between")
    if len(model) == 0:
        raise ConfigError(f"model: {describe(cfg)} returned an empty nn.Sequential")
    if type(model).forward is not nn.Sequential.forward:   # the stages run the layers, never this
        raise ConfigError(f"model: {describe(cfg)} returned a {type(model).__name__}, an nn.Sequential with a forward "
                          "of its own, which the pipeline would not run: each stage runs its layers one after another; "
                          "move what that forward adds into a layer")
    layers: dict[int, str] = {}
    for name, layer in model._modules.items():   # named_children() would skip a repeat
        if id(layer) in layers:
            raise ConfigError(f"model: {describe(cfg)} uses one module as layers {layers[id(layer)]} and {name}: each "
                              "stage builds its layers apart, so they would train as two; give each its own module")
        layers[id(layer)] = name
    names = [name for name, _ in model.named_children()]
    if names != [str(i) for i in range(len(model))]:  # weights are named by layer index ("3.weight")
        raise ConfigError(f"model: {describe(cfg)} returned an nn.Sequential with named layers {names[:5]}; "
                          "build it from a list of layers, numbered 0..n-1")
    check_parameters(f"model: {describe(cfg)}", model, watch.writes)
    if cfg.init is None and (bare := _without_reset(model)):   # found before any process starts
        raise ConfigError(_not_initialised(bare[0], cfg))
    odd = {k: t.dtype for k, t in model.state_dict(keep_vars=True).items() if t.dtype not in wire.CARRIED}
    if odd:  # found now, not when the trained weights are written out
        raise ConfigError(f"model: {describe(cfg)}'s state_dict holds {sorted(map(str, set(odd.values())))} tensors "
                          f"({list(odd)[:5]}); HetPipe carries and writes {', '.join(map(str, wire.CARRIED))}")
    return model if dtype is None else model.to(dtype=getattr(torch, dtype))


def _without_reset(model: nn.Sequential) -> list[str]:
    """Parameters that no reset_parameters() can set: no module that holds them (one parameter may
    sit in two modules of a layer, tied), nor one above such a module in their layer, has one;
    also one the factory made off the meta device (not registered the usual way), which a stage
    would keep at whatever the generator gave it then. A partial reset is found when a stage builds
    the layer."""
    found: list[str] = []
    for index, layer in enumerate(model):
        covered: set[int] = set()
        for module in layer.modules():
            if callable(reset_of(module)):
                covered.update(id(p) for p in module.parameters())
        found.extend(f"{index}.{name}" for name, p in layer.named_parameters() if id(p) not in covered)
    return found


def _not_initialised(name: str, cfg: ModelConfig) -> str:
    return (f"model: parameter {name} of {describe(cfg)} is not initialised by any reset_parameters(); give the model "
            "a reset_parameters() or a model.init file")


def layer_seed(seed: int, index: int) -> int:
    """The seed layer `index`'s parameters are drawn with: independent of every other layer."""
    return (seed * 1_000_003 + index * 7919 + 1) % (2**63 - 1)


def _reset(layer: nn.Module) -> None:
    # Children before parents, as construction runs: a parent's reset may override its children's.
    for module in reversed(list(layer.modules())):
        reset = reset_of(module)
        if callable(reset):
            reset()


def _materialise(layer: nn.Module) -> None:
    """Gives the layer's meta parameters CPU memory filled with NaN (what no reset covers stays
    NaN: found, never trained on); an integer or bool one (frozen: a step count, a mask), which
    holds no NaN, zeros. Its buffers are kept as the factory made them."""
    made: dict[int, nn.Parameter] = {}  # a parameter shared by two modules stays shared
    for module in layer.modules():
        for name, p in module._parameters.items():
            if p is not None and p.device.type == "meta":
                if id(p) not in made:
                    fill = float("nan") if p.is_floating_point() else 0
                    made[id(p)] = nn.Parameter(torch.full(p.shape, fill, dtype=p.dtype), p.requires_grad)
                module._parameters[name] = made[id(p)]


def build_layers(job: JobConfig, begin: int, end: int, *, device: str = "cpu",
                 model: nn.Sequential | None = None) -> nn.Sequential:
    """Layers [begin, end) of the job's model, initialised (see the module docstring) in the
    training dtype on `device`; state_dict keys as in the whole model. model: its structure, if
    the caller has it already."""
    model = structure(job.model, job.base_dir, check_writes=False) if model is None else model
    if not 0 <= begin < end <= len(model):
        raise ConfigError(f"layers [{begin}, {end}) but {describe(job.model)} has {len(model)}")
    dtype = getattr(torch, job.train.dtype)
    # A plain nn.Sequential of those layers (keys as in the whole model): slicing a subclass calls
    # its own __init__ with them, which may take something else (a width).
    stage = nn.Sequential(OrderedDict(list(model._modules.items())[begin:end]))
    for index, layer in zip(range(begin, end), list(stage)):
        _materialise(layer)
        with GLOBAL_STATE, torch.random.fork_rng(devices=[]):
            torch.manual_seed(layer_seed(job.train.seed, index))
            _reset(layer)
        for name, p in layer.named_parameters():
            # model.init gives every parameter its value (check_init refuses one it lacks).
            if job.model.init is None and p.is_floating_point() and bool(torch.isnan(p).any()):
                raise ConfigError(_not_initialised(f"{index}.{name}", job.model))
        layer.to(device=device, dtype=dtype)   # a factory's float64 or half layers too: train.dtype decides
    return stage


def build(job: JobConfig, device: str = "cpu") -> nn.Sequential:
    """The whole model, initialised as the stages build it (for single-process runs)."""
    model = structure(job.model, job.base_dir, check_writes=False)
    return build_layers(job, 0, len(model), device=device, model=model)


@contextlib.contextmanager
def evaluating(module: nn.Module) -> Iterator[None]:
    """module in eval mode while inside, then each of its modules back in its own mode: a
    factory's model (or a batch norm it froze) that trains in eval mode keeps doing so after an
    evaluation, where module.train() after it would switch it over mid-run (and on VW 0 alone)."""
    modes = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for m, training in modes:
            m.training = training


def layer_keys(model: nn.Sequential, begin: int, end: int) -> list[str]:
    """state_dict keys of layers [begin, end), in layer order."""
    return [k for k in model.state_dict(keep_vars=True) if begin <= int(k.split(".", 1)[0]) < end]


def trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters that train (requires_grad), named, in order. A frozen one is held as a
    buffer is: by the stages, never by an optimizer or a parameter server."""
    return [(name, p) for name, p in module.named_parameters() if p.requires_grad]


def parameter_keys(model: nn.Sequential, begin: int, end: int) -> list[str]:
    """Names of the trained parameters of layers [begin, end), in order: a stage's pushes and pulls."""
    return [k for k, _ in trainable(model) if begin <= int(k.split(".", 1)[0]) < end]


def tied_keys(model: nn.Module) -> dict[str, list[str]]:
    """The state_dict keys that name a tensor already named by an earlier key (a parameter tied
    within a layer: two modules holding one), by that first key, which is the one named_parameters
    (and so the shards and the pushes) know it by."""
    first: dict[int, str] = {}
    tied: dict[str, list[str]] = {}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in first:
            tied.setdefault(first[id(tensor)], []).append(key)
        else:
            first[id(tensor)] = key
    return tied
