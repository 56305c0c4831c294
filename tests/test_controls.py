"""Controls (controls.py): the oracle relation target is the class block matrix; the permuted teacher
reads one consistent bijection while the student's input is unchanged."""

from __future__ import annotations

import math
import re

import pytest
import torch

from kvdistill.align.aligner import KVAligner
from kvdistill.cache import KVCache
from kvdistill.controls import (
    ORACLE_MARGIN,
    TextPermutation,
    oracle_cache,
    oracle_code,
    oracle_width,
    parse_vocab,
)
from kvdistill.data import DataError, DistillCollator, TeacherView
from kvdistill.fields import IGNORE, freeze
from kvdistill.losses import RelationKVLoss
from kvdistill.models import load_tokenizer

# ----------------------------------------------------------------------------- oracle

# two samples, 7 tokens: classes 0/1/2, tokens without a class, and padding at the end of sample 1
CLASSES = torch.tensor([[0, 1, IGNORE, 0, 1, 1, 2],
                        [2, IGNORE, 2, 0, 0, IGNORE, IGNORE]])
MASK = torch.tensor([[1] * 7, [1] * 5 + [0] * 2])
SEG = torch.tensor([[0, 0, 0, 1, 1, 2, 2], [0, 0, 1, 1, 2, -1, -1]])


