"""`scripts/new_project.py NAME` (a thin project, the default): a project of its own on the
engine, importing only hydra_ddp.api. In process: what it writes, its size, its imports, its
refusals, that the engine's checkout is left alone, and that its configs compose over the
engine's. Slow: a fresh
virtualenv with the engine installed from this checkout, then the project's README commands
(train on 2 ranks with torchrun, then its tests)."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import json
import math
import os
import re
import shutil
import subprocess
import sys
import time
import venv
from pathlib import Path
from types import SimpleNamespace

import pytest

import hydra_ddp
from hydra_ddp.api import compose

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "scripts" / "new_project.py"
FILES = {
    ".ci/run", ".gitignore", "README.md", "pyproject.toml", "tests/test_config.py",
    "tests/test_train.py", "src/{n}/__init__.py", "src/{n}/callbacks.py", "src/{n}/data.py",
    "src/{n}/loss.py", "src/{n}/model.py", "src/{n}/train.py", "src/{n}/conf/{n}.yaml",
    "src/{n}/conf/data/{n}.yaml", "src/{n}/conf/loss/{n}.yaml", "src/{n}/conf/model/{n}.yaml",
}  # fmt: skip
MAX_LINES = 1500


def new_project(*args: str) -> SimpleNamespace:
    """`python scripts/new_project.py ARGS`, in process: its exit status, stdout and stderr."""
    spec = importlib.util.spec_from_file_location("new_project_thin_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = [str(SCRIPT), *args]
    bytecode, sys.dont_write_bytecode = sys.dont_write_bytecode, True  # no scripts/__pycache__
    try:
        spec.loader.exec_module(module)
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            module.main()
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    finally:
        sys.argv, sys.dont_write_bytecode = argv, bytecode
    return SimpleNamespace(returncode=code, stdout=out.getvalue(), stderr=err.getvalue())


def git_status() -> str:
    return subprocess.run(
        ["git", "-C", str(REPO), "status", "--porcelain", "--ignored", "--untracked-files=all"],
        check=True,
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout


def files_of(project: Path) -> list[str]:
    return sorted(str(p.relative_to(project)) for p in project.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def made(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """One thin project `my_proj`, made in a fresh folder, with the checkout's status around it."""
    parent = tmp_path_factory.mktemp("thin")
    before = git_status()
    proc = new_project("my_proj", "--dir", str(parent))
    return SimpleNamespace(proc=proc, root=parent / "my_proj", before=before, after=git_status())


def test_it_writes_the_project_and_leaves_the_checkout_alone(made: SimpleNamespace) -> None:
    assert made.proc.returncode == 0, made.proc.stderr
    assert files_of(made.root) == sorted(f.format(n="my_proj") for f in FILES)
    assert made.after == made.before  # nothing written, built or cached in the engine's tree
    pyproject = (made.root / "pyproject.toml").read_text()
    assert f'"hydra-ddp=={hydra_ddp.__version__}"' in pyproject
    assert 'name = "my_proj"' in pyproject and 'my-proj-train = "my_proj.train:run"' in pyproject
    assert 'my_proj = ["conf/**/*.yaml"]' in pyproject  # the configs ship in the package
    assert os.access(made.root / ".ci" / "run", os.X_OK)
    readme = (made.root / "README.md").read_text()
    first = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    commands = [line for line in first.splitlines() if line and not line.startswith("#")]
    assert commands[0].endswith("torchrun --standalone --nproc_per_node=2 -m my_proj.train")
    assert commands[1].endswith("python -m pytest") and len(commands) == 2
    assert "python -m pytest" in made.proc.stdout and "my_proj" in made.proc.stdout


def test_it_is_small(made: SimpleNamespace) -> None:
    lines = sum(
        len(p.read_text().splitlines())
        for p in made.root.rglob("*")
        if p.suffix in (".py", ".yaml")
    )
    assert 0 < lines <= MAX_LINES, f"{lines} lines of .py and .yaml (at most {MAX_LINES})"


def test_it_imports_only_the_engine_api(made: SimpleNamespace) -> None:
    wrong = []
    for path in made.root.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [node.module or ""] if not node.level else ["<relative>"]
            else:
                continue
            # The engine's API, the project itself, the standard library or another library.
            wrong += [
                f"{path.relative_to(made.root)}: {name}"
                for name in names
                if name.split(".")[0] in ("hydra_ddp", "hydra_plugins", "<relative>")
                and name != "hydra_ddp.api"
            ]
    assert not wrong, wrong
    targets = [
        t
        for path in made.root.rglob("*.yaml")
        for t in re.findall(r"_target_:\s*(\S+)", path.read_text())
    ]
    assert targets and all(t.startswith("my_proj.") for t in targets), targets


def test_its_configs_compose_over_the_engines(made: SimpleNamespace) -> None:
    conf = made.root / "src" / "my_proj" / "conf"
    cfg = compose(conf, "my_proj", ["model.hidden=32"])
    assert cfg.model["_target_"] == "my_proj.model.MLP" and cfg.model["hidden"] == 32
    assert cfg.data["_target_"] == "my_proj.data.Blobs" and cfg.trainer.epochs == 10
    assert cfg.loss["_target_"] == "my_proj.loss.FocalLoss" and cfg.logger.project == "my_proj"
    assert cfg.ddp.wrapper.value == "ddp" and "acc" in cfg.metrics  # the engine's groups
    # The engine's presets still win over the project's settings.
    assert compose(conf, "my_proj", ["debug=fast"]).trainer.max_steps == 3


