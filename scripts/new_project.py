"""Make the template yours in one command: a thin project on this engine, or a full fork.

    python scripts/new_project.py myproj --dir ..              # ../myproj/ on this engine
    python scripts/new_project.py myproj --fork                # src/hydra_ddp -> src/myproj, ...
    python scripts/new_project.py my_proj --fork --strip model/gpt --strip data/text --dry-run

Two ways to make it yours. A thin project (the default) is a project of its own in ./NAME/ (or
--dir PATH/NAME/), written from scripts/thin_template/ with `myproj` replaced by NAME: its
model, data, loss, callbacks, configs layered over the engine's, tests and CI, depending on
hydra-ddp at this version and importing only `hydra_ddp.api`; upgrading the engine is `pip
install -U`. It never writes into the engine's checkout. It is what a team should own: the
machinery stays a dependency. A full fork (--fork) owns all the machinery and takes no fix
from upstream.

With --fork, in place, in the repository root (or --root), it

  * renames the package directory src/hydra_ddp -> src/NAME, and the Hydra plugins
    src/hydra_plugins/hydra_ddp_* (the Ray launcher, the pruning sweeper) -> NAME_* (`git mv`
    in a git work tree);
  * rewrites every text file (git's tracked and untracked-but-not-ignored files; without git,
    the tree minus .git, .venv, outputs, multirun, wandb and caches): hydra_ddp -> NAME,
    hydra-ddp -> NAME with dashes (the distribution, the console script <dashed>-train, the W&B
    project), HYDRA_DDP -> NAME in capitals. That covers imports, `_target_` strings,
    pyproject.toml, the README and docs/;
  * with --strip GROUP/CHOICE, deletes conf/GROUP/CHOICE.yaml, unless a defaults list chooses it
    (conf/train.yaml's default, or e.g. data/diabetes.yaml's `override /loss: mse`);
  * removes this script, its tests and the thin project's template: they only apply to the
    template.

Every check runs before anything changes; a refusal is one `error: ...` line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib.util
import keyword
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

OLD = "hydra_ddp"
SKIP_DIRS = {".git", ".venv", "outputs", "multirun", "wandb", "__pycache__", ".pytest_cache"}
SELF = [
    Path("scripts/new_project.py"),
    Path("scripts/thin_template"),
    Path("tests/test_new_project.py"),
    Path("tests/test_thin_project.py"),
]
TEMPLATE = Path(__file__).resolve().parent / "thin_template"
TEMPLATE_NAME = "myproj"  # the project's name in the template's paths and text


def fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def git(root: Path, *args: str) -> str:
    return subprocess.run(
        ["git", "-C", str(root), *args], check=True, capture_output=True, text=True
    ).stdout


def is_git_tree(root: Path) -> bool:
    try:
        return Path(git(root, "rev-parse", "--show-toplevel").strip()).resolve() == root
    except (OSError, subprocess.CalledProcessError):
        return False


def project_files(root: Path, use_git: bool) -> list[Path]:
    """Relative paths of the project's files: git's view of them, else a filtered walk."""
    if use_git:
        names = git(root, "ls-files", "-z", "--cached", "--others", "--exclude-standard")
        found = sorted({Path(n) for n in names.split("\0") if n})
    else:
        found = []
        for dirpath, dirs, files in os.walk(root):
            dirs[:] = [d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")]
            found += [Path(dirpath, f).relative_to(root) for f in files]
    return [p for p in found if (root / p).is_file() and not (root / p).is_symlink()]


def chosen_by(conf: Path) -> dict[str, list[str]]:
    """`group/choice` -> the conf/ files whose defaults list chooses it (`- [override] g: c`)."""
    chosen: dict[str, list[str]] = {}
    for path in sorted(conf.rglob("*.yaml")):
        text, here = path.read_text(), path.parent.relative_to(conf).as_posix()
        try:
            import yaml

            entries = (yaml.safe_load(text) or {}).get("defaults") or []
        except ImportError:  # no PyYAML: the simple `- key: value` lines are all this needs
            entries = [dict([kv]) for kv in re.findall(r"^\s*-\s*([^:#\n]+):\s*(\S+)", text, re.M)]
        except (yaml.YAMLError, AttributeError):
            continue
        for entry in entries:
            for key, value in entry.items() if isinstance(entry, dict) else []:
                group = key.split()[-1].split("@")[0]  # `override x@pkg` -> x
                if not group.startswith("/") and here != ".":  # relative to the file's group
                    group = f"{here}/{group}"
                for v in value if isinstance(value, list) else [value]:
                    chosen.setdefault(f"{group.strip('/')}/{v}", []).append(
                        path.relative_to(conf.parent).as_posix()
                    )
    return chosen


def yaml_target(path: Path, name: str) -> str:
    """The YAML's `_target_` (its first one), else the schema its defaults extend."""
    text = path.read_text().replace(OLD, name)
    if m := re.search(r"^\s*_target_:\s*(\S+)", text, re.M):
        return f"_target_ {m.group(1)}"
    if m := re.search(r"^\s*-\s*(/schema/[^@\s]+)", text, re.M):
        return f"the _target_ of the schema {m.group(1)} (src/{name}/config.py)"
    return "no _target_"


