"""Multi-turn episodes on a scripted engine: the trajectory is exactly the model's sampled ids
and the observations' ids (token-in / token-out), the loss mask is 1 on model tokens only, the
limits truncate with finish reason "length", and failing environments end only their episode."""

from __future__ import annotations

import random
import threading
import time

import numpy as np
import pytest

from gspo_megatron.data.dataset import Prompt
from gspo_megatron.data.tokenizer import build_tool_char_tokenizer
from gspo_megatron.envs import Environment, StepResult
from gspo_megatron.envs.registry import EnvConfig
from gspo_megatron.ranks import SingleRank
from gspo_megatron.rollout.base import RolloutSample, SamplingParams
from gspo_megatron.rollout.episodes import EpisodeRunner

TOKENIZER = build_tool_char_tokenizer()
EOS = TOKENIZER.eos_token_id
STOP = SamplingParams(max_new_tokens=8, stop_token_ids=(EOS,), seed=1)


class ScriptedEngine:
    """A driver stand-in: each call samples random digits with random log-probs, ending with
    <eos> at random or running to max_new_tokens; it records every sampled turn."""

    def __init__(self, seed: int = 0, stop_probability: float = 0.7, routes: bool = False):
        self.rng = random.Random(seed)
        self.stop_probability = stop_probability
        self.routes = routes
        self.turns: list[tuple[list[int], list[int], list[float]]] = []  # (context, ids, lps)

    def generate(self, prompts, n, params):
        assert n == 1
        out = []
        for context in prompts:
            stops = self.rng.random() < self.stop_probability
            # finish "length" means the turn ran to its token budget
            length = self.rng.randint(1, params.max_new_tokens) if stops else params.max_new_tokens
            ids = [TOKENIZER.convert_tokens_to_ids(self.rng.choice("0123456789"))
                   for _ in range(length - stops)] + [EOS] * stops  # fmt: skip
            lps = [-self.rng.random() for _ in ids]
            self.turns.append((list(context), ids, lps))
            routes = None
            if self.routes:
                routes = np.arange(len(context) + len(ids) - 1, dtype=np.int32)[:, None, None]
            out.append([RolloutSample(list(context), ids, lps, "stop" if stops else "length",
                                      routed_experts=routes)])  # fmt: skip
        return out


class RandomObservations(Environment):
    """Text or id observations of random length; done after a random number of turns."""

    inline_safe = True

    def reset(self, prompt, label=None):
        self.rng = random.Random(prompt)
        self.left = self.rng.randint(1, 4)

    def step(self, turn):
        self.left -= 1
        if self.left == 0:
            return StepResult(done=True, reward=0.5)
        if self.rng.random() < 0.5:
            return StepResult(observation="9" * self.rng.randint(0, 12), tool_calls=1)
        ids = [self.rng.randrange(4, 40) for _ in range(self.rng.randint(1, 12))]
        return StepResult(observation=ids)


def prompts(count: int) -> list[Prompt]:
    return [Prompt(i, TOKENIZER.encode(f"{i}+{i}="), f"{i}+{i}=", str(2 * i)) for i in range(count)]


def runner(name: str, max_sequence_length: int = 96, **settings) -> EpisodeRunner:
    cfg = EnvConfig(name=f"{__name__}:{name}", **settings)
    return EpisodeRunner(cfg, TOKENIZER, SingleRank(), max_sequence_length)


