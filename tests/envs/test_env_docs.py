"""docs/ENVIRONMENTS.md's own example runs as written: its `Guess` class, and its command line
`gspo-train env.name=mypackage.games:Guess env.kwargs.max_guesses=8` (an environment's
keyword arguments given without Hydra's `+`)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from gspo_megatron.config import ConfigError, compose, resolve

DOC = Path(__file__).resolve().parents[2] / "docs" / "ENVIRONMENTS.md"


def _doc_example() -> tuple[str, list[str]]:
    """The first Python block of the doc (the Guess class) and the overrides of the command
    that runs it."""
    text = DOC.read_text()
    code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
    command = re.search(r"`gspo-train (env\.name=mypackage\.games:Guess[^`]*)`", text).group(1)
    return code, shlex.split(command)


@pytest.fixture
def guess_package(tmp_path, monkeypatch):
    code, overrides = _doc_example()
    package = tmp_path / "mypackage"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "games.py").write_text(code)
    monkeypatch.syspath_prepend(str(tmp_path))
    return overrides


def test_the_documented_command_runs_the_documented_environment(guess_package):
    overrides = guess_package
    assert "env.kwargs.max_guesses=8" in overrides  # the form the doc shows, without '+'
    cfg, _, _ = resolve(compose(overrides), check_inputs=False)
    assert cfg.env.name == "mypackage.games:Guess"
    assert cfg.env.kwargs == {"max_guesses": 8}
    from mypackage.games import Guess

    assert Guess(**cfg.env.kwargs).max_guesses == 8


def test_environment_kwargs_are_still_checked_against_the_class(guess_package):
    with pytest.raises(ConfigError, match="env.kwargs do not fit environment"):
        resolve(
            compose(["env.name=mypackage.games:Guess", "env.kwargs.rounds=3"]), check_inputs=False
        )


def test_open_mappings_take_new_keys_without_plus():
    # a preset's kwargs are kept and extended; '+' and '++' still work
    raw = compose(["env=retrieval", "env.kwargs.extra=1", "++env.kwargs.distractors=5"])
    assert raw["env"]["kwargs"] == {"distractors": 5, "extra": 1}
    # a loss hyper-parameter its preset does not list, checked by the loss
    raw = compose(["algorithm=ppo", "algorithm.hparams.clip_c=3"])
    assert resolve(raw, check_inputs=False)[0].algorithm.hparams["clip_c"] == 3
    with pytest.raises(ConfigError, match="algorithm.hparams: tau_pos is not a hyperparameter"):
        resolve(compose(["algorithm=ppo", "algorithm.hparams.tau_pos=1"]), check_inputs=False)
    # the sections themselves stay closed
    from hydra.errors import ConfigCompositionException

    with pytest.raises(ConfigCompositionException, match="env.max_guesses"):
        compose(["env.max_guesses=8"])
