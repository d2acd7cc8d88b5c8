"""The character tokenizer: ids, specials, save/load, chat template; vocabulary checks."""

from __future__ import annotations

import random
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from gspo_megatron.data import (
    Prompt,
    VocabMismatchError,
    build_char_tokenizer,
    check_prompt_ids,
    check_vocab,
    load_tokenizer,
)
from gspo_megatron.data.tokenizer import (
    CHAR_VOCABULARIES,
    DEFAULT_CHARS,
    SPECIAL_TOKENS,
    CharTokenizer,
)
from gspo_megatron.rewards import SYNTHETIC_TASKS, make_task

REPO = Path(__file__).resolve().parents[2]


def test_ids_specials_and_decoding():
    tok = build_char_tokenizer()
    assert len(tok) == 4 + len(DEFAULT_CHARS) == 48
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id, tok.unk_token_id) == (0, 1, 2, 3)
    ids = tok("rev:1234=").input_ids
    # <bos>, then one id per character: digits 4..13, letters 14..39, then " +-=:,.\n" 40..47
    assert ids == [1, 14 + 17, 14 + 4, 14 + 21, 44, 5, 6, 7, 8, 43]
    assert tok.convert_ids_to_tokens(ids)[1:] == list("rev:1234=")
    assert tok.decode(ids, skip_special_tokens=True) == "rev:1234="
    # a response ending in the stop token, then padding
    assert tok.decode([8, 7, 6, 5, 2, 0, 0], skip_special_tokens=True) == "4321"
    assert tok("A!*").input_ids == [1, 3, 3, 3]  # characters outside the vocabulary -> <unk>
    assert tok("a  b").input_ids[1:] == [14, 40, 40, 15]  # spaces are kept, one token each


def test_save_pretrained_round_trip(tmp_path):
    tok = build_char_tokenizer()
    tok.save_pretrained(tmp_path)
    for loaded in (AutoTokenizer.from_pretrained(tmp_path), load_tokenizer(str(tmp_path))):
        assert loaded.get_vocab() == tok.get_vocab()
        assert loaded("sort:3141=").input_ids == tok("sort:3141=").input_ids
        assert loaded.eos_token == "<eos>" and loaded.pad_token_id == 0
        assert loaded.chat_template == tok.chat_template


def test_chat_template():
    tok = build_char_tokenizer()
    text = tok.apply_chat_template(
        [{"role": "user", "content": "12+34="}], tokenize=False, add_generation_prompt=True
    )
    assert text == "<bos>12+34="
    text = tok.apply_chat_template(
        [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}],
        tokenize=False,
    )
    assert text == "<bos>1+1=2<eos>"
    assert build_char_tokenizer(chat_template=None).chat_template is None
    with pytest.raises(ValueError, match="duplicate"):
        build_char_tokenizer(chars="0120")


@pytest.mark.parametrize("name", sorted(SYNTHETIC_TASKS))
def test_default_synthetic_tasks_fit_the_tiny_model(name):
    # prompt (with <bos>) + response + <eos> stays within 32 tokens, with no unknown characters
    task = make_task(name, max_digits=8 if name != "add" else 4)
    tok = build_char_tokenizer()
    rng = random.Random(0)
    for _ in range(50):
        prompt, target = task.sample(rng)
        ids = tok(prompt).input_ids
        assert tok.unk_token_id not in ids
        assert len(ids) + len(target) + 1 <= 32


def test_vocab_checks():
    tok = build_char_tokenizer()
    check_vocab(tok, 48)
    check_vocab(tok, 64)  # a padded model vocabulary is fine
    with pytest.raises(VocabMismatchError, match="largest id 47.*vocabulary of 40"):
        check_vocab(tok, 40)
    good = [Prompt(0, [1, 5, 6], "12"), Prompt(1, [1, 47], "\n")]
    check_prompt_ids(good, 48)
    with pytest.raises(VocabMismatchError, match="prompt 1 has token id 47"):
        check_prompt_ids(good, 47)


