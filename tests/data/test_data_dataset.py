"""JSONL / Parquet prompt data: fields, chat templates, length filter, bad rows, empty sets."""

from __future__ import annotations

import logging

import pytest

from gspo_megatron.data import (
    DataConfig,
    DataError,
    build_char_tokenizer,
    build_datasets,
    load_prompt_dataset,
    write_jsonl,
    write_parquet,
)

# roles by first letter: s: system, u: user, a: assistant (all characters in the vocabulary)
ROLE_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    return build_char_tokenizer()


def _write_lines(path, lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def test_jsonl_prompts_labels_and_ids(tmp_path, tok):
    path = tmp_path / "train.jsonl"
    write_jsonl(path, [{"prompt": "rev:12=", "label": "21"}, {"prompt": "1+1=", "label": 2}])
    ds = load_prompt_dataset(path, tok)
    assert len(ds) == 2 and ds.stats.rows == 2 and ds.stats.kept == 2
    assert ds[0].index == 0 and ds[0].prompt == "rev:12=" and ds[0].label == "21"
    assert ds[0].prompt_ids == tok("rev:12=").input_ids  # with <bos>
    assert ds[1].index == 1 and ds[1].label == 2
    assert ds.longest_prompt() == 8


def test_malformed_lines_report_file_and_line(tmp_path, tok, caplog):
    path = _write_lines(
        tmp_path / "bad.jsonl",
        [
            '{"prompt": "1+1=", "label": "2"}',
            '{"prompt": "2+2=", "label": ',  # line 2: truncated
            "",  # blank lines are not rows
            '["not", "an", "object"]',  # line 4
            '{"prompt": "3+3=", "label": "6"}',
        ],
    )
    with caplog.at_level(logging.WARNING, logger="gspo_megatron.data.dataset"):
        ds = load_prompt_dataset(path, tok, on_error="skip")
    assert [p.prompt for p in ds] == ["1+1=", "3+3="]
    assert ds.stats.malformed == 2 and ds.stats.rows == 4 and ds.stats.kept == 2
    assert f"{path}:2: malformed JSON" in caplog.text
    assert f"{path}:4: expected a JSON object, got list" in caplog.text

    with pytest.raises(DataError, match=f"{path}:2: malformed JSON.*data.on_error=skip"):
        load_prompt_dataset(path, tok, on_error="raise")

    (tmp_path / "latin1.jsonl").write_bytes(b'{"prompt": "1="}\n{"prompt": "\xe9"}\n')
    with pytest.raises(DataError, match="latin1.jsonl:2: not valid UTF-8"):
        load_prompt_dataset(tmp_path / "latin1.jsonl", tok, label_key=None, on_error="raise")


def test_missing_fields_are_named(tmp_path, tok):
    path = tmp_path / "fields.jsonl"
    write_jsonl(path, [{"question": "1+1=", "answer": "2"}, {"prompt": "1=", "label": "1"}])
    with pytest.raises(DataError, match=r"fields.jsonl:1: missing field 'prompt' \(fields: "):
        load_prompt_dataset(path, tok, on_error="raise")
    ds = load_prompt_dataset(path, tok)
    assert len(ds) == 1 and ds.stats.missing_field == 1
    with pytest.raises(DataError, match="missing field 'solution'.*data.label_key"):
        load_prompt_dataset(
            path, tok, prompt_key="question", label_key="solution", on_error="raise"
        )
    ds = load_prompt_dataset(path, tok, prompt_key="question", label_key="answer")
    assert [(p.prompt, p.label) for p in ds] == [("1+1=", "2")]
    # a wrong field name everywhere -> empty -> the error says which field and what rows have
    with pytest.raises(DataError, match="no prompts in .*field 'text' was missing .*question"):
        load_prompt_dataset(path, tok, prompt_key="text")
    write_jsonl(path, [{"prompt": 5, "label": "x"}])
    with pytest.raises(DataError, match="must be text or a list of chat messages"):
        load_prompt_dataset(path, tok, on_error="raise")


def test_chat_messages_and_templates(tmp_path, tok):
    rtok = build_char_tokenizer(chat_template=ROLE_TEMPLATE)
    path = tmp_path / "chat.jsonl"
    messages = [{"role": "user", "content": "1+1="}]
    write_jsonl(path, [{"messages": messages, "label": "2"}])
    ds = load_prompt_dataset(path, rtok, prompt_key="messages")  # messages -> template applied
    assert ds[0].prompt == "u:1+1=\na:"
    assert ds[0].prompt_ids == rtok("u:1+1=\na:", add_special_tokens=False).input_ids  # no <bos>
    ds = load_prompt_dataset(path, rtok, prompt_key="messages", system_prompt="be brief")
    assert ds[0].prompt == "s:be brief\nu:1+1=\na:"
    with pytest.raises(DataError, match="chat messages but data.apply_chat_template=false"):
        load_prompt_dataset(path, rtok, prompt_key="messages", apply_chat_template=False)

    text = tmp_path / "text.jsonl"
    write_jsonl(text, [{"prompt": "2+2=", "label": "4"}])
    assert load_prompt_dataset(text, rtok)[0].prompt == "2+2="  # text: as is by default
    ds = load_prompt_dataset(text, rtok, apply_chat_template=True)  # text as a user message
    assert ds[0].prompt == "u:2+2=\na:"
    # the built-in char template: <bos> + content, so the ids equal plain tokenization
    ds = load_prompt_dataset(text, tok, apply_chat_template=True)
    assert ds[0].prompt == "<bos>2+2=" and ds[0].prompt_ids == tok("2+2=").input_ids
    with pytest.raises(DataError, match="no chat template"):
        bare = build_char_tokenizer(chat_template=None)
        load_prompt_dataset(text, bare, apply_chat_template=True)


def test_max_prompt_length_drops_and_counts(tmp_path, tok, caplog):
    path = tmp_path / "lengths.jsonl"
    prompts = ["1=", "12=", "123=", "1234=", "12345="]  # 3..7 tokens with <bos>
    write_jsonl(path, [{"prompt": p, "label": "x"} for p in prompts])
    with caplog.at_level(logging.WARNING, logger="gspo_megatron.data.dataset"):
        ds = load_prompt_dataset(path, tok, max_prompt_length=5)
    assert [p.prompt for p in ds] == ["1=", "12=", "123="]
    assert [p.index for p in ds] == [0, 1, 2]
    assert ds.stats.too_long == 2 and ds.stats.kept == 3 and ds.stats.rows == 5
    assert "dropped 2 of 5 prompts longer than max_prompt_length=5" in caplog.text
    with pytest.raises(DataError, match="5 prompts exceed data.max_prompt_length=2"):
        load_prompt_dataset(path, tok, max_prompt_length=2)


def test_empty_and_missing_files(tmp_path, tok):
    empty = _write_lines(tmp_path / "empty.jsonl", ["", "  "])
    with pytest.raises(DataError, match="no prompts in .*empty.jsonl.*'rows': 0"):
        load_prompt_dataset(empty, tok)
    with pytest.raises(DataError, match="data file not found"):
        load_prompt_dataset(tmp_path / "nope.jsonl", tok)
    with pytest.raises(DataError, match="cannot tell the format"):
        load_prompt_dataset(_write_lines(tmp_path / "data.txt", ["{}"]), tok)


def test_parquet_round_trip_with_nested_fields(tmp_path, tok):
    rtok = build_char_tokenizer(chat_template=ROLE_TEMPLATE)
    # verl's layout: chat messages in "prompt", the gold answer under reward_model.ground_truth
    records = [
        {
            "prompt": [{"role": "user", "content": f"{i}+{i}="}],
            "reward_model": {"ground_truth": str(2 * i), "style": "rule"},
            "extra": i,
        }
        for i in range(5)
    ]
    path = tmp_path / "train.parquet"
    write_parquet(path, records)
    ds = load_prompt_dataset(path, rtok, label_key="reward_model.ground_truth")
    assert [(p.prompt, p.label) for p in ds] == [(f"u:{i}+{i}=\na:", str(2 * i)) for i in range(5)]

    flat = tmp_path / "flat.parquet"
    write_parquet(flat, [{"prompt": "rev:12=", "label": "21"}, {"prompt": "1=", "label": "1"}])
    jsonl = tmp_path / "flat.jsonl"
    write_jsonl(jsonl, [{"prompt": "rev:12=", "label": "21"}, {"prompt": "1=", "label": "1"}])
    assert load_prompt_dataset(flat, tok).prompts == load_prompt_dataset(jsonl, tok).prompts
    with pytest.raises(DataError, match=r"no column 'answer' \(columns: \['prompt', 'label'\]\)"):
        load_prompt_dataset(flat, tok, label_key="answer")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet")
    with pytest.raises(DataError, match="cannot read as Parquet"):
        load_prompt_dataset(tmp_path / "broken.parquet", tok)


def test_several_files_and_config(tmp_path, tok):
    a, b = tmp_path / "a.jsonl", tmp_path / "b.parquet"
    write_jsonl(a, [{"q": "1=", "y": "1"}])
    write_parquet(b, [{"q": "2=", "y": "2"}, {"q": "3=", "y": "3"}])
    cfg = DataConfig(
        train_files=[str(a), str(b)], eval_files=[str(a)], prompt_key="q", label_key="y"
    )
    train, evals = build_datasets(cfg, tok)
    assert [p.prompt for p in train] == ["1=", "2=", "3="] and [p.index for p in train] == [0, 1, 2]
    assert [p.prompt for p in evals] == ["1="]
    with pytest.raises(ValueError, match="exactly one of data.train_files"):
        DataConfig().validate()
    with pytest.raises(ValueError, match="exactly one of data.train_files"):
        DataConfig(train_files=[str(a)], task="copy").validate()
    with pytest.raises(ValueError, match="data.on_error"):
        DataConfig(task="copy", on_error="ignore").validate()
