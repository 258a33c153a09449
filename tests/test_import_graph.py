"""The layering, read from the code: engine/'s layers import only downwards, no import cycle among the
project's modules, and the entry points that only print help or data import no torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def module_graph() -> dict[str, set[str]]:
    """module -> project modules it imports (lazy imports inside functions included: a cycle through a
    function-level import is still a cycle a reader has to untangle)."""
    files = {p: ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
             for base in ("engine", "ui") for p in (REPO / base).rglob("*.py")}
    files[REPO / "app.py"] = "app"
    names = set(files.values())
    graph = {}
    for path, name in files.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                deps |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                submodules = {f"{node.module}.{a.name}" for a in node.names} & names
                deps |= submodules
                if len(submodules) < len(node.names):
                    deps.add(node.module)
        graph[name] = {d for d in deps if d in names and d != name}
    return graph


# engine/'s layers, lowest first (docs/architecture.md, "Layers"): a module's layer is its folder under
# engine/. The modules directly in engine/ that every layer may import are the contract (below every
# layer); the entry points (engine/cli.py, engine/__main__.py), ui/ and app.py sit on top of all of them.
LAYERS = ("devices", "models", "config", "pipeline", "worker", "tp", "fleet", "serving", "bench")
CONTRACT = frozenset({"engine", "engine.protocol", "engine.errors", "engine.metrics", "engine.processes",
                      "engine.settings"})
ON_TOP = frozenset({"engine.cli", "engine.__main__"})
CONTRACT_PACKAGE = "protocol"  # engine/protocol/: the contract's one package, its modules part of the contract


def layer_of(module: str) -> str | None:
    """The layer a module belongs to ("contract" or a name of LAYERS); "top" for the entry points, ui/ and
    app.py, which may import anything; None for a module of engine/ that is in neither."""
    parts = module.split(".")
    if parts[0] != "engine" or module in ON_TOP:
        return "top"
    if module in CONTRACT or module.startswith(f"engine.{CONTRACT_PACKAGE}."):
        return "contract"
    return parts[1] if parts[1] in LAYERS else None


def layer_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that breaks the layer rule, one line each: a module may import the contract, its own
    layer and the layers below it, never one above (lazy, function-level imports count: they run too); the
    contract imports only the contract; a module of engine/ outside the contract and every layer folder is
    named as such."""
    rank = {"contract": 0, **{name: i + 1 for i, name in enumerate(LAYERS)}}
    found = []
    for module in sorted(graph):
        layer = layer_of(module)
        if layer is None:
            found.append(f"{module} is in no layer: move it into a layer folder (or the contract)")
            continue
        if layer == "top":
            continue
        for dep in sorted(graph[module]):
            dep_layer = layer_of(dep)
            if dep_layer in rank and rank[dep_layer] > rank[layer]:
                found.append(f"{module} ({layer}) imports {dep} ({dep_layer}), a higher layer")
            elif dep_layer == "top":
                found.append(f"{module} ({layer}) imports {dep}, an entry point")
    return found


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
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
                found.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for v in graph:
        if v not in index:
            visit(v)
    return found


def test_the_checker_finds_a_cycle():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_among_the_project_modules():
    graph = module_graph()
    assert {"engine.serving.manager", "engine.devices.spec", "ui.generate", "app"} <= set(graph)  # the scan sees them
    assert cycles(graph) == []


def test_the_layer_checker_names_an_import_from_a_higher_layer():
    graph = {
        "engine.protocol": {"engine.settings", "engine.errors"},  # the contract imports the contract
        "engine.settings": set(), "engine.errors": set(),
        "engine.devices.spec": {"engine.protocol"},
        "engine.models.tiny": {"engine.devices.spec", "engine.models.weights"},  # below, and its own layer
        "engine.models.weights": set(),
        "engine.config.flags": {"engine.protocol", "engine.serving.manager"},  # up: serving
        "engine.worker.client": {"engine.tp.wire"},  # up, lazily in a function: still an import
        "engine.tp.wire": set(),
        "engine.serving.manager": {"engine.config.flags", "engine.worker.client", "engine.tp.client"},
        "engine.tp.client": {"engine.worker.client"},
        "engine.metrics": {"engine.pipeline.runner"},  # the contract reaching into a layer
        "engine.pipeline.runner": {"engine.cli"},  # an entry point is above everything
        "engine.stray": set(),  # neither contract nor layer folder
        "engine.cli": {"engine.bench.run", "engine.serving.manager"},  # the entry points may import anything
        "engine.bench.run": {"engine.serving.manager"},
        "app": {"engine.cli", "ui.blocks"}, "ui.blocks": {"engine.bench.run"},
    }
    assert layer_violations(graph) == [
        "engine.config.flags (config) imports engine.serving.manager (serving), a higher layer",
        "engine.metrics (contract) imports engine.pipeline.runner (pipeline), a higher layer",
        "engine.pipeline.runner (pipeline) imports engine.cli, an entry point",
        "engine.stray is in no layer: move it into a layer folder (or the contract)",
        "engine.worker.client (worker) imports engine.tp.wire (tp), a higher layer",
    ]


def test_every_engine_folder_is_a_layer():
    folders = {p.parent.name for p in (REPO / "engine").glob("*/__init__.py")} - {CONTRACT_PACKAGE}
    assert folders == set(LAYERS), "a new folder of engine/ needs its place in LAYERS (and docs/architecture.md)"
    for name in LAYERS:
        assert ast.get_docstring(ast.parse((REPO / "engine" / name / "__init__.py").read_text())), name


def test_engine_layers_import_only_downwards():
    graph = module_graph()
    assert {"engine.serving.manager", "engine.pipeline.runner", "engine.worker.loop"} <= set(graph)
    assert layer_violations(graph) == []


def test_help_and_presets_import_no_torch():
    probe = ("import runpy, sys\nsys.argv = {argv!r}\ntry:\n    runpy.run_path({path!r}, run_name='__main__')\n"
             "except SystemExit:\n    pass\nimport json\nprint(json.dumps('torch' in sys.modules))")
    for argv, path in ((["app.py", "--help"], str(REPO / "app.py")),):
        out = subprocess.run([sys.executable, "-c", probe.format(argv=argv, path=path)], capture_output=True,
                             text=True, cwd=REPO, check=True)
        assert json.loads(out.stdout.strip().splitlines()[-1]) is False, argv
    out = subprocess.run([sys.executable, "-c", "import sys\nfrom engine.cli import main\nmain(['presets'])\n"
                          "print('torch' in sys.modules)"], capture_output=True, text=True, cwd=REPO, check=True)
    assert out.stdout.strip().splitlines()[-1] == "False"
