"""hydra-ddp: a Hydra-configured research training template for PyTorch DDP."""

__version__ = "0.1.0"
