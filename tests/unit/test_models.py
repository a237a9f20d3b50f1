"""hetpipe/models.py: a user's model factory, layers built alone with the same initial values as
the whole model, and a stage's slice of model.init."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import save_file

from hetpipe import zoo
from hetpipe.config import ConfigError, JobConfig, ModelConfig, parse_job
from hetpipe.model_init import initialise, initialise_from, load_init
from hetpipe.models import build, build_layers, layer_keys, structure

USER_MODELS = """
import torch
from torch import nn

class Scale(nn.Module):
    # A buffer (a constant the factory sets) and a parameter initialised by reset_parameters.
    def __init__(self, n):
        super().__init__()
        self.register_buffer("offset", torch.arange(n, dtype=torch.float32))
        self.weight = nn.Parameter(torch.empty(n))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.uniform_(self.weight, 0.5, 1.5)

    def forward(self, x):
        return x * self.weight + self.offset

class Raw(nn.Module):
    # A parameter no reset_parameters() initialises.
    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * self.weight

class Noise(nn.Module):
    # A buffer drawn on the CPU while the factory runs, and a parameter drawn by its reset.
    def __init__(self):
        super().__init__()
        self.register_buffer("noise", torch.empty(6).normal_(generator=torch.Generator().manual_seed(3)))
        self.weight = nn.Parameter(torch.empty(6))
        self.reset_parameters()

    def reset_parameters(self):
        nn.init.normal_(self.weight)

    def forward(self, x):
        return x

def noise_net():
    return nn.Sequential(Noise())

def net(width=8, classes=3, features=4):
    return nn.Sequential(nn.Linear(features, width), nn.ReLU(), Scale(width), nn.Linear(width, classes))

def raw_net():
    return nn.Sequential(Raw())

class TiedOut(nn.Module):
    # The embedding's weight registered on the parent too, as the output projection: a tie within
    # one layer, which the embedding's own reset initialises.
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(5, 4)
        self.out_weight = self.embed.weight

    def forward(self, x):
        return nn.functional.linear(self.embed(x), self.out_weight)

def tied_to_a_reset_child():
    return nn.Sequential(TiedOut())

class Unregistered(nn.Module):
    # A parameter put in place without register_parameter: not on the meta device, and no reset.
    def __init__(self):
        super().__init__()
        self._parameters["scale"] = nn.Parameter(torch.randn(3))

    def forward(self, x):
        return x * self.scale

def unregistered():
    return nn.Sequential(Unregistered())

def no_parameters():
    return nn.Sequential(nn.Flatten(), nn.ReLU())

def not_sequential():
    return nn.Linear(4, 4)

def named_layers():
    from collections import OrderedDict
    return nn.Sequential(OrderedDict(fc1=nn.Linear(4, 8), act=nn.ReLU(), fc2=nn.Linear(8, 3)))

def needs_args(width):
    return net(width)

def inits_itself():
    # As torchvision's and nanoGPT's models do in their constructors: lost on a stage.
    model = net()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, 0.0, 0.02)
            module.bias.data.zero_()
    return model

def truncates_itself():
    # As timm's and many GPT-style models do: nn.init.trunc_normal_ (like orthogonal_) asks
    # is_meta and returns, so no dispatch mode sees it: lost on a stage all the same.
    model = net()
    for module in model.modules():
        if isinstance(module, nn.Linear):
            nn.init.trunc_normal_(module.weight, std=0.02)
    nn.init.orthogonal_(model[3].weight)
    return model

def loads_weights():
    model = net()
    model.load_state_dict({k: torch.zeros_like(v, device="cpu") for k, v in model.state_dict().items()})
    return model

class Tied(nn.Module):
    # One parameter, two uses in one layer: kept as one.
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)
        self.b.weight = self.a.weight

    def forward(self, x):
        return self.b(self.a(x))

def tied_in_a_layer():
    return nn.Sequential(Tied(), nn.Linear(4, 3))

def own_reset():
    # A factory's own function called reset_parameters: its writes are lost too.
    def reset_parameters(model):
        nn.init.zeros_(model[0].bias)
    model = net()
    reset_parameters(model)
    return model

def derived_temporary():
    # Writes to a tensor made from a parameter, not to the parameter: nothing a stage loses.
    model = net()
    scratch = model[0].weight.new_empty(3)
    scratch.fill_(1.0)
    return model

def one_module_twice():
    shared = nn.Linear(4, 4)
    return nn.Sequential(shared, nn.ReLU(), shared)

