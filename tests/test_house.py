"""The house rules of src/ (issue 26): modules, classes and functions small enough to read, and
no import cycle, so a package can be read (and copied) without the rest of the tree."""

from __future__ import annotations

import ast
from pathlib import Path
from typing import Iterator

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
MAX_MODULE, MAX_CLASS, MAX_FUNCTION = 400, 200, 80


def _modules() -> dict[str, Path]:
    found = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = path.relative_to(SRC).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        found[name] = path
    return found


def test_no_module_class_or_function_is_over_its_size_limit() -> None:
    over = []
    for name, path in _modules().items():
        text = path.read_text()
        if (lines := text.count("\n")) > MAX_MODULE:
            over.append(f"module {name}: {lines} lines > {MAX_MODULE}")
        for node in ast.walk(ast.parse(text)):
            if not isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            size = (node.end_lineno or node.lineno) - node.lineno + 1
            if isinstance(node, ast.ClassDef) and size > MAX_CLASS:
                over.append(f"class {name}.{node.name}: {size} lines > {MAX_CLASS}")
            elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and size > MAX_FUNCTION:
                over.append(f"function {name}.{node.name}: {size} lines > {MAX_FUNCTION}")
    assert not over, "\n".join(over)


def _import_nodes(node: ast.AST) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement below `node`, in functions too (an import put off into a function
    to dodge a cycle is still a cycle for the reader), but not under `if TYPE_CHECKING:`, which
    never runs."""
    for child in ast.iter_child_nodes(node):
        if isinstance(child, ast.Import | ast.ImportFrom):
            yield child
        elif isinstance(child, ast.If) and ast.unparse(child.test).endswith("TYPE_CHECKING"):
            yield from (n for branch in child.orelse for n in _import_nodes(branch))
        else:
            yield from _import_nodes(child)


def _imports(tree: ast.Module, name: str, is_package: bool, known: set[str]) -> set[str]:
    """The modules of ours that `name` imports, each with the packages above it, which Python
    loads first."""
    package = name if is_package else name.rpartition(".")[0]
    targets: set[str] = set()
    for node in _import_nodes(tree):
        if isinstance(node, ast.Import):
            targets.update(a.name for a in node.names)
        else:
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1])
                base = f"{base}.{node.module}" if node.module else base
            targets.add(base)
            # `from pkg import mod` loads pkg.mod when it is a module of ours.
            targets.update(f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in known)
    edges = set()
    for target in targets:
        parts = target.split(".")
        edges.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
    return {e for e in edges if e in known and e != name and not name.startswith(e + ".")}


def test_no_import_cycle_between_modules_of_src() -> None:
    modules = _modules()
    known = set(modules)
    graph = {
        name: _imports(ast.parse(path.read_text()), name, path.stem == "__init__", known)
        for name, path in modules.items()
    }
    # A package's __init__ may import its own submodules (re-exports): that is not a cycle,
    # provided no submodule imports the package's __init__-defined names back; the edge from a
    # submodule to its parent package is therefore left out above.
    cycles, state = [], dict.fromkeys(graph, 0)

    def visit(node: str, stack: list[str]) -> None:
        state[node] = 1
        for nxt in sorted(graph[node]):
            if state[nxt] == 1:
                cycles.append(" -> ".join([*stack[stack.index(nxt) :], nxt]))
            elif state[nxt] == 0:
                visit(nxt, [*stack, nxt])
        state[node] = 2

    for name in sorted(graph):
        if state[name] == 0:
            visit(name, [name])
    assert not cycles, "import cycles:\n" + "\n".join(cycles)


def test_every_package_of_src_ships_in_the_wheel() -> None:
    # pyproject lists packages by hand (conf/ ships as hydra_ddp.conf); a subpackage left out
    # works in an editable checkout and fails only once installed, so this catches it early.
    tomllib = pytest.importorskip("tomllib")
    listed = set(
        tomllib.loads((SRC.parent / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    packages = {name for name, path in _modules().items() if path.name == "__init__.py"}
    missing = sorted(packages - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks: {', '.join(missing)}"


# The directories GitHub's standard Python .gitignore treats as build output: a package by one of
# these names drops out of the commits of a user who adds that .gitignore to their clone.
BUILD_OUTPUT_DIRS = {"build", "dist", "develop-eggs", "downloads", "eggs", "lib", "lib64", "parts"}
BUILD_OUTPUT_DIRS |= {"sdist", "var", "wheels"}


def test_no_directory_is_named_like_build_output() -> None:
    named = sorted(
        str(path.relative_to(SRC.parent))
        for top in ("src", "conf", "scripts", "tests", "docs")
        for path in (SRC.parent / top).rglob("*")
        if path.is_dir() and path.name in BUILD_OUTPUT_DIRS
    )
    assert not named, f"rename these: the standard Python .gitignore hides them: {named}"


MAX_TRAIN_PY, MAX_JOB_IMPORTS = 120, 15


def test_train_py_is_the_flow_and_no_plumbing() -> None:
    """train.py reads like the design: short, nothing done at its import but the Ctrl-C guard
    (first, before torch), no launcher's environment read, no os._exit."""
    path = SRC / "hydra_ddp" / "train.py"
    text = path.read_text()
    assert text.count("\n") <= MAX_TRAIN_PY, f"train.py: {text.count(chr(10))} lines"
    tree = ast.parse(text)
    imports = [n for n in tree.body if isinstance(n, ast.Import | ast.ImportFrom)]
    ours = [n for n in imports if ast.unparse(n).startswith(("import hydra_ddp", "from hydra_ddp"))]
    assert ast.unparse(ours[0]) == "import hydra_ddp.launch.interrupt", (
        "the Ctrl-C guard comes first"
    )
    at_import = [
        ast.unparse(n)
        for n in tree.body
        if not isinstance(n, ast.Import | ast.ImportFrom | ast.FunctionDef | ast.ClassDef)
        and not (isinstance(n, ast.Expr) and isinstance(n.value, ast.Constant))  # docstring
        and not (isinstance(n, ast.If) and "__main__" in ast.unparse(n.test))
        and not (isinstance(n, ast.If) and ast.unparse(n.test) == "TYPE_CHECKING")
    ]
    assert not at_import, f"train.py runs at import: {at_import}"
    for banned in ("os.environ", "os._exit", "isort: split", "sys.argv"):
        assert banned not in text, f"train.py: {banned} belongs to launch/command.py"


def _internal_imports(path: Path, name: str, known: set[str]) -> set[str]:
    """The modules of ours `name` imports, module and function level: `from a.b import c` is a.b,
    or a.b.c when that is a module of ours."""
    package = name.rpartition(".")[0]
    found = set()
    for node in _import_nodes(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
            continue
        base = node.module or ""
        if node.level:
            up = package.split(".")[: len(package.split(".")) - node.level + 1]
            base = ".".join([*up, *([node.module] if node.module else [])])
        for alias in node.names:
            found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
    return {m for m in found if m.split(".")[0] == "hydra_ddp"}


def test_the_job_builder_imports_few_modules() -> None:
    modules = _modules()
    found = _internal_imports(
        modules["hydra_ddp.loop.prepare"], "hydra_ddp.loop.prepare", set(modules)
    )
    assert len(found) <= MAX_JOB_IMPORTS, f"loop/prepare.py imports {len(found)}: {sorted(found)}"
