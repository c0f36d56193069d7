"""scripts/new_project.py --fork on a copy of this checkout: rename, strip, then test and train
the copy (the thin project, the default, is tests/test_thin_project.py's).

The copy holds the working tree's current files (git's tracked and untracked-but-not-ignored
ones), so the test checks the tree as it is, not the last commit. The script runs in process: the
copy's scripts/new_project.py is loaded and its main() called with the command line's arguments
(its exit status and output captured as a subprocess's would be).
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

REPO = Path(__file__).resolve().parents[1]
OLD = "hydra_ddp"


def copy_checkout(dst: Path, *, commit: bool) -> Path:
    """Copy the checkout's files into dst; with commit, make dst a git repo with one commit."""
    names = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, names):
        src = REPO / name
        if src.is_file():  # a tracked file deleted in the working tree is left out
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    if commit:
        git = [
            "git",
            "-C",
            str(dst),
            "-c",
            "user.email=test@example.com",
            "-c",
            "user.name=test",
            "-c",
            "commit.gpgsign=false",
            "-c",
            "init.defaultBranch=main",
        ]
        for args in (["init", "-q"], ["add", "-A"], ["commit", "-q", "-m", "template"]):
            subprocess.run(git + args, check=True, capture_output=True, timeout=60)
    return dst


def new_project(root: Path, *args: str, script: Path | None = None) -> SimpleNamespace:
    """`python <root>/scripts/new_project.py --fork ARGS` (or `script`), in process: its exit
    status, stdout and stderr."""
    script = script or root / "scripts" / "new_project.py"
    spec = importlib.util.spec_from_file_location("new_project_under_test", script)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = [str(script), "--fork", *args]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            module.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        sys.argv = argv
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def snapshot(root: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(root)): p.read_bytes()
        for p in root.rglob("*")
        if p.is_file() and ".git" not in p.relative_to(root).parts
    }


def leftovers(root: Path, files: list[str]) -> list[str]:
    """Files still naming the template (binary files skipped)."""
    found = []
    for name in files:
        try:
            text = (root / name).read_bytes().decode("utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        found += [f"{name}: {s}" for s in (OLD, "hydra-ddp", "HYDRA_DDP") if s in text]
    return found


def renamed_env(root: Path, tmp: Path) -> dict[str, str]:
    """A user's environment for the renamed copy: its src/ only, W&B offline under tmp."""
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WANDB_", "TORCHELASTIC_", "SLURM_", "SUBMITIT_"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    keep = [
        p
        for p in env.get("PYTHONPATH", "").split(os.pathsep)
        if p and not Path(p).resolve().is_relative_to(REPO)
    ]
    env.update(
        PYTHONPATH=os.pathsep.join([str(root / "src"), *keep]),
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp / "wandb"),
        WANDB_CONFIG_DIR=str(tmp / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp / "wandb-data"),
        NETRC=str(tmp / "no-netrc"),
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
    )
    return env


def check(proc):
    assert proc.returncode == 0, (
        f"exit {proc.returncode}\n--- stdout\n{proc.stdout[-4000:]}"
        f"\n--- stderr\n{proc.stderr[-6000:]}"
    )
    return proc


@pytest.mark.parametrize(
    "args,says",
    [
        (["myproj", "--strip", "model/mlp"], "default"),  # the default model
        (["myproj", "--strip", "model/nope"], "model/nope"),  # no such file
        (
            ["myproj", "--strip", "model/gpt", "--strip", "ddp/default"],
            "default",
        ),  # all checked first
        (["My-Proj"], "My-Proj"),
        ([OLD], OLD),
        (["class"], "keyword"),
    ],
)
def test_refusals_change_nothing(tmp_path: Path, args: list[str], says: str) -> None:
    root = copy_checkout(tmp_path, commit=False)
    before = snapshot(root)
    proc = new_project(root, *args)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and says in lines[0], proc.stderr
    assert (root / "src" / OLD).is_dir() and snapshot(root) == before


def test_refuses_a_choice_another_config_chooses(tmp_path: Path) -> None:
    root = copy_checkout(tmp_path, commit=False)
    (root / "conf" / "model" / "tiny.yaml").write_text("hidden: 8\n")
    (root / "conf" / "data" / "mine.yaml").write_text(
        "# @package _global_\ndefaults:\n  - override /model: tiny\n"
    )
    before = snapshot(root)
    proc = new_project(root, "myproj", "--strip", "model/tiny")
    assert proc.returncode == 2 and "conf/data/mine.yaml" in proc.stderr, proc.stderr
    assert snapshot(root) == before