@pytest.mark.parametrize("seed", range(20))
def test_loss_mask_is_exactly_the_model_tokens(seed):
    """Property test over random episodes: the trajectory is the initial context, then each
    turn's sampled ids (mask 1, their log-probs) and each observation's ids (mask 0), in order;
    each turn's request was the whole trajectory before it; limits hold."""
    engine = ScriptedEngine(seed)
    cfg = dict(max_turns=random.Random(seed).randint(1, 5), max_tokens=40)
    groups = runner("RandomObservations", **cfg).run(engine, prompts(6), 3, STOP)
    turns = iter(engine.turns)
    by_context = {}
    for context, ids, lps in engine.turns:
        by_context.setdefault(tuple(context), []).append((ids, lps))
    for group in groups:
        for s in group:
            assert len(s.response_ids) == len(s.logprobs) == len(s.loss_mask)
            assert len(s.response_ids) <= 40
            assert s.episode.turns <= cfg["max_turns"]
            # walk the trajectory: every model span is a recorded turn for exactly that context
            pos, model_turns = 0, 0
            while pos < len(s.response_ids):
                if s.loss_mask[pos] == 1:
                    context = tuple(s.prompt_ids + s.response_ids[:pos])
                    ids, lps = by_context[context].pop(0)
                    span = s.response_ids[pos : pos + len(ids)]
                    assert span == ids[: len(span)]
                    assert s.logprobs[pos : pos + len(span)] == lps[: len(span)]
                    assert s.loss_mask[pos : pos + len(span)] == [1] * len(span)
                    pos += len(span)
                    model_turns += 1
                else:
                    assert s.logprobs[pos] == 0.0
                    pos += 1
            assert model_turns == s.episode.turns
            assert s.loss_mask[-1] == 1  # a trajectory ends with the model's tokens
    assert next(turns, None) is not None


def test_text_observations_go_through_the_chat_template():
    engine = ScriptedEngine(3, stop_probability=1.0)

    class Once(Environment):
        inline_safe = True

        def step(self, turn):
            if turn.endswith("tool"):
                return StepResult(done=True)
            return StepResult(observation="12")

    globals()["Once"] = Once
    (group,) = runner("Once", max_turns=2).run(engine, prompts(1), 1, STOP)
    s = group[0]
    first = len(engine.turns[0][1])
    observed = [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if m == 0]
    assert TOKENIZER.convert_ids_to_tokens(observed) == [
        "<tool_response>",
        "1",
        "2",
        "</tool_response>",
    ]
    assert s.response_ids[:first] == engine.turns[0][1]
    assert s.episode.answer_start == first + 4


class Endless(Environment):
    inline_safe = True

    def step(self, turn):
        return StepResult(observation=[5, 6, 7])


def test_limits_end_episodes_with_length():
    engine = ScriptedEngine(1, stop_probability=1.0)
    (group,) = runner("Endless", max_turns=2).run(engine, prompts(1), 4, STOP)
    assert all(s.finish_reason == "length" and s.episode.turns == 2 for s in group)
    # an observation that leaves no room for a model token truncates the episode
    (group,) = runner("Endless", max_turns=5, max_tokens=11).run(engine, prompts(1), 4, STOP)
    for s in group:
        assert s.finish_reason == "length" and len(s.response_ids) <= 11
        assert s.episode.truncated_observation or s.episode.turns == 5 or len(s.response_ids) >= 10


def test_turn_cut_by_the_episode_budget_and_routes_cut_with_it():
    engine = ScriptedEngine(2, stop_probability=0.0, routes=True)  # every turn runs 8 tokens
    (group,) = runner("Endless", max_tokens=5).run(engine, prompts(1), 2, STOP)
    for s in group:
        assert len(s.response_ids) == 5 and s.finish_reason == "length"
        assert s.routed_experts.shape[0] == len(s.prompt_ids) + len(s.response_ids) - 1


class Raises(Environment):
    def step(self, turn):
        if "3" in turn:
            raise RuntimeError("boom")
        return StepResult(done=True)


class Hangs(Environment):
    release = threading.Event()
    wait_s = 120.0

    def step(self, turn):
        if "3" in turn:
            self.release.wait(self.wait_s)
        return StepResult(done=True)


@pytest.mark.parametrize("executor", ["thread", "process"])
@pytest.mark.parametrize(("name", "failure"), [("Raises", "error"), ("Hangs", "timeout")])
def test_failing_environment_ends_only_its_episode(name, failure, executor, caplog):
    engine = ScriptedEngine(4, stop_probability=1.0)
    Hangs.release = threading.Event()
    episodes = runner(name, timeout_s=1.0, executor=executor, workers=2)
    started = time.monotonic()
    groups = episodes.run(engine, prompts(4), 2, STOP)
    # far less than a hung call would take: it was abandoned (thread) or killed (process)
    assert time.monotonic() - started < Hangs.wait_s / 2
    Hangs.release.set()
    episodes.close()
    samples = [s for g in groups for s in g]
    failed = [s for s in samples if s.episode.failure == failure]
    assert failed and len(failed) < len(samples)
    assert all("3" in TOKENIZER.decode(s.response_ids) for s in failed)
    assert all(s.episode.failure is None and s.finish_reason == "stop"
               for s in samples if s not in failed)  # fmt: skip
    # the first failure's text, with the environment's name, on both executor paths
    (warning,) = [
        r.getMessage() for r in caplog.records if r.name == "gspo_megatron.rollout.episodes"
    ]
    assert f"{__name__}:{name}: {len(failed)} of 8 episodes" in warning
    assert ("RuntimeError: boom" if name == "Raises" else "1 s") in warning


