"""Code-execution rewards: programs from responses run on test cases in the sandbox
(gspo_megatron/sandbox), LiveCodeBench / CodeForces test formats, and a sandbox service for
clusters. See docs/SANDBOX.md.
"""

from gspo_megatron.rewards.code.problems import CodeProblem, TestCase, parse_problem
from gspo_megatron.rewards.code.reward import REASONS, SCORINGS, CodeOutcome, CodeReward

__all__ = [
    "REASONS",
    "SCORINGS",
    "CodeOutcome",
    "CodeProblem",
    "CodeReward",
    "TestCase",
    "parse_problem",
]