def test_dry_run_changes_nothing(tmp_path: Path) -> None:
    root = copy_checkout(tmp_path, commit=False)
    before = snapshot(root)
    gpt = ["--strip", "model/gpt", "--strip", "experiment/text_gpt"]  # the experiment uses it
    proc = check(new_project(root, "myproj", *gpt, "--dry-run"))
    assert "would rewrite pyproject.toml" in proc.stdout
    assert "would delete conf/model/gpt.yaml" in proc.stdout and "dry run:" in proc.stdout
    assert snapshot(root) == before


def test_rename_without_git_then_refuse_a_second_time(tmp_path: Path) -> None:
    root = copy_checkout(tmp_path / "plain", commit=False)
    files = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    proc = check(new_project(root, "my_proj"))
    assert "my-proj-train" in proc.stdout and "python -m my_proj.train" in proc.stdout
    assert (root / "src" / "my_proj" / "train.py").is_file() and not (root / "src" / OLD).exists()
    assert not (root / "scripts" / "new_project.py").exists()
    now = [str(p.relative_to(root)) for p in root.rglob("*") if p.is_file()]
    # Gone: itself, its tests and the thin project's template.
    only_template = ("scripts/new_project.py", "scripts/thin_template/", "tests/test_new_project")
    gone = [f for f in files if f.startswith((*only_template, "tests/test_thin_project"))]
    assert len(gone) > 4 and not (root / "scripts" / "thin_template").exists()
    assert len(now) == len(files) - len(gone) and leftovers(root, now) == []
    assert 'name = "my-proj"' in (root / "pyproject.toml").read_text()
    again = new_project(
        root, "other", "--root", str(root), script=REPO / "scripts" / "new_project.py"
    )
    assert again.returncode == 2 and again.stderr.startswith("error: "), again.stderr
    clash = copy_checkout(tmp_path / "clash", commit=False)
    (clash / "src" / "taken").mkdir()
    proc = new_project(clash, "taken")
    assert proc.returncode == 2 and "already exists" in proc.stderr, proc.stderr


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_renamed_copy_passes_its_config_tests_and_trains_on_two_ranks(tmp_path: Path) -> None:
    root = copy_checkout(tmp_path / "myproj_repo", commit=True)
    proc = check(new_project(root, "myproj", "--strip", "data/synthetic"))
    assert "myproj-train" in proc.stdout and "pip install -e ." in proc.stdout

    assert (root / "src" / "myproj").is_dir() and not (root / "src" / OLD).exists()
    assert not (root / "conf" / "data" / "synthetic.yaml").exists()
    tracked = subprocess.run(
        ["git", "-C", str(root), "ls-files"], check=True, text=True, capture_output=True
    ).stdout.split()
    assert "src/myproj/train.py" in tracked and not any(OLD in t for t in tracked)  # git mv
    assert "conf/data/synthetic.yaml" not in tracked
    assert leftovers(root, [t for t in tracked if (root / t).is_file()]) == []
    pyproject = (root / "pyproject.toml").read_text()
    assert re.search(r'^myproj-train = "myproj\.train:main"$', pyproject, re.M), pyproject

    env = renamed_env(root, tmp_path)
    where = check(
        subprocess.run(
            [sys.executable, "-c", "import myproj; print(myproj.__file__)"],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=120,
        )
    )
    assert Path(where.stdout.strip()).resolve().is_relative_to(root.resolve())

    check(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "tests/test_config.py",
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=400,
        )
    )

    check(
        subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc_per_node=2",
                "-m",
                "myproj.train",
                "logger=none",
                "trainer.progress=false",
                "trainer.max_steps=5",
            ],
            cwd=root,
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )
    )
    summaries = [p for p in (root / "outputs").rglob("summary.json") if p.parent.name != "stats"]
    assert len(summaries) == 1, summaries
    assert re.search(r'"world_size":\s*2\b', summaries[0].read_text())
    composed = (summaries[0].parent / ".hydra" / "config.yaml").read_text()
    assert re.search(r"_target_: myproj\.", composed) and OLD not in composed, composed
