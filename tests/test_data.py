"""Data: formatting, segments under two tokenizers, labels, loaders, collator."""

import json

import pytest
import torch

from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING
from kvdistill.data import (
    DataError,
    DistillCollator,
    TeacherView,
    format_example,
    load_records,
    split_answer,
    tokenize_example,
)
from kvdistill.models import load_tokenizer

REC = {"question": "Tom has 12 apples. Tom buys 5 more apples. How many apples does Tom have now?",
       "answer": "12 + 5 = 17.\n#### 17"}


def test_split_and_format():
    assert split_answer("a\nb\n#### 1,234") == ("a\nb", "1,234")
    assert split_answer("42") == ("", "42")
    f = format_example(REC)
    assert f.text[: f.prompt_end].endswith("Answer:")
    assert f.text[f.prompt_end : f.reasoning_end] == " 12 + 5 = 17."
    assert f.text[f.reasoning_end :] == "\n#### 17"


def _segment_texts(tok, enc):
    return {s: tok.decode(enc["input_ids"][enc["segment_ids"] == s]) for s in (PROMPT, REASONING, ANSWER)}


@pytest.mark.parametrize("tok_name", ["bpe", "bpe_alt"])
def test_segments_follow_characters_under_any_tokenizer(tiny_world, tok_name):
    tok = load_tokenizer(tiny_world.tokenizers[tok_name])
    enc = tokenize_example(tok, REC)
    f = format_example(REC)
    texts = _segment_texts(tok, enc)
    assert texts[PROMPT] == f.text[: f.prompt_end]
    assert texts[REASONING] == " 12 + 5 = 17."
    assert texts[ANSWER] == "\n#### 17" + tok.eos_token
    # segments are contiguous and ordered
    assert torch.all(enc["segment_ids"][1:] >= enc["segment_ids"][:-1])


def test_two_tokenizers_differ_in_length_but_agree_on_segment_text(tiny_world):
    a = tokenize_example(load_tokenizer(tiny_world.tokenizers["bpe"]), REC)
    b = tokenize_example(load_tokenizer(tiny_world.tokenizers["bpe_alt"]), REC)
    assert len(a["input_ids"]) != len(b["input_ids"])
    for s in (PROMPT, REASONING, ANSWER):
        assert (a["segment_ids"] == s).any() and (b["segment_ids"] == s).any()


def test_labels_mask_prompt_only(tiny_world):
    tok = load_tokenizer(tiny_world.tokenizers["bpe"])
    enc = tokenize_example(tok, REC)
    prompt = enc["segment_ids"] == PROMPT
    assert torch.all(enc["labels"][prompt] == -100)
    assert torch.equal(enc["labels"][~prompt], enc["input_ids"][~prompt])


def test_rationale_field_replaces_reference():
    rec = {**REC, "t1": "5 + 12 = 17.\nSo 17.\n#### 17"}
    f = format_example(rec, rationale_field="t1")
    assert "So 17." in f.text and "12 + 5" not in f.text
    with pytest.raises(DataError, match="no rationale field"):
        format_example(REC, rationale_field="t2")
    # a bare chain of thought (no `####`) is the rationale; the reference final answer stays
    bare = format_example({**REC, "t1": "5 + 12 = 17."}, rationale_field="t1")
    ref = format_example(REC)
    assert bare.text[bare.prompt_end:bare.reasoning_end] == " 5 + 12 = 17."
    assert bare.text[bare.reasoning_end:] == ref.text[ref.reasoning_end:]


def test_collator_pads_and_adds_teacher_views(tiny_world):
    tok = load_tokenizer(tiny_world.tokenizers["bpe"])
    alt = load_tokenizer(tiny_world.tokenizers["bpe_alt"])
    records = load_records(tiny_world.data_dir, "train", limit=3)
    batch = DistillCollator(tok, max_length=256, teachers={"alt": TeacherView(alt)})(records)
    B, T = batch["input_ids"].shape
    assert B == 3 and batch["labels"].shape == (B, T) == batch["segment_ids"].shape
    pad = batch["attention_mask"] == 0
    assert torch.all(batch["segment_ids"][pad] == PAD) and torch.all(batch["labels"][pad] == -100)
    t = batch["teacher_inputs"]["alt"]
    assert t["input_ids"].shape[0] == 3 and "labels" not in t
    assert t["input_ids"].shape[1] != T


