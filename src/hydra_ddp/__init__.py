"""hydra-ddp: a Hydra-configured research training template for PyTorch DDP and FSDP2.

Read it in this order (README, "Layout", has every module):

- Entry points: `train` (`python -m hydra_ddp.train`), `eval` (evaluate or predict with a saved
  checkpoint), `export` (a folder anyone can load, and its loader). `config` is the typed schema
  of the template's own keys and the one place their defaults live; `components` builds what a
  `_target_` names.
- What you copy and edit: `models`, `losses`, `metrics`, `optim` (parameter groups, schedules),
  `callbacks` (hooks into the loop), `step` (the training step, for a step of your own), the data
  sources in `data`, and `examples/` (worked projects: images, text, GAN, contrastive, ...).
- The machinery, one package per part: `loop/` (the training loop and evaluation), `data/`
  (sources, each rank's view, sampling policies), `checkpoint/` (what a checkpoint holds, how it
  is written and resumed), `tracking/` (stats to the files, W&B and TensorBoard),
  `distributed/` (launching, the process group, DDP and FSDP2 wrappers, preemption), `rundir/`
  (what a job writes beside its checkpoints: one job per run dir, paths, run.json, sweep report).
  `errors` holds the one exception type for bad input and the one-line messages.
"""

__version__ = "0.1.0"
