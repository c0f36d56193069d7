"""How a W&B run starts, and what the job says when it cannot: the mode from ``logger.mode``,
the environment and the login W&B would find; how long an online start may take; W&B's errors
as one line each, saying what to do.

The login is looked for in local files only, never prompting nor asking the server, so that
``logger.mode=auto`` is decided at once without an account or a network (``wandb.login`` would
also make the key the process's credentials and rewrite W&B's settings file).
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Optional

from hydra_ddp.config import LoggerConfig, WandbMode
from hydra_ddp.errors import UserError, shorten

WANDB_MAX_LEN = 128  # W&B rejects longer groups/names/job types
# WANDB_MODE's values as W&B reads them.
_ENV_MODES = {"online": "online", "run": "online", "offline": "offline", "dryrun": "offline",
              "disabled": "disabled"}  # fmt: skip
# W&B's cloud, by both its names: `wandb login` saves the key for the first (W&B's default
# host), an older release's login for the second, and W&B reads either.
_CLOUD = ("api.forge.coreweave.com", "api.wandb.ai")


def resolve_mode(mode: WandbMode) -> tuple[str, str]:
    """W&B's mode for ``logger.mode``, and why: ``auto`` honours ``WANDB_MODE`` /
    ``WANDB_DISABLED``, else goes online exactly when W&B credentials exist locally."""
    if mode == WandbMode.online and credentials_source() is None:
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
    source = credentials_source()
    if source is None:
        host, _ = wandb_host()
        return "offline", (
            f"logger.mode=auto found no W&B login: no WANDB_API_KEY and no netrc entry for {host}"
        )
    return "online", f"logger.mode=auto found W&B credentials in {source}"


def credentials_source() -> Optional[str]:
    """Where W&B would find credentials (never the key itself), or None: the places W&B
    reads, the netrc entry ``wandb login`` writes for the host included; validity unchecked."""
    import netrc

    for key in ("WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE"):
        if os.environ.get(key):
            return key
    host, where = wandb_host()
    files = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for name in files:
        path = Path(name).expanduser()
        try:
            entries = netrc.netrc(str(path))
            if any(entries.authenticators(h) for h in (_CLOUD if host in _CLOUD else [host])):
                return f"{path.name} for {host} ({where})"
        except (netrc.NetrcParseError, OSError):
            continue
    return None


def wandb_host() -> tuple[str, str]:
    """The W&B host W&B itself would use, and which setting named it: ``WANDB_BASE_URL``, else
    the ``base_url`` that ``wandb login --host`` saved in W&B's settings file."""
    import configparser
    from urllib.parse import urlsplit

    url, where = os.environ.get("WANDB_BASE_URL"), "WANDB_BASE_URL"
    config_dir = Path(os.environ.get("WANDB_CONFIG_DIR", "~/.config/wandb")).expanduser()
    for path in (Path("wandb") / "settings", config_dir / "settings"):
        if url:
            break
        parser = configparser.ConfigParser()
        try:
            parser.read(path)
        except configparser.Error:
            continue
        if parser.has_option("default", "base_url"):
            url, where = parser.get("default", "base_url"), str(path)
    if not url:
        url, where = "https://api.wandb.ai", "the default host"
    return urlsplit(url if "//" in url else f"https://{url}").netloc, where


def init_timeout_s(cfg: LoggerConfig) -> tuple[float, str]:
    """How long wandb.init may try to reach the server, and which setting said so."""
    env = os.environ.get("WANDB_INIT_TIMEOUT", "").strip()
    if not env:
        return cfg.init_timeout_s, "logger.init_timeout_s"
    try:
        if float(env) > 0:
            return float(env), "WANDB_INIT_TIMEOUT"
    except ValueError:
        pass
    raise UserError(
        f"WANDB_INIT_TIMEOUT={shorten(env)} is not a number of seconds > 0: unset it or set "
        "logger.init_timeout_s"
    )


def clip(text: str, limit: int = WANDB_MAX_LEN) -> str:
    """Shorten over-long W&B names while keeping distinct inputs distinct."""
    if len(text) <= limit:
        return text
    digest = hashlib.sha1(text.encode()).hexdigest()[:8]
    return f"{text[: limit - 9]}-{digest}"


def init_error(error: Exception, cfg: LoggerConfig, mode: str) -> UserError:
    """What wandb.init raised, as the line the job stops with, quoting W&B's own reason (its
    first line, the project shortened: W&B quotes a 300-character name back in full)."""
    import wandb

    why = (str(error).strip().splitlines() or [type(error).__name__])[0]
    why = why.replace(cfg.project, shorten(cfg.project, 40)) if cfg.project else why
    why = why if len(why) <= 200 else why[:197] + "..."
    if isinstance(error, (wandb.errors.AuthenticationError, wandb.errors.UsageError)):
        if isinstance(error, wandb.errors.AuthenticationError):
            todo = "log in again (`wandb login`, or WANDB_API_KEY), or set logger.mode=offline"
        elif mode == "offline":
            todo = (
                "fix logger.project / logger.entity / logger.name (W&B allows up to "
                f"{WANDB_MAX_LEN} characters, none of / \\ # ? % :)"
            )
        else:
            todo = (
                "fix logger.project / logger.entity / logger.name and check your W&B login, "
                "or set logger.mode=offline"
            )
        project = shorten(cfg.project, quote=True)
        return UserError(f"W&B could not start a run for logger.project={project} ({why}): {todo}")
    if isinstance(error, (wandb.errors.CommError, TimeoutError)):
        # Status codes as whole words: a run id (hex) may hold "403" and time out all the same.
        if re.search(r"not found|\b(404|403|409)\b|permission|deleted|conflict", why, re.I):
            # The server answered, and said no: nothing to do with the network.
            return UserError(
                f"W&B refused the run ({why}): check logger.entity and logger.project (and "
                "your access to them); a run deleted on the server cannot be resumed: "
                "trainer.resume=never starts new runs (from step 0)"
            )
        # Else the server is out of reach (no network, a wrong WANDB_BASE_URL, a firewall):
        # wandb.init has given up after `timeout` seconds.
        timeout, timeout_from = init_timeout_s(cfg)
        return UserError(
            f"W&B could not be reached within {timeout:g} s ({timeout_from}; {why}): rerun "
            "with logger.mode=offline and upload later with `wandb sync <output dir>/wandb/"
            f"offline-run-*`, or check the network and WANDB_BASE_URL, or raise {timeout_from}"
        )
    return UserError(
        f"W&B could not start a run ({type(error).__name__}: {why}): set logger.mode=offline "
        "to train without the server, and upload later with `wandb sync`"
    )
