"""The command: what runs when a user types `python -m hydra_ddp.train ...`, down to one rank's
`train` call. `command` (the command line, its checks and Hydra, without torch), `runner` (one
composed job, the self-launch of its workers, and how it ends), `interrupt` (Ctrl-C while
workers start). Nothing below imports it; a user rarely edits here. No imports in this file:
train.py imports `interrupt` before torch.
"""
