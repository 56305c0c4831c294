"""Dataset formats (kvdistill.formats, docs/data.md): detection, records, segments and shared character
coordinates of messages, prompt/completion and text records, under the tiny tokenizers with and without
a chat template."""

import copy
import json

import pytest
import torch

from kvdistill import formats
from kvdistill.cache import ANSWER, PROMPT
from kvdistill.data import (
    NO_CHAR,
    UNSHARED,
    DataError,
    DistillCollator,
    TeacherView,
    describe_format,
    format_example,
    has_finals,
    load_records,
    prompt_reads,
    records_from_dataset,
    require_finals,
    shorten_rationale,
    tokenize_example,
)
from kvdistill.models import load_model, load_tokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
# Gemma-like: trims content, calls the assistant "model", no end-of-turn newline stripped by us
TRIMMING = ("{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else m['role'] }}\n"
            "{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}")
CHAT = (("system", "Be brief."), ("user", "What is 2+2?"), ("assistant", "4."), ("user", "And 3+3?"),
        ("assistant", "6."))
MSGS = {"messages": CHAT}


@pytest.fixture(scope="module")
def toks(tiny_world):
    """bpe and bpe_alt as loaded (no chat template), and bpe with ChatML / a trimming template."""
    bpe, alt = (load_tokenizer(tiny_world.tokenizers[n]) for n in ("bpe", "bpe_alt"))
    chatml, trim = copy.deepcopy(bpe), copy.deepcopy(alt)
    chatml.chat_template, trim.chat_template = CHATML, TRIMMING
    return {"bpe": bpe, "alt": alt, "chatml": chatml, "trim": trim}


def _write(tmp_path, rows, name="train.jsonl"):
    (tmp_path / name).write_text("\n".join(json.dumps(r) for r in rows))
    return tmp_path / name


def _learned(tok, enc):
    return tok.decode(enc["input_ids"][enc["labels"] != -100])


# ----------------------------------------------------------------------------- detection and loading


@pytest.mark.parametrize("columns, fmt", [
    (["question", "answer"], "question_answer"),
    (["question", "answer", "text", "messages"], "question_answer"),  # as before the other formats existed
    (["messages", "id"], "messages"),
    (["prompt", "completion", "text"], "prompt_completion"),
    (["text", "meta"], "text"),
])
def test_format_is_detected_from_the_columns(columns, fmt):
    assert formats.detect_format(columns, "d")[0] == fmt


def test_dataset_format_and_field_map_name_the_format():
    assert formats.detect_format(["text", "messages"], "d", "text") == ("text", {"text": "text"})
    assert formats.detect_format(["conversations"], "d", field_map={"messages": "conversations"}) == (
        "messages", {"messages": "conversations"})
    assert formats.detect_format(["instruction", "output"], "d", field_map={
        "prompt": "instruction", "completion": "output"})[0] == "prompt_completion"
    assert formats.detect_format(["Q", "A"], "d", field_map={"question": "Q", "answer": "A"}) == (
        "question_answer", {"question": "Q", "answer": "A"})
    with pytest.raises(DataError, match="field_map keys"):
        formats.detect_format(["Q"], "d", "text", field_map={"question": "Q"})
    with pytest.raises(DataError, match="is not one of"):
        formats.detect_format(["text"], "d", "sharegpt")


def test_a_dataset_that_fits_no_format_is_one_line_naming_its_columns_and_the_formats(tmp_path):
    path = _write(tmp_path, [{"instruction": "a", "output": "b"}])
    with pytest.raises(DataError) as err:
        load_records(path)
    msg = str(err.value)
    assert "\n" not in msg and "['instruction', 'output']" in msg and "fit no dataset format" in msg
    for fmt in formats.FORMATS:
        assert fmt in msg
    with pytest.raises(DataError, match=r"columns \['messages'\] not found"):
        load_records(path, dataset_format="messages")