def is_self(rel: Path) -> bool:
    return any(rel.is_relative_to(p) for p in SELF)


def engine_version(root: Path) -> str:
    """hydra_ddp.__version__ of the checkout at `root`, read without importing it."""
    init = (root / "src" / OLD / "__init__.py").read_text()
    return re.search(r'^__version__ = "([^"]+)"', init, re.M).group(1)


def thin_files(name: str, version: str) -> dict[Path, tuple[str, int]]:
    """The thin project's files: relative path -> (text, mode), NAME put in for the template's."""
    files = {}
    for path in sorted(TEMPLATE.rglob("*")):
        rel = path.relative_to(TEMPLATE)
        if not path.is_file() or any(p in SKIP_DIRS or p.endswith("_cache") for p in rel.parts):
            continue
        text = path.read_text().replace(f"{TEMPLATE_NAME}-train", f"{name.replace('_', '-')}-train")
        text = text.replace(TEMPLATE_NAME, name)
        if rel == Path("pyproject.toml"):
            text = re.sub(r'"hydra-ddp==[^"]*"', f'"hydra-ddp=={version}"', text)
        files[Path(str(rel).replace(TEMPLATE_NAME, name))] = (text, path.stat().st_mode & 0o777)
    return files


def make_thin(name: str, parent: Path, root: Path, dry_run: bool) -> None:
    """Write the thin project NAME into parent/NAME (see the module docstring)."""
    target = (parent / name).resolve()
    if target.exists():
        fail(f"{target} already exists: remove it, or give another NAME or --dir")
    if target.is_relative_to(root):
        fail(
            f"{target} is inside the engine's checkout {root}: give --dir a folder outside it "
            "(e.g. --dir .. from the checkout's root)"
        )
    files = thin_files(name, engine_version(root))
    verb = "would " if dry_run else ""
    for rel in files:
        print(f"  {verb}write {target.name}/{rel}")
    if dry_run:
        print(f"dry run: {len(files)} files would be written; nothing was written")
        return
    for rel, (text, mode) in files.items():
        (target / rel).parent.mkdir(parents=True, exist_ok=True)
        (target / rel).write_text(text)
        (target / rel).chmod(mode)
    print(
        f"\ndone: {target} ({len(files)} files), on hydra-ddp {engine_version(root)}\nnext:\n"
        f'  cd {target}\n  pip install -e ".[dev]"    # with hydra-ddp installed, or from '
        "your index\n"
        f"  torchrun --standalone --nproc_per_node=2 -m {name}.train\n  python -m pytest"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description="Write a thin project NAME/ on this engine, or (--fork) rename the "
        "template's package, distribution, console script and W&B project to NAME, in place; "
        "optionally drop example configs.",
        epilog="--strip only deletes the YAML file: the Python classes it pointed at stay in "
        "src/NAME and stay importable; removing them is your call.",
    )
    parser.add_argument("name", metavar="NAME", help="new import name, e.g. myproj or my_proj")
    parser.add_argument(
        "--strip",
        action="append",
        default=[],
        metavar="GROUP/CHOICE",
        help="delete conf/GROUP/CHOICE.yaml (repeatable), e.g. model/gpt",
    )
    parser.add_argument(
        "--dry-run", action="store_true", help="print what would change, change nothing"
    )
    parser.add_argument(
        "--root",
        type=Path,
        default=Path(__file__).resolve().parents[1],
        help="repository root (default: the one holding this script)",
    )
    parser.add_argument(
        "--fork",
        action="store_true",
        help="rename this checkout in place (a full fork), instead of writing a thin project",
    )
    parser.add_argument(
        "--thin",
        action="store_true",
        help="write a thin project NAME/ that depends on this engine (the default)",
    )
    parser.add_argument(
        "--dir",
        type=Path,
        default=Path.cwd(),
        help="the folder to make the thin project NAME/ in (default: the current one)",
    )
    args = parser.parse_args()
    root, name = args.root.resolve(), args.name

    if not re.fullmatch(r"[a-z][a-z0-9_]*", name):
        fail(f"NAME {name!r}: use lowercase letters, digits and _, starting with a letter")
    if name == OLD or keyword.iskeyword(name) or name in sys.stdlib_module_names:
        fail(f"NAME {name!r} is the template's own name, a Python keyword or a standard module")
    if importlib.util.find_spec(name) is not None:
        fail(f"NAME {name!r} would shadow the installed module {name!r}; pick another")
    if args.fork and args.thin:
        fail("--fork and --thin: pick one (a thin project is the default)")
    if not args.fork:
        if args.strip:
            fail("--strip is for a full fork (add --fork): a thin project has only its own configs")
        make_thin(name, args.dir, root, args.dry_run)
        return
    if not (root / "src" / OLD).is_dir():
        fail(f"{root / 'src' / OLD} does not exist: already renamed, or --root is wrong")
    if (root / "src" / name).exists():
        fail(f"{root / 'src' / name} already exists")
    chosen, strips = chosen_by(root / "conf"), {}
    # A file stripped in the same call does not hold on to what it chooses.
    stripped = {
        Path("conf", *c.strip("/").rpartition("/")[::2]).as_posix() + ".yaml" for c in args.strip
    }
    for choice in args.strip:
        group, _, option = choice.strip("/").rpartition("/")
        path = Path("conf", group, f"{option}.yaml")
        if not group or not (root / path).is_file():
            fail(f"--strip {choice}: no {path} (give GROUP/CHOICE, e.g. model/gpt)")
        users = [u for u in chosen.get(f"{group}/{option}", []) if u not in stripped]
        if "conf/train.yaml" in users:
            fail(f"--strip {choice}: it is the default in conf/train.yaml; change that first")
        if users:
            fail(f"--strip {choice}: the defaults list of {', '.join(users)} chooses it")
        strips[path] = f"{group}={option}"

    use_git = is_git_tree(root)
    files = project_files(root, use_git)
    texts, plan = {}, {}  # path -> its text after the rename; path -> replacements made
    for rel in files:
        if rel in strips or is_self(rel):
            continue
        try:
            text = (root / rel).read_bytes().decode("utf-8")  # bytes: line endings kept
        except (UnicodeDecodeError, OSError):
            continue  # binary (or unreadable): left alone
        new = text.replace(OLD, name).replace("hydra-ddp", name.replace("_", "-"))
        texts[rel] = new.replace("HYDRA_DDP", name.upper())
        if count := sum(text.count(s) for s in (OLD, "hydra-ddp", "HYDRA_DDP")):
            plan[rel] = count

    # The package dir and the Hydra plugins' dirs (the Ray launcher, the pruning sweeper: their
    # names carry the package's, so two renamed projects in one environment do not shadow
    # each other's plugins).
    renames = {Path("src", OLD): Path("src", name)}
    for plugin in sorted((root / "src" / "hydra_plugins").glob(f"{OLD}_*")):
        if plugin.is_dir():
            new_name = name + plugin.name[len(OLD) :]
            renames[plugin.relative_to(root)] = Path("src", "hydra_plugins", new_name)

    def moved(rel: Path) -> Path:  # a file's path after the renames
        for old, new in renames.items():
            if rel.is_relative_to(old):
                return new / rel.relative_to(old)
        return rel

    verb = "would " if args.dry_run else ""
    for old, new in renames.items():
        print(f"{verb}rename {old} -> {new}" + (" (git mv)" if use_git else ""))
    for rel, count in plan.items():
        print(f"  {verb}rewrite {rel} ({count} replacement{'s' * (count != 1)})")
    for path, override in strips.items():
        print(
            f"  {verb}delete {path}: it pointed at {yaml_target(root / path, name)}; "
            "the Python code stays"
        )
        if users := [str(moved(r)) for r, text in texts.items() if override in text]:
            print(f"    {override} is still mentioned in: {', '.join(users)}")
    present = [p for p in SELF if (root / p).exists()]
    if present:
        print(f"  {verb}remove {', '.join(map(str, present))} (template-only)")
    if args.dry_run:
        print(f"dry run: {len(plan)} files would change; nothing was written")
        return

    def remove(rel: Path) -> None:
        if use_git and git(root, "ls-files", str(rel)).strip():
            git(root, "rm", "-r", "-q", "-f", str(rel))
        if (root / rel).is_dir():  # what git did not track in it
            shutil.rmtree(root / rel)
        elif (root / rel).exists():
            (root / rel).unlink()

    for path in strips:
        remove(path)
    for old, new in renames.items():
        if use_git and git(root, "ls-files", str(old)).strip():
            git(root, "mv", str(old), str(new))  # moves the untracked files with it too
        else:
            (root / old).rename(root / new)
    for rel in plan:
        (root / moved(rel)).write_bytes(texts[rel].encode("utf-8"))
    for rel in present:
        remove(rel)

    dashed = name.replace("_", "-")
    print(
        f"\ndone: {len(plan)} files changed, {len(strips)} configs removed\n"
        f"  import name     {name}\n  console script  {dashed}-train\nnext:\n"
        "  pip uninstall -y hydra-ddp    # if the template was installed\n"
        f"  pip install -e .\n  python -m {name}.train"
    )


if __name__ == "__main__":
    main()
