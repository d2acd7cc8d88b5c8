"""A key -> value "search" tool over a generated corpus, for the synthetic `lookup` task
(data.task=lookup: "code:kqz=" -> the key's 4-digit code, which the prompt does not contain).

    <tool_call>{"name": "search", "arguments": {"query": "kqz"}}</tool_call>

answers with a passage: the document of the key, among `distractors` documents of other keys,
each saying "the code of <key> is <code>". The observation is long relative to the 4-digit
answer, which is what makes it a test of per-token loss masks: the passage's tokens are context,
never trained on. Codes come from `lookup_code`, the function the data set's labels come from,
so the corpus needs no storage.
"""

from __future__ import annotations

import json
import random
import string
from typing import Any, ClassVar

from gspo_megatron.envs.tools import ToolEnvironment, ToolError
from gspo_megatron.rewards.synthetic import lookup_code


class RetrievalEnv(ToolEnvironment):
    inline_safe = True
    tools: ClassVar = {}

    def __init__(self, distractors: int = 3, seed: int = 0) -> None:
        if distractors < 0:
            raise ValueError(f"env.kwargs.distractors must be >= 0, got {distractors}")
        self.distractors = distractors
        self.seed = seed
        self.tools = {"search": self.search}

    # Each letter of a demonstrated query is wrong with this probability.
    demonstration_letter_error: ClassVar[float] = 0.5

    @classmethod
    def demonstration(cls, prompt: str, label: Any, rng: random.Random) -> list[str]:
        """A noisy demonstrator: searches for the prompt's key with each letter wrong with
        probability `demonstration_letter_error` and answers with the code of what it searched
        for (the format of a search and of reading its passage, not the task)."""
        key = prompt.removeprefix("code:").rstrip("=")
        letters = string.ascii_lowercase
        query = "".join(rng.choice(letters) if rng.random() < cls.demonstration_letter_error
                        else c for c in key)  # fmt: skip
        arguments = json.dumps({"query": query}, separators=(",", ":"))
        call = f'<tool_call>{{"name":"search","arguments":{arguments}}}</tool_call>'
        return [call, lookup_code(query)]

    def search(self, query: str) -> str:
        key = str(query).strip().lower()
        if not key or len(key) > 16 or not set(key) <= set(string.ascii_lowercase):
            raise ToolError("query must be a key of lowercase letters")
        rng = random.Random(f"retrieval|{self.seed}|{key}")
        others = {
            "".join(rng.choice(string.ascii_lowercase) for _ in key)
            for _ in range(self.distractors)
        }
        keys = sorted(others - {key}) + [key]
        rng.shuffle(keys)
        return " ".join(f"the code of {k} is {lookup_code(k)}." for k in keys)
