"""`gspo-train` under the emulated accelerator: every tensor the run gives the model or a
would-be-NCCL collective is where a GPU run needs it, through generation, scoring, old-policy
and reference forwards, training, evaluation, checkpoint save and resume."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from launch import REPO, free_port, hf_policy, read_metrics

RUNNER = Path(__file__).resolve().parent / "emulated_train.py"
SMALL = [
    "rollout.prompts_per_step=4",
    "rollout.group_size=4",
    "rollout.max_new_tokens=4",
    "eval.heldout.problems=4",
    "algorithm.num_minibatches=2",
    "data.num_train=64",
    "logging.progress=false",
    "logging.tensorboard=false",
]


def emulated_train(
    run_dir: Path, *overrides: str, nproc: int = 1, program: str = "gspo-train"
) -> list[dict]:
    """Run gspo-train (or gspo-eval) under the emulation; the proof lines of every rank."""
    args = [str(RUNNER), program, f"hydra.run.dir={run_dir}", *SMALL, *overrides]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}",
               f"--master-port={free_port()}", *args]  # fmt: skip
    else:
        cmd = [sys.executable, *args]
    # tests/ for the environments of multi-turn runs (envs/scripted_envs.py)
    path = f"{REPO}{os.pathsep}{REPO / 'tests'}"
    env = {"PYTHONPATH": path, "OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    log = "".join(p.read_text() for p in run_dir.glob("*.rank*.log"))
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:] + log[-4000:]
    proofs = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(proofs) == nproc, proc.stdout
    for proof in proofs:
        assert proof["mixed_op_refused"] and proof["params_on_device"], proof
    return proofs


def test_gspo_train_save_resume(tmp_path):
    """3 steps (KL reference, TIS weights, evaluation, a checkpoint at step 2 and at the end),
    then a resume from step 3 to 4 (checkpoint load, RNG state, reference rebuilt)."""
    common = ["algorithm.kl_coef=0.1", "algorithm.mismatch=tis",
              "algorithm.mismatch_level=geometric", "eval.every=2"]  # fmt: skip
    emulated_train(tmp_path, *common, "trainer.steps=3", "trainer.save_every=2")
    emulated_train(tmp_path, *common, "trainer.steps=4")
    records = read_metrics(tmp_path)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert "eval/pass@1" in records[1]
    assert sorted(p.name for p in (tmp_path / "checkpoints").glob("step_*"))[-1] == "step_000004"


@pytest.mark.distributed
def test_gspo_train_ep2_from_hugging_face_routing_replay(tmp_path):
    """Two ranks with expert parallelism, initial weights from a Hugging Face directory, R3
    replay of the rollout's routes, and asynchronous rollouts (the generator process takes the
    weights from the devices, the samples and routes go back to them), and the verified Hugging
    Face export of the last checkpoint."""
    init = hf_policy(tmp_path / "hf")
    run = tmp_path / "run"
    emulated_train(
        run, "parallel=ep2", f"model.init_from={init}", "algorithm.routing_replay=r3",
        "rollout.mode=async", "trainer.steps=3", "eval.every=3", "trainer.export_hf_every=3",
        nproc=2,
    )  # fmt: skip
    # the Hugging Face export's read-back compares the device's weights with the host's file
    export = json.loads((run / "checkpoints/step_000003/hf/gspo_export.json").read_text())
    assert export["verified"] and export["lora_merged"] is None, export
    records = read_metrics(run)
    assert len(records) == 3 and records[-1]["async/staleness_max"] == 1


@pytest.mark.distributed
def test_gspo_train_multi_turn_episodes_ep2(tmp_path):
    """Two ranks with expert parallelism running episodes: every rank generates each turn,
    rank 0 steps the environments and shares their answers, the observations' ids and the
    masks reach the devices with the trajectories, R3 replays the last turn's routes. Then
    gspo-eval on the same layout evaluates the last checkpoint as the loop did."""
    multi_turn = [
        "parallel=ep2", "env.name=envs.scripted_envs:TwoObservations", "env.max_tokens=40",
        "model.tokenizer=char_tools", "model.vocab_size=80",
        # a random policy ends a turn with <eos> in ~1 of 6 turns of 12 tokens
        "rollout.max_new_tokens=12", "rollout.group_size=8",
    ]  # fmt: skip
    emulated_train(
        tmp_path, *multi_turn, "algorithm.routing_replay=r3", "trainer.steps=2", "eval.every=2",
        nproc=2,
    )  # fmt: skip
    records = read_metrics(tmp_path)
    assert len(records) == 2 and all(r["env/turns_mean"] > 1 for r in records)
    assert all(r["env/model_token_fraction"] < 1 for r in records)
    # gspo-eval on the two ranks, from the last checkpoint: the loop's evaluation at that step
    out = tmp_path / "gspo_eval"
    emulated_train(out, *multi_turn, f"model.init_from={tmp_path / 'checkpoints' / 'step_000002'}",
                   nproc=2, program="gspo-eval")  # fmt: skip
    in_loop = tmp_path / "eval" / "step_000002" / "heldout.jsonl"
    assert (out / "heldout.jsonl").read_text() == in_loop.read_text()


@pytest.mark.distributed
def test_gspo_train_ppo_with_a_reward_model_tp2_sp(tmp_path):
    """Two ranks, the policy with tensor and sequence parallelism, running PPO: the critic on a
    layout of its own (data parallel, its own process groups; starting from the policy's
    seeded weights through a scratch checkpoint) with its forward and value steps, GAE, a
    learned reward model scoring on every rank (from a Hugging Face sequence-classification
    directory), the critic offloaded during rollouts and saved and resumed with the policy."""
    rm = hf_policy(tmp_path / "rm", reward_model=True)
    run = tmp_path / "run"
    common = ["parallel=tp2", "algorithm=ppo", "critic.parallel.tp=1",
              "critic.parallel.sequence_parallel=false", f"reward.model_path={rm}",
              "reward.model_weight=0.1", "trainer.offload_during_rollout=optimizer",
              "eval.every=0"]  # fmt: skip
    emulated_train(run, *common, "critic.warmup_steps=1", "trainer.steps=2", nproc=2)
    emulated_train(run, *common, "critic.warmup_steps=1", "trainer.steps=3", nproc=2)
    records = read_metrics(run)
    assert [r["step"] for r in records] == [1, 2, 3]
    assert records[0]["actor/optimizer_steps"] == 0 and records[0]["critic/optimizer_steps"] == 2
    assert all(r["reward/model_std"] > 0 for r in records)
    # the critic's head starts at zero, then learns
    assert records[0]["critic/values_mean"] == 0.0 and records[2]["critic/values_mean"] != 0.0
    critic = run / "checkpoints" / "step_000003" / "critic" / "gspo_checkpoint.json"
    assert json.loads(critic.read_text())["layout"]["tp"] == 1
    assert not (run / "critic_init_from_policy").exists()


@pytest.mark.distributed
def test_gspo_train_lora_tp2_sp_from_hugging_face_with_kl(tmp_path):
    """Two ranks with tensor and sequence parallelism training LoRA adapters (docs/LORA.md)
    over base weights from a Hugging Face directory: the adapters' collectives, the KL
    reference as the base model with the adapters off, a learned reward model beside them, the
    state offloaded during rollouts, a checkpoint of adapters and frozen base, and beside it the
    verified Hugging Face export of the merged model (trainer.export_hf_every)."""
    init = hf_policy(tmp_path / "hf")
    rm = hf_policy(tmp_path / "rm", reward_model=True)
    run = tmp_path / "run"
    emulated_train(
        run, "parallel=tp2", "lora.rank=4", f"model.init_from={init}", "algorithm.kl_coef=0.1",
        f"reward.model_path={rm}", "reward.model_weight=0.1",
        "trainer.offload_during_rollout=all", "trainer.steps=2", "eval.every=2",
        "trainer.export_hf_every=2", nproc=2,
    )  # fmt: skip
    records = read_metrics(run)
    assert len(records) == 2 and records[-1]["actor/kl_ref"] > 0
    export = json.loads((run / "checkpoints/step_000002/hf/gspo_export.json").read_text())
    assert export["verified"] and export["lora_merged"]["rank"] == 4, export


# Two steps of episodes with two observations each, on the tool-call character tokenizer.
TWO_TURN_EPISODES = (
    "env.name=envs.scripted_envs:TwoObservations", "env.max_tokens=40",
    "model.tokenizer=char_tools", "model.vocab_size=80", "rollout.max_new_tokens=12",
    "rollout.group_size=8", "trainer.steps=2", "eval.every=0",
)  # fmt: skip


def assert_kept_context(records: list[dict]) -> None:
    """Both steps ran episodes of more than one turn, each reusing K/V kept between turns."""
    assert len(records) == 2 and all(r["env/turns_mean"] > 1 for r in records)
    assert all(r["rollout/prefix_cache_reused_tokens"] > 0 for r in records)


def test_gspo_train_multi_turn_kept_context_and_turn_credit(tmp_path):
    """One rank running episodes with the torch decoder: the K/V kept between an episode's
    turns (rollout.prefix_cache_tokens) live on the device with the batch's cache they are
    copied into, and per-turn credit's token advantages reach the loss there."""
    emulated_train(
        tmp_path, *TWO_TURN_EPISODES, "algorithm=gspo_token", "algorithm.credit=turn",
        "algorithm.turn_gamma=0.5",
    )  # fmt: skip
    records = read_metrics(tmp_path)
    assert_kept_context(records)


