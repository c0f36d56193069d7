"""W&B's mode for this job (online, offline, disabled) from ``logger.mode`` and the
environment, with the reason for the choice; and how long an online start may take."""

from __future__ import annotations

import os

from hydra_ddp.config import LoggerConfig, WandbMode
from hydra_ddp.errors import UserError, shorten
from hydra_ddp.tracking.wandb_login import wandb_credentials_source, wandb_host

_ENV_MODES = {
    "online": "online",
    "run": "online",
    "offline": "offline",
    "dryrun": "offline",
    "disabled": "disabled",
}


def resolve_mode(mode: WandbMode) -> tuple[str, str]:
    """Turn ``logger.mode`` into W&B's mode and a human-readable reason for the choice.

    ``auto`` honours an explicit ``WANDB_MODE`` / ``WANDB_DISABLED`` in the environment, else
    goes online exactly when W&B credentials exist locally (see `wandb_credentials_source`).
    """
    if mode == WandbMode.online and wandb_credentials_source() is None:
        # W&B would ask for a key on a terminal and wait forever (or fail on every rank).
        host, where = wandb_host()
        raise UserError(
            f"logger.mode=online but W&B has no login for {host} (from {where}): run `wandb "
            "login` (or set WANDB_API_KEY), or use logger.mode=offline / auto"
        )
    if mode != WandbMode.auto:
        return mode.value, f"logger.mode={mode.value}"
    if os.environ.get("WANDB_DISABLED", "").lower() in ("1", "true", "yes"):
        return "disabled", "WANDB_DISABLED is set"
    env_mode = os.environ.get("WANDB_MODE", "").strip().lower()
    if env_mode in _ENV_MODES:
        return _ENV_MODES[env_mode], f"WANDB_MODE={env_mode}"
    source = wandb_credentials_source()
    if source is None:
        host, _ = wandb_host()
        return "offline", (
            f"logger.mode=auto found no W&B login: no WANDB_API_KEY and no netrc entry for {host}"
        )
    return "online", f"logger.mode=auto found W&B credentials in {source}"


def init_timeout_s(cfg: LoggerConfig) -> tuple[float, str]:
    """How long wandb.init may try to reach the server, and which setting said so."""
    env = os.environ.get("WANDB_INIT_TIMEOUT", "").strip()
    if env:
        try:
            if float(env) > 0:
                return float(env), "WANDB_INIT_TIMEOUT"
        except ValueError:
            pass
        raise UserError(
            f"WANDB_INIT_TIMEOUT={shorten(env)} is not a number of seconds > 0: unset it or "
            "set logger.init_timeout_s"
        )
    return cfg.init_timeout_s, "logger.init_timeout_s"
