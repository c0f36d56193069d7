"""The command: what runs when a user types `python -m hydra_ddp.train ...` (or torchrun,
submitit or Ray starts it), down to one rank's `train` call.

- `command`: the command line's checks and Hydra (a sweep with `-m`: Basic, Ray, submitit,
  Optuna), without torch: a sweep's launching process only composes and hands out jobs;
- `runner`: one composed job in the process that runs it: the config typed and checked, the job
  here (one rank of torchrun, SLURM or Ray, or a single process) or on workers it starts, and
  every way a job ends as an exit status;
- `workers`: `python -m hydra_ddp.train dist.nproc_per_node=N` without torchrun: the workers
  started with torch's elastic agent;
- `interrupt`: Ctrl-C while workers start: one line, exit 130.

Nothing here is imported by the engine below it; a user rarely edits here. Kept free of imports
in this file: train.py imports `interrupt` first, before torch.
"""