def test_gspo_train_lora_torch_decoder_kept_context(tmp_path):
    """A LoRA policy on one rank generating with the torch decoder (each adapter merged into
    its weight on the device at every batch, the output layer and final norm trained whole
    beside them), running episodes with the K/V kept between turns: a decoder that could not
    keep them would count every prompt as rollout/prefix_cache_unsupported."""
    emulated_train(
        tmp_path, "lora.rank=4", "lora.modules_to_save=[output_layer,final_norm]",
        *TWO_TURN_EPISODES,
    )  # fmt: skip
    records = read_metrics(tmp_path)
    assert_kept_context(records)
    assert all(r["rollout/prefix_cache_unsupported"] == 0 for r in records)
    # the rollouts' log-probs are the adapted policy's (the trainer's recompute)
    assert all(r["mismatch/logprob_abs_diff_max"] < 1e-5 for r in records)


def test_gspo_train_lora_async(tmp_path):
    """LoRA adapters with asynchronous rollouts: the adapters (and the base, once) gathered
    from the devices for the generator process, which merges them."""
    emulated_train(tmp_path, "lora.rank=4", "rollout.mode=async", "trainer.steps=3", "eval.every=0")
    records = read_metrics(tmp_path)
    assert len(records) == 3 and records[-1]["async/staleness_max"] == 1
