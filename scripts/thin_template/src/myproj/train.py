"""The entry: the engine's training job with this project's configs.

torchrun --standalone --nproc_per_node=2 -m myproj.train        # 2 ranks
python -m myproj.train dist.nproc_per_node=2 trainer.epochs=5   # the job starts its ranks
python -m myproj.train --cfg job                                # the composed config
myproj-check trainer.epochs=5                                   # check it before a long job
"""

from __future__ import annotations

from pathlib import Path

from hydra_ddp.api import main, run_checks

# conf/ ships inside the package (pyproject.toml's package-data), so this works once installed.
CONF = Path(__file__).resolve().parent / "conf"


def run() -> None:
    """Compose conf/myproj.yaml (over the engine's conf) with the command line, then train."""
    main(config_path=CONF, config_name="myproj")


def run_check() -> None:
    """`myproj-check <the overrides you train with>`: short real runs of this training, checked
    for rank agreement, exact resume, rows, determinism, gradient sync and the checkpoint's
    round trip (the engine's docs/check.md)."""
    run_checks(config_path=CONF, config_name="myproj")


if __name__ == "__main__":
    run()
