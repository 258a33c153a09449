"""The tests' own shape: no test asserts on the wall clock. On a busy 2-core CI a timed assert flakes; tests
synchronise on events, fake clocks and counted calls (`wait_until` waits on a condition), and speed
figures live in the benchmark (`python -m bench bench`), which prints them.

The check reads tests/ with ast: a value is a wall-clock reading when it comes from time.monotonic(),
time.perf_counter(), time.time() (or their _ns forms), from a name, attribute or container that holds one,
or from a function of the same module that returns one; an assert that compares such a value fails it.
A loop that waits until a deadline is not an assert and stays allowed (that is what `wait_until` does).
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
WALL_CLOCKS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns", "time_ns"}
APPENDERS = {"append", "extend", "add", "insert", "setdefault", "update"}
SPREADERS = (ast.Assign, ast.AnnAssign, ast.AugAssign, ast.NamedExpr, ast.For, ast.Call)
# calls whose result is still a time when their argument is one
TRANSPARENT = {"max", "min", "sum", "abs", "round", "sorted", "float", "int", "list", "tuple", "median", "mean",
               "fsum", "quantile", "percentile"}


def _key(node: ast.AST) -> str | None:
    """`a`, `a.b`, `a.b[i]` -> "a", "a.b", "a.b": what an assignment taints and a read finds."""
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        base = _key(node.value)
        return f"{base}.{node.attr}" if base else None
    if isinstance(node, ast.Subscript | ast.Starred):
        return _key(node.value)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):  # spans.setdefault(k, []).append
        return _key(node.func.value)
    return None


def _is_clock_call(node: ast.AST, clock_functions: set[str]) -> bool:
    if not isinstance(node, ast.Call):
        return False
    func = node.func
    if isinstance(func, ast.Attribute) and func.attr in WALL_CLOCKS:
        return isinstance(func.value, ast.Name) and func.value.id == "time"
    if isinstance(func, ast.Name):
        return func.id in clock_functions or func.id in WALL_CLOCKS - {"time"}
    return False


class _Scope:
    """The names (and dotted attributes) of one function, or a module, that hold a wall-clock reading."""

    def __init__(self, clock_functions: set[str], inherited: set[str] = frozenset()):
        self.clock_functions = clock_functions
        self.tainted = set(inherited)

    def reads_clock(self, expr: ast.AST | None) -> bool:
        """Whether `expr` is (derived from) a reading: arithmetic and max/min/sum/round/... of one count;
        another call's arguments do not (`Resident("fp32", time.monotonic())` is an object, not a time)."""
        if expr is None or isinstance(expr, ast.Lambda):
            return False
        if _is_clock_call(expr, self.clock_functions):
            return True
        if isinstance(expr, ast.Name | ast.Attribute) and _key(expr) in self.tainted:
            return True
        if isinstance(expr, ast.Call):
            func = expr.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if name not in TRANSPARENT:
                return self.reads_clock(func)
        return any(self.reads_clock(child) for child in ast.iter_child_nodes(expr))

    def _taint(self, target: ast.AST) -> bool:
        if isinstance(target, ast.Tuple | ast.List):
            return any([self._taint(t) for t in target.elts])
        key = _key(target)
        if key is None or key in self.tainted:
            return False
        self.tainted.add(key)
        return True

    def _grows(self, node: ast.AST) -> bool:
        """Whether `node` puts a wall-clock reading somewhere not yet known to hold one."""
        if isinstance(node, ast.Assign) and self.reads_clock(node.value):
            return any([self._taint(t) for t in node.targets])
        if isinstance(node, ast.AnnAssign | ast.AugAssign | ast.NamedExpr) and self.reads_clock(node.value):
            return self._taint(node.target)
        if isinstance(node, ast.For) and self.reads_clock(node.iter):
            return self._taint(node.target)
        if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in APPENDERS
                and any(self.reads_clock(a) for a in node.args)):
            return self._taint(node.func.value)
        return False

    def settle(self, body: list[ast.AST]) -> None:
        """Spread the taint through assignments until nothing new holds a reading (order does not matter)."""
        nodes = [node for stmt in body for node in ast.walk(stmt) if isinstance(node, SPREADERS)]
        while any([self._grows(node) for node in nodes]):
            pass


def _functions(tree: ast.AST) -> list[ast.FunctionDef | ast.AsyncFunctionDef]:
    return [n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)]


def _clock_functions(tree: ast.AST) -> set[str]:
    """Functions of the module that return a wall-clock reading (`def took(): return perf_counter() - t0`)."""
    found: set[str] = set()
    while True:
        more = set()
        for fn in _functions(tree):
            if fn.name in found or not any(isinstance(n, ast.Return) and n.value for n in ast.walk(fn)):
                continue
            scope = _Scope(found)
            scope.settle(fn.body)
            returns = [n for n in ast.walk(fn) if isinstance(n, ast.Return)]
            if fn.name not in found and any(scope.reads_clock(r.value) for r in returns):
                more.add(fn.name)
        if not more:
            return found
        found |= more


def _compares_a_time(node: ast.AST, scope: _Scope) -> bool:
    """An ordering or equality comparison with a reading on a side (`in`/`is` ask about presence, not time)."""
    return (isinstance(node, ast.Compare) and scope.reads_clock(node)
            and not all(isinstance(op, ast.In | ast.NotIn | ast.Is | ast.IsNot) for op in node.ops))


