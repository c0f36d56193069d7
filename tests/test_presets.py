"""Named experiments (conf/experiment/) and the configs an installed console script finds.

An experiment composes with the data set's loss and metrics, the command line still wins over
it, and it runs on two real gloo ranks (helpers/ranks.py). The installed `hydra-ddp-train` (a
regular, non-editable install into a fresh venv) runs from any folder; an editable one reads
conf/ of its checkout, edits included.
"""

from __future__ import annotations

import re
import shutil
import site
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from conftest import FAST, REPO, ok, only_job_dir, run, summary, user_env
from helpers.inproc import train_ranks
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from hydra_ddp import config as C
from hydra_ddp.launch.command import config_dir
from hydra_ddp.rundir.paths import register_resolvers

CONF = REPO / "conf"

# experiment -> the group choices it makes (with the data set's loss and metrics), and the
# metrics its summary.json reports.
EXPERIMENTS = {
    "digits_cnn": (
        {"data": "digits", "model": "cnn", "loss": "cross_entropy", "metrics": "classification"},
        {"acc"},
    ),
    "text_gpt": (
        {"data": "text", "model": "gpt", "loss": "cross_entropy", "metrics": "language_model"},
        {"ppl", "bpc"},
    ),
    "diabetes_mlp": (
        {"data": "diabetes", "model": "mlp", "loss": "mse", "metrics": "regression"},
        {"mse", "r2"},
    ),
    # The "your project" examples (hydra_ddp/examples/; trained on 2 ranks by
    # test_own_data_models_and_steps.py too): their own data, model or loss replace the group's.
    "images": ({"data": None, "model": "cnn", "metrics": "classification"}, {"acc"}),
    "dict_lm": ({"data": None, "model": None, "loss": "model_output", "metrics": "none"}, set()),
    "dict_lm_transformers": ({"data": None, "model": None, "loss": "model_output"}, set()),
    "siamese": ({"data": None, "model": None, "loss": None, "metrics": "classification"}, {"acc"}),
    "gradient_penalty": ({"data": "digits", "model": None, "loss": None}, {"acc"}),
    "gan": ({"data": None, "model": None, "optim": "gan", "metrics": "none"}, set()),
    "contrastive": ({"data": None, "model": None, "loss": None, "metrics": "none"}, set()),
}

C.register_configs()
register_resolvers()


def composed(*overrides: str, hydra: bool = False):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose(config_name="train", overrides=list(overrides), return_hydra_config=hydra)


def choices(*overrides: str) -> dict[str, str]:
    return dict(composed(*overrides, hydra=True).hydra.runtime.choices)


def test_every_experiment_is_tested_and_the_checkout_configs_are_used() -> None:
    assert {p.stem for p in (CONF / "experiment").glob("*.yaml")} == set(EXPERIMENTS)
    # In a checkout, the configs are its conf/ (so edits count at once), not a packaged copy.
    assert Path(config_dir()) == CONF


@pytest.mark.parametrize("name", sorted(EXPERIMENTS))
def test_experiment_composes_with_its_choices_and_is_documented(name: str) -> None:
    expected, metrics = EXPERIMENTS[name]
    got = choices(f"experiment={name}")
    assert {k: got[k] for k in expected} == expected and got["experiment"] == name
    cfg = OmegaConf.to_object(composed(f"experiment={name}"))  # typed: the schema accepts it
    assert set(cfg.metrics) == metrics
    assert cfg.trainer.monitor in {"val/loss", *(f"val/{m}" for m in metrics)}
    assert cfg.trainer.precision == C.Precision.fp32  # runs on a CPU-only machine
    header = (CONF / "experiment" / f"{name}.yaml").read_text().split("defaults:")[0]
    assert header.startswith("# @package _global_\n")
    assert re.search(
        rf"^#\s+(torchrun|python) .*hydra_ddp\.train .*experiment={name}", header, re.M
    )
    assert re.search(r"\d+ (s|min)\b", header), f"{name}: say roughly how long it takes"


def test_experiment_keeps_the_data_sets_task_and_the_command_line_wins() -> None:
    reg = composed("experiment=diabetes_mlp")
    assert reg.loss._target_ == "torch.nn.MSELoss" and set(reg.metrics) == {"mse", "r2"}
    assert choices("experiment=diabetes_mlp", "loss=huber")["loss"] == "huber"
    assert composed("experiment=digits_cnn", "trainer.max_steps=7").trainer.max_steps == 7
    assert composed("experiment=digits_cnn", "model.channels=8").model.channels == 8
    text = choices("experiment=text_gpt", "data=digits", "model=mlp")
    assert (text["data"], text["model"], text["metrics"]) == ("digits", "mlp", "classification")
    # Without experiment=..., nothing changes: the default job is digits with the MLP.
    assert choices()["experiment"] is None and choices()["model"] == "mlp"


