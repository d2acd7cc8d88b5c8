"""`emulated_train.py gspo-train ARGS` (or gspo-eval ARGS): that command under the
emulated accelerator (tests/device_emulation.py): a host tensor given to the
model or to a would-be-NCCL collective fails the run, naming the op and call site. Runs under
torchrun too.

Before training (or evaluating), each rank prints one JSON line proving the emulation is on: a
host/device mix is refused and the policy's parameters are device tensors.
"""

from __future__ import annotations

import json
import os
import sys

import device_emulation

device_emulation.enable()

import torch  # noqa: E402

from gspo_megatron import evaluate, train  # noqa: E402
from gspo_megatron.trainer import Trainer  # noqa: E402


def _prove_emulation(run):
    def checked(self, *args):
        try:
            torch.ones(1, device="cuda") + torch.ones(2)
            refused = False
        except device_emulation.DeviceMixError:
            refused = True
        params = [p for chunk in self.engine.unwrapped_chunks for p in chunk.parameters()]
        proof = {
            "rank": torch.distributed.get_rank(),
            "mixed_op_refused": refused,
            "params_on_device": all(device_emulation.on_device(p) for p in params),
        }
        # One write() of the whole line: the ranks share the pipe, and print() writes the text
        # and the newline separately (two ranks' lines interleaved).
        sys.stdout.flush()
        os.write(sys.stdout.fileno(), (json.dumps(proof) + "\n").encode())
        return run(self, *args)

    return checked


if __name__ == "__main__":
    if sys.argv.pop(1) == "gspo-eval":
        evaluate.Evaluation.run = _prove_emulation(evaluate.Evaluation.run)
        evaluate.main()
    else:
        Trainer.train = _prove_emulation(Trainer.train)
        train.main()
