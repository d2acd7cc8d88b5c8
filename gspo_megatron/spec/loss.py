"""Which policy loss a training step optimises, with its hyper-parameters, KL penalty and
entropy bonus."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LossSettings:
    """Which policy loss and its hyper-parameters (names as in gspo_megatron.algorithms)."""

    name: str = "gspo"
    hparams: dict = field(default_factory=dict)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
