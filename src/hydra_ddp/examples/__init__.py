"""Worked examples of fitting a project of your own, each trained on two ranks by the tests and
described in the README ("Your data, your model, your step"):

- `images`: a per-item image Dataset with random crop/flip transforms (`TorchDatasets`);
- `language_model`: dict batches and a model that returns its own `.loss` (`loss=model_output`);
- `siamese`: a two-input model whose loss adds an auxiliary term, logged as its own curve;
- `penalty`: a gradient penalty on the inputs (a loss that reads the batch);
- `gan`: a GAN, two optimizers and a step of its own (`step._target_`), clipped per optimizer;
- `contrastive`: NT-Xent with negatives from every rank
  (`hydra_ddp.distributed.all_gather_with_grad`).

Each is a module of plain torch code plus a file in conf/experiment/; none edits the template.
"""
