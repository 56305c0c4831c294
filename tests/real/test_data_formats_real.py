"""A messages record under the real pair's tokenizers: SmolLM2-135M-Instruct's ChatML template against Gemma-3-270m
read plain (it ships without a chat template) and through a Gemma-style template (`<start_of_turn>`, content
trimmed, `model` for the assistant): the assistant-content characters pair across, and each side learns exactly
its assistant turns."""

import copy

import pytest

from kvdistill.align.time import time_index
from kvdistill.cache import ANSWER
from kvdistill.data import UNSHARED, format_example, pad_batch, tokenize_example
from kvdistill.models import load_tokenizer

pytestmark = pytest.mark.real

# the Gemma 3 instruct template's turn layout (the converted 270m base model has no template)
GEMMA = ("{{ bos_token }}{% for m in messages %}{% set role = 'model' if m['role'] == 'assistant' else m['role'] %}"
         "<start_of_turn>{{ role }}\n{{ m['content'] | trim }}<end_of_turn>\n{% endfor %}"
         "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
REC = {"messages": (("system", "Be brief."), ("user", "Café naïve: 12345 apples 🍕 and 東京は 2 more?"),
                    ("assistant", "12345 + 2 = 12347 🍕.\n\tSo 東京 gets 3.5 × 4 = 14."), ("user", "And 3+3?"),
                    ("assistant", "  6.\n"))}
CONTENTS = ("12345 + 2 = 12347 🍕.\n\tSo 東京 gets 3.5 × 4 = 14.", "6.")  # the second as Gemma's template trims it


@pytest.fixture(scope="module")
def toks(real_pair):
    smol, gemma = load_tokenizer(real_pair["student"]), load_tokenizer(real_pair["teacher"])
    templated = copy.deepcopy(gemma)
    templated.chat_template = GEMMA
    return {"smol": smol, "gemma": gemma, "gemma_chat": templated}


def test_each_reader_learns_its_assistant_turns(toks):
    assert toks["smol"].chat_template and not toks["gemma"].chat_template
    learned = {n: tok.decode(enc["input_ids"][enc["labels"] != -100])
               for n, tok in toks.items() for enc in [tokenize_example(tok, REC)]}
    # its EOS is <|im_end|>: none appended; "\n  " is one token whose last character is content, so it is learned
    assert learned["smol"] == f"{CONTENTS[0]}<|im_end|>\n  6.\n<|im_end|>"
    assert learned["gemma_chat"] == f"{CONTENTS[0]}<end_of_turn>6.<end_of_turn><eos>"
    # the plain rendering: content + the newline ending its turn, EOS last; "Assistant: " + "  6." puts the header's
    # space in the content's first token (▁▁▁)
    assert learned["gemma"] == f"{CONTENTS[0]}\n   6.\n<eos>"


@pytest.mark.parametrize("teacher", ["gemma", "gemma_chat"])
def test_assistant_content_pairs_between_the_templates(toks, teacher):
    """In the shared (plain-rendering) coordinates every assistant content ends at the same character on both
    sides, and with char-ends time alignment every SmolLM2 content token reads Gemma tokens that overlap it."""
    plain = format_example(REC).text
    s, t = tokenize_example(toks["smol"], REC), tokenize_example(toks[teacher], REC)
    for content in CONTENTS:
        lo = plain.index(content)
        for enc in (s, t):
            inside = (enc["char_ends"] >= lo) & (enc["char_ends"] < lo + len(content))
            assert enc["char_ends"][inside].max() == lo + len(content) - 1
            assert (enc["segment_ids"][inside] == ANSWER).all()
    assert (s["char_ends"] == UNSHARED).sum() > 20  # ChatML's own text pairs with nothing
    assert ((t["char_ends"] == UNSHARED).sum() > 10) == (teacher == "gemma_chat")

    b_s, b_t = pad_batch([s], toks["smol"].pad_token_id), pad_batch([t], toks[teacher].pad_token_id)
    idx = time_index(b_t["attention_mask"], b_t["segment_ids"], b_s["attention_mask"], b_s["segment_ids"],
                     src_ends=b_t["char_ends"], tgt_ends=b_s["char_ends"])
    t_ends = t["char_ends"].tolist()
    t_spans = [(max(e for e in t_ends[:q] if e >= 0) + 1 if any(e >= 0 for e in t_ends[:q]) else 0, e + 1)
               for q, e in enumerate(t_ends)]  # each teacher token's shared characters (start, end)
    s_ends, checked = s["char_ends"].tolist(), 0
    for p, e in enumerate(s_ends):
        lo = next((plain.index(c) for c in CONTENTS if plain.index(c) <= e < plain.index(c) + len(c)), None)
        if lo is None:
            continue
        assert idx.valid[0, p]
        q = int(idx.lo[0, p])
        assert t_ends[q] >= 0 and t_spans[q][0] <= e < t_spans[q][1], (p, e, q, t_spans[q])
        checked += 1
    assert checked > 15  # the content tokens of both assistant turns


@pytest.mark.parametrize("rec", [{"prompt": "2 + 2 =", "completion": " 4"}, {"text": "2 + 2 = 4"}])
def test_plain_formats_keep_the_tokenizers_bos_whatever_its_template(toks, rec):
    """Standard prompt/completion and text are read as given, with the special tokens the tokenizer adds
    (Gemma's <bos>), even under use_chat_template and with a chat template."""
    tok = toks["gemma_chat"]
    enc = tokenize_example(tok, rec, use_chat_template=True)
    assert tok.decode(enc["input_ids"]) == "<bos>2 + 2 = 4<eos>"
    assert enc["labels"][0] == -100 and enc["char_ends"][0] == -1
