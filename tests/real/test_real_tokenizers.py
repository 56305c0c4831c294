"""The real pair's tokenizers (Gemma-3-270m: SentencePiece with byte fallback, adds <bos>, pads left as converted,
no chat template; SmolLM2-135M-Instruct: byte-level BPE, no BOS, a chat template) on text with digits, accents,
emoji, CJK, tabs, newlines and runs of spaces: offsets, the collator's padding and the time alignment."""

from itertools import pairwise

import pytest
import torch

from kvdistill import data
from kvdistill.align.time import NO_CHAR, time_index
from kvdistill.data import (
    DistillCollator,
    TeacherView,
    format_example,
    pad_batch,
    prompt_reads,
    tokenize_example,
)
from kvdistill.models import load_tokenizer

pytestmark = pytest.mark.real

ROLES = ["teacher", "student"]
REC = {"question": "Café naïve: Tom has 12345 apples 🍕🚀 and 東京は has\t\t2   more.\nHow many? 한국어 𝔘",
       "answer": "12345 + 2 = 12347 apples.\n\tSo    👨‍👩‍👧 東京 gets 3.5 × 4 = 14.\n\n#### 12347"}


@pytest.fixture(scope="module")
def toks(real_pair):
    return {role: load_tokenizer(real_pair[role]) for role in ROLES}


def _spans(tok, text, add_special_tokens=True):
    """`(ids, [(start, end)])` of `text`, the specials' spans included ((0, 0) for <bos>)."""
    enc = tok(text, return_offsets_mapping=True, add_special_tokens=add_special_tokens)
    return enc["input_ids"], enc["offset_mapping"]


@pytest.mark.parametrize("role", ROLES)
def test_offsets_rebuild_the_text(toks, role):
    """Neither tokenizer drops a character (no normalizer that deletes; Gemma maps ' ' to '▁' one for one): the
    non-special tokens' spans, in order, cover the whole text without a gap. They may overlap: the byte pieces of one
    character (Gemma's <0xF0>..., SmolLM2's byte-level pieces of an emoji or a CJK character) each report its span."""
    tok = toks[role]
    text = format_example(REC).text
    ids, spans = _spans(tok, text)
    special = set(tok.all_special_ids)
    assert [s for i, s in zip(ids, spans) if i in special] == ([(0, 0)] if role == "teacher" else [])  # <bos>
    rebuilt, covered = "", 0
    for i, (s, e) in zip(ids, spans):
        if i in special:
            continue
        assert s <= covered and e >= covered and e > s, f"gap or backstep at {text[covered:covered + 5]!r}"
        rebuilt += text[covered:e]
        covered = e
    assert rebuilt == text
    pieces = sum(a == b for a, b in pairwise(spans) if a[1] > a[0])  # neighbours reporting one span
    assert pieces > 0  # byte pieces exist on both sides (𝔘 is byte fallback in Gemma, many emoji in SmolLM2)


@pytest.mark.parametrize("role", ROLES)
def test_collator_pads_right_whatever_the_tokenizer_says(toks, role):
    """Gemma's converted tokenizer pads left; the collator pads right for every reader regardless (pad_batch), which
    the models' default positions assume, and the time alignment is checked under both sides below."""
    tok = toks[role]
    assert tok.padding_side == ("left" if role == "teacher" else "right")
    records = [REC, {"question": "What is 2 + 2?", "answer": "#### 4"}]
    batch = DistillCollator(toks["student"], teachers={"t": TeacherView(toks["teacher"])})(records)
    mask = (batch if role == "student" else batch["teacher_inputs"]["t"])["attention_mask"]
    assert mask[1, 0] == 1 and mask[1, -1] == 0  # the short row: tokens first, padding after
    assert torch.equal(mask, mask.sort(1, descending=True).values)


