"""Evaluate a finished (or stopped) run's checkpoint, or predict with it, without training.

    python -m hydra_ddp.eval run=outputs/2026-11-30/17-01-28    # last checkpoint, test split
    python -m hydra_ddp.eval run=<dir> ckpt=best split=val      # or ckpt=<file>
    python -m hydra_ddp.eval run=<dir> predict=true             # + predictions_test.pt
    python -m hydra_ddp.eval run=<dir> dist.nproc_per_node=2 trainer.batch_size=256
    torchrun --standalone --nproc_per_node=2 -m hydra_ddp.eval run=<dir>

The job is rebuilt from the run's `.hydra/config.yaml` (the other `key=value` arguments override
it, as on the training command line), the checkpoint's weights are loaded (its EMA average when
the run kept one, as the run evaluated), and the split is evaluated exactly as training does it,
on any number of ranks. The metrics are printed and written to `<run>/eval_<split>.json`.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from omegaconf import OmegaConf

from hydra_ddp import launch
from hydra_ddp.config import TrainConfig
from hydra_ddp.dist import env_from_environ, launcher_rank, under_launcher
from hydra_ddp.errors import UserError, exit_code
from hydra_ddp.evaluation import Request, evaluate_run
from hydra_ddp.tracking import RunInfo

log = logging.getLogger("hydra_ddp.eval")

USAGE = (
    "usage: python -m hydra_ddp.eval run=<run dir> [ckpt=last|best|<file>] [split=test|val] "
    "[predict=true] [key=value ...]"
)


def parse(argv: list[str]) -> tuple[Request, list[str]]:
    """The eval arguments, and the config overrides among them."""
    mine: dict[str, str] = {}
    overrides = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq:
            raise UserError(f"{arg!r} is not key=value. {USAGE}")
        if key in ("run", "ckpt", "split", "predict"):
            mine[key] = value
        else:
            overrides.append(arg)
    if "run" not in mine:
        raise UserError(f"run=<run dir> is missing. {USAGE}")
    if mine.get("split", "test") not in ("test", "val"):
        raise UserError(f"split={mine['split']} is not a split: use split=test or split=val")
    predict = mine.get("predict", "false").lower()
    if predict not in ("true", "false"):
        raise UserError(f"predict={mine['predict']}: use predict=true or predict=false")
    request = Request(
        run=Path(mine["run"]),
        ckpt=mine.get("ckpt", "last"),
        split=mine.get("split", "test"),
        predict=predict == "true",
    )
    return request, overrides


def job_config(run_dir: Path, overrides: list[str]) -> TrainConfig:
    """The run's composed config, typed, with `overrides` (dotted keys) applied."""
    path = run_dir / ".hydra" / "config.yaml"
    if not path.is_file():
        raise UserError(
            f"run={run_dir}: no {path.relative_to(run_dir)} there; give the output dir of a "
            "training run (it holds .hydra/, checkpoints/ and summary.json)"
        )
    try:
        saved = OmegaConf.load(path)
        merged = OmegaConf.merge(
            OmegaConf.structured(TrainConfig), saved, OmegaConf.from_dotlist(overrides)
        )
        return OmegaConf.to_object(merged)  # type: ignore[return-value]
    except UserError:
        raise
    except Exception as e:
        raise UserError(f"{path} with {' '.join(overrides) or 'no overrides'}: {e}") from None


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(
        level=logging.INFO if launcher_rank() == 0 else logging.WARNING,
        format="[%(asctime)s][%(name)s][%(levelname)s] - %(message)s",
        stream=sys.stderr,
    )
    try:
        request, overrides = parse(sys.argv[1:] if argv is None else argv)
        cfg = job_config(request.run, overrides)
        run = RunInfo(output_dir=request.run, job_name="eval", group="eval", config={})
        if cfg.dist.nproc_per_node > 1 and not under_launcher():
            launch.spawn(cfg, run, evaluate_run, (request,), log_stem="eval")
        else:
            evaluate_run(cfg, env_from_environ(cfg.dist), run, request)
    except Exception as e:
        sys.exit(exit_code(e, log))


if __name__ == "__main__":
    main()