def test_dry_run_lists_the_files_and_writes_nothing(tmp_path: Path) -> None:
    proc = new_project("preview", "--thin", "--dir", str(tmp_path), "--dry-run")
    assert proc.returncode == 0, proc.stderr
    assert "would write preview/src/preview/train.py" in proc.stdout and "dry run:" in proc.stdout
    assert files_of(tmp_path) == [] and not (tmp_path / "preview").exists()


def test_the_api_is_one_documented_module_that_has_what_the_template_uses() -> None:
    import hydra_ddp.api as api

    assert "whole" in api.__doc__ and "may change between versions" in api.__doc__
    missing = [name for name in api.__all__ if not hasattr(api, name)]
    assert not missing, missing
    template = REPO / "scripts" / "thin_template"
    used = {
        alias.name
        for path in template.rglob("*.py")
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module == "hydra_ddp.api"
        for alias in node.names
    }
    assert used and used <= set(api.__all__), used - set(api.__all__)
    undocumented = [n for n in api.__all__ if n != "__version__" and f"`{n}" not in api.__doc__]
    assert not undocumented, undocumented


@pytest.mark.parametrize("how", ["exists", "inside", "strip", "both"])
def test_refusals_write_nothing(tmp_path: Path, how: str) -> None:
    args = {
        "exists": ["taken", "--dir", str(tmp_path)],
        "inside": ["mine", "--thin", "--dir", str(REPO / "tests")],
        "strip": ["mine", "--dir", str(tmp_path), "--strip", "model/gpt"],
        "both": ["mine", "--thin", "--fork", "--dir", str(tmp_path)],
    }[how]
    (tmp_path / "taken").mkdir()
    before, listed = git_status(), files_of(tmp_path)
    proc = new_project(*args)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc
    says = {
        "exists": "already exists",
        "inside": "inside the engine",
        "strip": "--strip",
        "both": "pick one",
    }
    assert says[how] in lines[0]
    assert git_status() == before and files_of(tmp_path) == listed
    assert not (REPO / "tests" / "mine").exists()


def run(cmd: str, cwd: Path, env: dict[str, str], timeout: int) -> float:
    """Run a shell command line (a README's), fail with its output's tail; its wall time."""
    start = time.monotonic()
    done = subprocess.run(
        ["bash", "-c", f"set -euo pipefail; {cmd}"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"{cmd}\n--- stdout\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return time.monotonic() - start


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_a_fresh_venv_installs_the_engine_and_runs_the_readme(tmp_path: Path) -> None:
    timings = {}
    start = time.monotonic()
    proc = new_project("myproj", "--thin", "--dir", str(tmp_path))
    assert proc.returncode == 0, proc.stderr
    project = tmp_path / "myproj"
    # The engine as it is in this working tree, copied first: a build writes build/ and
    # *.egg-info next to its sources, and the checkout stays untouched.
    engine = tmp_path / "engine"
    names = subprocess.run(
        ["git", "-C", str(REPO), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout.split("\0")
    for name in filter(None, names):
        if (REPO / name).is_file():
            (engine / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, engine / name)
    venv.create(tmp_path / "venv", with_pip=True)
    bin_dir = tmp_path / "venv" / "bin"
    env = {
        k: v
        for k, v in os.environ.items()
        if not k.startswith(("WANDB_", "TORCHELASTIC_", "SLURM_", "PYTHON", "VIRTUAL_ENV"))
        and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    }
    env.update(
        PATH=f"{bin_dir}{os.pathsep}{env['PATH']}",
        VIRTUAL_ENV=str(tmp_path / "venv"),
        WANDB_MODE="offline",
        WANDB_DIR=str(tmp_path / "wandb"),
        WANDB_CONFIG_DIR=str(tmp_path / "wandb-config"),
        WANDB_CACHE_DIR=str(tmp_path / "wandb-cache"),
        WANDB_DATA_DIR=str(tmp_path / "wandb-data"),
        NETRC=str(tmp_path / "no-netrc"),
        OMP_NUM_THREADS="1",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
    )
    # A CPU build of this torch is on local disk: never an unpinned torch (it would pull CUDA).
    timings["torch"] = run('pip install -q "torch==2.13.0"', tmp_path, env, 600)
    timings["engine"] = run(f"pip install -q {engine}", tmp_path, env, 600)
    where = subprocess.run(
        [bin_dir / "python", "-c", "import hydra_ddp, sys; print(hydra_ddp.__file__)"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    ).stdout
    assert "site-packages" in where, where  # the installed engine, not this checkout

    readme = (project / "README.md").read_text()
    block = re.search(r"```bash\n(.*?)```", readme, re.S).group(1)
    train, test = [line for line in block.splitlines() if line and not line.startswith("#")]
    run_dir = tmp_path / "run"
    short = f" trainer.max_steps=30 trainer.log_interval=10 hydra.run.dir={run_dir}"
    timings["install+train"] = run(train + short, project, env, 600)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["steps"] == 30, summary
    assert math.isfinite(summary["train_loss"]) and math.isfinite(summary["val_loss"])
    for rank in (0, 1):
        rows = [json.loads(r) for r in (run_dir / "stats" / f"rank{rank}.jsonl").open()]
        losses = [row["loss"] for row in rows if "loss" in row]
        assert losses and all(math.isfinite(x) for x in losses), rows
    timings["install+tests"] = run(test, project, env, 600)
    timings["total"] = time.monotonic() - start
    print("thin project timings (s):", {k: round(v, 1) for k, v in timings.items()})
