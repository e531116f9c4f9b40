"""The package's imports point one way: no cycle among batchspec's modules, counting every import
that runs (module level and inside functions; not those for type checkers only), so layers stay
layers."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).parent.parent / "batchspec"


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _running_nodes(tree: ast.AST):
    """Every node except those under `if TYPE_CHECKING:` (imports for annotations only)."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for other in node.orelse:
                yield other
                yield from _running_nodes(other)
            continue
        yield node
        yield from _running_nodes(node)


def import_graph() -> dict[str, set[str]]:
    """module -> the batchspec modules it imports (a `from package import name` that names a
    submodule counts as importing the submodule)."""
    modules = {_module_name(p): p for p in PACKAGE.rglob("*.py")}
    graph: dict[str, set[str]] = {name: set() for name in modules}
    for name, path in modules.items():
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for node in _running_nodes(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
                source = ".".join([*base, node.module] if node.module else base) if node.level else node.module
                targets = [f"{source}.{alias.name}" if f"{source}.{alias.name}" in modules else source
                           for alias in node.names]
            graph[name] |= {t for t in targets if t in modules and t != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_the_cycle_finder_sees_function_level_imports():
    """The finder has power: an import inside a function that closes a loop is a cycle."""
    graph = import_graph()
    assert "batchspec.forensics.invariants" in graph["batchspec.build"]  # imported inside build_engine
    assert "batchspec.errors" in graph["batchspec.kv.slots"]
    assert cycles({**graph, "batchspec.errors": {"batchspec.kv.slots"}}) == [["batchspec.errors", "batchspec.kv.slots"]]


def test_the_engine_and_generate_need_no_optional_extra():
    """`pip install batchspec` (no extras) runs the engine, `generate` and `audit`: none of them imports
    what the serve, bench or ray extras install."""
    import subprocess
    import sys

    code = ("import sys\n"
            "import batchspec.llm, batchspec.build, batchspec.commands.generate, batchspec.commands.audit\n"
            "bad = [m for m in sys.modules if m.split('.')[0] in "
            "('fastapi', 'uvicorn', 'starlette', 'prometheus_client', 'openai', 'matplotlib', 'ray', 'pyarrow')]\n"
            "assert not bad, bad\n")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_a_command_whose_extra_is_missing_says_which_to_install(monkeypatch, capsys):
    import importlib

    import pytest

    from batchspec import cli

    real = importlib.import_module

    def without_fastapi(name, *args):
        if name == "batchspec.commands.serve":
            raise ModuleNotFoundError("No module named 'fastapi'", name="fastapi")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_fastapi)
    with pytest.raises(SystemExit) as exit_:
        cli.main(["serve"])
    assert exit_.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["batchspec serve: error: needs the serve extra (fastapi is not installed): pip install 'batchspec[serve]'"]