def _aligned_batch(toks, side, chat=False):
    """Both readers' features of `REC` and of a short record, padded on `side`, and their char-ends time index."""
    records = [REC, {"question": "Is 7 > 3?", "answer": "Yes.\n#### yes"}]
    feats = {r: [tokenize_example(toks[r], rec, use_chat_template=chat) for rec in records] for r in ROLES}
    b = {r: pad_batch(feats[r], toks[r].pad_token_id, side) for r in ROLES}
    t, s = b["teacher"], b["student"]
    idx = time_index(t["attention_mask"], t["segment_ids"], s["attention_mask"], s["segment_ids"],
                     src_ends=t["char_ends"], tgt_ends=s["char_ends"])
    return records, b, idx


def _shared_spans(tok, rec, chat):
    """Every token's `(start, end)` in the plain-prompt text (`None`: no shared character), EOS appended."""
    f = format_example(rec, tokenizer=tok if chat else None)
    _, spans = _spans(tok, f.text, add_special_tokens=not (chat and tok.chat_template))
    shared = torch.arange(len(f.text)) if f.shared is None else f.shared
    out = [(int(shared[s]), int(shared[e - 1]) + 1) if e > s and shared[e - 1] >= 0 else None for s, e in spans]
    return [*out, None]  # the EOS tokenize_example appends


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("side", ["right", "left"])
def test_time_alignment_reads_overlapping_teacher_tokens(toks, side, chat):
    """Every student token with a character reads teacher tokens whose span overlaps its own (proportional
    resampling drifts by a token or more: Gemma's <bos>, one CJK token against three byte pieces); the student's
    EOS reads the teacher's EOS, nobody reads <bos>; under a chat template the template's tokens read nothing."""
    records, b, idx = _aligned_batch(toks, side, chat)
    t_mask, s_mask = b["teacher"]["attention_mask"], b["student"]["attention_mask"]
    for i, rec in enumerate(records):
        t_pos = t_mask[i].nonzero().flatten().tolist()  # batch position of the k-th real token
        s_pos = s_mask[i].nonzero().flatten().tolist()
        t_spans = dict(zip(t_pos, _shared_spans(toks["teacher"], rec, chat)))
        s_spans = _shared_spans(toks["student"], rec, chat)
        assert len(s_spans) == len(s_pos) and len(t_spans) == len(t_pos)
        for k, (p, span) in enumerate(zip(s_pos, s_spans)):
            if span is None:
                continue
            assert idx.valid[i, p]
            for q in (int(idx.lo[i, p]), int(idx.hi[i, p])):
                assert t_spans[q] is not None, f"student token {k} {span} reads teacher special token {q}"
                a, e = t_spans[q]
                assert a < span[1] and span[0] < e, f"student token {k} {span} reads teacher {q} {(a, e)}"
        assert idx.valid[i, s_pos[-1]] and idx.lo[i, s_pos[-1]] == t_pos[-1]  # EOS -> EOS
        assert not (idx.valid[i] & ((idx.lo[i] == t_pos[0]) | (idx.hi[i] == t_pos[0]))).any()  # <bos> unread
        template = [p for p, span in zip(s_pos, s_spans[:-1]) if span is None]
        assert bool(template) == chat and not idx.valid[i, template].any()