def block_matrix(classes: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """`[B, T, T]` by hand: a class row is uniform over the valid tokens of its class; a row without a
    class is uniform over all valid tokens."""
    valid = mask.bool()
    same = (classes[:, :, None] == classes[:, None, :]) & (classes[:, :, None] >= 0)
    rel = torch.where((classes >= 0)[:, :, None], same, torch.ones_like(same)) & valid[:, None, :]
    rel = rel.float()
    return rel / rel.sum(-1, keepdim=True)


def relation_probs(x: torch.Tensor, mask: torch.Tensor, heads: int, temperature: float) -> torch.Tensor:
    """The relation loss's row distribution (its docstring's formula) `[L, B, R, T, T]` of `[L, B, T, F]`."""
    fn = RelationKVLoss(relation_heads=heads, temperature=temperature)
    x = fn.split_heads(x, "teacher")  # [L, B, R, T, d]
    logits = x @ x.transpose(-1, -2) / math.sqrt(x.shape[-1]) / temperature
    return logits.masked_fill(~mask.bool()[None, :, None, None, :], -math.inf).softmax(-1)


@pytest.mark.parametrize(("heads", "temperature", "time_mode"), [(1, 1.0, "segment"), (4, 0.5, "global")])
def test_oracle_relation_target_is_the_class_block_matrix(heads, temperature, time_mode):
    L_s, L_t = 3, 2
    oracle = oracle_cache(CLASSES, MASK, SEG, layers=L_t, heads=heads, width=3, temperature=temperature)
    student = KVCache(torch.randn(L_s, 2, 2, 7, 8), torch.randn(L_s, 2, 2, 7, 8), MASK, SEG)
    # the path of a real teacher: time + layer alignment (no projector for the relation loss)
    aligner = KVAligner(time_mode=time_mode, projector="none")
    a = aligner(oracle, student)
    assert a.teacher_keys.shape == (L_s, 2, 7, heads * 3)  # every student layer reads an oracle layer
    want = block_matrix(CLASSES, MASK)[:, None]  # [B, 1, T, T]
    for x in (a.teacher_keys, a.teacher_values):
        p = relation_probs(x, a.mask, heads, temperature)  # [L, B, R, T, T]
        rows = MASK.bool()[None, :, None, :, None].expand_as(p)  # padded rows are not rows of the loss
        assert torch.allclose(p[rows], want.expand_as(p)[rows], atol=1e-5)


def test_relation_loss_reads_the_oracle_as_its_target():
    oracle = oracle_cache(CLASSES, MASK, SEG, layers=2, heads=2, width=3)
    fn = RelationKVLoss(relation_heads=2, reduction="mean", compile=False)
    t = oracle.keys.transpose(2, 3)  # [L, B, T, H, D]
    loss_same, _ = fn(t.clone().requires_grad_(), t, MASK, SEG)
    assert float(loss_same.detach()) < 1e-6  # a student with the oracle's codes matches it
    loss_random, _ = fn(torch.randn(2, 2, 7, 6, requires_grad=True), t, MASK, SEG)
    assert float(loss_random.detach()) > 0.1


def test_fourier_code_gram_depends_only_on_the_difference_mod_p():
    p = 7
    v = torch.arange(p)
    code = oracle_code(v[None], p, "fourier")[0]  # [p, C]
    gram = code @ code.T  # [p, p]
    diff = (v[:, None] - v[None, :]) % p
    assert torch.allclose(gram, torch.cos(2 * math.pi * diff / p), atol=1e-6)
    for d in range(p):  # one value per difference: (a - b) mod p alone fixes the relation
        assert torch.allclose(gram[diff == d], gram[diff == d][0].expand(p), atol=1e-6)
    assert torch.equal(oracle_code(torch.tensor([[IGNORE, 3]]), p, "fourier")[0, 0], torch.zeros(p))
    with pytest.raises(ValueError, match="onehot"):
        oracle_code(v[None], p, "magnitude")


@pytest.mark.parametrize(("heads", "temperature"), [(1, 1.0), (2, 0.5)])
def test_fourier_oracle_rows_through_the_aligner(heads, temperature):
    p = 5
    numbers = torch.tensor([[0, 4, IGNORE, 1, 2, 0, 3], [3, IGNORE, 1, 4, 4, IGNORE, IGNORE]])
    oracle = oracle_cache(numbers, MASK, SEG, layers=2, heads=heads, width=p, temperature=temperature, code="fourier")
    student = KVCache(torch.randn(3, 2, 2, 7, 8), torch.randn(3, 2, 2, 7, 8), MASK, SEG)
    a = KVAligner(time_mode="segment", projector="none")(oracle, student)
    # by hand: logit margin * cos(2π(a - b)/p) between numbers, 0 to and from a token without one
    has = numbers >= 0
    cos = torch.cos(2 * math.pi * (numbers[:, :, None] - numbers[:, None, :]) / p)
    logits = torch.where(has[:, :, None] & has[:, None, :], ORACLE_MARGIN * cos, torch.zeros(()))
    want = logits.masked_fill(~MASK.bool()[:, None, :], -math.inf).softmax(-1)[:, None]  # [B, 1, T, T]
    for x in (a.teacher_keys, a.teacher_values):
        got = relation_probs(x, a.mask, heads, temperature)  # [L, B, R, T, T]
        rows = MASK.bool()[None, :, None, :, None].expand_as(got)
        assert torch.allclose(got[rows], want.expand_as(got)[rows], atol=1e-5)


def test_oracle_width_and_refusals():
    rec = {"question": "b=7. k=b.", "answer": "#### 7", "token_fields": freeze({"chain": [[0, 1, 0], [5, 6, 3]]})}
    assert oracle_width([rec, {**rec, "token_fields": freeze({"chain": [[0, 1, 1]]})}], "chain") == 4
    with pytest.raises(DataError, match=r"field 'class'.*oracle_field"):
        oracle_width([rec], "class")
    with pytest.raises(DataError, match="record 1 lacks"):
        oracle_width([rec, {"question": "q", "answer": "#### 1"}], "chain")
    with pytest.raises(DataError, match=">= code width"):
        oracle_cache(CLASSES, MASK, SEG, layers=1, heads=1, width=2)


# ----------------------------------------------------------------------------- permuted input

BINDING = [
    {"question": "b=7. k=b. q=4. m=k. z=q. What is m?", "answer": "#### 7",
     "token_fields": freeze({"chain": [[0, 1, 0], [5, 6, 0], [7, 8, 0], [10, 11, 1], [15, 16, 0], [17, 18, 0],
                                       [20, 21, 1], [22, 23, 1], [33, 34, 0]]})},
    {"question": "z=3. b=z. What is b?", "answer": "#### 3",
     "token_fields": freeze({"chain": [[0, 1, 0], [5, 6, 0], [7, 8, 0], [18, 19, 0]]})},
]
NAMES = ["b", "k", "q", "m", "z", "x"]


def pairs(perm: TextPermutation, text: str) -> list[tuple[str, str]]:
    """(source string, what the teacher reads in its place) for every replaced piece of `text`."""
    new, edits = perm.apply(text)
    return [(text[a:b], new[na:nb]) for a, b, na, nb in edits]


def test_permutation_is_one_seeded_bijection_without_fixed_points():
    perm = TextPermutation.seeded("names", NAMES, seed=3)
    table = perm.table
    assert sorted(table) == sorted(table.values()) == sorted(NAMES)  # onto the vocab: no two sources, one target
    assert all(s != t for s, t in table.items())
    assert TextPermutation.seeded("names", NAMES, seed=3) == perm  # the run's seed fixes the map
    assert TextPermutation.seeded("names", NAMES, seed=4).table != table


def test_permuted_teacher_sees_a_consistent_map_within_and_across_records():
    perm = TextPermutation.seeded("names", NAMES, seed=0)
    seen: dict[str, str] = {}
    for r in BINDING:
        for src, dst in pairs(perm, r["question"]) + pairs(perm, r["answer"]):
            assert seen.setdefault(src, dst) == dst  # the same source always reads the same
    assert len(set(seen.values())) == len(seen)  # injective
    q = BINDING[0]["question"]
    assert perm(BINDING[0])["question"] == re.sub(r"\b[bkqmz]\b", lambda m: perm.table[m.group()], q)
    assert "What is" in perm(BINDING[0])["question"]  # only whole-word vocab entries change


def test_a_permuted_teacher_reads_a_conversation_with_its_contents_rewritten_and_its_roles_kept():
    perm = TextPermutation.seeded("numbers", "0..58", seed=1)
    t = perm.table
    rec = {"messages": (("user", "What is 31 + 40?"), ("assistant", "12")), "index": 3}
    assert perm(rec) == {"messages": (("user", f"What is {t['31']} + {t['40']}?"), ("assistant", t["12"])), "index": 3}


def test_numbers_outside_the_declared_range_are_kept():
    perm = TextPermutation.seeded("numbers", "0..58", seed=1)
    rec = {"question": "What is 31 + 40 mod 59? And 007?", "answer": "12 + 0 = 12\n#### 12"}
    out = perm(rec)
    t = perm.table
    assert out["question"] == f"What is {t['31']} + {t['40']} mod 59? And {t['7']}?"
    assert out["answer"] == f"{t['12']} + {t['0']} = {t['12']}\n#### {t['12']}"
    assert parse_vocab("numbers", [3, "4", 3]) == ("3", "4")
    for kind, vocab, match in [("numbers", ["a"], "integers"), ("names", ["a b"], "whole words"),
                               ("names", ["a"], "at least 2"), ("names", "abc", "must list"),
                               ("letters", ["a", "b"], "permute must be")]:
        with pytest.raises(ValueError, match=match):
            parse_vocab(kind, vocab)


def test_field_spans_move_with_their_text():
    perm = TextPermutation.seeded("numbers", "0..200", seed=2)
    q = "Tom has 12 apples. Ann gets 5 more, 100 in all."
    rec = {"question": q, "answer": "#### 17",
           "token_fields": freeze({"value": [[8, 10, 12], [28, 29, 5]], "who": [[0, 3, 1], [19, 22, 2]],
                                   "inside": [[9, 17, 4], [0, 9, 3]]})}
    out = perm(rec)
    new = out["question"]
    spans = dict(out["token_fields"])
    t = perm.table
    assert [new[s:e] for s, e, _ in spans["value"]] == [t["12"], t["5"]]  # a number's span: its new text
    assert [new[s:e] for s, e, _ in spans["who"]] == ["Tom", "Ann"]  # untouched text, shifted
    # a span starting or ending inside a number covers all of it
    assert [new[s:e] for s, e, _ in spans["inside"]] == [f"{t['12']} apples", f"Tom has {t['12']}"]
    assert [v for *_, v in spans["value"]] == [12, 5]  # a field's values are facts of the problem: kept


def test_student_reads_the_original_text_and_the_teacher_the_permuted(tiny_world):
    tok = load_tokenizer(tiny_world.tokenizers["bpe"])
    perm = TextPermutation.seeded("names", NAMES, seed=0)
    plain = DistillCollator(tok)(BINDING)
    batch = DistillCollator(tok, teachers={"t": TeacherView(tok, rewrite=perm)})(BINDING)
    assert torch.equal(batch["input_ids"], plain["input_ids"])  # the student's input is unchanged
    assert torch.equal(batch["token_fields"]["chain"], plain["token_fields"]["chain"])
    t = batch["teacher_inputs"]["t"]
    text = tok.decode(t["input_ids"][0][t["attention_mask"][0].bool()])
    assert perm(BINDING[0])["question"] in text and BINDING[0]["question"] not in text
    chain = t["token_fields"]["chain"][0]  # the fields sit on the renamed tokens
    named = tok.decode(t["input_ids"][0][chain >= 0]).replace(" ", "")
    renamed = perm(BINDING[0])["question"]
    assert named == "".join(renamed[s:e] for s, e, _ in dict(perm(BINDING[0])["token_fields"])["chain"])