# The "your project" examples train on 2 ranks in test_own_data_models_and_steps.py too (dict
# batches, the GAN, per-item data): their runs here are slow ones.
EXAMPLES = {
    "images", "dict_lm", "dict_lm_transformers", "siamese", "gradient_penalty", "gan",
    "contrastive",  # trained on 2 ranks by test_contrastive.py
    "text_gpt",  # trained on 2 ranks, in process, by test_end_of_job.py
}  # fmt: skip


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=pytest.mark.slow) if n in EXAMPLES else n for n in sorted(EXPERIMENTS)],
)
def test_experiment_runs_on_two_ranks(tmp_path: Path, name: str) -> None:
    if name == "dict_lm_transformers":
        pytest.importorskip("transformers")  # the optional extra (.ci/run installs it)
    job = tmp_path / "job"
    train_ranks(job, f"experiment={name}", "dist.nproc_per_node=2", "trainer.max_steps=3", *FAST)
    s = summary(job)
    assert s["world_size"] == 2 and s["steps"] == 3
    for metric in EXPERIMENTS[name][1]:
        assert s[f"val_{metric}"] is not None and s[f"test_{metric}"] is not None, metric


@pytest.mark.slow  # every CLI run of the default suite runs outside the checkout too
def test_composes_from_a_folder_outside_the_checkout(tmp_path: Path) -> None:
    proc = ok(run([sys.executable, "-m", "hydra_ddp.train", "--cfg", "job"], tmp_path))
    assert "_target_: hydra_ddp.data.Digits" in proc.stdout
    assert not (tmp_path / "outputs").exists()


# ------------------------------------------------------------------------------------------
# Installed: a wheel in a fresh venv, and an editable install of a copy of the checkout
# ------------------------------------------------------------------------------------------


def _copy_checkout(dest: Path) -> Path:
    """What a build reads (a build writes build/ and *.egg-info/ next to it: not in REPO)."""
    skip = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("src", "conf"):
        shutil.copytree(REPO / name, dest / name, ignore=skip)
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, dest / name)
    return dest


def _venv_with_package(tmp: Path, *pip_args: str) -> Path:
    """A fresh venv seeing this environment's packages (torch, setuptools, pip...) after its
    own, with the package installed from a copy of the checkout, offline."""
    venv = tmp / "venv"
    ok(
        run(
            [sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(venv)],
            tmp,
        )
    )
    # --system-site-packages reaches the base interpreter's packages, not those of a venv the
    # tests run in: name this environment's site-packages too (plain paths, so their own .pth
    # files, such as the editable install of this checkout, are not read).
    ours = {
        *site.getsitepackages(),
        sysconfig.get_paths()["purelib"],
        sysconfig.get_paths()["platlib"],
    }
    purelib = subprocess.run(
        [
            str(venv / "bin" / "python"),
            "-c",
            "import sysconfig; print(sysconfig.get_paths()['purelib'])",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    Path(purelib, "parent_env.pth").write_text("".join(f"{p}\n" for p in sorted(ours)))
    env = user_env(tmp, PYTHONPATH=None, PIP_NO_INDEX="1", PIP_DISABLE_PIP_VERSION_CHECK="1")
    ok(
        run(
            [
                str(venv / "bin" / "python"),
                "-m",
                "pip",
                "install",
                "--no-deps",
                "--no-build-isolation",
                *pip_args,
            ],
            tmp,
            env=env,
            timeout=300,
        )
    )
    return venv


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_installed_console_script_runs_from_any_folder(tmp_path: Path) -> None:
    repo = _copy_checkout(tmp_path / "repo")
    venv = _venv_with_package(tmp_path, str(repo))
    work = tmp_path / "work"
    work.mkdir()
    env = user_env(work, PYTHONPATH=None)  # the installed package, not src/ of the checkout
    script = str(venv / "bin" / "hydra-ddp-train")

    helped = ok(run([script, "--help"], work, env=env)).stdout
    for group in ("data", "model", "loss", "metrics", "experiment", "optim", "scheduler"):
        assert re.search(rf"^{group}: ", helped, re.M), helped
    assert f"experiment: {', '.join(sorted(EXPERIMENTS))}" in helped

    ok(run([script, *FAST, "trainer.max_steps=3"], work, env=env, timeout=300))
    job = only_job_dir(work)
    assert summary(job)["steps"] == 3
    # Composed from the copy inside the installed package, not from a checkout.
    hydra_yaml = (job / ".hydra" / "hydra.yaml").read_text()
    found = re.search(r"path: (\S+)\n\s+schema: file\n\s+provider: main", hydra_yaml)
    assert found, hydra_yaml
    main = Path(found.group(1)).resolve()
    assert main.is_relative_to(venv.resolve()) and main.parts[-2:] == ("hydra_ddp", "conf")


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_editable_install_reads_the_checkouts_conf_edits_included(tmp_path: Path) -> None:
    repo = _copy_checkout(tmp_path / "repo")
    venv = _venv_with_package(tmp_path, "-e", str(repo))
    (repo / "conf" / "experiment" / "mine.yaml").write_text(
        "# @package _global_\ntrainer:\n  batch_size: 17\n"
    )
    work = tmp_path / "work"
    work.mkdir()
    env = user_env(work, PYTHONPATH=None)
    shown = ok(
        run(
            [str(venv / "bin" / "hydra-ddp-train"), "--cfg", "job", "experiment=mine"],
            work,
            env=env,
        )
    ).stdout
    assert "batch_size: 17" in shown