def tied_across_layers():
    first, last = nn.Linear(4, 4), nn.Linear(4, 4)
    last.weight = first.weight
    return nn.Sequential(first, nn.ReLU(), last)


def all_frozen():
    return net().requires_grad_(False)


def in_float64():
    return net().double()


class Counted(nn.Linear):
    # A frozen integer parameter (a step count) beside the weights, set by the reset.
    def __init__(self, *shape):
        super().__init__(*shape)
        self.count = nn.Parameter(torch.ones(2, dtype=torch.int64), requires_grad=False)

    def reset_parameters(self):
        super().reset_parameters()
        if hasattr(self, "count"):
            self.count.data.fill_(7)


def with_a_count():
    return nn.Sequential(Counted(4, 8), nn.ReLU(), nn.Linear(8, 3))


class Skip(nn.Sequential):
    # A forward of its own, which no stage runs.
    def forward(self, x):
        return self[2](self[1](self[0](x)) + self[0](x))


def skip_connection():
    return Skip(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 3))


class Wide(nn.Sequential):
    def __init__(self, width, **more):
        super().__init__(nn.Linear(4, width))


def cached(build):
    # A decorator that takes an argument of its own beside the factory's.
    import functools

    @functools.wraps(build)
    def wrapper(*args, cache=True, **kwargs):
        return build(*args, **kwargs)
    return wrapper


@cached
def decorated(width=8):
    return net(width)


def positional_only(width=8, /, **more):
    return net(more.get("width", width))


def wrong_inside(width=8):
    return nn.Sequential(nn.Linear(4, width), len(width))


def exits():
    raise SystemExit(2)
