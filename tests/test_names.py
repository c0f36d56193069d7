"""One meaning per name, and one definition per fact (STYLE.md: "a word that names two things in
one codebase costs every reader a lookup").

What is checked, read from the source with `ast` (src/ parsed once for all the checks):

* No two modules of `hydra_ddp` define the same public top-level function or class, so a name
  seen at a call site (`set_aside_stats`, `build_policy`) leads to one definition. Private
  helpers (`_fmt`) are left out: they are read only inside their own module. `ALLOWED` lists the
  deliberate exceptions, each with its reason; a new one is added there on purpose, not by
  accident.
* The names retired, for naming several things (`parts` was a module, the Job's components, the
  checkpoint's objects and a policy's per-rank ranges) or for saying nothing of what a function
  does (`of`, `kept`), define nothing again: no module, function, class, method or class field
  of src/ takes them.
* The duplicates folded stay folded: the config check helper is errors.check_setting alone (a second
  one fails the first check, `_require` the second); the built-in comm hooks are named in
  ddp_config.COMM_HOOKS only; only data/sources.py loads the digits (`split_digits`); FAST is set in
  tests/conftest.py only.

Local variables are not checked: a name inside one function is read next to its meaning.
"""

from __future__ import annotations

import ast
import functools
import re
from collections import defaultdict
from pathlib import Path

from hydra_ddp.ddp_config import COMM_HOOKS
from hydra_ddp.distributed import comm_hooks
from hydra_ddp.protocols import PROTOCOLS

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
PACKAGE = SRC / "hydra_ddp"

# Public top-level names that several modules define on purpose.
ALLOWED = {
    "main": "every `python -m hydra_ddp.<entry>` module's entry function",
    "load": "checkpoint.load reads a training checkpoint, export.load rebuilds a model from an "
    "export folder: each package's documented front door, always read qualified",
}

# Each of these named two or more things, or a function without saying what it does.
RETIRED = {
    "parts", "Parts", "damage", "set_aside", "record", "built", "of", "kept", "changed", "_at",
    "_require",
}  # fmt: skip


@functools.cache
def _src_trees() -> dict[Path, ast.Module]:
    return {p: ast.parse(p.read_text(), str(p)) for p in sorted(SRC.rglob("*.py"))}


def _trees(root: Path) -> dict[Path, ast.Module]:
    return {p: tree for p, tree in _src_trees().items() if p.is_relative_to(root)}


def _where(path: Path, node: ast.AST) -> str:
    return f"{path.relative_to(REPO)}:{getattr(node, 'lineno', 0)}"


def test_no_two_modules_of_the_package_define_the_same_public_name() -> None:
    defined: dict[str, list[str]] = defaultdict(list)
    for path, tree in _trees(PACKAGE).items():
        for node in tree.body:
            is_def = isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
            if is_def and not node.name.startswith("_"):
                defined[node.name].append(_where(path, node))
    # A contract of hydra_ddp.protocols and the base class that implements it with defaults
    # (data.DataSource, tracking.Sink, ...) are one concept, its contract and its default: one
    # more definition, outside protocols.py, is allowed for those names.
    contracts = {p.__name__ for p in PROTOCOLS}
    for name in contracts & set(defined):
        at = defined[name]
        if len(at) == 2 and sum("src/hydra_ddp/protocols.py:" in w for w in at) == 1:
            del defined[name]
    shared = {n: at for n, at in defined.items() if len(at) > 1 and n not in ALLOWED}
    assert not shared, "one name, several definitions (rename one, or add it to ALLOWED):\n" + (
        "\n".join(f"{n}: {', '.join(at)}" for n, at in sorted(shared.items()))
    )
    assert set(ALLOWED) <= {n for n, at in defined.items() if len(at) > 1}, "ALLOWED is stale"


def test_no_retired_name_is_defined_again() -> None:
    found = [str(p.relative_to(REPO)) for p in SRC.rglob("*.py") if p.stem in RETIRED]  # a module
    for path, tree in _trees(SRC).items():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                if node.name in RETIRED:
                    found.append(f"{_where(path, node)} {node.name}")
            if isinstance(node, ast.ClassDef):  # a dataclass field or class attribute
                for item in node.body:
                    target = getattr(item, "target", None)
                    if isinstance(target, ast.Name) and target.id in RETIRED:
                        found.append(f"{_where(path, item)} {node.name}.{target.id}")
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                if node.attr in RETIRED:  # self.parts = ...
                    found.append(f"{_where(path, node)} .{node.attr}")
    assert not found, "a retired name is back; give it a name that says what it is:\n" + (
        "\n".join(found)
    )


def test_the_built_in_comm_hooks_are_named_in_one_table() -> None:
    names = set(COMM_HOOKS) - {"none"}  # "none" is every switch's off, not only this one's
    elsewhere = [
        f"{_where(path, node)} {node.value!r}"
        for path, tree in _trees(SRC).items()
        if path.name != "ddp_config.py"
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and node.value in names
    ]
    assert not elsewhere, "a comm hook's name outside ddp_config.COMM_HOOKS:\n" + "\n".join(
        elsewhere
    )
    assert COMM_HOOKS["none"] is None
    for name, cls in COMM_HOOKS.items():  # the table's classes are comm_hooks.py's
        assert cls is None or issubclass(getattr(comm_hooks, cls), comm_hooks.CommHook), name


def test_only_the_data_module_loads_and_splits_the_digits() -> None:
    loaders = [
        _where(path, node)
        for path, tree in _trees(SRC).items()
        for node in ast.walk(tree)
        if isinstance(node, ast.Name | ast.alias)
        and getattr(node, "id", getattr(node, "name", None)) == "load_digits"
    ]
    assert loaders and all(w.startswith("src/hydra_ddp/data/sources.py:") for w in loaders), loaders


def test_fast_is_set_in_conftest_only() -> None:
    setters = [
        str(path.relative_to(REPO))
        for path in sorted((REPO / "tests").rglob("*.py"))
        if re.search(r"^FAST\b.*=", path.read_text(), re.MULTILINE)
    ]
    assert setters == ["tests/conftest.py"], setters
