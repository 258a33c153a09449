"""The layering, read from the code: no import cycle among the project's modules, and the entry points
that only print help or data import no torch."""

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