def test_each_format_loads_as_hashable_plain_dicts(tmp_path):
    rows = [{"messages": [{"role": "user", "content": "hi", "name": "x"}, {"role": "assistant", "content": "yo"}]}]
    recs = load_records(_write(tmp_path, rows, "m.jsonl"))
    assert recs == [{"messages": (("user", "hi"), ("assistant", "yo"))}]  # other message keys dropped
    hash(tuple(recs[0].items()))
    pc = load_records(_write(tmp_path, [{"prompt": "2+2=", "completion": "4", "id": 3}], "p.jsonl"), extra_fields=["id"])
    assert pc == [{"prompt": "2+2=", "completion": "4", "id": 3}]
    conv = load_records(_write(tmp_path, [{"prompt": [{"role": "user", "content": "2+2?"}],
                                           "completion": [{"role": "assistant", "content": "4"}]}], "c.jsonl"))
    assert conv == [{"prompt": (("user", "2+2?"),), "completion": (("assistant", "4"),)}]
    text = load_records(_write(tmp_path, [{"text": "once upon a time"}] * 3, "t.jsonl"), limit=2, require_final=True)
    assert text == [{"text": "once upon a time"}] * 2  # require_final is the question/answer preset's only


def test_records_from_a_datasets_object(tmp_path):
    import datasets

    rows = [{"messages": [{"role": "user", "content": f"q{i}"}, {"role": "assistant", "content": f"a{i}"}]}
            for i in range(4)]
    ds = datasets.Dataset.from_list(rows)
    want = [{"messages": (("user", f"q{i}"), ("assistant", f"a{i}"))} for i in range(4)]
    assert load_records(ds) == records_from_dataset(ds) == want
    assert records_from_dataset(datasets.DatasetDict({"train": ds}), limit=2) == want[:2]
    assert records_from_dataset(ds.to_iterable_dataset(), limit=3) == want[:3]
    with pytest.raises(DataError, match="no split 'test'"):
        records_from_dataset(datasets.DatasetDict({"train": ds}), "test")
    assert load_records(rows, limit=1) == want[:1]  # a list of dicts too
    with pytest.raises(DataError, match="dataset record 1 is a str, not a mapping"):
        records_from_dataset([rows[0], "hi"])
    qa = datasets.Dataset.from_list([{"question": "2+2?", "answer": "4\n#### 4"}])
    assert load_records(qa, require_final=True) == [{"question": "2+2?", "answer": "4\n#### 4"}]
    with pytest.raises(DataError, match="dataset record 0 has no final answer"):
        records_from_dataset([{"question": "2+2?", "answer": "4\n####"}], require_final=True)


@pytest.mark.parametrize("row, expect", [
    ({"messages": [{"role": "user", "content": "hi"}]}, "has no assistant message"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": " "}]},
     "assistant message 1 of 'messages' is empty"),
    ({"messages": [{"role": "user", "content": ["hi"]}]}, "message 0 of its 'messages'"),
    ({"messages": "hi"}, "not a non-empty list"),
    ({"prompt": "hi", "completion": [{"role": "assistant", "content": "yo"}]}, "must both be strings"),
    ({"prompt": "hi", "completion": ""}, "empty 'completion'"),
    ({"text": "   "}, "its 'text' is empty"),
    ({"text": "abc", "token_fields": {"v": [[0, 1, 2]]}}, "token_fields"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}],
      "token_fields": {"v": [[0, 1, 2]]}}, "a messages record has none"),
])
def test_bad_records_are_one_line_data_errors(tmp_path, row, expect):
    with pytest.raises(DataError, match=expect) as err:
        load_records(_write(tmp_path, [row]))
    assert "train.jsonl line 1" in str(err.value) and "\n" not in str(err.value)


def test_finals_and_the_format_line():
    qa, text = [{"question": "q", "answer": "#### 1"}], [{"text": "abc"}]
    assert has_finals(qa) and not has_finals(text) and not has_finals([])
    require_finals(qa, "accuracy_eval_steps")
    with pytest.raises(DataError, match=r"accuracy_eval_steps scores final answers.*text records, which have none"):
        require_finals(text, "accuracy_eval_steps")
    assert describe_format([MSGS] * 2, "train.jsonl") == (
        "train.jsonl: 2 records, format messages (read through each reader's chat template ('Role: content' lines "
        "for one without)); LM loss on the assistant turns (answer segment)")
    assert "format standard prompt_completion (read through the text as given)" in describe_format(
        [{"prompt": "a", "completion": "b"}])
    assert "format question_answer" in describe_format(qa) and "'#### <final>' = answer segment" in describe_format(qa)


