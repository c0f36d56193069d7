"""Worked examples of fitting a project of your own, each a module of plain torch code plus a
file in conf/experiment/ (`experiment=<name>`), none editing the template, each trained on two
ranks by the tests: a per-item image Dataset with transforms (`images`), dict batches and a model
that returns its own loss (`dict_lm`), a two-input model with an auxiliary loss term
(`siamese`), a loss that reads the batch (`gradient_penalty`), a GAN with two optimizers and a
step of its own (`gan`), and NT-Xent with negatives from every rank (`contrastive`).
"""
