"""Supervised warm start on an environment's demonstrations: a cold start before multi-turn RL.

    python tools/sft_warm_start.py --out ckpt/calculator_format --steps 150 \
        +experiment=calculator_cpu
    gspo-train +experiment=calculator_cpu model.init_from=ckpt/calculator_format

Takes the same overrides as gspo-train (the model, tokenizer, data, env sections are read) and
writes a model-only gspo-megatron checkpoint for `model.init_from`. Each step draws
`rollout.prompts_per_step` prompts, has the environment class script one demonstration episode
per prompt (`Environment.demonstration`: its model turns), runs the episodes through the same
`EpisodeRunner` as RL (the environment answers every scripted turn; observations are masked
out) and takes one optimizer step on the mean negative log-likelihood of the model's tokens:
a policy-gradient loss at ratio 1 with advantage 1 (the loss `dapo`, token mean). One process.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path


class ScriptedTurns:
    """A rollout driver that "samples" the demonstrations' turns: each episode's next scripted
    turn (ending with the stop token), found by its initial context (distinct per episode)."""

    def __init__(self, scripts: dict[tuple[int, ...], list[list[int]]], stop_id: int) -> None:
        self.scripts = scripts
        self.stop_id = stop_id

    def generate(self, contexts, n, params):
        from gspo_megatron.rollout.base import RolloutSample

        out = []
        for context in contexts:
            prompt = next(p for p in self.scripts if tuple(context[: len(p)]) == p)
            ids = self.scripts[prompt].pop(0) + [self.stop_id]
            out.append([RolloutSample(list(context), ids, [0.0] * len(ids), "stop")])
        return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="the checkpoint directory to write")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("overrides", nargs="*", help="gspo-train overrides")
    args = parser.parse_args(argv)

    from gspo_megatron.config import ConfigError, compose, resolve

    try:
        cfg, model, layout = resolve(compose(args.overrides), 1)
        if not cfg.env.enabled:
            raise ConfigError("a warm start needs an environment (env=...) with demonstrations")
    except ConfigError as err:
        sys.exit(f"sft_warm_start: config error: {err}")
    if Path(args.out).exists():
        sys.exit(f"sft_warm_start: {args.out} exists")

    from gspo_megatron.megatron import cpu_compat

    cpu_compat.apply()
    from gspo_megatron.components import build_policy_engine, load_run_tokenizer
    from gspo_megatron.data.config import build_datasets
    from gspo_megatron.envs.registry import environment_class
    from gspo_megatron.megatron import parallel
    from gspo_megatron.megatron.checkpointing import save_engine
    from gspo_megatron.ranks import SingleRank
    from gspo_megatron.rollout.base import SamplingParams
    from gspo_megatron.rollout.episodes import EpisodeRunner
    from gspo_megatron.spec.loss import LossSettings
    from gspo_megatron.spec.sample import TrainSample
    from gspo_megatron.spec.training import OptimizerSettings

    cfg.optimizer = OptimizerSettings(lr=args.lr, decay_style="constant", warmup_steps=0)
    tokenizer = load_run_tokenizer(cfg)
    train_data, _ = build_datasets(cfg.data, tokenizer)
    env = environment_class(cfg.env.name)
    parallel.initialize(layout, seed=cfg.seed)
    engine = build_policy_engine(cfg, model, layout)
    runner = EpisodeRunner(cfg.env, tokenizer, SingleRank(), cfg.engine.max_sequence_length)
    rng = random.Random(cfg.seed)
    stop = tokenizer.eos_token_id
    params = SamplingParams(max_new_tokens=cfg.rollout.max_new_tokens, stop_token_ids=(stop,))
    loss = LossSettings("dapo", {"clip_low": 1e9, "clip_high": 1e9})
    for step in range(1, args.steps + 1):
        drawn = rng.sample(list(train_data.prompts), cfg.rollout.prompts_per_step)
        # an episode's turns are found by its prompt: one episode per distinct prompt
        prompts = list({tuple(p.prompt_ids): p for p in drawn}.values())
        scripts = {}
        for p in prompts:
            turns = env.demonstration(p.prompt, p.label, rng)
            if turns is None:
                sys.exit(f"sft_warm_start: environment {cfg.env.name} has no demonstrations")
            encoded = [tokenizer.encode(t, add_special_tokens=False) for t in turns]
            scripts[tuple(p.prompt_ids)] = encoded
        groups = runner.run(ScriptedTurns(scripts, stop), prompts, 1, params)
        samples = [
            TrainSample(s.prompt_ids, s.response_ids, advantage=1.0, loss_mask=s.loss_mask)
            for (s,) in groups
        ]
        for s, lp in zip(samples, engine.forward(samples).logprobs, strict=True):
            s.old_logprobs = lp.tolist()  # ratio 1: the gradient is the log-likelihood's
        metrics = engine.train_step(samples, loss)
        if step == 1 or step % 25 == 0 or step == args.steps:
            nll = -sum(
                lp * m for s in samples for lp, m in zip(s.old_logprobs, s.loss_mask, strict=True)
            ) / sum(sum(s.loss_mask) for s in samples)
            print(f"step {step}: nll per model token {nll:.4f} (lr {metrics['lr']:.1e})")
    save_engine(engine, args.out, with_optimizer=False)
    print(f"wrote {args.out}")
    engine.close()
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
