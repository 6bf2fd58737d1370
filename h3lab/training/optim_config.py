"""`OptimizerConfig`: the AdamW settings of a training run, one value that supervised training (`TrainConfig`) and
RL (`GrpoConfig`, `NftConfig`) each hold as their `optim` field.

Fields: `lr`, `betas` (two numbers in [0, 1)), `eps`, `weight_decay` (decoupled, >= 0) and `master_weights` (a
float32 master copy of every non-float32 parameter), checked on construction by `StrictAdamW.check_hyperparameters`:
a bad value is one `SettingError` line `AdamW.<name>=<value>: <rule>` (a front end names the flag, `--lr 0.0: ...`).
`build(params)` is the run's `StrictAdamW`.

Record layout: a run config seals these five keys at its own top level, in this order (`RECORD_KEYS`:
`{"lr": .., "betas": [b1, b2], "eps": .., "weight_decay": .., "master_weights": ..}` beside the config's other
fields), so `to_record()` / `from_record(config_dict)` read and write the layout every sealed run and job.json holds.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from torch import nn

from .objective import TrainingError
from .optim import StrictAdamW

RECORD_KEYS = ("lr", "betas", "eps", "weight_decay", "master_weights")


@dataclass(frozen=True)
class OptimizerConfig:
    """AdamW's hyper-parameters (module docstring); the defaults are the training CLIs' (`--lr`, `--weight-decay`)."""

    lr: float = 1e-4
    betas: tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    weight_decay: float = 0.0
    master_weights: bool = True

    def __post_init__(self) -> None:
        lr, betas, eps, weight_decay = StrictAdamW.check_hyperparameters(self.lr, self.betas, self.eps,
                                                                         self.weight_decay)
        if not isinstance(self.master_weights, bool):
            raise TrainingError(f"AdamW master_weights={self.master_weights!r}: must be true or false")
        for name, value in (("lr", lr), ("betas", betas), ("eps", eps), ("weight_decay", weight_decay)):
            object.__setattr__(self, name, value)

    def build(self, params: Sequence[tuple[str, nn.Parameter]]) -> StrictAdamW:
        """The run's optimiser over `params` (name, parameter) pairs."""
        return StrictAdamW(params, lr=self.lr, betas=self.betas, eps=self.eps, weight_decay=self.weight_decay,
                           master_weights=self.master_weights)

    def to_record(self) -> dict[str, Any]:
        """The five keys a run config seals (module docstring)."""
        return {"lr": self.lr, "betas": list(self.betas), "eps": self.eps, "weight_decay": self.weight_decay,
                "master_weights": self.master_weights}

    @classmethod
    def from_record(cls, data: dict) -> "OptimizerConfig":
        """The optimiser of a sealed config record (`data` holds `RECORD_KEYS` beside other fields)."""
        missing = [k for k in RECORD_KEYS if k not in data]
        if missing:
            raise TrainingError(f"config record lacks the optimiser keys {missing}: must hold {', '.join(RECORD_KEYS)}")
        return cls(lr=data["lr"], betas=tuple(data["betas"]), eps=data["eps"], weight_decay=data["weight_decay"],
                   master_weights=data["master_weights"])
