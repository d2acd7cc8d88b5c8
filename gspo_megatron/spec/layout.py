"""One validated parallel layout: every degree in one place, checked before megatron starts."""

from __future__ import annotations

import math
from dataclasses import dataclass


class LayoutError(ValueError):
    """An inconsistent parallel setting; the message names the setting and the fix."""


@dataclass(frozen=True)
class ParallelLayout:
    """Parallel degrees of the training engine (config group `parallel/`).

    dp is derived from the world size: world = tp * pp * cp * dp. Experts use their own
    decomposition of the same ranks: world = etp * ep * edp * pp.
    """

    tp: int = 1  # tensor parallel
    pp: int = 1  # pipeline parallel
    vpp: int = 1  # virtual pipeline stages (model chunks) per pipeline rank
    cp: int = 1  # context parallel
    ep: int = 1  # expert parallel
    etp: int = 1  # expert tensor parallel
    sequence_parallel: bool = False
    world_size: int = 1

    def __post_init__(self) -> None:
        for name in ("tp", "pp", "vpp", "cp", "ep", "etp", "world_size"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise LayoutError(f"parallel.{name} must be a positive integer, got {value!r}")
        model_parallel = self.tp * self.pp * self.cp
        if self.world_size % model_parallel:
            raise LayoutError(
                f"world size {self.world_size} is not divisible by parallel.tp*pp*cp = "
                f"{self.tp}*{self.pp}*{self.cp} = {model_parallel}; change the layout or the "
                "number of processes"
            )
        expert_parallel = self.etp * self.ep * self.pp
        if self.world_size % expert_parallel:
            raise LayoutError(
                f"world size {self.world_size} is not divisible by parallel.etp*ep*pp = "
                f"{self.etp}*{self.ep}*{self.pp} = {expert_parallel}"
            )
        if self.vpp > 1 and self.pp == 1:
            raise LayoutError("parallel.vpp > 1 needs parallel.pp > 1")
        if self.sequence_parallel and self.tp == 1:
            raise LayoutError("parallel.sequence_parallel needs parallel.tp > 1")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp * self.cp)

    @property
    def edp(self) -> int:
        """Expert data parallel size."""
        return self.world_size // (self.etp * self.ep * self.pp)

    def check_model(
        self,
        *,
        num_layers: int,
        num_attention_heads: int,
        num_key_value_heads: int,
        num_experts: int | None,
        vocab_size: int | None = None,
    ) -> None:
        """Check the layout against a model's shape; raise LayoutError naming the setting."""
        if num_attention_heads % self.tp:
            raise LayoutError(
                f"parallel.tp={self.tp} must divide the model's {num_attention_heads} attention "
                "heads"
            )
        if num_key_value_heads % self.tp:
            raise LayoutError(
                f"parallel.tp={self.tp} must divide the model's {num_key_value_heads} key/value "
                "heads (GQA groups)"
            )
        stages = self.pp * self.vpp
        if num_layers % stages:
            raise LayoutError(
                f"parallel.pp*vpp = {self.pp}*{self.vpp} = {stages} must divide the model's "
                f"{num_layers} layers"
            )
        if num_experts:
            if num_experts % self.ep:
                raise LayoutError(
                    f"parallel.ep={self.ep} must divide the model's {num_experts} experts"
                )
            if self.tp > 1 and not self.sequence_parallel:
                raise LayoutError(
                    "MoE training with parallel.tp > 1 needs parallel.sequence_parallel=true "
                    "(megatron-core requirement)"
                )
        elif self.ep > 1 or self.etp > 1:
            raise LayoutError("parallel.ep/etp > 1 needs a Mixture-of-Experts model")

    def check_sequence_length(self, max_sequence_length: int) -> None:
        """The padded sequence length must split evenly over CP (2*cp chunks) and SP (tp)."""
        multiple = self.sequence_multiple
        if max_sequence_length % multiple:
            raise LayoutError(
                f"maximum sequence length {max_sequence_length} must be a multiple of "
                f"{multiple} (2*parallel.cp and parallel.tp with sequence parallelism)"
            )

    @property
    def sequence_multiple(self) -> int:
        """Every micro-batch's padded length is a multiple of this: 2*cp chunks under CP, and
        each CP rank's part a multiple of tp under sequence parallelism."""
        multiple = 2 * self.cp if self.cp > 1 else 1
        if self.sequence_parallel:
            multiple = math.lcm(multiple, self.cp * self.tp)
        return multiple

    def describe(self) -> str:
        return (
            f"tp={self.tp} pp={self.pp} vpp={self.vpp} cp={self.cp} dp={self.dp} ep={self.ep} "
            f"etp={self.etp} edp={self.edp} sp={self.sequence_parallel} world={self.world_size}"
        )