def test_collator_tokenizes_each_record_once_per_view(tiny_world, monkeypatch):
    import kvdistill.data as data

    tok = load_tokenizer(tiny_world.tokenizers["bpe"])
    alt = load_tokenizer(tiny_world.tokenizers["bpe_alt"])
    records = load_records(tiny_world.data_dir, "train", limit=4)
    collate = DistillCollator(tok, max_length=256, teachers={"alt": TeacherView(alt)})
    calls = []
    monkeypatch.setattr(data, "tokenize_example", lambda *a, **k: calls.append(a[1]) or tokenize_example(*a, **k))
    first = collate(records)
    assert len(calls) == 8  # 4 records x (student, alt)
    again = collate(records[::-1])  # other order, same records: nothing tokenized again
    assert len(calls) == 8
    for key in ("input_ids", "segment_ids", "labels"):
        assert torch.equal(again[key].flip(0), first[key])
    for key in ("input_ids", "segment_ids"):
        assert torch.equal(again["teacher_inputs"]["alt"][key].flip(0), first["teacher_inputs"]["alt"][key])
    collate([{**records[0], "answer": records[0]["answer"] + " "}])  # changed content: tokenized anew
    assert len(calls) == 10
    first["input_ids"][0, 0] = -7  # batches are fresh tensors: the cached features are untouched
    assert collate(records)["input_ids"][0, 0] != -7
    # bounded: past max_cached entries records are tokenized every time (a large dataset read once)
    small = DistillCollator(tok, max_length=256, max_cached=3)
    small(records), small(records)
    assert len(small._features) == 3 and len(calls) == 10 + 4 + 1


def test_load_records_formats_and_field_map(tmp_path):
    rows = [{"Q": f"q{i}", "A": f"r\n#### {i}"} for i in range(5)]
    (tmp_path / "train.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    recs = load_records(tmp_path, "train", field_map={"question": "Q", "answer": "A"}, limit=3)
    assert recs == [{"question": f"q{i}", "answer": f"r\n#### {i}"} for i in range(3)]
    import datasets

    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "x.parquet"))
    assert len(load_records(tmp_path / "x.parquet", "train", field_map={"question": "Q", "answer": "A"})) == 5
    with pytest.raises(DataError, match="columns"):
        load_records(tmp_path / "x.parquet", "train")
    with pytest.raises(DataError, match="not found"):
        load_records(tmp_path / "missing.jsonl")


def test_unreachable_hub_dataset_fails_clearly():
    with pytest.raises(DataError, match="without network"):
        load_records("nobody-here/not-a-dataset-xyz", "train")


def test_shorten_rationale_for_a_privileged_student():
    from kvdistill.data import LATENT_TOKEN, parse_student_input, shorten_rationale

    rec = {"question": "q", "answer": "1 + 2 = 3.\n3 + 4 = 7.\n#### 7"}
    assert shorten_rationale(rec, "full") == rec
    assert shorten_rationale(rec, "no_rationale")["answer"] == "#### 7"
    assert shorten_rationale(rec, "short_rationale:1")["answer"] == "1 + 2 = 3.\n#### 7"
    assert shorten_rationale(rec, "short_rationale:5")["answer"] == rec["answer"]
    assert shorten_rationale(rec, "latent:3")["answer"] == f"{LATENT_TOKEN * 3}\n#### 7"
    assert parse_student_input("short_rationale:2") == ("short_rationale", 2)
    assert parse_student_input("latent:4") == ("latent", 4)
    for bad in ("short", "short_rationale:0", "short_rationale:x", "latent", "latent:0", "latent:-1"):
        with pytest.raises(ValueError, match="latent:N"):
            parse_student_input(bad)


@pytest.mark.parametrize("vocab_size", [300, 1000])
def test_latent_slots_are_n_reasoning_tokens_under_any_tokenizer(vocab_size):
    """`latent:N` gives exactly N student tokens in the reasoning segment, emitted as labels,
    and decoding with skip_special_tokens drops them (so answer extraction is unchanged)."""
    from kvdistill.data import LATENT_TOKEN, add_latent_token, shorten_rationale
    from kvdistill.models import build_tokenizer

    rec = {"question": "What is 3 + 4 - 2?", "answer": "3 + 4 = 7.\n7 - 2 = 5.\n#### 5"}
    tok = build_tokenizer([f"Question: {rec['question']}\nAnswer: {rec['answer']}"] * 5, vocab_size,
                          split_digits=vocab_size < 500)
    assert add_latent_token(tok) and not add_latent_token(tok)  # added once
    slot = tok.convert_tokens_to_ids(LATENT_TOKEN)
    for n in (1, 4, 7):
        ex = tokenize_example(tok, shorten_rationale(rec, f"latent:{n}"))
        reasoning = ex["segment_ids"] == REASONING
        assert int(reasoning.sum()) == n
        assert (ex["input_ids"][reasoning] == slot).all() and (ex["labels"][reasoning] == slot).all()
        assert tok.decode(ex["input_ids"], skip_special_tokens=True).endswith("Answer:\n#### 5")
