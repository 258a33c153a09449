"""The layering, read from the code: the serving engine, the measuring bench and the training each in a package
of their own, stacked engine < training < bench < ui/app.py; engine/'s layers import only downwards; the
bench drives the engine through its public interfaces; no import cycle among the project's modules; and the
entry points that only print help or data import no torch."""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


# The project's packages, lowest first: the engine serves (a host imports only it); training makes the
# embedded model (it may use the engine's builders); bench measures the engine (and scores images with the
# training package's checker); the UI and app.py sit on top and may import any of them (the Compare and Advisor
# tabs run the bench's code). A package imports its own modules and lower packages only.
PACKAGES = ("engine", "training", "bench", "ui")


def module_graph() -> dict[str, set[str]]:
    """module -> project modules it imports (lazy imports inside functions included: a cycle through a
    function-level import is still a cycle a reader has to untangle)."""
    files = {p: ".".join(p.relative_to(REPO).with_suffix("").parts).removesuffix(".__init__")
             for base in PACKAGES for p in (REPO / base).rglob("*.py")}
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
LAYERS = ("devices", "models", "families", "config", "pipeline", "worker", "tp", "fleet", "serving")
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


def package_of(module: str) -> str:
    return "ui" if module == "app" else module.split(".")[0]


def package_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of a higher package (PACKAGES' order), one line each: the engine never imports the bench
    or the training code, training never the bench, none of them the UI or app.py."""
    rank = {name: i for i, name in enumerate(PACKAGES)}
    return [f"{module} ({package_of(module)}) imports {dep} ({package_of(dep)}), a higher package"
            for module in sorted(graph) for dep in sorted(graph[module])
            if rank[package_of(dep)] > rank[package_of(module)]]


# The engine's public interfaces, all the bench may import of it: the contract, the configuration, the
# devices, the tiny models, the manager and its serving pieces, the fleet's entry, the client (and the
# in-process runtime, engine/serving/inprocess.py, a client too), the thread priority helper, the CLI's
# machinery (bench/commands.py runs its table through it), the levers' vocabularies the advisor and Compare
# list, and the pipeline call a request makes (what a bare diffusers call passes to be compared with the
# engine). Not the runner nor the worker loop nor tensor parallel's internals.
ENGINE_PUBLIC = ("engine.config", "engine.devices", "engine.models", "engine.serving", "engine.fleet",
                 "engine.worker.client", "engine.worker.priority", "engine.cli", "engine.pipeline.stepcache",
                 "engine.pipeline.attention", "engine.pipeline.memory", "engine.pipeline.progress",
                 "engine.pipeline.calls")
# The bench modules that measure the runner or a layer's internals themselves, each named with what it
# imports beyond ENGINE_PUBLIC and why the client cannot stand in.
BENCH_INTERNALS = {
    # The pipeline bench times the runner's own stages (load, warm, first and steady requests) and the
    # engine overhead: an engine request against a bare diffusers call on the same compiled pipeline object,
    # which only an in-process runner has. measure.py builds those runners; its cold-start and persistent
    # cache probes' children are the same runner in a fresh process.
    "bench.measure": {"engine.pipeline.runner"},
    "bench.pipeline": {"engine.pipeline.runner"},
    "bench.cold_start": {"engine.pipeline.runner"},  # compiles counted in the warming thread itself
    # Random-weight denoiser alone, a recipe applied to it, no request path at all (the GPU run).
    "bench.denoiser": {"engine.pipeline.runner", "engine.pipeline.recipes", "engine.pipeline.aot"},
    # In-process memory: the denoiser's stored bytes, the prompt-embedding cache's own counters and a child's
    # peak resident memory around one generate; a client sees none of them.
    "bench.memory": {"engine.pipeline.runner"},
    # Runs inside torchrun's ranks and times the context-parallel transform on a bare denoiser.
    "bench.context_parallel": {"engine.tp.group", "engine.tp.plan", "engine.tp.runner"},
}


def bench_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import of the engine by the bench beyond its public interfaces and the named exceptions."""
    def public(dep: str) -> bool:
        return (layer_of(dep) == "contract" or dep == "engine.cli"
                or any(dep == p or dep.startswith(p + ".") for p in ENGINE_PUBLIC))

    return [f"{module} imports {dep}: the bench uses the engine's public interfaces (the manager, the client)"
            for module in sorted(graph) if package_of(module) == "bench"
            for dep in sorted(graph[module])
            if package_of(dep) == "engine" and not public(dep) and dep not in BENCH_INTERNALS.get(module, ())]


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
        "engine.cli": {"engine.serving.manager"},  # the entry points may import anything of the engine
        "app": {"engine.cli", "ui.blocks"}, "ui.blocks": {"engine.serving.manager"},
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


def dangling_imports() -> list[str]:
    """Every import of a project package's module that is not in the checkout (an old path after a move:
    `engine.bench`, `engine.models.shapes`), in the packages, app.py, the tests and the scripts."""
    files = [p for base in (*PACKAGES, "tests", "scripts") for p in (REPO / base).rglob("*.py")] + [REPO / "app.py"]
    found = []
    for path in files:
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                modules = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                modules = [node.module]
            else:
                continue
            for module in modules:
                parts = module.split(".")
                folder = REPO.joinpath(*parts)
                if parts[0] in PACKAGES and not (folder.with_suffix(".py").is_file() or folder.is_dir()):
                    found.append(f"{path.relative_to(REPO)}:{node.lineno} imports {module}, which does not exist")
    return found


def test_no_import_names_a_module_that_moved_away():
    assert dangling_imports() == []


def test_the_package_checker_names_an_upward_import():
    graph = {
        "engine.serving.manager": {"bench.run"},  # the engine reaching into the bench
        "engine.cli": {"training.shapes.train"},  # an entry point of the engine is still the engine
        "training.shapes.train": {"engine.models.tiny_builders", "bench.quality"},  # down: fine; up: not
        "bench.quality": {"training.shapes.fidelity", "ui.views"},  # down: fine; the UI: not
        "bench.run": {"engine.serving.manager"}, "ui.views": {"bench.quality"}, "app": {"engine.cli", "bench.run"},
        "engine.models.tiny_builders": set(), "training.shapes.fidelity": set(),
    }
    assert package_violations(graph) == [
        "bench.quality (bench) imports ui.views (ui), a higher package",
        "engine.cli (engine) imports training.shapes.train (training), a higher package",
        "engine.serving.manager (engine) imports bench.run (bench), a higher package",
        "training.shapes.train (training) imports bench.quality (bench), a higher package",
    ]


def test_the_engine_imports_neither_the_bench_nor_the_training_and_nothing_imports_upwards():
    graph = module_graph()
    assert {"bench.run", "bench.advise", "training.shapes.train", "training.train_embedded"} <= set(graph)
    assert not (REPO / "engine" / "bench").exists() and not (REPO / "engine" / "models" / "shapes").exists()
    assert package_violations(graph) == []


def test_the_bench_checker_names_an_import_of_the_runner():
    graph = {"bench.soak": {"engine.serving.manager", "engine.protocol", "engine.worker.loop"},
             "bench.memory": {"engine.pipeline.runner", "engine.pipeline.lora"},  # a named exception, and beyond it
             "bench.configs": {"engine.pipeline.stepcache", "engine.settings", "training.shapes.grammar"}}
    why = ": the bench uses the engine's public interfaces (the manager, the client)"
    assert bench_violations(graph) == [f"bench.memory imports engine.pipeline.lora{why}",
                                       f"bench.soak imports engine.worker.loop{why}"]


def test_the_bench_uses_only_the_engines_public_interfaces_but_for_the_named_exceptions():
    graph = module_graph()
    assert bench_violations(graph) == []
    for module, internals in BENCH_INTERNALS.items():  # an exception no longer needed goes from the list
        assert module in graph, f"{module}: no such bench module"
        assert internals <= graph[module], f"{module} no longer imports {sorted(internals - graph[module])}"


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
    out = subprocess.run([sys.executable, "-c", "import sys\nfrom bench.commands import main\ntry:\n"
                          "    main(['--help'])\nexcept SystemExit:\n    pass\nprint('torch' in sys.modules)"],
                         capture_output=True, text=True, cwd=REPO, check=True)
    assert "advise" in out.stdout and out.stdout.strip().splitlines()[-1] == "False"
