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
    default_stop_strings,
    evaluate_model,
    generate_completions,
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
