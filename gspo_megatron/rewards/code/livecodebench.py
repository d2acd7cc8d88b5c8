"""LiveCodeBench problems as prompt records for the code reward.

    python -m gspo_megatron.rewards.code.livecodebench lcb.jsonl problems.jsonl

reads LiveCodeBench's code-generation rows (question_content, starter_code, public_test_cases,
private_test_cases, metadata, ...) and writes one {"prompt", "label", "question_id",
"platform", "difficulty"} line each; `gspo-eval ... reward=code
'+eval.benchmarks.lcb={files: [problems.jsonl], samples: 8, ks: [1, 8]}'` then scores them.

LiveCodeBench ships private tests either as JSON text or as base64 of zlib-compressed pickled
JSON text. The pickle is read with an unpickler that refuses every class and function, so only
plain data (text, numbers, lists, dicts) can come out of it: loading a file never runs code.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import pickle
import zlib
from typing import Any

from gspo_megatron import files
from gspo_megatron.rewards.base import RewardError
from gspo_megatron.rewards.code.problems import parse_problem

STDIN_INSTRUCTIONS = (
    "Read the input from stdin, solve the problem and write the answer to stdout (do not test "
    "on the sample inputs directly). Enclose your code within delimiters as follows:\n"
    "```python\n# YOUR CODE HERE\n```"
)
STARTER_INSTRUCTIONS = (
    "Complete the following starter code and enclose the whole solution within delimiters:\n"
    "```python\n{starter_code}\n```"
)


class _PlainDataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):  # every global is refused
        raise pickle.UnpicklingError(f"refusing to load {module}.{name} from a test file")


def decode_tests(value: Any, where: str) -> list[dict[str, Any]]:
    """A LiveCodeBench test list from JSON text, or from base64(zlib(pickle(JSON text)))."""
    if isinstance(value, list):
        return value
    if not isinstance(value, str):
        raise ValueError(f"{where}: tests must be text, got {type(value).__name__}")
    try:
        tests = json.loads(value)
    except json.JSONDecodeError:
        try:
            raw = zlib.decompress(base64.b64decode(value))
            tests = _PlainDataUnpickler(io.BytesIO(raw)).load()
        except (ValueError, zlib.error, pickle.UnpicklingError, EOFError) as exc:
            raise ValueError(
                f"{where}: tests are neither JSON nor LiveCodeBench's encoding: {exc}"
            ) from None
        if isinstance(tests, str | bytes):
            tests = json.loads(tests)
    if not isinstance(tests, list):
        raise ValueError(f"{where}: tests must be a list, got {type(tests).__name__}")
    return tests


def lcb_prompt(row: dict[str, Any]) -> str:
    starter = (row.get("starter_code") or "").strip()
    instructions = (
        STARTER_INSTRUCTIONS.format(starter_code=starter) if starter else STDIN_INSTRUCTIONS
    )
    return (
        "You will be given a programming problem. Write a correct Python program that meets "
        "its specification and passes all tests.\n\n"
        f"Question: {row['question_content'].strip()}\n\n{instructions}\n\n"
        "### Answer: (use the provided format with backticks)\n\n"
    )


def lcb_record(row: dict[str, Any], where: str = "row") -> dict[str, Any]:
    """One LiveCodeBench row as a prompt record whose label the code reward reads."""
    missing = [k for k in ("question_content", "public_test_cases") if k not in row]
    if missing:
        raise ValueError(f"{where}: not a LiveCodeBench row (missing {missing})")
    tests = decode_tests(row["public_test_cases"], f"{where}: public_test_cases")
    if row.get("private_test_cases"):
        tests += decode_tests(row["private_test_cases"], f"{where}: private_test_cases")
    metadata = row.get("metadata") or {}
    if isinstance(metadata, str):
        metadata = json.loads(metadata) if metadata.strip() else {}
    label = {"tests": tests, "fn_name": metadata.get("func_name")}
    parse_problem(label)  # a bad row fails here, naming itself, not at scoring time
    return {
        "prompt": lcb_prompt(row),
        "label": label,
        **{k: row[k] for k in ("question_id", "platform", "difficulty") if k in row},
    }


def read_rows(path: str) -> list[dict[str, Any]]:
    """The prompt records of a LiveCodeBench JSONL file (ValueError naming the line)."""
    records = []
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc.msg})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: a row must be a JSON object")
            try:
                records.append(lcb_record(row, where))
            except RewardError as exc:
                raise ValueError(f"{where}: {exc}") from None
    return records


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description="LiveCodeBench rows -> code-reward prompts.")
    parser.add_argument("source", help="LiveCodeBench JSONL (code_generation rows)")
    parser.add_argument("out", help="JSONL with prompt and label fields")
    args = parser.parse_args(argv)
    try:
        records = read_rows(args.source)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"livecodebench: {exc}") from None
    text = "".join(json.dumps(record, ensure_ascii=False) + "\n" for record in records)
    files.write_atomically(args.out, text)  # a kill leaves the old file or the new one
    print(f"wrote {len(records)} problems to {args.out}")


if __name__ == "__main__":
    main()
