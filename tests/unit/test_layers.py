"""The import graph (read from the source, function-local imports included): layers point one way,
core <- services <- launch, and no module imports itself through others."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CORE = {"hetpipe"}
SERVICES = {"stage_worker", "ps_server", "coordinator", "baselines"}
LAUNCH = {"launch"}
PACKAGES = CORE | SERVICES | LAUNCH


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    out = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "v1" not in path.relative_to(ROOT).parts:  # generated stubs
                out[_module_name(path)] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    """The project module an import names (a package's __init__ for `from pkg import sub` too)."""
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _imports(module: str, path: Path) -> set[str]:
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package
                package = module.split(".")[: -node.level if path.name != "__init__.py" else None]
                base = ".".join(package[: len(package) - (node.level - 1)] + ([base] if base else []))
            # `from pkg import mod` depends on the module; `from mod import name` on mod.
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in MODULES else base for a in node.names]
        for name in names:
            target = _resolve(name)
            if target is not None and target != module:
                found.add(target)
    return found


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _layer(module: str) -> str:
    top = module.split(".")[0]
    return "core" if top in CORE else "launch" if top in LAUNCH else "service"


def test_the_graph_is_read() -> None:
    # The reader must see real edges, or the checks below would pass on nothing.
    assert "hetpipe.rpc" in GRAPH["hetpipe.wire"]
    assert "coordinator.planner.plan" in GRAPH["launch.cli"] or "coordinator.planner" in GRAPH["launch.cli"]
    assert "stage_worker.runtime" in GRAPH["stage_worker.servicer"]


def test_core_imports_no_service_and_no_launch_layer() -> None:
    upward = {(m, t) for m, targets in GRAPH.items() if _layer(m) == "core"
              for t in targets if _layer(t) != "core"}
    assert not upward, f"the core reaches up: {sorted(upward)}"


def test_services_import_no_launch_layer() -> None:
    upward = {(m, t) for m, targets in GRAPH.items() if _layer(m) == "service"
              for t in targets if _layer(t) == "launch"}
    assert not upward, f"a service reaches into the launch layer: {sorted(upward)}"


@pytest.mark.parametrize(("service", "may_use"), [
    ("stage_worker", set()), ("ps_server", set()),
    ("coordinator", set()),
    ("baselines", {"coordinator.planner"}),  # the planner is pure: the baselines plan like HetPipe
])
def test_services_keep_to_themselves(service: str, may_use: set[str]) -> None:
    others = SERVICES - {service}
    crossing = {(m, t) for m, targets in GRAPH.items() if m.split(".")[0] == service
                for t in targets if t.split(".")[0] in others and not any(
                    t == allowed or t.startswith(allowed + ".") for allowed in may_use)}
    assert not crossing, f"{service} reaches into another service: {sorted(crossing)}"


def test_the_planner_does_not_need_the_coordinator_service() -> None:
    service = {(m, t) for m, targets in GRAPH.items() if m.startswith("coordinator.planner")
               for t in targets if t.startswith("coordinator.") and not t.startswith("coordinator.planner")}
    assert not service, f"the planner imports the coordinator service: {sorted(service)}"


def test_no_import_circle() -> None:
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    circles: list[list[str]] = []

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                circles.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    assert not circles, f"modules that import each other: {circles}"
