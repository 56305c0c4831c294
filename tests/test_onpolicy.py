"""On-policy component: seeding, where a generation ends, sampling, completion tokenization and batching."""

import pytest
import torch
from torch import nn

from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING
from kvdistill.data import DataError, format_prompt, tokenize_example
from kvdistill.models import load_model, load_tokenizer
from kvdistill.onpolicy import (
    completion_batch,
    on_policy_step,
    sample_completions,
    sampling_seed,
    split_generated,
    tokenize_completion,
    write_completions,
)

QUESTION = "Tom has 12 apples. Tom buys 5 more apples. How many apples does Tom have now?"
SAMPLING = {"temperature": 1.0, "top_p": 1.0, "max_new_tokens": 12, "max_length": 160}


@pytest.fixture(scope="module")
def student(tiny_world):
    return load_model(tiny_world.models["student"], dtype="fp32"), load_tokenizer(tiny_world.models["student"])


def test_seeds_differ_by_step_rank_and_micro_batch_and_repeat():
    seeds = {sampling_seed(0, s, r, m) for s in range(20) for r in range(4) for m in range(3)}
    assert len(seeds) == 20 * 4 * 3  # DDP ranks (and steps, micro-batches) never share a seed
    assert sampling_seed(3, 7, 1, 2) == sampling_seed(3, 7, 1, 2)  # a resumed step replays its sampling
    assert all(0 <= s < 2**63 for s in seeds)


def test_lmbda_draw_is_per_step_and_seeded():
    assert not any(on_policy_step(0, s, 0.0) for s in range(50))
    assert all(on_policy_step(0, s, 1.0) for s in range(50))
    draws = [on_policy_step(0, s, 0.5) for s in range(400)]
    assert 0.4 < sum(draws) / 400 < 0.6
    assert draws == [on_policy_step(0, s, 0.5) for s in range(400)]
    assert draws != [on_policy_step(1, s, 0.5) for s in range(400)]


def test_generation_ends_at_the_first_eos_and_padding_is_not_text():
    eos, pad = 0, 1
    new = torch.tensor([[5, pad, 6, eos, pad, pad],  # a sampled pad inside the text, then EOS and filler
                        [5, 6, 7, 8, 9, 9],  # ran to the budget
                        [eos, pad, pad, pad, pad, pad],  # stopped at once
                        [5, eos, 7, eos, pad, pad]])  # only the first EOS ends it
    lengths, finished = split_generated(new, [eos])
    assert lengths.tolist() == [3, 6, 0, 1]
    assert finished.tolist() == [True, False, True, True]


class FixedGenerator(nn.Module):
    """A stand-in model whose `generate` appends fixed rows (pads inside, EOS, filler)."""

    def __init__(self, rows: torch.Tensor):
        super().__init__()
        self.rows, self.w = rows, nn.Parameter(torch.zeros(1))
        self.generation_config = None

    def generate(self, input_ids, attention_mask, **kwargs):
        return torch.cat([input_ids, self.rows[:, : kwargs["max_new_tokens"]]], 1)


def test_decoded_completions_drop_padding_and_stop_at_eos(tiny_world):
    tok = load_tokenizer(tiny_world.tokenizers["bpe"])
    a, b = tok(" 12", add_special_tokens=False)["input_ids"], tok(" + 5", add_special_tokens=False)["input_ids"]
    eos, pad = tok.eos_token_id, tok.pad_token_id
    assert eos != pad
    row0 = [*a, pad, *b, eos, *b]  # text after EOS is not the completion
    row1 = [*b, *b, *b, *b, *b, *b][: len(row0)]
    model = FixedGenerator(torch.tensor([row0, row1]))
    done = sample_completions(model, tok, ["Q: a\nA:", "Q: b\nA:"], **{**SAMPLING, "max_new_tokens": len(row0)},
                              seed=0)
    assert [c.text for c in done] == [" 12 + 5", tok.decode(row1)]
    assert [c.finished for c in done] == [True, False]
    assert done[0].tokens == len(a) + 1 + len(b)


def test_sampling_is_seeded_leaves_global_rng_and_train_mode(student):
    model, tok = student
    model.train()
    prompts = [format_prompt(QUESTION), format_prompt("What is 3 + 4?")]
    state = torch.get_rng_state()
    first = sample_completions(model, tok, prompts, **SAMPLING, seed=1)
    assert torch.equal(torch.get_rng_state(), state)  # the caller's random stream is untouched
    assert model.training
    assert [c.text for c in sample_completions(model, tok, prompts, **SAMPLING, seed=1)] == [c.text for c in first]
    others = [sample_completions(model, tok, prompts, **SAMPLING, seed=s) for s in range(2, 5)]
    assert any([c.text for c in o] != [c.text for c in first] for o in others)


def test_budget_is_cut_so_prompt_and_completion_fit_max_length(student):
    model, tok = student
    prompt = format_prompt(QUESTION)
    n_prompt = len(tok(prompt)["input_ids"])
    done = sample_completions(model, tok, [prompt], **{**SAMPLING, "max_new_tokens": 500,
                                                        "max_length": n_prompt + 5}, seed=0)
    assert done[0].tokens <= 5
    with pytest.raises(DataError, match="no room for a completion"):
        sample_completions(model, tok, [prompt], **{**SAMPLING, "max_length": n_prompt}, seed=0)


@pytest.mark.parametrize("tok_name", ["bpe", "bpe_alt"])
def test_a_canonical_completion_tokenizes_as_the_gold_text(tiny_world, tok_name):
    tok = load_tokenizer(tiny_world.tokenizers[tok_name])
    gold = tokenize_example(tok, {"question": QUESTION, "answer": "12 + 5 = 17.\n#### 17"})
    mine = tokenize_completion(tok, {"question": QUESTION, "answer": " 12 + 5 = 17.\n#### 17", "finished": True})
    for key in gold:
        assert torch.equal(gold[key], mine[key]), key


