"""The core stays a library: `import toktier` loads no tooling, server, client or their dependencies."""

import ast
import os
import subprocess
import sys
from pathlib import Path

import toktier

# What must stay out of a process that only imports the library.
_OUTSIDE = ("toktier.tools", "toktier_sidecar", "rich", "faker", "emoji", "toktier_client")
_CORE = Path(toktier.__file__).parent


def test_import_toktier_loads_no_tooling():
    code = (
        "import toktier, sys; "
        f"print(sorted(m for m in sys.modules if m.startswith({_OUTSIDE!r})))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]", out.stdout


def _imported_modules(path: Path) -> set[str]:
    """Absolute names of every module a source file imports (resolving relative imports)."""
    pkg = ".".join(("toktier", *path.relative_to(_CORE).parent.parts))
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = pkg.rsplit(".", node.level - 1)[0] if node.level > 1 else pkg
                base = f"{parent}.{base}" if base else parent
            names.add(base)
            names.update(f"{base}.{a.name}" for a in node.names)
    return names


def test_core_never_imports_tooling():
    """Not even lazily: a function-level import of the tools from the core would be an upward arrow."""
    core = [p for p in _CORE.rglob("*.py") if "tools" not in p.relative_to(_CORE).parts[:1]]
    core = [p for p in core if p.name != "__main__.py"]  # the `python -m toktier` shim runs the tools' CLI
    assert len(core) > 10
    bad = {
        str(p.relative_to(_CORE)): sorted(m for m in _imported_modules(p) if m.startswith(_OUTSIDE))
        for p in core
    }
    assert {k: v for k, v in bad.items() if v} == {}


# -- the `toktier` command (toktier.tools.cli) ------------------------------------------------


def test_version_via_python_m():
    out = subprocess.run([sys.executable, "-m", "toktier", "--version"], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == f"toktier {toktier.__version__}"


def test_tokenizers_with_missing_data_loads_nothing_else(tmp_path):
    """qwen3's file lives in TOKTIER_DATA_DIR: empty, it is listed as unavailable with the message on
    stderr (the listing itself succeeds: exit 0), no traceback;
    listing tokenizers imports neither the server nor another subcommand."""
    code = (
        "import sys; from toktier.tools.cli import main; rc = main(['tokenizers']); "
        "print(sorted(m for m in sys.modules if m.startswith(('toktier_sidecar', 'toktier.tools.verify', "
        "'toktier.tools.demo', 'toktier.tools.corpus', 'rich', 'faker', 'emoji')))); sys.exit(rc)"
    )
    env = {**os.environ, "TOKTIER_DATA_DIR": str(tmp_path)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "Traceback" not in out.stderr
    assert "qwen3" in out.stderr and "fetch-test-data.sh" in out.stderr  # the message says how to get it
    assert "cl100k_base" in out.stdout and "qwen3          unavailable" in out.stdout
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_demo_with_missing_data_prints_the_message(tmp_path, monkeypatch, capsys):
    from toktier.tools.cli import main

    monkeypatch.setenv("TOKTIER_DATA_DIR", str(tmp_path))
    assert main(["demo", "--tokenizer", "qwen3", "--steps", "1", "--start-chars", "10"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("toktier: tokenizer 'qwen3'") and "fetch-test-data.sh" in err


def test_unknown_tokenizer_is_a_usage_error(capsys):
    from toktier.tools.cli import main

    assert main(["demo", "--tokenizer", "no_such_tokenizer"]) == 2
    assert "cl100k_base" in capsys.readouterr().err  # the message lists what exists


def test_missing_tools_extra_gets_an_install_hint(monkeypatch, capsys):
    from toktier.tools import cli, demo

    def run_demo(cfg):
        raise ModuleNotFoundError("No module named 'faker'", name="faker")

    monkeypatch.setattr(demo, "run_demo", run_demo)
    assert cli.main(["demo"]) == 1
    assert "toktier[tools]" in capsys.readouterr().err


def test_serve_dispatches_through_the_one_module_name(monkeypatch):
    """The server package may be renamed: `serve` imports whatever `SERVE_MODULE` names, when run."""
    import types

    from toktier.tools import cli

    seen = []
    fake = types.ModuleType("fake_server_cli")
    fake.main = lambda argv: seen.append(argv) or 0
    monkeypatch.setitem(sys.modules, "fake_server_cli", fake)
    monkeypatch.setattr(cli, "SERVE_MODULE", "fake_server_cli")
    assert cli.main(["serve", "--socket", "x"]) == 0
    assert seen == [["--socket", "x"]]


def _core_import_graph() -> dict[str, set[str]]:
    """toktier module -> toktier modules it imports (any import statement, also inside functions)."""
    import ast
    from pathlib import Path

    root = Path(toktier.__file__).resolve().parent
    mods = {}
    for path in root.rglob("*.py"):
        rel = path.relative_to(root.parent).with_suffix("")
        parts = list(rel.parts)
        if "tools" in parts:
            continue  # tooling sits above the core; its own imports are not the core's
        is_pkg = parts[-1] == "__init__"
        name = ".".join(parts[:-1] if is_pkg else parts)
        mods[name] = (path, is_pkg)
    graph: dict[str, set[str]] = {m: set() for m in mods}
    for name, (path, is_pkg) in mods.items():
        package = name if is_pkg else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            targets: list[str] = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = package
                for _ in range(node.level - 1):
                    base = base.rpartition(".")[0]
                mod = (f"{base}.{node.module}" if node.module else base) if node.level else (node.module or "")
                targets = [f"{mod}.{a.name}" if f"{mod}.{a.name}" in mods else mod for a in node.names]
            for t in targets:
                while t and t not in mods:
                    t = t.rpartition(".")[0]
                if t and t != name:
                    graph[name].add(t)
    return graph


def test_no_import_cycle_in_the_core():
    """The core's modules form a DAG (packages' own __init__ re-exports aside)."""
    graph = _core_import_graph()
    assert "toktier.fullpath" in graph and "toktier.gpu.router" in graph
    # A package's __init__ re-exports its submodules; a submodule reaching back to its package's
    # __init__ (rather than a sibling module) would be the cycle to catch, so keep those edges.
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycle = stack[stack.index(n):] + [n]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if n not in state:
                visit(n)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m)