CONVERSATIONS = [
    [{"role": "user", "content": "12+34="}],
    [{"role": "user", "content": "1+1="}, {"role": "assistant", "content": "2"}],
    [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "lookup: x"},
        {"role": "assistant", "content": '<tool_call>{"name":"search"}</tool_call>'},
        {"role": "tool", "content": "x = 7"},
    ],
]


@pytest.mark.parametrize("name", sorted(CHAR_VOCABULARIES))
def test_char_tokenizer_matches_its_transformers_form(name):
    """CharTokenizer (plain Python, what runs use) against the PreTrainedTokenizerFast it
    describes: the same ids for random texts (characters, specials and extra tokens anywhere,
    characters outside the vocabulary), the same text for random ids (specials skipped or
    not, ids outside the vocabulary), the same vocabulary and chat template renderings."""
    ours = load_tokenizer(name)
    assert isinstance(ours, CharTokenizer)
    hf = ours.to_hf()
    assert ours.get_vocab() == hf.get_vocab() and len(ours) == len(hf)
    for attr in ("pad", "bos", "eos", "unk"):
        assert getattr(ours, f"{attr}_token") == getattr(hf, f"{attr}_token")
        assert getattr(ours, f"{attr}_token_id") == getattr(hf, f"{attr}_token_id")
    vocab = CHAR_VOCABULARIES[name]
    pieces = [*vocab.chars, *SPECIAL_TOKENS, *vocab.extra_tokens, "A", "!", "é", "<", ">"]
    rng = random.Random(0)
    texts = ["".join(rng.choice(pieces) for _ in range(rng.randint(0, 30))) for _ in range(300)]
    texts += ["<bo<bos>x", "calculatorcalculator", '{"name":"{"name":"', ""]
    for special in (True, False):
        assert (
            ours(texts, add_special_tokens=special)["input_ids"]
            == hf(texts, add_special_tokens=special, return_attention_mask=False)["input_ids"]
        )
        for text in texts[:50]:
            assert ours.encode(text, add_special_tokens=special) == hf.encode(
                text, add_special_tokens=special
            )
            assert ours(text).input_ids == hf(text).input_ids
    for _ in range(300):
        ids = [rng.randrange(-2, len(ours) + 3) for _ in range(rng.randint(0, 20))]
        ids = [i for i in ids if i >= 0]  # transformers refuses negative ids
        for skip in (True, False):
            assert ours.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
    tokens = [rng.choice([*pieces, "Z"]) for _ in range(40)]
    assert ours.convert_tokens_to_ids(tokens) == hf.convert_tokens_to_ids(tokens)
    assert ours.convert_tokens_to_ids("<eos>") == hf.convert_tokens_to_ids("<eos>")
    for conversation in CONVERSATIONS:
        for prompt in (True, False):
            assert ours.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=prompt
            ) == hf.apply_chat_template(conversation, tokenize=False, add_generation_prompt=prompt)


def test_char_tokenizer_saves_transformers_files(tmp_path):
    ours = load_tokenizer("char_tools")
    ours.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    text = '<tool_call>{"name":"calculator","arguments":{"expression":"1+2"}}</tool_call>'
    assert loaded(text).input_ids == ours(text).input_ids
    assert loaded.chat_template == ours.chat_template


def test_a_run_with_the_char_tokenizer_imports_no_transformers():
    """The character tokenizer, the synthetic data set and its chat template need no
    transformers (its import costs more than a second of every run's start)."""
    code = (
        "import sys\n"
        "from gspo_megatron.data import DataConfig, build_datasets, load_tokenizer\n"
        "tok = load_tokenizer('char')\n"
        "train, heldout = build_datasets(DataConfig(task='copy'), tok)\n"
        "assert len(train.prompts) > 0\n"
        "tok.apply_chat_template([{'role': 'user', 'content': '1'}], tokenize=False)\n"
        "heavy = ('transformers', 'tokenizers')\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in heavy))\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == "[]"