"""


def job(tmp_path: Path, factory: str = "mymodels:net", **extra: Any) -> JobConfig:
    (tmp_path / "mymodels.py").write_text(USER_MODELS)
    (tmp_path / "needs_missing.py").write_text("import not_installed_pkg\n")
    raw = {"model": {"factory": factory, **extra}, "data": {"name": "synthetic", "args": {"features": 4, "classes": 3}},
           "train": {"seed": 5}}
    return parse_job(raw, base_dir=str(tmp_path))


def test_a_stages_layers_built_alone_equal_the_whole_models(tmp_path: Path) -> None:
    j = job(tmp_path)
    whole = build(j).state_dict()
    for begin, end in ((0, 2), (2, 4), (1, 3), (3, 4)):
        part = build_layers(j, begin, end).state_dict()
        assert list(part) == layer_keys(structure(j.model, j.base_dir), begin, end)
        for key, value in part.items():
            assert torch.equal(value, whole[key]), key
    assert torch.equal(whole["2.offset"], torch.arange(8, dtype=torch.float32)), "buffers are the factory's"
    other = build(parse_job({**_raw(j), "train": {"seed": 6}}, base_dir=j.base_dir)).state_dict()
    assert not torch.equal(other["3.weight"], whole["3.weight"]), "another seed, other values"


def test_layers_built_on_threads_at_once_equal_those_built_alone(tmp_path: Path) -> None:
    # Two stages of one process load at once (each Assign loads in the background): each
    # layer's seeded draws must not interleave with another thread's.
    j = job(tmp_path, args={"width": 256, "features": 256})
    alone = build(j).state_dict()
    found: list[str] = []

    def load(begin: int, end: int) -> None:
        for _ in range(30):
            part = build_layers(j, begin, end).state_dict()
            found.extend(key for key, value in part.items() if not torch.equal(value, alone[key]))

    threads = [threading.Thread(target=load, args=span) for span in ((0, 2), (2, 4), (0, 4), (3, 4))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not found, f"layers drew other layers' random numbers: {sorted(set(found))}"


def _raw(j: JobConfig) -> dict[str, Any]:
    return {"model": {"factory": j.model.factory}, "data": {"name": "synthetic", "args": {"features": 4, "classes": 3}}}


def test_a_layers_values_do_not_depend_on_the_layers_before_it(tmp_path: Path) -> None:
    # Layer 0 grows, and its initialisation draws more random numbers; layers 2 and 3 still get
    # the same values: every layer starts from its own seed.
    small, big = build(job(tmp_path, args={"features": 4})), build(job(tmp_path, args={"features": 40}))
    assert small.state_dict()["0.weight"].shape != big.state_dict()["0.weight"].shape
    for key in ("2.weight", "3.weight", "3.bias"):
        assert torch.equal(small.state_dict()[key], big.state_dict()[key]), key


def test_a_stage_skips_the_draws_on_the_meta_device_and_keeps_those_on_the_cpu(tmp_path: Path) -> None:
    # A stage builds the structure without the FactoryWrites check, and with the initialisers'
    # draws on meta tensors skipped: the first (torch's Python reference of normal_ on the meta
    # device) would import torch._dynamo, about a second of every stage's start. A draw the
    # factory makes on the CPU is its own, and kept.
    j = job(tmp_path, factory="mymodels:noise_net")
    model = structure(j.model, j.base_dir, check_writes=False)
    assert model[0].weight.is_meta
    assert torch.equal(model[0].noise, torch.empty(6).normal_(generator=torch.Generator().manual_seed(3)))
    layers = build_layers(j, 0, 1)
    assert torch.isfinite(layers[0].weight).all() and layers[0].weight.std() > 0, "its reset draws, off the meta device"
    code = ("import sys; from hetpipe.config import ModelConfig; from hetpipe import models; "
            "args = {'context': 8, 'dim': 16, 'heads': 2, 'layers': 1, 'vocab': 32}; "
            "m = models.structure(ModelConfig(name='gpt', args=args), '.', check_writes=False); "
            "assert all(p.is_meta for p in m.parameters()); print('torch._dynamo' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert done.stdout.strip() == "False", done.stdout + done.stderr


def test_float64_jobs_get_float64_layers(tmp_path: Path) -> None:
    j = parse_job({**_raw(job(tmp_path)), "train": {"dtype": "float64"}}, base_dir=str(tmp_path))
    assert all(t.dtype == torch.float64 for t in build(j).state_dict().values())


def test_a_factorys_float64_layers_train_in_train_dtype(tmp_path: Path) -> None:
    j = job(tmp_path, factory="mymodels:in_float64")
    assert all(t.dtype == torch.float32 for t in build(j).state_dict().values())


@pytest.mark.parametrize(("factory", "args", "match"), [
    ("nowhere:net", {}, r"model\.factory: cannot import module 'nowhere'"),
    ("nowhere.deeper:net", {}, r"model\.factory: cannot import module 'nowhere\.deeper'"),
    ("needs_missing:net", {}, r"model\.factory: importing 'needs_missing' failed: ModuleNotFoundError: No module "
                              r"named 'not_installed_pkg'"),
    ("mymodels:missing", {}, r"model\.factory: module 'mymodels' has no attribute 'missing'"),
    ("mymodels:nett", {}, r"model\.factory: module 'mymodels' has no attribute 'nett' \(did you mean net\?\)"),
    ("mymodels:not_sequential", {}, r"model: mymodels:not_sequential returned a Linear, expected an nn\.Sequential"),
    ("mymodels:skip_connection", {}, r"model: mymodels:skip_connection returned a Skip, an nn\.Sequential with a "
                                     r"forward of its own, which the pipeline would not run"),
    ("mymodels:named_layers", {}, r"model: mymodels:named_layers returned an nn\.Sequential with named layers "
                                  r"\['fc1', 'act', 'fc2'\]; build it from a list of layers, numbered 0\.\.n-1"),
    ("mymodels:needs_args", {}, r"model\.args: mymodels:needs_args: .*missing 1 required .*'width'$"),
    ("mymodels:net", {"zzz": 3}, r"model\.args: mymodels:net: .*unexpected keyword argument 'zzz'$"),
    ("mymodels:net", {"widht": 3}, r"model\.args: mymodels:net: .*unexpected keyword argument 'widht' \(did you "
                                   r"mean width\?\)"),
    # A class names the required argument missing, not the misspelt one given for it.
    ("mymodels:Wide", {"widht": 3}, r"model\.args: mymodels:Wide: .*missing 1 required .*'width' "
                                    r"\(widht: did you mean width\?\)"),
    # A TypeError inside the factory is its own, not model.args': named with where it was raised.
    ("mymodels:wrong_inside", {}, r"model: mymodels:wrong_inside\(\*\*model\.args\) failed: TypeError: object of "
                                  r"type 'int' has no len\(\) \(mymodels\.py:\d+ in wrong_inside\)"),
    ("mymodels:raw_net", {}, r"parameter 0\.weight of mymodels:raw_net is not initialised by any reset_parameters"),
    ("mymodels:inits_itself", {}, r"model: mymodels:inits_itself writes parameters itself \(normal_ on 0\.weight, "
                                  r"zero_ on 0\.bias, normal_ on 3\.weight, \.\.\.\), outside any reset_parameters\(\)"),
    ("mymodels:truncates_itself", {}, r"model: mymodels:truncates_itself writes parameters itself \(trunc_normal_ on "
                                      r"0\.weight, trunc_normal_ on 3\.weight, orthogonal_ on 3\.weight\), outside"),
    ("mymodels:loads_weights", {}, r"writes parameters itself \(copy_ on 0\.weight, copy_ on 0\.bias, copy_ on 2\.weight"),
    ("mymodels:own_reset", {}, r"writes parameters itself \(zero_ on 0\.bias\)"),
    ("mymodels:one_module_twice", {}, r"model: mymodels:one_module_twice uses one module as layers 0 and 2"),
    ("mymodels:tied_across_layers", {}, r"model: mymodels:tied_across_layers ties 0\.weight and 2\.weight \(one "
                                        r"parameter in two layers\)"),
    ("mymodels:exits", {}, r"model: mymodels:exits\(\*\*model\.args\) failed: SystemExit: 2"),
    ("mymodels:all_frozen", {}, r"model: mymodels:all_frozen freezes every parameter \(requires_grad False\): there "
                                r"is nothing to train"),
    ("mymodels:no_parameters", {}, r"model: mymodels:no_parameters has no parameters: there is nothing to train"),
    ("mymodels:unregistered", {}, r"parameter 0\.scale of mymodels:unregistered is not initialised by any reset"),
])
def test_a_factory_that_does_not_fit_says_why(tmp_path: Path, factory: str, args: dict[str, Any], match: str) -> None:
    j = job(tmp_path, factory, args=args)
    with pytest.raises(ConfigError, match=match):
        structure(j.model, j.base_dir)   # what the plan finds
        build(j)                         # what a stage finds: a parameter no reset initialised


def test_a_parameter_no_reset_sets_is_taken_from_model_init(tmp_path: Path) -> None:
    """Refused before any process starts without a model.init (no module above it has a reset),
    and built with one: the stage's NaN check used to refuse it before model.init was read."""
    with pytest.raises(ConfigError, match=r"parameter 0\.weight of mymodels:raw_net is not initialised"):
        structure(job(tmp_path, "mymodels:raw_net").model, str(tmp_path))
    save_file({"0.weight": torch.tensor([1.0, 2.0, 3.0])}, str(tmp_path / "init.safetensors"))
    j = job(tmp_path, "mymodels:raw_net", init="init.safetensors")
    structure(j.model, j.base_dir)
    layers = build_layers(j, 0, 1)
    initialise(j, layers)
    assert layers[0].weight.tolist() == [1.0, 2.0, 3.0]


