"""Scoring (`kvdistill.evaluate.scoring`): accuracy identities with fake models, real tiny models for the plumbing."""

import json
import math

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from kvdistill.data import format_prompt, load_records, pad_batch, tokenize_example
from kvdistill.evaluate.answers import gold_answer
from kvdistill.evaluate.scoring import (
    StopOnStrings,
    answer_context,
    default_stop_strings,
    evaluate_model,
    generate_completions,
    gold_answer_nll,
    read_items,
    reference_perplexity,
    score_completions,
    truncate_at_stop,
    use_chat,
    write_results,
)
from kvdistill.models import load_model, load_tokenizer


class FakeModel(torch.nn.Module):
    """A 'model' whose greedy completion of a question is `answer_fn(question)`.

    It decodes each left-padded prompt, finds the question, and returns the prompt ids followed
    by the answer's token ids and EOS, right-padded like HF `generate` output.
    """

    def __init__(self, tokenizer, answer_fn):
        super().__init__()
        self.tokenizer, self.answer_fn = tokenizer, answer_fn
        self.calls: list[torch.Tensor] = []

    def generate(self, input_ids, attention_mask, max_new_tokens, pad_token_id, **kwargs):
        self.calls.append(attention_mask.clone())
        rows = []
        for ids, mask in zip(input_ids, attention_mask):
            prompt = self.tokenizer.decode(ids[mask.bool()], skip_special_tokens=True)
            question = prompt.split("Question: ", 1)[1].rsplit("\nAnswer:", 1)[0]
            new = self.tokenizer(" " + self.answer_fn(question), add_special_tokens=False)["input_ids"]
            rows.append([*new[:max_new_tokens], self.tokenizer.eos_token_id])
        width = max(len(r) for r in rows)
        new = torch.tensor([r + [pad_token_id] * (width - len(r)) for r in rows])
        return torch.cat([input_ids, new], dim=1)


@pytest.fixture(scope="module")
def tok(tiny_world):
    return load_tokenizer(tiny_world.models["student"])


@pytest.fixture(scope="module")
def records(tiny_world):
    return load_records(tiny_world.data_dir, split="test", limit=12)


def test_echo_gold_model_scores_one(tok, records):
    by_question = {r["question"]: r["answer"] for r in records}
    model = FakeModel(tok, lambda q: by_question[q])
    out = evaluate_model(
        model, tok, records, batch_size=5, max_new_tokens=200, perplexity=False, progress=False
    )
    assert out["accuracy"] == 1.0
    assert (out["n"], out["n_correct"], out["n_no_answer"]) == (12, 12, 0)
    assert out["ci_high"] == 1.0 and out["ci_low"] < 1.0
    assert [it["gold"] for it in out["items"]] == [gold_answer(r["answer"]) for r in records]
    assert all(it["extracted"] == it["gold"] and it["correct"] for it in out["items"])
    assert set(out["items"][0]) == {"index", "question", "gold", "prediction", "extracted", "correct"}
    # left padding: in every batch the real tokens end in the last column
    assert all(bool(m[:, -1].all()) for m in model.calls)
    assert tok.padding_side == "right"  # restored


def test_zero_model_scores_rate_of_zero_golds(tok):
    golds = [0, 5, 0, 12, 0, 7, 3, 0]
    recs = [
        {"question": f"Sam has {g} coins and item {i}. How many?", "answer": f"He has {g}.\n#### {g}"}
        for i, g in enumerate(golds)
    ]
    # a run-on completion: the second question's answer must be cut off by the stop string
    model = FakeModel(tok, lambda q: "so #### 0\nQuestion: next one\nAnswer: 5\n#### 5")
    out = evaluate_model(model, tok, recs, batch_size=3, max_new_tokens=200, perplexity=False, progress=False)
    assert out["accuracy"] == pytest.approx(golds.count(0) / len(golds))
    assert all("Question" not in it["prediction"] for it in out["items"])
    assert out["stop_strings"] == ["\nQuestion:"]


def test_score_completions_and_files(tmp_path, records):
    items, summary = score_completions(records[:3], ["#### 1", "nothing", records[2]["answer"]])
    assert summary["n"] == 3 and summary["n_no_answer"] == 1
    assert items[2]["correct"]
    write_results({**summary, "items": items}, tmp_path)
    assert read_items(tmp_path) == items
    assert json.loads((tmp_path / "summary.json").read_text())["n"] == 3
    with pytest.raises(ValueError):
        score_completions(records[:2], ["a"])


