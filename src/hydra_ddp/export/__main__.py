"""`python -m hydra_ddp.export`: see writer.py."""

from hydra_ddp.export.writer import main

main()
