"""Prompt data sets from JSONL and Parquet files.

    ds = load_prompt_dataset("train.jsonl", tokenizer, prompt_key="prompt", label_key="label",
                             max_prompt_length=512)
    ds[0]       # Prompt(index=0, prompt_ids=[...], prompt="...", label="72")
    ds.stats    # rows read, kept, dropped as too long, malformed, missing fields

Fields are looked up by name; a dotted name reaches into nested objects
("reward_model.ground_truth", verl's Parquet layout). The prompt field holds either text or a
list of chat messages ({"role", "content"}). Chat messages are always rendered with the
tokenizer's chat template (`apply_chat_template(..., add_generation_prompt=True)`); plain text is
rendered with it when `apply_chat_template=True` (as one user message, after `system_prompt` if
given) and tokenized as is otherwise (with the tokenizer's own special tokens, e.g. <bos>).

Bad rows: malformed JSON, a line that is not an object, a missing or mistyped field. With
`on_error="skip"` (default) each is reported as `file:line: what` in the log, counted in `stats`
and skipped; with `on_error="raise"` the first one stops loading with that message. Prompts
longer than `max_prompt_length` tokens are dropped and counted. A data set left empty is an
error that says why.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from gspo_megatron.files import replacing, staged

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


logger = logging.getLogger(__name__)

OnError = Literal["skip", "raise"]
FileFormat = Literal["auto", "jsonl", "parquet"]
_MISSING = object()
_MAX_LOGGED = 10
_TOKENIZE_CHUNK = 1024


class DataError(ValueError):
    """Prompt data that cannot be used; the message says where and what to change."""


@dataclass(frozen=True)
class Prompt:
    """One prompt: its position in the data set, token ids, rendered text and label."""

    index: int
    prompt_ids: list[int]
    prompt: str
    label: Any = None


@dataclass
class DataStats:
    """What loading saw: rows read, kept and dropped (by reason)."""

    rows: int = 0
    kept: int = 0
    too_long: int = 0
    malformed: int = 0
    missing_field: int = 0

    def as_dict(self) -> dict[str, int]:
        return asdict(self)


@dataclass
class PromptDataset(Sequence[Prompt]):
    """Tokenized prompts kept after filtering; `prompts[i].index == i`."""

    prompts: list[Prompt]
    stats: DataStats = field(default_factory=DataStats)
    source: str = "<memory>"

    def __len__(self) -> int:
        return len(self.prompts)

    def __getitem__(self, i):  # type: ignore[override]
        return self.prompts[i]

    def longest_prompt(self) -> int:
        return max((len(p.prompt_ids) for p in self.prompts), default=0)


# --------------------------------------------------------------------------- reading rows


class _Problems:
    """Reports bad rows: raise at once, or log (the first few) and count."""

    def __init__(self, on_error: OnError, stats: DataStats) -> None:
        if on_error not in ("skip", "raise"):
            raise DataError(f"data.on_error must be 'skip' or 'raise', got {on_error!r}")
        self.on_error = on_error
        self.stats = stats
        self.logged = 0

    def report(self, where: str, what: str, kind: str) -> None:
        message = f"{where}: {what}"
        if self.on_error == "raise":
            raise DataError(f"{message} (set data.on_error=skip to skip such rows)")
        setattr(self.stats, kind, getattr(self.stats, kind) + 1)
        if self.logged < _MAX_LOGGED:
            logger.warning("skipping %s", message)
        elif self.logged == _MAX_LOGGED:
            logger.warning("more bad rows are skipped without a message; see the data stats")
        self.logged += 1


def _detect_format(path: str, fmt: FileFormat) -> str:
    if fmt != "auto":
        if fmt not in ("jsonl", "parquet"):
            raise DataError(f"data.format must be auto, jsonl or parquet, got {fmt!r}")
        return fmt
    lower = path.lower()
    if lower.endswith(".parquet"):
        return "parquet"
    if lower.endswith((".jsonl", ".json", ".ndjson")):
        return "jsonl"
    raise DataError(
        f"cannot tell the format of {path} from its name; name it .jsonl or .parquet, or set "
        "data.format=jsonl|parquet"
    )


def _jsonl_rows(path: str, problems: _Problems) -> Iterator[tuple[str, dict]]:
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                problems.stats.rows += 1
                problems.report(where, f"not valid UTF-8 ({exc.reason})", "malformed")
                continue
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as exc:
                problems.stats.rows += 1
                problems.report(
                    where, f"malformed JSON: {exc.msg} at column {exc.colno}", "malformed"
                )
                continue
            if not isinstance(record, dict):
                problems.stats.rows += 1
                problems.report(
                    where, f"expected a JSON object, got {type(record).__name__}", "malformed"
                )
                continue
            yield where, record


def _pyarrow(path: str):
    try:
        import pyarrow
        import pyarrow.parquet
    except ImportError:
        raise DataError(
            f"{path}: reading Parquet needs pyarrow, which this install left out: "
            "pip install 'gspo-megatron[parquet]' (or bash tools/install.sh)"
        ) from None
    return pyarrow, pyarrow.parquet


def _parquet_rows(path: str, columns: list[str], problems: _Problems) -> Iterator[tuple[str, dict]]:
    pa, pq = _pyarrow(path)

    try:
        pf = pq.ParquetFile(path)
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: cannot read as Parquet: {exc}") from exc
    names = pf.schema_arrow.names
    missing = [c for c in columns if c not in names]
    if missing:
        raise DataError(
            f"{path}: no column {missing[0]!r} (columns: {names}); set data.prompt_key / "
            "data.label_key to existing columns"
        )
    row = 0
    for batch in pf.iter_batches(batch_size=_TOKENIZE_CHUNK, columns=columns):
        for record in batch.to_pylist():
            row += 1
            yield f"{path}:row {row}", record


def _get(record: dict, key: str) -> Any:
    """record[key], or a dotted path into nested objects; _MISSING if absent."""
    if key in record:
        return record[key]
    value: Any = record
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return _MISSING
        value = value[part]
    return value


def _is_messages(value: Any) -> bool:
    return (
        isinstance(value, list)
        and len(value) > 0
        and all(isinstance(m, dict) and "role" in m and "content" in m for m in value)
    )


# --------------------------------------------------------------------------- building prompts


@dataclass
class _Pending:
    text: str
    templated: bool
    label: Any


def _render(
    value: Any,
    tokenizer: PreTrainedTokenizerBase,
    apply_chat_template: bool | None,
    system_prompt: str | None,
) -> tuple[str, bool]:
    """(text, templated) for a prompt field value that is text or chat messages."""
    if _is_messages(value):
        if apply_chat_template is False:
            raise DataError(
                "the prompt field holds chat messages but data.apply_chat_template=false; set "
                "it to true (or null) or point data.prompt_key at a text field"
            )
        messages = list(value)
    elif apply_chat_template:
        messages = [{"role": "user", "content": value}]
    else:
        return value, False
    if system_prompt is not None and messages[0].get("role") != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    if not getattr(tokenizer, "chat_template", None):
        raise DataError(
            "the tokenizer has no chat template; use one that has, or set "
            "data.apply_chat_template=false with a text prompt field"
        )
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return text, True


def prompts_from_records(
    rows: Iterable[tuple[str, dict]],
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str = "prompt",
    label_key: str | None = "label",
    apply_chat_template: bool | None = None,
    system_prompt: str | None = None,
    max_prompt_length: int | None = None,
    on_error: OnError = "skip",
    stats: DataStats | None = None,
    source: str = "<memory>",
) -> PromptDataset:
    """Tokenize (where, record) rows into a PromptDataset, filtering as configured.

    `where` names the row in messages (e.g. "train.jsonl:12"). Records come from
    `load_prompt_dataset` or from memory (synthetic tasks).
    """
    problems = _Problems(on_error, stats if stats is not None else DataStats())
    return _build(
        rows,
        tokenizer,
        problems,
        prompt_key=prompt_key,
        label_key=label_key,
        apply_chat_template=apply_chat_template,
        system_prompt=system_prompt,
        max_prompt_length=max_prompt_length,
        source=source,
    )


def _build(
    rows: Iterable[tuple[str, dict]],
    tokenizer: PreTrainedTokenizerBase,
    problems: _Problems,
    *,
    prompt_key: str,
    label_key: str | None,
    apply_chat_template: bool | None,
    system_prompt: str | None,
    max_prompt_length: int | None,
    source: str,
) -> PromptDataset:
    stats = problems.stats
    if system_prompt is not None and apply_chat_template is False:
        raise DataError("data.system_prompt needs data.apply_chat_template=true (or null)")
    if max_prompt_length is not None and max_prompt_length < 1:
        raise DataError(f"data.max_prompt_length must be >= 1, got {max_prompt_length}")
    prompts: list[Prompt] = []
    pending: list[_Pending] = []
    missing_seen: dict[str, list[str]] = {}

    def flush() -> None:
        for templated in (False, True):
            group = [p for p in pending if p.templated == templated]
            if not group:
                continue
            ids = tokenizer(
                [p.text for p in group],
                add_special_tokens=not templated,
                return_attention_mask=False,
            )["input_ids"]
            for p, prompt_ids in zip(group, ids, strict=True):
                if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
                    stats.too_long += 1
                    continue
                prompts.append(Prompt(len(prompts), list(prompt_ids), p.text, p.label))
        pending.clear()

    for where, record in rows:
        stats.rows += 1
        value = _get(record, prompt_key)
        if value is _MISSING:
            missing_seen.setdefault(prompt_key, sorted(record))
            problems.report(
                where,
                f"missing field {prompt_key!r} (fields: {sorted(record)}); set data.prompt_key",
                "missing_field",
            )
            continue
        if not isinstance(value, str) and not _is_messages(value):
            problems.report(
                where,
                f"field {prompt_key!r} must be text or a list of chat messages "
                f"({{role, content}}), got {type(value).__name__}",
                "missing_field",
            )
            continue
        label = None
        if label_key is not None:
            label = _get(record, label_key)
            if label is _MISSING:
                missing_seen.setdefault(label_key, sorted(record))
                problems.report(
                    where,
                    f"missing field {label_key!r} (fields: {sorted(record)}); set "
                    "data.label_key (null for no label)",
                    "missing_field",
                )
                continue
        text, templated = _render(value, tokenizer, apply_chat_template, system_prompt)
        pending.append(_Pending(text, templated, label))
        if len(pending) >= _TOKENIZE_CHUNK:
            flush()
    flush()
    stats.kept = len(prompts)
    if stats.too_long:
        logger.warning(
            "%s: dropped %d of %d prompts longer than max_prompt_length=%s tokens",
            source,
            stats.too_long,
            stats.rows,
            max_prompt_length,
        )
    if not prompts:
        hint = ""
        for key, fields in missing_seen.items():
            hint += f"; field {key!r} was missing (rows have {fields})"
        if stats.too_long:
            hint += f"; {stats.too_long} prompts exceed data.max_prompt_length={max_prompt_length}"
        raise DataError(f"no prompts in {source}: {stats.as_dict()}{hint}")
    return PromptDataset(prompts, stats, source)


def load_prompt_dataset(
    paths: str | os.PathLike | Sequence[str | os.PathLike],
    tokenizer: PreTrainedTokenizerBase,
    *,
    prompt_key: str = "prompt",
    label_key: str | None = "label",
    apply_chat_template: bool | None = None,
    system_prompt: str | None = None,
    max_prompt_length: int | None = None,
    on_error: OnError = "skip",
    format: FileFormat = "auto",
) -> PromptDataset:
    """Load and tokenize prompts from one or more JSONL / Parquet files (in the given order)."""
    if isinstance(paths, str | os.PathLike):
        paths = [paths]
    paths = [os.fspath(p) for p in paths]
    if not paths:
        raise DataError("no data files given; set data.train_files")
    for path in paths:
        if not os.path.isfile(path):
            raise DataError(f"data file not found: {path}")
    stats = DataStats()
    problems = _Problems(on_error, stats)
    top_columns = [k.split(".")[0] for k in (prompt_key, label_key) if k is not None]

    def rows() -> Iterator[tuple[str, dict]]:
        for path in paths:
            if _detect_format(path, format) == "parquet":
                yield from _parquet_rows(path, sorted(set(top_columns)), problems)
            else:
                yield from _jsonl_rows(path, problems)

    return _build(
        rows(),
        tokenizer,
        problems,
        prompt_key=prompt_key,
        label_key=label_key,
        apply_chat_template=apply_chat_template,
        system_prompt=system_prompt,
        max_prompt_length=max_prompt_length,
        source=", ".join(paths),
    )


def write_jsonl(path: str | os.PathLike, records: Iterable[dict]) -> None:
    """Write records one JSON object per line (UTF-8), replacing `path` atomically."""
    with replacing(path) as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")


def write_parquet(path: str | os.PathLike, records: Sequence[dict]) -> None:
    """Write records as a Parquet table (columns inferred by pyarrow), replacing `path`
    atomically."""
    pa, pq = _pyarrow(str(path))

    with staged(path) as tmp:
        pq.write_table(pa.Table.from_pylist(list(records)), tmp)