def test_a_parameter_tied_to_a_child_with_a_reset_is_initialised_by_it(tmp_path: Path) -> None:
    j = job(tmp_path, "mymodels:tied_to_a_reset_child")
    structure(j.model, j.base_dir)
    layer = build_layers(j, 0, 1)[0]
    assert layer.out_weight is layer.embed.weight and bool(torch.isfinite(layer.out_weight).all())


def test_writes_to_what_is_not_a_parameter_are_the_factorys_own_business(tmp_path: Path) -> None:
    structure(job(tmp_path, factory="mymodels:derived_temporary").model, str(tmp_path))


def test_an_integer_parameter_is_built_as_its_reset_sets_it(tmp_path: Path) -> None:
    # Planned, but each stage's build failed: NaN, what marks a parameter no reset set, is no int64.
    j = job(tmp_path, "mymodels:with_a_count")
    structure(j.model, j.base_dir)
    layer = build_layers(j, 0, 1)[0]
    assert layer.count.dtype == torch.int64 and layer.count.tolist() == [7, 7]
    assert bool(torch.isfinite(layer.weight).all())


def test_a_sequential_subclass_of_its_own_init_is_built_layer_by_layer(tmp_path: Path) -> None:
    # Planned, but each stage's build failed: slicing it called Wide(OrderedDict) for its width.
    j = job(tmp_path, "mymodels:Wide", args={"width": 4})
    structure(j.model, j.base_dir)
    layers = build_layers(j, 0, 1)
    assert type(layers) is torch.nn.Sequential and list(layers.state_dict()) == ["0.weight", "0.bias"]


def test_a_parameter_shared_within_a_layer_stays_shared(tmp_path: Path) -> None:
    layer = build_layers(job(tmp_path, factory="mymodels:tied_in_a_layer"), 0, 1)[0]
    assert layer.a.weight is layer.b.weight