def test_stop_strings_helpers(tok):
    assert default_stop_strings("Question: {question}\nAnswer:") == ["\nQuestion:"]
    assert default_stop_strings("{question}\n=>") == []
    assert truncate_at_stop("a #### 3\nQuestion: b\nQ: c", ["\nQ:", "\nQuestion:"]) == "a #### 3"
    ids = tok(["Answer: 4\nQuestion: x", "Answer: 4 and"], return_tensors="pt", padding=True)["input_ids"]
    done = StopOnStrings(tok, ["\nQuestion:"], prompt_len=1)(ids, None)
    assert done.tolist() == [True, False]


def test_batched_generation_matches_unbatched(tiny_world, tok, records):
    model = load_model(tiny_world.models["student"], dtype="fp32")
    prompts = [format_prompt(r["question"]) for r in records[:5]]
    one = generate_completions(model, tok, prompts, batch_size=1, max_new_tokens=8, progress=False)
    many = generate_completions(model, tok, prompts, batch_size=5, max_new_tokens=8, progress=False)
    assert one == many


def test_reference_perplexity_matches_per_example_ce(tiny_world, tok, records):
    model = load_model(tiny_world.models["qwen2_teacher"], dtype="fp32")
    recs = records[:3]
    got = reference_perplexity(model, tok, recs, batch_size=3)
    nll, count = 0.0, 0
    for r in recs:  # unpadded, one at a time, with HF's own label shifting
        b = pad_batch([tokenize_example(tok, r)], tok.pad_token_id)
        with torch.no_grad():
            loss = model(input_ids=b["input_ids"], labels=b["labels"]).loss
        n = int((b["labels"][:, 1:] != -100).sum())
        nll, count = nll + float(loss) * n, count + n
    assert got["tokens"] == count
    assert got["perplexity"] == pytest.approx(math.exp(nll / count), rel=1e-4)


def test_chat_template_modes(tiny_world):
    tok = load_tokenizer(tiny_world.models["student"])
    assert not use_chat(tok, "auto")
    with pytest.raises(ValueError):
        use_chat(tok, "on")
    tok.chat_template = "{% for m in messages %}<s>{{ m['content'] }}</s>{% endfor %}{% if add_generation_prompt %}A:{% endif %}"
    assert use_chat(tok, "auto") and not use_chat(tok, "off")
    model = FakeModel(tok, lambda q: "#### 1")
    model.generate = lambda input_ids, attention_mask, **kw: torch.cat(  # echo "#### 1" after the prompt
        [
            input_ids,
            tok(" #### 1", add_special_tokens=False, return_tensors="pt")["input_ids"].repeat(
                len(input_ids), 1
            ),
        ],
        1,
    )
    recs = [{"question": "q", "answer": "#### 1"}]
    out = evaluate_model(model, tok, recs, perplexity=False, progress=False)
    assert out["chat_template"] is True and out["accuracy"] == 1.0


def test_saved_student_loads_like_lm_eval_hf(tiny_world):
    """lm-eval's `--model hf --model_args pretrained=DIR` loads with the Auto classes; so must we."""
    path = tiny_world.models["student"]
    model = AutoModelForCausalLM.from_pretrained(path)
    tok = AutoTokenizer.from_pretrained(path)
    ids = tok("Question: 1 + 1?\nAnswer:", return_tensors="pt")["input_ids"]
    assert model(ids).logits.shape[:2] == ids.shape


# ----------------------------------------------------------------------------- answer NLL


def test_answer_context_is_the_training_format():
    p = "Question: q\nAnswer:"
    assert answer_context(p, " 3 + 4 = 7.\n#### 7\n#### 9") == p + " 3 + 4 = 7.\n#### "  # own rationale, cut at ####
    assert answer_context(p, " so it is 7") == p + " so it is 7\n#### "  # no marker: all rationale
    assert answer_context(p, " #### 7") == p + "\n#### "  # no rationale: as format_example writes "#### n"
    assert answer_context(p, "") == p + "\n#### "


