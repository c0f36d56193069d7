"""The training loop and what runs inside it.

- `prepare`: one rank's job (`hydra_ddp.rank_job.RankJob`), built before its process group
  (hydra_ddp.train calls it in order); `wrapping`: the model wrapped (DDP/FSDP2), the EMA,
  torch.compile; `checkpointing`: the job's checkpoint members (the template's and the
  callbacks'), its checkpointer, resume.
- `fit`: what the loop works with (`build_loop`), the training loop (`fit`) and the end of the
  run (`finish_run`: last validation, last checkpoint, test, summary).
- `position`: where the loop is (`Position`, moved only by the loop), the batches from there,
  and the position as a checkpoint member with its resume arithmetic (`PositionState`).
- `scoring`: the loss and every metric over a split, exact across ranks.
- `evaluation`: validation during training (the monitor, the best checkpoint, early stopping)
  and the evaluation of a saved checkpoint; `predict`: one prediction per row of a split.
- `monitor`, `ema`, `profiling`: the monitored metric, the weights' moving average, the profiler.

What a user edits is outside this package: the step (`hydra_ddp.step`), callbacks
(`hydra_ddp.callbacks`), how a batch reaches the model (`hydra_ddp.batches`) and components
(`conf/`). Editing here changes the loop for every run.
"""
