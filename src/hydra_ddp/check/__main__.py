"""`python -m hydra_ddp.check <overrides>`: see hydra_ddp/check/__init__.py."""

from hydra_ddp.check import main

main()
