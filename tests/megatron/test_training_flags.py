"""TrainingEngine._set_training: the train/eval flags Module.train would set, over a module list
made once (and each chunk's own `train` when a module overrides it)."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from gspo_megatron.megatron import cpu_compat

cpu_compat.apply()  # before megatron-core is imported

from gspo_megatron.megatron.training_engine import TrainingEngine  # noqa: E402


class _OwnTrain(torch.nn.Linear):
    """A module whose `train` does more than set flags."""

    def train(self, mode: bool = True):
        self.calls = getattr(self, "calls", 0) + 1
        return super().train(mode)


def _chunks(own_train: bool) -> list[torch.nn.Module]:
    inner = _OwnTrain(2, 2) if own_train else torch.nn.Linear(2, 2)
    return [
        torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Sequential(inner, torch.nn.ReLU())),
        torch.nn.Sequential(torch.nn.Dropout(0.5)),
    ]


def _flags(chunks: list[torch.nn.Module]) -> list[bool]:
    return [m.training for chunk in chunks for m in chunk.modules()]


def test_set_training_sets_the_flags_module_train_sets():
    for own_train in (False, True):
        ours, reference = _chunks(own_train), _chunks(own_train)
        engine = SimpleNamespace(model=ours, _training_flags=None)
        # one module in another mode than its chunk: both paths set every flag
        ours[0][1][1].eval()
        reference[0][1][1].eval()
        for mode in (False, True, False):
            TrainingEngine._set_training(engine, mode)
            for chunk in reference:
                chunk.train(mode)
            assert _flags(ours) == _flags(reference) == [mode] * len(_flags(ours))
        if own_train:
            assert engine._training_flags == []  # fell back to the chunks' own train
            assert ours[0][1][0].calls == 3
        else:
            assert len(engine._training_flags) == len(_flags(ours))