class Counts(Environment):
    """Observes its own turn count until the third turn: state that must survive each call."""

    def __init__(self) -> None:
        self.turns = 0

    def step(self, turn):
        self.turns += 1
        return StepResult(observation=[5] * self.turns, done=self.turns == 3)


@pytest.mark.parametrize("executor", ["inline", "thread", "process"])
def test_environment_state_lives_through_the_episode(executor):
    episodes = runner("Counts", executor=executor, workers=2)
    groups = episodes.run(ScriptedEngine(7, stop_probability=1.0), prompts(2), 3, STOP)
    episodes.close()
    for s in (s for g in groups for s in g):
        observed = [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if m == 0]
        assert observed == [5, 5, 5] and s.episode.turns == 3 and s.finish_reason == "stop"


class BadObservation(Environment):
    inline_safe = True

    def step(self, turn):
        return StepResult(observation={"text": turn})


class BadReset(Environment):
    inline_safe = True

    def reset(self, prompt, label=None):
        return 3.5

    def step(self, turn):
        return StepResult(done=True)


class EmptyReset(BadReset):
    def reset(self, prompt, label=None):
        return []


class NanReward(Environment):
    inline_safe = True

    def step(self, turn):
        return StepResult(done=True, reward=float("nan"))


@pytest.mark.parametrize("name", ["BadObservation", "BadReset", "EmptyReset", "NanReward"])
def test_contract_violation_ends_the_episode_named_in_a_warning(name, caplog):
    groups = runner(name).run(ScriptedEngine(5, stop_probability=1.0), prompts(2), 2, STOP)
    records = [s.episode for g in groups for s in g]
    assert all(r.failure == "malformed" for r in records)
    (warning,) = [r for r in caplog.records if r.name == "gspo_megatron.rollout.episodes"]
    assert name in warning.getMessage() and "4 of 4 episodes" in warning.getMessage()


class FailsToBuild(Environment):
    def __init__(self):
        raise OSError("no sandbox")

    def step(self, turn):
        raise AssertionError


def test_environment_that_cannot_be_built_gives_empty_failed_episodes():
    (group,) = runner("FailsToBuild").run(ScriptedEngine(6), prompts(1), 2, STOP)
    assert all(s.response_ids == [] and s.episode.failure == "error" for s in group)


def test_tool_error_observes_or_ends():
    from gspo_megatron.envs.calculator import CalculatorEnv

    globals()["CalculatorEnv"] = CalculatorEnv

    class BadCall(ScriptedEngine):
        def generate(self, prompts, n, params):
            ids = TOKENIZER.encode("<tool_call>{bad</tool_call>", add_special_tokens=False)
            return [[RolloutSample(list(p), ids + [EOS], [-0.1] * (len(ids) + 1), "stop")]
                    for p in prompts]  # fmt: skip

    (group,) = runner("CalculatorEnv", 400, max_turns=2).run(BadCall(), prompts(1), 1, STOP)
    s = group[0]
    observed = TOKENIZER.decode(
        [t for t, m in zip(s.response_ids, s.loss_mask, strict=True) if not m]
    )
    assert observed.startswith("<tool_response>error: the tool call is not valid ")
    assert s.episode.tool_errors == 2 and s.episode.turns == 2 and s.episode.failure is None
    (group,) = runner("CalculatorEnv", on_tool_error="end").run(BadCall(), prompts(1), 1, STOP)
    assert group[0].episode.failure == "tool_error" and group[0].episode.turns == 1