def wall_clock_asserts(source: str, filename: str = "<test>") -> list[str]:
    """`file:line: assert ...` for every assert in `source` that compares a wall-clock reading."""
    tree = ast.parse(source, filename)
    clock_functions = _clock_functions(tree)
    module = _Scope(clock_functions)
    module.settle([n for n in tree.body if not isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)])
    found = set()
    # one scope per top-level function or class: closures and methods share what they set (self.at)
    scopes = [n for n in tree.body if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)]
    for top in scopes:
        scope = _Scope(clock_functions, module.tainted)
        scope.settle(top.body)
        for node in ast.walk(top):
            if isinstance(node, ast.Assert) and any(_compares_a_time(c, scope) for c in ast.walk(node.test)):
                found.add(f"{filename}:{node.lineno}: {ast.unparse(node.test)[:100]}")
    for node in ast.walk(ast.Module(body=[n for n in tree.body if n not in scopes], type_ignores=[])):
        if isinstance(node, ast.Assert) and any(_compares_a_time(c, module) for c in ast.walk(node.test)):
            found.add(f"{filename}:{node.lineno}: {ast.unparse(node.test)[:100]}")
    return sorted(found, key=lambda line: int(line.split(":")[1]))


def _tests():
    return sorted(TESTS.glob("*.py"))


def test_no_test_asserts_on_wall_clock_time():
    found = [hit for path in _tests() for hit in wall_clock_asserts(path.read_text(), path.name)]
    print(f"wall-clock asserts in tests/: {len(found)}")
    assert found == []


def test_the_wall_clock_check_finds_timed_asserts():
    """The check bites on each shape a timed assert takes: directly, through a name, a derived name, a
    container, an attribute, and a helper that returns the elapsed time."""
    snippet = '''
import time
from time import perf_counter

def test_direct():
    started = time.monotonic()
    run()
    assert time.monotonic() - started < 5

def test_derived():
    t0 = perf_counter()
    run()
    took = perf_counter() - t0
    wall = took * 1000
    assert 80 < wall < 1000, "too slow"

def test_container():
    marks = {}
    marks["a"] = time.time()
    stamps = []
    stamps.append(time.monotonic())
    assert marks["a"] <= stamps[-1]

def took(fn):
    started = time.perf_counter()
    fn()
    return time.perf_counter() - started

def test_helper():
    assert took(run) < 1.0

class Probe:
    def mark(self):
        self.at = time.monotonic()

    def test_attribute(self):
        self.mark()
        assert self.at > 0
'''
    found = wall_clock_asserts(snippet)
    assert [line.split(":")[1] for line in found] == ["8", "15", "22", "30", "38"], found


def test_the_wall_clock_check_lets_waits_and_fake_clocks_pass():
    snippet = '''
import time

def test_waits():
    deadline = time.monotonic() + 30
    while not done() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert done()

def test_fake_clock(clock):
    clock.t += 5
    assert clock.t == 5
    start = time.monotonic()
    print(f"took {time.monotonic() - start:.1f} s")
    assert len([1, 2]) < 5
'''
    assert wall_clock_asserts(snippet) == []


def test_modules_that_look_for_processes_host_wide_run_apart_under_xdist():
    """`make test` runs modules on two workers at once; one that scans every process on the host (psutil's
    process_iter) would see another module's ranks or workers, so it joins the group that runs alone."""
    from conftest import HOST_WIDE_PROCESSES

    scanning = {path.name for path in _tests() if path.name.startswith("test_") and "process_iter(" in path.read_text()}
    print(f"modules in the host-wide group: {sorted(HOST_WIDE_PROCESSES)}")
    assert scanning - {"test_test_shape.py"} <= HOST_WIDE_PROCESSES
    assert all((TESTS / name).is_file() for name in HOST_WIDE_PROCESSES), "a module in the group was renamed"


def test_two_workers_get_whole_modules_and_the_host_wide_group_together(tmp_path):
    """`make test`'s two xdist workers: every test of a module on one worker, and the host-wide group's
    modules on one worker, with this folder's own conftest (its scheduler) doing the grouping."""
    import os
    import subprocess
    import sys

    from conftest import HOST_WIDE_PROCESSES

    (tmp_path / "conftest.py").write_text((TESTS / "conftest.py").read_text())
    log = tmp_path / "workers.log"
    body = "import os\n" + "".join(
        f"def test_{i}():\n    open({str(log)!r}, 'a').write(__name__ + ' ' + os.environ['PYTEST_XDIST_WORKER'] + '\\n')\n"
        for i in range(4))
    host_wide = sorted(HOST_WIDE_PROCESSES)[:2]
    for name in [*host_wide, "test_alpha.py", "test_beta.py", "test_gamma.py"]:
        (tmp_path / name).write_text(body)
    env = {**os.environ, "SHOWCASE_TEST_CACHE": str(tmp_path / "cache")}
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-n", "2", "--dist", "loadscope",
                          "--no-loadscope-reorder", "-p", "no:cacheprovider", "-p", "no:randomly", str(tmp_path)],
                         cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    workers: dict[str, set[str]] = {}
    for line in log.read_text().splitlines():
        module, worker = line.split()
        workers.setdefault(module, set()).add(worker)
    print(f"workers per module: {workers}")
    assert len(workers) == 5 and all(len(w) == 1 for w in workers.values()), workers
    first, second = (Path(name).stem for name in host_wide)
    assert workers[first] == workers[second]