def test_chat_student_reads_its_template_the_plain_teacher_its_prompt(toks):
    """`use_chat_template`: the student's ids are its chat template's, the teacher's the plain prompt's (it has none);
    the question and answer characters pair across, and one line says what each reads."""
    S, T = toks["student"], toks["teacher"]
    batch = DistillCollator(S, use_chat_template=True, teachers={"gemma": TeacherView(T)})([REC])
    f_s, f_t = format_example(REC, tokenizer=S), format_example(REC)
    assert f_s.text.startswith("<|im_start|>system\n") and f_t.text.startswith("Question: ")
    n = int(batch["attention_mask"].sum())
    assert batch["input_ids"][0, :n].tolist() == S(f_s.text, add_special_tokens=False)["input_ids"] + [S.eos_token_id]
    t = batch["teacher_inputs"]["gemma"]
    assert t["input_ids"][0].tolist() == T(f_t.text)["input_ids"] + [T.eos_token_id]
    # both readers' char_ends are in the plain text: each question / answer character is where the teacher has it
    ends_s, ends_t = batch["char_ends"][0, :n], t["char_ends"][0]
    q = f_t.text.index(REC["question"])
    for lo, hi in ((q, q + len(REC["question"])), (f_t.prompt_end, len(f_t.text))):
        inside = (ends_s >= lo) & (ends_s < hi)
        assert inside.any() and ends_s[inside].max() == ends_t[(ends_t >= lo) & (ends_t < hi)].max() == hi - 1
    assert (ends_s == data.UNSHARED).sum() > 20 and not (ends_t == data.UNSHARED).any()
    assert data.NO_CHAR == NO_CHAR
    assert prompt_reads(S, {"gemma": T, "same": None}, use_chat_template=True) == (
        "prompts: student reads its chat template; teacher gemma reads prompt_template "
        "'Question: {question}\\nAnswer:' (it has no chat template); teacher same reads the student's tokens")
    assert prompt_reads(S, {"gemma": T}) == (
        "prompts: student reads prompt_template 'Question: {question}\\nAnswer:'; "
        "teacher gemma reads prompt_template 'Question: {question}\\nAnswer:'")


def test_a_teachers_own_template_pairs_the_question_and_after_never_its_prefix(toks):
    """A teacher's `template` (a few-shot prefix only it reads): its prefix and template words pair with no
    student token, every other character with the same character of the student's text; per-token fields land
    on the question, not on a copy of it in the prefix."""
    S, T = toks["student"], toks["teacher"]
    rec = {"question": "a=4. e=a. What is e?", "answer": "#### 4",
           "token_fields": {"value": [[0, 1, 4], [5, 6, 4], [18, 19, 4]]}}
    own = "a=4. e=a. What is e? 4\nb=2. What is b? 2\n\n{question}\nAnswer:"  # the prefix holds the question
    batch = DistillCollator(S, teachers={"gemma": TeacherView(T, template=own)})([rec])
    t, f_t, plain = batch["teacher_inputs"]["gemma"], format_example(rec, own_template=own), format_example(rec).text
    assert f_t.text.startswith(own.split("{question}")[0]) and f_t.text.endswith(plain[plain.index(rec["question"]):])
    raw = torch.tensor([e - 1 if e > s else NO_CHAR for s, e in _spans(T, f_t.text)[1]])  # [T] ends in its own text
    ends = t["char_ends"][0, :len(raw)]
    prefix = raw < len(own.split("{question}")[0])
    assert raw[prefix].ge(0).any() and (ends[prefix & (raw >= 0)] == data.UNSHARED).all()
    shared = ends >= 0
    assert shared.sum() >= 8 and all(plain[c] == f_t.text[r] for c, r in zip(ends[shared].tolist(), raw[shared].tolist()))
    # the student's tokens of the question read the teacher's tokens of the question, none of the prefix's
    s_ends = batch["char_ends"]
    idx = time_index(t["attention_mask"], t["segment_ids"], batch["attention_mask"], batch["segment_ids"], "segment",
                     t["char_ends"], s_ends)
    q = plain.index(rec["question"])
    in_q = (s_ends[0] >= q) & (s_ends[0] < q + len(rec["question"]))
    assert in_q.sum() >= 4 and not prefix[idx.lo[0, in_q]].any() and idx.valid[0, in_q].all()
    # the value field: 4 on the three spans of the question, none on the prefix's copy
    values = t["token_fields"]["value"][0, :len(raw)]
    assert not (values[prefix] == 4).any() and (values == 4).sum() >= 3
    assert prompt_reads(S, {"gemma": T}, own_templates={"gemma": own}).endswith(
        f"teacher gemma reads its own template {own!r} (its text outside the question pairs with no student token)")
