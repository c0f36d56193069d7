"""Where W&B would find a login on this machine, read from local files only: no prompt, no
network. logger.mode=auto goes online exactly when there is one (wandb_mode.resolve_mode)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional


def wandb_credentials_source() -> Optional[str]:
    """Where W&B would find credentials on this machine, or None when there are none.

    The places W&B reads: ``WANDB_API_KEY``, ``WANDB_IDENTITY_TOKEN_FILE``, and the netrc
    entry (``$NETRC``, ``~/.netrc`` or ``~/_netrc``) that ``wandb login`` writes for the W&B
    host: ``WANDB_BASE_URL``, else the ``base_url`` that ``wandb login --host`` saved in W&B's
    settings file (``$WANDB_CONFIG_DIR/settings``, default ``~/.config/wandb/settings``, or
    ``./wandb/settings``), else api.wandb.ai. Only local files are read: it never prompts and
    never contacts the server, so a key's validity is not checked here. Returns a short
    description of the source, never the key itself.
    """
    if os.environ.get("WANDB_API_KEY"):
        return "WANDB_API_KEY"
    if os.environ.get("WANDB_IDENTITY_TOKEN_FILE"):
        return "WANDB_IDENTITY_TOKEN_FILE"
    host, where = wandb_host()
    found = _netrc_entry(host)
    return f"{found} for {host} ({where})" if found else None


def wandb_host() -> tuple[str, str]:
    """The W&B server host W&B itself would use, and which setting named it."""
    from urllib.parse import urlsplit

    url, where = os.environ.get("WANDB_BASE_URL"), "WANDB_BASE_URL"
    if not url:
        import configparser

        config_dir = Path(os.environ.get("WANDB_CONFIG_DIR", "~/.config/wandb")).expanduser()
        for path in (Path("wandb") / "settings", config_dir / "settings"):
            parser = configparser.ConfigParser()
            try:
                parser.read(path)
            except configparser.Error:
                continue
            if parser.has_option("default", "base_url"):
                url, where = parser.get("default", "base_url"), str(path)
                break
    if not url:
        url, where = "https://api.wandb.ai", "the default host"
    return urlsplit(url if "//" in url else f"https://{url}").netloc, where


def _netrc_entry(host: str) -> Optional[str]:
    import netrc

    paths = [os.environ["NETRC"]] if os.environ.get("NETRC") else ["~/.netrc", "~/_netrc"]
    for name in paths:
        path = Path(name).expanduser()
        try:
            if netrc.netrc(str(path)).authenticators(host):
                return f"{path.name}"
        except (FileNotFoundError, netrc.NetrcParseError, OSError):
            continue
    return None
