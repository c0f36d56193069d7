"""What the tests share: running the loop in process (inproc) or on gloo ranks (ranks),
reading W&B offline files back (wandb_records), and the user code the tests plug in by
`_target_` (user_*.py, *_callbacks.py, *_model(s).py), as a researcher's own modules."""
