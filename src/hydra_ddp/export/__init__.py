"""A run's weights in, a model out, for anyone: `python -m hydra_ddp.export run=<dir>` writes a
self-describing folder (writer.py), and `load(folder)` rebuilds the model from it with torch,
safetensors and the model's own class only (export_format.py: importing this package imports
nothing else of the template). docs/weights.md has both, with an example.
"""

from hydra_ddp.export_format import Vocabulary, load, read_config, vocabulary

__all__ = ["Vocabulary", "load", "read_config", "vocabulary"]