# ----------------------------------------------------------------------------- segments


def test_text_learns_every_token(toks):
    tok = toks["bpe"]
    enc = tokenize_example(tok, {"text": "The cat sat on the mat."})
    assert _learned(tok, enc) == "The cat sat on the mat." + tok.eos_token
    assert (enc["segment_ids"] == ANSWER).all() and (enc["char_ends"][:-1] >= 0).all()


@pytest.mark.parametrize("name", ["bpe", "chatml"])
def test_standard_prompt_completion_is_the_text_as_given(toks, name):
    """The prompt is used as given (no template, even under use_chat_template: TRL's standard format)."""
    tok, rec = toks[name], {"prompt": "Translate: chat ->", "completion": " cat"}
    enc = tokenize_example(tok, rec, use_chat_template=True)
    assert tok.decode(enc["input_ids"]) == "Translate: chat -> cat" + tok.eos_token
    assert _learned(tok, enc) == " cat" + tok.eos_token
    assert format_example(rec).prompt_end == len(rec["prompt"])
    assert prompt_reads(tok, {}, example=rec) == "prompts: every reader reads the prompt_completion records' text as given"


def test_token_fields_of_a_standard_prompt_load_and_land_on_its_tokens(toks, tmp_path):
    """token_fields are character spans of a standard prompt as of a question (`fields.py`): they load, and
    the tokens over a span carry its value under any reader's prompt template, nowhere else."""
    row = {"prompt": "Rada: ", "completion": "7", "token_fields": {"value": [[0, 4, 7]], "query": [[4, 6, 1]]}}
    rec, = load_records(_write(tmp_path, [row]))
    assert rec["token_fields"] == (("query", ((4, 6, 1),)), ("value", ((0, 4, 7),)))
    tok = toks["bpe"]
    for own in (None, "Bram: 3\nTova: 5\n{question}"):
        enc = tokenize_example(tok, rec, own_template=own)
        text = format_example(rec, own_template=own).text
        lo = text.rindex("Rada")
        spans = tok(text, return_offsets_mapping=True, add_special_tokens=False)["offset_mapping"]
        on_name = torch.tensor([s < lo + 4 and e > lo for s, e in spans] + [False])  # + the EOS
        assert (enc["field:value"][on_name] == 7).all() and (enc["field:value"][~on_name] != 7).all()
        assert (enc["field:query"] == 1).sum() >= 1 and (enc["field:query"][on_name] != 1).all()


def test_a_teachers_template_wraps_a_standard_prompt(toks):
    """`{question}` is the prompt: the teacher's text is its template around it, the completion learned after
    it; the prompt and completion map onto the plain text, the template's own characters are UNSHARED.
    Text and conversational records have no prompt to wrap: one line."""
    rec = {"prompt": "Rada: ", "completion": "7"}
    f = format_example(rec, own_template="Rada: 7\n{question}")
    assert f.text == "Rada: 7\nRada: 7" and f.prompt_end == len("Rada: 7\nRada: ")
    assert f.shared.tolist() == [UNSHARED] * 8 + list(range(7))
    enc = tokenize_example(toks["bpe"], rec, own_template="Rada: 7\n{question}")
    assert _learned(toks["bpe"], enc) == "7" + toks["bpe"].eos_token
    assert (enc["char_ends"] == UNSHARED).any() and enc["char_ends"].max() == len("Rada: 7") - 1
    for bad in ({"text": "abc"}, {"prompt": CHAT[:4], "completion": CHAT[4:]}):
        with pytest.raises(DataError, match="drop the teacher's template"):
            format_example(bad, own_template="x {question}")
    assert prompt_reads(toks["bpe"], {}, example=rec, own_templates={"t": "S\n{question}"}).endswith(
        "; teacher t reads its own template 'S\\n{question}' around the prompt")
    sheet = "Bram: 3\n" * 40 + "{question}"  # a fact sheet: its two ends on the console line
    assert prompt_reads(toks["bpe"], {}, example=rec, own_templates={"t": sheet}).endswith(
        f"teacher t reads its own template {sheet[:30]!r}...{sheet[-30:]!r} (330 characters) around the prompt")