def test_the_student_reads_the_ids_it_sampled_not_its_text_retokenized(tiny_world):
    """A sample that splits its text one character per token (not the tokenizer's split), with a character
    sampled as two byte tokens: the student's row is its prompt's tokens then exactly those ids; each token
    ends at its own character, the first byte of "é" at none (it adds no character), yet it is a target."""
    tok = load_tokenizer(tiny_world.tokenizers["bpe"])
    text = " 12 + 5 = 17 é\n#### 17"
    per_char = [i for ch in text.replace("é", "") for i in tok.encode(ch, add_special_tokens=False)]
    at = text.index("é")
    ids = per_char[:at] + tok.convert_tokens_to_ids(["Ã", "©"]) + per_char[at:] + [tok.eos_token_id]
    assert tok.decode(ids, skip_special_tokens=True) == text and len(per_char) > len(tok.encode(text, add_special_tokens=False))
    rec = {"question": QUESTION, "answer": text, "finished": True, "ids": ids}
    enc = tokenize_completion(tok, rec, sampled=True)
    prompt = format_prompt(QUESTION)
    n_prompt = len(tok(prompt)["input_ids"])
    assert enc["input_ids"][n_prompt:].tolist() == ids and len(enc["input_ids"]) == n_prompt + len(ids)
    ends = enc["char_ends"][n_prompt:].tolist()
    chars = list(range(len(prompt), len(prompt) + len(text)))
    assert ends == [*chars[:at], -1, chars[at], *chars[at + 1:], -1]  # the first byte and EOS: no character
    seg = enc["segment_ids"][n_prompt:].tolist()
    answer = text.index("\n####")
    assert seg == [REASONING] * (answer + 1) + [ANSWER] * (len(text) - answer) + [ANSWER]  # "é" is 2 tokens; EOS
    assert (enc["labels"][n_prompt:] == enc["input_ids"][n_prompt:]).all()  # every sampled token is a target
    retok = tokenize_completion(tok, rec)  # a reader with the text alone tokenizes it its own way
    assert len(retok["input_ids"]) < len(enc["input_ids"])


def test_completion_without_marker_is_one_reasoning_segment(tiny_world):
    tok = load_tokenizer(tiny_world.tokenizers["bpe"])
    enc = tokenize_completion(tok, {"question": QUESTION, "answer": " 12 + 5 is 17", "finished": True})
    seg = enc["segment_ids"]
    assert ANSWER not in seg.tolist()
    n_prompt = len(tok(format_prompt(QUESTION))["input_ids"])
    assert (seg[:n_prompt] == PROMPT).all() and (seg[n_prompt:] == REASONING).all()
    assert tok.decode(enc["input_ids"][seg == REASONING]) == " 12 + 5 is 17" + tok.decode([tok.eos_token_id])
    assert (enc["labels"][:n_prompt] == -100).all() and (enc["labels"][n_prompt:] == enc["input_ids"][n_prompt:]).all()


def test_marker_splits_reasoning_from_answer(tiny_world):
    tok = load_tokenizer(tiny_world.tokenizers["bpe_alt"])
    enc = tokenize_completion(tok, {"question": QUESTION, "answer": " 5 + 12 = 17\n#### 17 apples", "finished": True})
    text = {s: tok.decode(enc["input_ids"][enc["segment_ids"] == s], skip_special_tokens=True)
            for s in (REASONING, ANSWER)}
    assert text == {REASONING: " 5 + 12 = 17", ANSWER: "\n#### 17 apples"}


def test_only_a_finished_completion_gets_eos_and_max_length_cuts(tiny_world):
    tok = load_tokenizer(tiny_world.tokenizers["bpe"])
    rec = {"question": QUESTION, "answer": " 12 + 5 = 17", "finished": False}
    assert tokenize_completion(tok, rec)["input_ids"][-1] != tok.eos_token_id  # it was cut, not stopped
    assert tokenize_completion(tok, {**rec, "finished": True})["input_ids"][-1] == tok.eos_token_id
    empty = tokenize_completion(tok, {**rec, "answer": "", "finished": True})
    assert empty["segment_ids"][-1] == REASONING and empty["labels"][-1] == tok.eos_token_id  # stopping at once
    n_prompt = len(tok(format_prompt(QUESTION))["input_ids"])
    cut = tokenize_completion(tok, {**rec, "finished": True}, max_length=n_prompt + 2)
    assert len(cut["input_ids"]) == n_prompt + 2 and cut["input_ids"][-1] != tok.eos_token_id


def test_every_reader_tokenizes_the_written_text_not_the_gold(tiny_world, student):
    model, tok = student
    alt = load_tokenizer(tiny_world.tokenizers["bpe_alt"])
    gold = [{"question": QUESTION, "answer": "GOLD rationale\n#### 17", "index": 7},
            {"question": "What is 3 + 4?", "answer": "GOLD\n#### 7", "index": 9}]
    written = write_completions(model, tok, gold, **SAMPLING, seed=0)
    batch = completion_batch(written, tok, {"alt": alt}, torch.zeros(2, dtype=torch.bool), max_length=160)
    assert batch["index"].tolist() == [7, 9] and not batch["labelled"].any()
    for i, r in enumerate(written):
        assert "GOLD" not in r["answer"]
        for t, enc in ((tok, batch), (alt, batch["teacher_inputs"]["alt"])):
            real = enc["attention_mask"][i].bool()
            text = t.decode(enc["input_ids"][i][real & (enc["segment_ids"][i] != PROMPT)], skip_special_tokens=True)
            assert text == r["answer"]
            assert (enc["segment_ids"][i][~real] == PAD).all()
