"""Per-token fields (fields.py): a task's character spans land on the right tokens of any tokenizer."""

from __future__ import annotations

import json

import pytest
import torch

from kvdistill.data import DataError, DistillCollator, TeacherView, load_records, tokenize_example
from kvdistill.fields import IGNORE, char_values, freeze, token_values
from kvdistill.models import load_tokenizer

Q = "Tom has 12 apples. Tom gets 5 more. How many apples does Tom have now?"
# "12" -> 12 (a number's value), "5" -> 5; "Tom" -> chain 0 at all three places
REC = {"question": Q, "answer": "12 + 5 = 17.\n#### 17",
       "token_fields": {"value": [[8, 10, 12], [28, 29, 5]],
                        "chain": [[0, 3, 0], [19, 22, 0], [57, 60, 0]]}}


def test_char_values_place_spans_after_the_offset():
    v = char_values(10, ((0, 2, 7), (3, 4, 1)), offset=5)
    assert v.tolist() == [IGNORE] * 5 + [7, 7, IGNORE, 1, IGNORE]
    with pytest.raises(ValueError, match="runs past"):
        char_values(6, ((0, 2, 7),), offset=5)


def test_token_takes_its_last_characters_value_and_specials_ignore():
    chars = torch.tensor([1, 1, 2, 2, 3])
    ends = torch.tensor([1, 3, -1, 4])
    assert token_values(chars, ends).tolist() == [1, 2, IGNORE, 3]


def test_a_token_that_spells_more_than_a_name_takes_the_names_value():
    # "m=k. x?": m and k resolve to 5, x to 3; a line token "m=k." ends on "." and a query token "x?" on "?"
    chars = torch.tensor([5, IGNORE, 5, IGNORE, IGNORE, 3, IGNORE])
    assert token_values(chars, torch.tensor([3, 6])).tolist() == [5, 3]
    # per character, and a token without a covered character (the "=" alone) keeps IGNORE
    assert token_values(chars, torch.tensor([0, 1, 2, 3, 5, 6])).tolist() == [5, IGNORE, 5, IGNORE, 3, IGNORE]


@pytest.mark.parametrize("tok_name", ["bpe", "bpe_alt"])
def test_fields_mark_exactly_the_spans_text_under_any_tokenizer(tiny_world, tok_name):
    tok = load_tokenizer(tiny_world.tokenizers[tok_name])
    enc = tokenize_example(tok, {**REC, "token_fields": freeze(REC["token_fields"])})
    value, chain = enc["field:value"], enc["field:chain"]
    assert value.shape == chain.shape == enc["input_ids"].shape
    # the tokens carrying a value decode to the span's text (digits may split: each piece carries it)
    assert tok.decode(enc["input_ids"][value == 12]).strip() == "12"
    assert tok.decode(enc["input_ids"][value == 5]).strip() == "5"
    assert tok.decode(enc["input_ids"][chain == 0]).replace(" ", "") == "TomTomTom"
    assert value[-1] == IGNORE  # the appended EOS


def test_records_keep_fields_and_the_collator_pads_them(tiny_world, tmp_path):
    path = tmp_path / "train.jsonl"
    short = {"question": "Ann has 3 pens. How many?", "answer": "#### 3",
             "token_fields": {"value": [[8, 9, 3]], "chain": [[0, 3, 1]]}}
    path.write_text(json.dumps(REC) + "\n" + json.dumps(short) + "\n")
    records = load_records(path)
    tok = load_tokenizer(tiny_world.tokenizers["bpe"])
    alt = load_tokenizer(tiny_world.tokenizers["bpe_alt"])
    batch = DistillCollator(tok, teachers={"alt": TeacherView(alt)})(records)
    fields = batch["token_fields"]
    assert fields["value"].shape == batch["input_ids"].shape
    pad = batch["attention_mask"] == 0
    assert pad.any() and torch.all(fields["value"][pad] == IGNORE)
    assert (fields["chain"][1] == 1).sum() >= 1 and not (fields["chain"][1] == 0).any()
    t = batch["teacher_inputs"]["alt"]
    assert t["token_fields"]["value"].shape == t["input_ids"].shape  # the teacher's own tokenization


def test_a_bad_span_is_a_data_error_naming_the_field(tmp_path):
    path = tmp_path / "train.jsonl"
    path.write_text(json.dumps({**REC, "token_fields": {"value": [[5, 3, 1]]}}) + "\n")
    with pytest.raises(DataError, match=r"token_fields\['value'\] span \[5, 3, 1\]"):
        load_records(path)


def test_a_batch_mixing_records_with_and_without_fields_pads_the_union(tiny_world):
    tok = load_tokenizer(tiny_world.tokenizers["bpe"])
    plain = {"question": "Ann has 3 pens. How many?", "answer": "#### 3"}
    for records in ([plain, {**REC, "token_fields": freeze(REC["token_fields"])}],
                    [{**REC, "token_fields": freeze(REC["token_fields"])}, plain]):
        fields = DistillCollator(tok)(records)["token_fields"]
        without = 0 if records[0] is plain else 1
        assert set(fields) == {"value", "chain"}
        assert torch.all(fields["value"][without] == IGNORE) and (fields["value"][1 - without] == 12).any()