def test_plain_rendering_of_a_conversation(toks):
    """A reader without a chat template: 'Role: content' lines; each assistant turn learns its content and the
    newline that ends it, the last one the EOS; system and user turns (also between two assistant turns) are prompt."""
    f = format_example(MSGS)
    assert f.text == "System: Be brief.\nUser: What is 2+2?\nAssistant: 4.\nUser: And 3+3?\nAssistant: 6."
    learned = "".join(c for c, s in zip(f.text, f.segments) if s == ANSWER)
    assert learned == "4.\n6." and f.prompt_end == f.text.index("4.")
    tok = toks["alt"]
    enc = tokenize_example(tok, MSGS)
    seg = enc["segment_ids"].tolist()
    assert seg.count(ANSWER) and seg[-1] == ANSWER and PROMPT in seg[seg.index(ANSWER):]  # not monotone
    assert _learned(tok, enc).replace(" ", "") == "4.\n6." + tok.eos_token


def test_chat_template_learns_assistant_turns_and_their_end_of_turn(toks):
    tok = toks["chatml"]
    f = format_example(MSGS, tokenizer=tok)
    assert f.text.startswith("<|im_start|>system\nBe brief.<|im_end|>") and f.text.endswith("6.<|im_end|>")
    enc = tokenize_example(tok, MSGS)  # conversations take the template whatever use_chat_template says
    assert _learned(tok, enc) == "4.<|im_end|>6.<|im_end|>" + tok.eos_token
    # the content characters are those of the plain rendering; the template's own are UNSHARED
    plain = format_example(MSGS).text
    ends, own = enc["char_ends"][:-1], torch.tensor([e - 1 for _, e in tok(f.text, return_offsets_mapping=True,
                                                                             add_special_tokens=False)["offset_mapping"]])
    assert (ends == UNSHARED).sum() > 20 and enc["char_ends"][-1] == NO_CHAR
    for mine, theirs in zip(own[ends >= 0].tolist(), ends[ends >= 0].tolist()):
        assert f.text[mine] == plain[theirs]


@pytest.mark.parametrize("reader", ["chatml", "trim", "bpe"])
def test_assistant_content_pairs_across_readers(toks, reader):
    """Against the plain reader (bpe_alt, other vocabulary): every assistant turn's content ends at the same
    plain character on both sides, and the learned tokens with a shared character lie in the content."""
    rec = {"messages": (("user", "  What is 2+2?\n"), ("assistant", " 4, I think. "), ("user", "ok"),
                        ("assistant", "Yes: 4."))}
    plain = format_example(rec)
    a, b = tokenize_example(toks[reader], rec), tokenize_example(toks["alt"], rec)
    for content in ("4, I think.", "Yes: 4."):
        lo = plain.text.index(content)
        for enc in (a, b):
            inside = (enc["char_ends"] >= lo) & (enc["char_ends"] < lo + len(content))
            assert enc["char_ends"][inside].max() == lo + len(content) - 1
            assert (enc["labels"][inside] != -100).all()
    shared_learned = a["char_ends"][(a["labels"] != -100) & (a["char_ends"] >= 0)]
    assert all(plain.segments[e] == ANSWER for e in shared_learned.tolist())


def test_conversational_prompt_completion_learns_the_completion(toks):
    rec = {"prompt": CHAT[:4], "completion": CHAT[4:]}
    for tok in (toks["chatml"], toks["bpe"]):
        enc = tokenize_example(tok, rec)
        assert torch.equal(enc["input_ids"], tokenize_example(tok, MSGS)["input_ids"])
    assert _learned(toks["chatml"], tokenize_example(toks["chatml"], rec)) == "6.<|im_end|>" + toks["chatml"].eos_token


def test_trailing_turns_after_the_last_assistant_are_dropped():
    rec = {"messages": (*CHAT, ("user", "thanks"))}
    assert format_example(rec).text == format_example(MSGS).text


