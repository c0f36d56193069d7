"""A model whose constructor takes credentials (a database password, a hub token), outside the
package (tests/ is on sys.path): what test_sweep_secrets.py sweeps `+model.password` of."""

from __future__ import annotations

from hydra_ddp.models import MLP


class Guarded(MLP):
    """An MLP that needs a password and an API token; it keeps neither."""

    def __init__(
        self, in_features: int, out_features: int, hidden: int, depth: int, dropout: float,
        password: str, api_token: str,
    ):  # fmt: skip
        assert password.startswith("hunter") and api_token  # the real values reach the model
        super().__init__(in_features, out_features, hidden, depth, dropout)
