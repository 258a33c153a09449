"""Every environment variable the project reads is read in engine/settings.py, as a named setting.

Outside it, a module may *write* the environment (os.environ[...] = ..., update, setdefault, pop: for the
libraries it imports next, or for the children it starts) and may copy the whole of it (dict(os.environ),
{**os.environ, ...}, a save and restore, the System panel's redacted listing): none of these reads a
variable by name. A read by name (os.getenv, os.environ.get, os.environ[NAME], NAME in os.environ, or os's
environ or getenv imported under another name) is a setting and goes to engine/settings.py.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SETTINGS = ROOT / "engine" / "settings.py"


PACKAGES = ("engine", "bench", "training", "ui")  # the measuring and training packages read through it too


def sources() -> list[Path]:
    files = [f for top in PACKAGES for f in sorted((ROOT / top).rglob("*.py"))] + [ROOT / "app.py"]
    return [f for f in files if f != SETTINGS]


def _is_environ(node: ast.AST) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == "environ" and isinstance(node.value, ast.Name)
            and node.value.id == "os")


def reads_by_name(tree: ast.AST) -> list[int]:
    """Line numbers of every read of an environment variable by name."""
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            f = node.func
            if (f.attr == "getenv" and isinstance(f.value, ast.Name) and f.value.id == "os") or \
                    (f.attr == "get" and _is_environ(f.value)):
                lines.append(node.lineno)
        elif isinstance(node, ast.Subscript) and _is_environ(node.value) and isinstance(node.ctx, ast.Load):
            lines.append(node.lineno)
        elif isinstance(node, ast.Compare) and any(isinstance(op, ast.In | ast.NotIn) for op in node.ops) \
                and any(_is_environ(c) for c in node.comparators):
            lines.append(node.lineno)
        elif isinstance(node, ast.ImportFrom) and node.module == "os" \
                and any(a.name in ("environ", "getenv", "environb", "getenvb") for a in node.names):
            lines.append(node.lineno)
    return sorted(lines)


def test_no_module_outside_settings_reads_an_environment_variable_by_name():
    assert {"bench", "training"} <= {f.relative_to(ROOT).parts[0] for f in sources()}
    found = [f"{path.relative_to(ROOT)}:{line}" for path in sources()
             for line in reads_by_name(ast.parse(path.read_text(), filename=str(path)))]
    assert not found, "read these through a named setting in engine/settings.py: " + ", ".join(found)


def test_the_check_sees_each_kind_of_read_and_lets_writes_and_copies_pass():
    flagged = reads_by_name(ast.parse(
        "import os\nfrom os import getenv\n"
        "a = os.getenv('A')\nb = os.environ.get('B')\nc = os.environ['C']\nd = 'D' in os.environ\n"))
    assert flagged == [2, 3, 4, 5, 6]
    allowed = ast.parse("import os\nos.environ['A'] = '1'\nos.environ.update(B='2')\nos.environ.setdefault('C', '3')\n"
                        "env = {**os.environ, 'D': '4'}\nsaved = dict(os.environ)\nos.environ.pop('E', None)\n")
    assert reads_by_name(allowed) == []