def test_a_template_that_rewrites_or_refuses_is_one_line(toks):
    rewrites = copy.deepcopy(toks["bpe"])
    rewrites.chat_template = "{% for m in messages %}{{ m['role'] }}: {{ m['content'] | upper }}\n{% endfor %}"
    with pytest.raises(DataError, match="does not write assistant message 1 as given"):
        format_example({"messages": (("user", "2+2?"), ("assistant", "four"))}, tokenizer=rewrites)
    refuses = copy.deepcopy(toks["bpe"])
    refuses.chat_template = "{{ raise_exception('roles must alternate') }}"
    with pytest.raises(DataError, match=r"refuses a conversation with roles .*roles must alternate"):
        format_example(MSGS, tokenizer=refuses)


def test_question_answer_only_options_refuse_other_formats():
    with pytest.raises(DataError, match="student_input no_rationale shortens a question_answer"):
        shorten_rationale(MSGS, "no_rationale")
    assert shorten_rationale(MSGS, "full") == MSGS
    with pytest.raises(DataError, match="rationale_field 'r' replaces"):
        format_example({"text": "abc", "r": "x"}, rationale_field="r")


# ----------------------------------------------------------------------------- batching


def test_collator_caches_and_pairs_conversations(toks):
    student, teacher = toks["chatml"], toks["alt"]
    records = [{**MSGS, "index": 0}, {"messages": CHAT[1:3], "index": 1}]
    collate = DistillCollator(student, teachers={"t": TeacherView(teacher)})
    batch = collate(records)
    assert len(collate._features) == 4  # hashable records: one tokenization per view and record
    t = batch["teacher_inputs"]["t"]
    for i in range(2):
        n = int(batch["attention_mask"][i].sum())
        assert batch["input_ids"][i, :n].tolist() == tokenize_example(student, records[i])["input_ids"].tolist()
        s_ends, t_ends = batch["char_ends"][i], t["char_ends"][i]
        assert set(s_ends[s_ends >= 0].tolist()) <= set(range(len(format_example(records[i]).text)))
        assert s_ends.max() == t_ends.max()  # both end on the last assistant content's last character
    assert prompt_reads(student, {"t": teacher}, example=MSGS) == (
        "prompts: student reads its chat template; teacher t reads the plain rendering ('Role: content' lines) "
        "(it has no chat template)")


def test_eval_gives_the_lm_loss_and_generate_refuses_records_without_final_answers(tmp_path, tiny_world):
    """Scoring reads a final answer and a question; a messages data set has neither: eval gives its held-out LM
    loss on what training learns of it (the assistant turns) and nothing else, equal to the loss computed here;
    eval --no_perplexity and generate are refused in one line, writing nothing."""
    from kvdistill.commands import eval as eval_cmd
    from kvdistill.commands import generate as generate_cmd
    from kvdistill.data import pad_batch

    data = tmp_path / "chat.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "yo " * (i + 1)}]}
            for i in range(3)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    student = str(tiny_world.models["student"])
    assert eval_cmd.main(["--model", student, "--data", str(data), "--split", "train", "--output_dir",
                          str(tmp_path / "ok")]) == 0
    summary = json.loads((tmp_path / "ok" / "summary.json").read_text())
    assert summary["accuracy"] is None and summary["answer_nll"] is None and summary["n"] == 3
    model, tok = load_model(student, dtype="fp32"), load_tokenizer(student)
    batch = pad_batch([tokenize_example(tok, r) for r in load_records(data, "train")], tok.pad_token_id)
    with torch.no_grad():
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    labels = batch["labels"][:, 1:]
    nll = torch.nn.functional.cross_entropy(logits[:, :-1].flatten(0, 1), labels.flatten(), ignore_index=-100)
    assert summary["nll"] == pytest.approx(float(nll), rel=1e-5) and summary["target_tokens"] == int((labels != -100).sum())
    with pytest.raises(DataError, match=r"^these are messages records, with no final answers to score"):
        eval_cmd.main(["--model", student, "--data", str(data), "--split", "train", "--output_dir", str(tmp_path / "e"),
                       "--no_perplexity"])
    with pytest.raises(DataError, match=r"^kvdistill generate \(its prompts are questions\) scores final answers"):
        generate_cmd.main(["--model", student, "--data", str(data), "--split", "train", "--output", str(tmp_path / "g" / "t.jsonl")])
    assert not [*tmp_path.glob("e/*"), *tmp_path.glob("g/*")]  # no results, whole or partial
