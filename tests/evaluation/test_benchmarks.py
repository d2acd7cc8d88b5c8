"""The `eval` section's refusals, benchmark loading, and `run_benchmark` over a scripted
generator: chunked generation equals one call, failed reward calls are counted, episodes get
their environment's rewards."""

from __future__ import annotations

import json

import pytest

from gspo_megatron.config import ConfigError, compose, resolve
from gspo_megatron.data.dataset import DataError
from gspo_megatron.data.tokenizer import load_tokenizer
from gspo_megatron.evaluation.benchmarks import build_benchmarks, run_benchmark
from gspo_megatron.ranks import SingleRank
from gspo_megatron.rewards.registry import build_scorer
from gspo_megatron.rollout.base import EpisodeRecord, RolloutSample


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer("char")


def _bench_file(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


@pytest.mark.parametrize(
    ("override", "message"),
    [
        ("eval.heldout.ks=[2]", "eval.heldout.ks: k=2 is larger than eval.heldout.samples=1"),
        ("eval.heldout.ks=[0]", "eval.heldout.ks: every k must be an integer >= 1"),
        ("eval.heldout.files=[x.jsonl]", "eval.heldout.files: the held-out benchmark's problems"),
        ("eval.heldout.temperature=-1", "eval.heldout.temperature must be >= 0"),
        ("+eval.benchmarks.b={samples: 2}", "eval.benchmarks.b.files: a named benchmark needs"),
        ("+eval.benchmarks.heldout={files: [README.md]}", "eval.benchmarks.heldout: a benchmark's"),
        ("+eval.benchmarks.b={files: [README.md], ks: [4], samples: 3}", "k=4 is larger than"),
        ("+eval.benchmarks.b={files: [nope.jsonl]}", "eval.benchmarks.b.files entry nope.jsonl"),
        ("+eval.benchmarks.b={files: [README.md], sample: 2}", "eval.benchmarks.b.sample"),
        (
            "+eval.benchmarks.b={files: [README.md], data: {task: add}}",
            "eval.benchmarks.b.data.task",
        ),
        (
            "+eval.benchmarks.b={files: [README.md], data: {label_key: null}}",
            "eval.benchmarks.b.data.label_key is null",
        ),
        (
            "+eval.benchmarks.b={files: [README.md], data: {format: xml}}",
            "eval.benchmarks.b.data.format='xml' is not one of",
        ),
        (
            "+eval.benchmarks.b={files: [README.md], reward: {name: nope}}",
            "unknown eval.benchmarks.b.reward.name='nope'",
        ),
        (
            "+eval.benchmarks.b={files: [README.md], reward: {model_path: x}}",
            "eval.benchmarks.b.reward.model_path cannot be set per benchmark",
        ),
    ],
)
def test_bad_eval_settings_are_refused_by_key(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace(".", r"\.")):
        resolve(compose([override]))


@pytest.mark.parametrize(
    ("old", "new"),
    [
        ("trainer.eval_every=5", "eval.every"),
        ("rollout.eval_samples=4", "eval.heldout.samples"),
        ("rollout.eval_prompts=4", "eval.heldout.problems"),
        ("rollout.eval_temperature=1", "eval.heldout.temperature"),
    ],
)
def test_old_evaluation_keys_name_their_new_place(old, new):
    with pytest.raises(ConfigError, match=f"is now {new}"):
        compose([old])


def _benchmarks(tmp_path, tokenizer, rows, **settings):
    path = _bench_file(tmp_path / "b.jsonl", rows)
    raw = compose(["eval.heldout.problems=0"])
    raw["eval"]["benchmarks"] = {"b": {"files": [path], **settings}}
    cfg, model, _ = resolve(raw)
    scorer = build_scorer(cfg.reward)
    return build_benchmarks(cfg, tokenizer, None, scorer, vocab_size=model.vocab_size, seed=0)


def test_a_file_without_the_label_key_names_the_file_and_its_keys(tmp_path, tokenizer):
    with pytest.raises(DataError) as err:
        _benchmarks(tmp_path, tokenizer, [{"prompt": "copy:12=", "answer": "12"}])
    text = str(err.value)
    assert text.startswith("eval.benchmarks.b: ") and "b.jsonl:1" in text
    assert "missing field 'label'" in text and "['answer', 'prompt']" in text


def test_a_prompt_too_long_for_the_engine_is_refused(tmp_path, tokenizer):
    rows = [{"prompt": "copy:" + "1" * 60 + "=", "label": "1"}]
    with pytest.raises(ConfigError, match="eval.benchmarks.b: its longest prompt"):
        _benchmarks(tmp_path, tokenizer, rows, data={"max_prompt_length": 100})


class Scripted:
    """Rollouts (a RolloutCollector's `groups` and `response_text`) that spell a fixed text per
    (problem, sample), as token ids; `episode`: each sample's EpisodeRecord, by (problem index
    in the call, sample)."""

    def __init__(self, tokenizer, texts, episode=None):
        self.tokenizer, self.texts, self.calls = tokenizer, texts, []
        self.episode = episode

    def response_text(self, sample):
        return self.tokenizer.decode(sample.response_ids, skip_special_tokens=False)

    def groups(self, problems, n, params, *, now=False):
        assert now  # a benchmark generates with the current weights
        self.calls.append(len(problems))
        return [
            [
                RolloutSample(
                    prompt_ids=list(p.prompt_ids),
                    response_ids=self.tokenizer.convert_tokens_to_ids(list(self.texts[p.index][j])),
                    logprobs=[0.0] * len(self.texts[p.index][j]),
                    finish_reason="length",
                    episode=None if self.episode is None else self.episode(i, j),
                )
                for j in range(n)
            ]
            for i, p in enumerate(problems)
        ]


def test_chunks_give_the_result_of_one_call_and_failures_are_counted(tmp_path, tokenizer):
    rows = [{"prompt": f"copy:{d}=", "label": d} for d in ("12", "34", "56", "78", "90")]
    texts = [["12", "1", "12"], ["3", "34", "34"], ["56", "56", "56"], ["x", "y", "z"]]
    texts.append(["9", "90", "0"])
    [bench] = _benchmarks(
        tmp_path, tokenizer, rows, samples=3, ks=[1, 2, 3], reward={"name": "exact_match"}
    )
    whole = run_benchmark(bench, Scripted(tokenizer, texts), SingleRank())
    chunked_gen = Scripted(tokenizer, texts)
    chunked = run_benchmark(bench, chunked_gen, SingleRank(), chunk_problems=2)
    assert chunked_gen.calls == [2, 2, 1]
    assert chunked.metrics == whole.metrics and chunked.records == whole.records
    solved = [[1, 0, 1], [0, 1, 1], [1, 1, 1], [0, 0, 0], [0, 1, 0]]
    assert [r["solved"] for r in whole.records] == solved
    assert whole.metrics["avg@3"] == pytest.approx(8 / 15)
    assert whole.metrics["pass@3"] == pytest.approx(4 / 5)
    # maj@2: [12,1] tie -> 12 (first) ok; [3,34] -> 3 wrong; 56 ok; x wrong; [9,90] -> 9 wrong
    assert whole.metrics["maj@2"] == pytest.approx(2 / 5)
    assert whole.metrics["maj@3"] == pytest.approx(3 / 5)  # 12, 34, 56
    assert whole.metrics["truncated_fraction"] == 1.0 and whole.metrics["reward_failures"] == 0

    def broken(prompt, response, label):
        raise RuntimeError("no verdict")

    bench.scorer = build_scorer_for(broken)
    failed = run_benchmark(bench, Scripted(tokenizer, texts), SingleRank())
    assert failed.metrics["reward_failures"] == 15 and failed.metrics["avg@3"] == 0
    assert "maj@2" not in failed.metrics  # a plain function cannot say what the answer is


def build_scorer_for(fn):
    from gspo_megatron.rewards.scorer import RewardScorer

    return RewardScorer(fn, timeout_s=5, max_concurrency=1, executor="thread")


def test_an_episode_scores_its_answer_plus_the_environments_rewards(tmp_path, tokenizer):
    rows = [{"prompt": "copy:12=", "label": "12"}, {"prompt": "copy:34=", "label": "34"}]
    [bench] = _benchmarks(tmp_path, tokenizer, rows, samples=2, reward={"name": "exact_match"})

    def episode(i, j):
        failure = "error" if (i, j) == (1, 1) else None
        return EpisodeRecord(answer_start=0, env_reward=0.5, failure=failure)

    episodes = Scripted(tokenizer, [["12", "1"], ["34", "34"]], episode=episode)
    result = run_benchmark(bench, episodes, SingleRank())
    assert [r["rewards"] for r in result.records] == [[1.5, 0.5], [1.5, 0.0]]
    assert result.metrics["reward_failures"] == 1


def test_partial_credit_is_not_a_solve(tmp_path, tokenizer):
    """The synthetic reward's partial credit counts in reward_mean, only a full score solves."""
    rows = [{"prompt": "copy:12=", "label": "12"}, {"prompt": "copy:34=", "label": "34"}]
    [bench] = _benchmarks(tmp_path, tokenizer, rows, samples=2, reward={"name": "synthetic"})
    texts = [["12", "13"], ["35", "44"]]
    result = run_benchmark(bench, Scripted(tokenizer, texts), SingleRank())
    assert [r["rewards"] for r in result.records] == [[1.0, 0.5], [0.5, 0.5]]
    assert [r["solved"] for r in result.records] == [[1, 0], [0, 0]]
    assert result.metrics["avg@2"] == 0.25 and result.metrics["reward_mean"] == 0.625
    assert result.metrics["pass@2"] == 0.5


def test_a_benchmarks_sampling_seed_does_not_depend_on_the_others(tmp_path, tokenizer):
    path = _bench_file(tmp_path / "b.jsonl", [{"prompt": "copy:12=", "label": "12"}])
    seeds = []
    for names in (["b"], ["a", "b"]):
        raw = compose(["eval.heldout.problems=0", "seed=3"])
        raw["eval"]["benchmarks"] = {n: {"files": [path], "temperature": 1.0} for n in names}
        cfg, model, _ = resolve(raw)
        built = build_benchmarks(
            cfg, tokenizer, None, build_scorer(cfg.reward), vocab_size=model.vocab_size, seed=3
        )
        seeds.append({b.name: b.params.seed for b in built})
    assert seeds[0]["b"] == seeds[1]["b"] != seeds[1]["a"]