@pytest.mark.parametrize("name", ["qwen2_teacher", "gpt2"])  # RoPE and learned absolute positions
def test_answer_nll_equals_hand_summed_log_probs(tiny_world, tok, name):
    """One left-padded batch of four lengths == per text, unpadded: -sum log p(answer token | prefix) from
    the model's own logits, the answer tokens found by growing the decoded prefix past the context."""
    model = load_model(tiny_world.models[name], dtype="fp32")
    contexts = ["Question: 2 + 2?\nAnswer:\n#### ", "Question: Tom has 12 apples and eats 5.\nAnswer: 12 - 5 = 7\n#### ",
                "Q: x\n#### ", "Q: fruit?\n#### "]
    answers = ["4", "7", "1,250", "apples"]  # " a" is one token across the boundary: it counts
    got = gold_answer_nll(model, tok, contexts, answers, batch_size=4)
    for (nll, n), c, a in zip(got, contexts, answers):
        ids = tok(c + a)["input_ids"]
        # first token whose prefix decodes past the context: it holds an answer character
        first = next(i for i in range(len(ids)) if len(tok.decode(ids[: i + 1])) > len(c))
        with torch.no_grad():
            logp = torch.log_softmax(model(torch.tensor([ids])).logits[0].double(), -1)  # [T, V]
        hand = -sum(float(logp[t - 1, ids[t]]) for t in range(first, len(ids)))
        assert n == len(ids) - first and n >= 1
        assert nll == pytest.approx(hand, rel=1e-4)
    (alone, _), = gold_answer_nll(model, tok, contexts[:1], answers[:1])  # unbatched: no padding
    assert alone == pytest.approx(got[0][0], rel=1e-5)
    with pytest.raises(ValueError):
        gold_answer_nll(model, tok, contexts, answers[:2])


def test_evaluate_model_writes_per_item_answer_nll(tiny_world, tok, records):
    model = load_model(tiny_world.models["qwen2_teacher"], dtype="fp32")
    recs = records[:4]
    out = evaluate_model(model, tok, recs, batch_size=2, max_new_tokens=6, perplexity=False, answer_nll=True,
                         progress=False)
    prompts = [format_prompt(r["question"]) for r in recs]
    want = gold_answer_nll(model, tok, [answer_context(p, it["prediction"]) for p, it in zip(prompts, out["items"])],
                           [r["answer"].rsplit("####", 1)[1].strip() for r in recs])
    assert [it["answer_tokens"] for it in out["items"]] == [n for _, n in want]
    assert [it["answer_nll"] for it in out["items"]] == pytest.approx([v for v, _ in want], rel=1e-5)
    assert out["answer_nll"] == pytest.approx(sum(n for n, _ in want) / 4)
    off = evaluate_model(model, tok, recs, batch_size=2, max_new_tokens=6, perplexity=False, progress=False)
    assert off["answer_nll"] is None and "answer_nll" not in off["items"][0]


def test_answer_nll_refuses_a_slow_tokenizer_before_generating(tok, records):
    from kvdistill.data import DataError

    class Slow:  # a tokenizer without character offsets
        is_fast = False

    model = FakeModel(tok, lambda q: pytest.fail("generated before the refusal"))
    with pytest.raises(DataError, match="slow tokenizer: the answer NLL needs character offsets"):
        evaluate_model(model, Slow(), records[:1], answer_nll=True, perplexity=False, progress=False)


def test_answer_nll_of_a_model_without_logits_to_keep(tiny_world, tok):
    """A forward without `logits_to_keep` (older or remote-code models) gets all logits, same numbers."""
    inner = load_model(tiny_world.models["gpt2"], dtype="fp32")

    class Plain(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def forward(self, input_ids, attention_mask, position_ids):
            return inner(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids)

    contexts, answers = ["Q: 2 + 2?\n#### ", "Question: Tom has 12 apples.\nAnswer: 12\n#### "], ["4", "1,250"]
    got = gold_answer_nll(Plain(), tok, contexts, answers)
    want = gold_answer_nll(inner, tok, contexts, answers)
    assert [n for _, n in got] == [n for _, n in want]
    assert [v for v, _ in got] == pytest.approx([v for v, _ in want], rel=1e-5)
