"""`python -m hydra_ddp.eval`: evaluate a finished (or stopped) run's checkpoint, or predict with
it, without training (USAGE below; examples in docs/make_it_yours.md; under torchrun too).

The job is rebuilt from the run's `.hydra/config.yaml` (the other arguments override it with
the training command line's grammar), the checkpoint's weights (its EMA, when the run kept one)
are loaded, and the split is evaluated as training does it, on any number of ranks, into
`<run>/eval_<split>.json`; predictions: see hydra_ddp/loop/scoring.py.
"""

from __future__ import annotations

import logging
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from hydra.core.override_parser.overrides_parser import OverridesParser
from omegaconf import DictConfig, OmegaConf, open_dict

from hydra_ddp.config import TrainConfig
from hydra_ddp.disk import check_regular
from hydra_ddp.distributed import env_from_environ
from hydra_ddp.errors import UserError, exit_code, first_line
from hydra_ddp.launch.command import config_dir
from hydra_ddp.launch.runner import spawn, to_typed
from hydra_ddp.launcher_env import launcher_rank, under_launcher
from hydra_ddp.loop.evaluation import Request, evaluate_run
from hydra_ddp.tracking import RunInfo

log = logging.getLogger("hydra_ddp.eval")

USAGE = (
    "usage: python -m hydra_ddp.eval run=<run dir> [ckpt=last|best|<file>] [split=test|val] "
    "[predict=true [predict_key=<name>] [predict_pad=<value>]] [key=value | +key=value ...]"
)
_MINE = tuple(f.name for f in fields(Request))


def arguments(argv: list[str], names: tuple[str, ...], usage: str) -> tuple[dict, list[str]]:
    """A command's `key=value` arguments of `names` (run= among them), and the others."""
    mine: dict[str, str] = {}
    others = []
    for arg in argv:
        key, eq, value = arg.partition("=")
        if not eq and not arg.startswith("~"):
            raise UserError(f"{arg!r} is not key=value. {usage}")
        if key in names:
            mine[key] = value
        else:
            others.append(arg)
    if "run" not in mine:
        raise UserError(f"run=<run dir> is missing. {usage}")
    return mine, others


def parse(argv: list[str]) -> tuple[Request, list[str]]:
    """The eval arguments, and the config overrides among them."""
    mine, overrides = arguments(argv, _MINE, USAGE)
    if mine.get("split", "test") not in ("test", "val"):
        raise UserError(f"split={mine['split']} is not a split: use split=test or split=val")
    predict = mine.get("predict", "false").lower()
    if predict not in ("true", "false"):
        raise UserError(f"predict={mine['predict']}: use predict=true or predict=false")
    if predict == "false" and ("predict_key" in mine or "predict_pad" in mine):
        raise UserError("predict_key and predict_pad shape predictions: add predict=true")
    pad = mine.get("predict_pad")
    try:
        pad_value = None if pad in (None, "", "null", "none") else float(pad)
    except ValueError:
        raise UserError(
            f"predict_pad={pad}: give the number to pad with (e.g. predict_pad=-100), or leave "
            "it out to keep one tensor per row"
        ) from None
    mine.update(run=Path(mine["run"]), predict=predict == "true", predict_pad=pad_value)
    mine["predict_key"] = mine.get("predict_key") or None
    return Request(**mine), overrides


def job_config(run_dir: Path, overrides: list[str]) -> TrainConfig:
    """The run's composed config, typed, with `overrides` applied as on the training command
    line."""
    path = run_dir / ".hydra" / "config.yaml"
    # A FIFO there is no missing file: say what it is (and never open it: that waits for ever).
    check_regular(
        path,
        f"run={run_dir}: the run's config",
        "put the config.yaml the run was trained with there, or give another run dir",
    )
    if not path.is_file():
        raise UserError(
            f"run={run_dir}: no {path.relative_to(run_dir)} there; give the output dir of a "
            "training run (it holds .hydra/, checkpoints/ and summary.json)"
        )
    try:
        saved = OmegaConf.load(path)
        # A run saved before sinks were chosen by `logger.sink._target_` names its sink in
        # `logger.backend`; evaluation writes to no sink, so the key is only dropped.
        if isinstance(saved.get("logger"), DictConfig):
            saved.logger.pop("backend", None)
        merged = OmegaConf.merge(OmegaConf.structured(TrainConfig), saved)
        for override in OverridesParser.create().parse_overrides(overrides):
            _apply(merged, override)
        return to_typed(merged)
    except UserError:
        raise
    except Exception as e:
        raise UserError(
            f"{path} with {' '.join(overrides) or 'no overrides'}: {first_line(e)}"
        ) from None


_ABSENT = object()


def _apply(cfg: DictConfig, override: Any) -> None:
    """One parsed override, with Hydra's meaning."""
    key, text = override.key_or_group, override.input_line
    if override.is_sweep_override():
        raise UserError(f"{text}: evaluation runs one job, not a sweep; give one value")
    if (Path(config_dir()) / key).is_dir() and not override.is_delete():
        raise UserError(
            f"{text}: evaluation rebuilds the run's saved config, where the config group "
            f"{key} is already chosen; set its keys instead ({key}.<name>=...)"
        )
    present = OmegaConf.select(cfg, key, default=_ABSENT, throw_on_missing=False)
    present = present is not _ABSENT
    with open_dict(cfg):
        if override.is_delete():
            parent, _, leaf = key.rpartition(".")
            node = OmegaConf.select(cfg, parent) if parent else cfg
            if not present or not isinstance(node, DictConfig):
                raise UserError(f"{text}: the run's config has no {key} to delete")
            del node[leaf]
        elif override.is_add() and present:
            raise UserError(f"{text}: {key} is already in the run's config; drop the +")
        elif not (override.is_add() or override.is_force_add() or present):
            if not key.startswith("vars."):  # vars: your own, added freely (as in training)
                raise UserError(
                    f"{text}: the run's config has no {key}; to add it use +{text} (your own "
                    f"variables: vars.<name>=...)"
                )
        if not override.is_delete():
            OmegaConf.update(cfg, key, override.value(), merge=True)


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
            spawn(cfg, run, evaluate_run, (request,), log_stem="eval")
        else:
            evaluate_run(cfg, env_from_environ(cfg.dist), run, request)
    except Exception as e:
        sys.exit(exit_code(e, log))


if __name__ == "__main__":
    main()
