"""run.json's view of the code (provenance.git_state), in a temporary git repo: untracked files
that are not ignored are listed with their sizes and make the tree dirty; their contents go into
the patch only with trainer.untracked_content=true, and `git apply` of that patch on a clean
checkout recreates them."""

from __future__ import annotations

import subprocess
from pathlib import Path

from hydra_ddp.rundir import provenance


def _git(repo: Path, *args: str) -> str:
    done = subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True,
                          check=True, timeout=30)  # fmt: skip
    return done.stdout


def _repo(tmp_path: Path) -> Path:
    repo = tmp_path / "repo"
    repo.mkdir()
    _git(repo, "init", "-q")
    (repo / ".gitignore").write_text("outputs/\n*.bin\n")
    (repo / "train.py").write_text("print('hi')\n")
    _git(repo, "add", ".")
    _git(repo, "-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "-m", "first")
    return repo


def test_untracked_files_are_listed_and_make_the_tree_dirty(tmp_path: Path) -> None:
    repo = _repo(tmp_path)
    out = tmp_path / "run"
    out.mkdir()
    clean = provenance.git_state(out, 1, checkout=repo)
    assert clean is not None and clean["dirty"] is False and clean["untracked"] == []
    assert "diff" not in clean and not list(out.iterdir())
    # A user's model in the repo root, a nested one, and files .gitignore excludes.
    (repo / "my_model.py").write_text("import torch\n" * 3)
    (repo / "models").mkdir()
    (repo / "models" / "head.py").write_bytes(b"x = 1\n")
    (repo / "outputs").mkdir()
    (repo / "outputs" / "log.txt").write_text("ignored")
    (repo / "weights.bin").write_bytes(b"\0" * 100)
    inside = repo / "my_runs" / "a"  # a run dir in the checkout: its own files are not listed
    inside.mkdir(parents=True)
    (inside / "train.log").write_text("log")
    listed = provenance.git_state(inside, 1, checkout=repo)["untracked"]
    assert [e["path"] for e in listed] == ["models/head.py", "my_model.py"]
    (inside / "train.log").unlink()
    state = provenance.git_state(out, 2, checkout=repo)
    assert state is not None and state["dirty"] is True
    assert state["untracked"] == [
        {"path": "models/head.py", "bytes": 6},
        {"path": "my_model.py", "bytes": 39},
    ]
    assert "diff" not in state and not list(out.iterdir()), "no contents without the opt-in"

    # Opted in: the patch holds them as new files, next to a tracked change.
    (repo / "train.py").write_text("print('changed')\n")
    state = provenance.git_state(out, 3, untracked_content=True, checkout=repo)
    patch = out / state["diff"]
    assert state["diff"] == "git_diff_3.patch" and "ignored" not in patch.read_text()
    clone = tmp_path / "clone"
    _git(tmp_path, "clone", "-q", str(repo), str(clone))
    _git(clone, "apply", str(patch))
    assert (clone / "my_model.py").read_text() == "import torch\n" * 3
    assert (clone / "models" / "head.py").read_bytes() == b"x = 1\n"
    assert (clone / "train.py").read_text() == "print('changed')\n"
