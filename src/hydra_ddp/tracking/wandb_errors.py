"""W&B's errors as one line each, saying what to do (errors.UserError); W&B's own reason is
quoted, first line only and clipped (W&B quotes a 300-character name back in full)."""

from __future__ import annotations

import hashlib
import re

from hydra_ddp.config import LoggerConfig
from hydra_ddp.errors import UserError, shorten
from hydra_ddp.tracking.wandb_mode import init_timeout_s

# W&B rejects longer groups/names/job types.
WANDB_MAX_LEN = 128
# The longest W&B reason quoted in an error line.
REASON_MAX_LEN = 200
# Where the job's W&B run ids are recorded, in its output dir (see wandb_ids.py).
IDS_FILE = "wandb_ids.json"


def clip(text: str, limit: int = WANDB_MAX_LEN) -> str:
    """Shorten over-long W&B names while keeping distinct inputs distinct."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha1(text.encode()).hexdigest()[:8]
    return f"{text[: limit - 9]}-{digest}"


def reason(error: Exception, project: str) -> str:
    """W&B's own reason, first line only, with the project name shortened and the whole
    clipped."""
    lines = str(error).strip().splitlines() or [type(error).__name__]
    text = lines[0].replace(project, shorten(project, 40)) if project else lines[0]
    if len(text) > REASON_MAX_LEN:
        text = text[: REASON_MAX_LEN - 3] + "..."
    return text


def shared_needs_online(why: str) -> UserError:
    return UserError(
        f"logger.layout=shared needs W&B online ({why}); use logger.layout=gather or group, "
        "or log in (`wandb login` or WANDB_API_KEY)"
    )


def init_error(error: Exception, cfg: LoggerConfig, mode: str) -> UserError:
    """What wandb.init raised, as the line the job stops with."""
    import wandb

    why = reason(error, cfg.project)
    if isinstance(error, (wandb.errors.AuthenticationError, wandb.errors.UsageError)):
        return _usage_error(error, cfg, mode)
    if isinstance(error, (wandb.errors.CommError, TimeoutError)):
        # Status codes as whole words: a run id (hex) may hold "403" and time out all the same.
        if re.search(r"not found|\b(404|403|409)\b|permission|deleted|conflict", why, re.I):
            # The server answered, and said no: nothing to do with the network.
            return UserError(
                f"W&B refused the run ({why}): check logger.entity and logger.project "
                "(and your access to them); a run deleted on the server cannot be resumed: "
                f"remove {IDS_FILE} from the output dir to start new runs"
            )
        # Else the server is out of reach (no network, a wrong WANDB_BASE_URL, a firewall):
        # wandb.init has given up after `timeout` seconds.
        timeout, timeout_from = init_timeout_s(cfg)
        return UserError(
            f"W&B could not be reached within {timeout:g} s ({timeout_from}; {why}): rerun "
            "with logger.mode=offline and upload later with `wandb sync <output dir>/wandb/"
            "offline-run-*`, or check the network and WANDB_BASE_URL, or raise "
            f"{timeout_from}"
        )
    return UserError(
        f"W&B could not start a run ({type(error).__name__}: {why}): set logger.mode=offline "
        "to train without the server, and upload later with `wandb sync`"
    )


def _usage_error(error: Exception, cfg: LoggerConfig, mode: str) -> UserError:
    import wandb

    project = shorten(cfg.project, quote=True)
    if isinstance(error, wandb.errors.AuthenticationError):
        todo = "log in again (`wandb login`, or WANDB_API_KEY), or set logger.mode=offline"
    elif mode == "offline":
        todo = (
            "fix logger.project / logger.entity / logger.name (W&B allows up to "
            f"{WANDB_MAX_LEN} characters, none of / \\ # ? % :)"
        )
    else:
        todo = (
            "fix logger.project / logger.entity / logger.name and check your W&B login, or "
            "set logger.mode=offline"
        )
    return UserError(
        f"W&B could not start a run for logger.project={project} "
        f"({reason(error, cfg.project)}): {todo}"
    )