@pytest.mark.parametrize("name", sorted(zoo.MODELS))
def test_no_zoo_model_writes_its_parameters_itself_so_a_plan_need_not_check(name: str) -> None:
    """structure() checks a user's factory for writes a stage would lose (FactoryWrites), and not a
    zoo model by name: that check's first use costs a process 0.7 s. Here each zoo model, named as
    a factory, is checked once, as a user's would be."""
    model = structure(ModelConfig(factory=f"hetpipe.zoo:{name}"), ".")
    assert all(p.is_meta for p in model.parameters())


def test_a_zoo_name_and_a_factory_are_the_same_thing() -> None:
    by_name = parse_job({"model": {"name": "mlp", "args": {"hidden": [8]}}})
    by_factory = parse_job({"model": {"factory": "hetpipe.zoo:mlp", "args": {"hidden": [8]}}})
    a, b = build(by_name).state_dict(), build(by_factory).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in a)
    with pytest.raises(ConfigError, match="give exactly one of model.name"):
        parse_job({"model": {"name": "mlp", "factory": "hetpipe.zoo:mlp"}})


def _save(state: dict[str, torch.Tensor], path: Path) -> None:
    """As a run writes its weights: one safetensors file, several and their index; or torch.save's."""
    if path.name.endswith(".index.json"):   # two files, every other key in the second
        names = {k: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, k in enumerate(state)}
        for name in set(names.values()):
            save_file({k: v for k, v in state.items() if names[k] == name}, str(path.parent / name))
        path.write_text(json.dumps({"metadata": {}, "weight_map": names}))
    elif path.suffix == ".safetensors":
        save_file(state, str(path))
    else:
        torch.save(state, path)


@pytest.mark.parametrize("suffix", [".safetensors", ".safetensors.index.json", ".pt"])
def test_model_init_is_read_key_by_key(tmp_path: Path, suffix: str) -> None:
    j = job(tmp_path)
    state = {k: v + 1 for k, v in build(j).state_dict().items()}
    path = tmp_path / f"init{suffix}"
    _save(state, path)
    j = job(tmp_path, init=path.name)
    layers = build_layers(j, 2, 4)
    keys = list(layers.state_dict())
    initialise_from(layers, load_init(j, keys), "model.init")
    assert all(torch.equal(layers.state_dict()[k], state[k]) for k in keys)
    with pytest.raises(ConfigError, match=r"model\.init: .* lacks \['9\.weight'\] \(it holds \['0\.bias', "):
        load_init(j, ["9.weight"])
    wrapped = tmp_path / "ddp" / f"init{suffix}"   # saved from a DistributedDataParallel model
    wrapped.parent.mkdir()
    _save({f"module.{k}": v for k, v in state.items()}, wrapped)
    with pytest.raises(ConfigError, match=r"lacks \['2\.weight', .*: its keys start with 'module\.', as a "
                                          r"DistributedDataParallel model's state_dict does"):
        load_init(job(tmp_path, init=f"ddp/{wrapped.name}"), keys)
    state["3.bias"][0] = float("nan")
    with pytest.raises(ConfigError, match=r"model\.init: 3\.bias holds NaN or Inf"):
        initialise_from(layers, {"3.bias": state["3.bias"]}, "model.init")


def test_model_init_values_past_the_training_dtype_are_refused(tmp_path: Path) -> None:
    """A float64 init value finite in the file but past float32's range is Inf in a float32
    stage: refused before any process starts (the run failed at minibatch 1, blaming the lr)."""
    from hetpipe.model_init import check_init

    j = job(tmp_path)
    state = {k: v.double() for k, v in build(j).state_dict().items()}
    state["3.bias"][0] = 1e300
    torch.save(state, tmp_path / "big.pt")
    big = job(tmp_path, init="big.pt")
    with pytest.raises(ConfigError, match=r"model\.init: .*big\.pt: 3\.bias holds values past float32's largest"):
        check_init(big, structure(big.model, big.base_dir, dtype="float32"))
    layers = build_layers(big, 2, 4)
    with pytest.raises(ConfigError, match=r"model\.init: 3\.bias holds values past float32's largest"):
        initialise_from(layers, {"3.bias": state["3.bias"]}, "model.init")
    as64 = parse_job({**json.loads(big.to_json()), "train": {"seed": 5, "dtype": "float64"}}, base_dir=None)
    check_init(as64, structure(as64.model, as64.base_dir, dtype="float64"))   # float64 holds it


