"""Which policy loss a training step optimises, with its hyper-parameters, KL penalty and
entropy bonus."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class LossSettings:
    """Which policy loss and its hyper-parameters (names as in gspo_megatron.algorithms).

    max_new_tokens: the clip fraction is also reported by response length, in quarters of this
    many tokens (rollout.max_new_tokens; 0: not split).
    """

    name: str = "gspo"
    hparams: dict = field(default_factory=dict)
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    max_new_tokens: int = 0