def test_an_index_that_puts_a_key_in_a_file_without_it_is_refused_naming_both(tmp_path: Path) -> None:
    j = job(tmp_path)
    state = build(j).state_dict()
    path = tmp_path / "init.safetensors.index.json"
    _save(state, path)
    index = json.loads(path.read_text())
    key = next(iter(index["weight_map"]))
    index["weight_map"][key] = next(n for n in set(index["weight_map"].values()) if n != index["weight_map"][key])
    path.write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=rf"model\.init: the index {path.name} puts {re.escape(key)} in "
                                          r"model-0000\d-of-00002\.safetensors, which does not hold it"):
        load_init(job(tmp_path, init=path.name), list(state))


class _Touch:
    """Unpickling this calls Path.touch(marker): the file appears iff the pickle's code ran.
    At module level so that torch.save can pickle it."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[Path]]:
        return Path.touch, (self.marker,)


def test_a_pickled_model_init_is_refused_without_running_it(tmp_path: Path) -> None:
    """A .pt init that would run code when unpickled is refused, and its code never runs."""
    path, marker = tmp_path / "evil.pt", tmp_path / "ran"
    torch.save({"0.weight": torch.zeros(1), "code": _Touch(marker)}, path)  # not a plain state_dict
    with pytest.raises(ConfigError, match="holds pickled objects besides tensors") as info:
        load_init(job(tmp_path, init="evil.pt"), ["0.weight"])
    assert not marker.exists(), "loading model.init ran the pickle's code"
    assert "\n" not in str(info.value) and "weights_only=False" not in str(info.value), "one line, and no advice to unpickle"
    torch.save(torch.nn.Linear(2, 2), tmp_path / "module.pt")   # a whole module saved, not its state_dict
    with pytest.raises(ConfigError, match=r"save model\.state_dict\(\) with torch\.save, or safetensors$"):
        load_init(job(tmp_path, init="module.pt"), ["0.weight"])


def test_each_job_gets_the_factory_module_of_its_own_folder(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A long-lived coordinator plans job after job in one process: a module named alike in two
    jobs' folders is each job's own, back and forth, not the first one imported."""
    from hetpipe.config import ModelConfig

    monkeypatch.setattr(sys, "path", list(sys.path))
    for folder, width in (("a", 8), ("b", 32)):
        (tmp_path / folder).mkdir()
        (tmp_path / folder / "job_model_twin.py").write_text(
            f"import torch\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(4, {width}))\n")
    cfg = ModelConfig(name=None, factory="job_model_twin:build")
    try:
        widths = [structure(cfg, str(tmp_path / folder))[0].out_features for folder in ("a", "b", "a")]
    finally:
        sys.modules.pop("job_model_twin", None)
    assert widths == [8, 32, 8]


def test_a_factory_module_edited_between_jobs_is_imported_anew(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The same folder, submitted again after its model file (and a module it imports) changed:
    a long-lived coordinator or stage worker builds the model as it is now."""
    from hetpipe.config import ModelConfig

    monkeypatch.setattr(sys, "path", list(sys.path))
    package = tmp_path / "job_model_edited"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "widths.py").write_text("OUT = 8\n")
    (package / "net.py").write_text("import torch\nfrom job_model_edited.widths import OUT\n"
                                    "def build():\n    return torch.nn.Sequential(torch.nn.Linear(4, OUT))\n")
    cfg = ModelConfig(name=None, factory="job_model_edited.net:build")
    try:
        widths = [structure(cfg, str(tmp_path))[0].out_features]
        widths.append(structure(cfg, str(tmp_path))[0].out_features)   # unchanged: the cached module
        (package / "widths.py").write_text("OUT = 32\n")                 # an imported module edited
        widths.append(structure(cfg, str(tmp_path))[0].out_features)
        (package / "net.py").write_text("import torch\ndef build():\n    return torch.nn.Sequential(torch.nn.Linear(4, 5))\n")
        widths.append(structure(cfg, str(tmp_path))[0].out_features)
    finally:
        for name in [n for n in sys.modules if n.startswith("job_model_edited")]:
            del sys.modules[name]
    assert widths == [8, 8, 32, 5]


@pytest.mark.parametrize(("factory", "args"), [("mymodels:decorated", {"cache": False, "width": 4}),
                                               ("mymodels:positional_only", {"width": 4})])
def test_a_factory_takes_what_its_call_takes_whatever_its_signature_says(tmp_path: Path, factory: str,
                                                                        args: dict[str, Any]) -> None:
    j = job(tmp_path, factory, args=args)
    assert structure(j.model, j.base_dir)[0].out_features == 4
