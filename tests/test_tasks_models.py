"""The regimes' tokenizers and models: whole-number tokens for 0..p-1, fields on the right tokens,
untied input and output embeddings."""

import pytest
import torch

from kvdistill.data import format_example, tokenize_example
from kvdistill.fields import IGNORE
from kvdistill.lab.tasks import binding, modular
from kvdistill.models import build_tokenizer, load_model, load_tokenizer, save_random_model
from kvdistill.tiny import tiny_configs

P = 59


@pytest.fixture(scope="module")
def modular_records():
    return modular.make_splits(n_dev=20, n_test=20, n_teacher_dev=5, p=P, other_task=False)


@pytest.mark.parametrize("vocab_size", [64, 400, 1000])  # below, at and above what the data merges alone
def test_every_number_below_p_is_one_token_wherever_it_stands(modular_records, vocab_size):
    texts = [format_example(r).text for r in modular_records["train"][:300]]
    tok = build_tokenizer(texts, vocab_size, numbers_whole=P)
    ids = {n: tok(str(n), add_special_tokens=False)["input_ids"] for n in range(P)}
    assert all(len(i) == 1 for i in ids.values()), {n: i for n, i in ids.items() if len(i) != 1}
    assert len({i[0] for i in ids.values()}) == P
    for rec in modular_records["test"][:10]:  # inside a question and after "#### ": the same token
        ex = tokenize_example(tok, rec)
        number = ex["field:number"]
        on = number != IGNORE
        assert on.sum() == len(rec["token_fields"]["number"])  # one token per number
        assert all(ex["input_ids"][i].item() == ids[int(number[i])][0] for i in on.nonzero().flatten())
        answer = int(rec["answer"].split()[-1])
        assert ex["input_ids"][-2].item() == ids[answer][0]  # the last token before EOS


def test_numbers_whole_knobs_are_checked():
    with pytest.raises(ValueError, match="exclude each other"):
        build_tokenizer(["1 2"], 300, split_digits=True, numbers_whole=10)
    with pytest.raises(ValueError, match=r"0\.\.100"):
        build_tokenizer(["1 2"], 300, numbers_whole=101)


def test_without_numbers_whole_a_small_vocab_splits_numbers():
    """The control of the test above: the plain BPE does not make these tokens by itself."""
    tok = build_tokenizer(["Question: 12+57=10. What is 3+4?"] * 3, 64)
    assert any(len(tok(str(n), add_special_tokens=False)["input_ids"]) > 1 for n in range(P))


@pytest.mark.parametrize("vocab_size", [300, 1000])
def test_binding_fields_land_on_the_name_tokens(vocab_size):
    recs = binding.generate_programs(40, seed=2)
    tok = build_tokenizer([format_example(r).text for r in recs], vocab_size)
    for rec in recs:
        ex = tokenize_example(tok, rec)
        on = ex["field:name"] != IGNORE
        assert int(on.sum()) == len(rec["token_fields"]["name"])
        names = [tok.decode(ex["input_ids"][i]).strip() for i in on.nonzero().flatten()]
        assert names == [rec["question"][s:e] for s, e, _ in rec["token_fields"]["name"]]
        assert ex["field:value"][on].tolist() == [v for _, _, v in rec["token_fields"]["value"]]
        assert (ex["field:chain"][~on] == IGNORE).all()


@pytest.mark.parametrize("tie", [True, False])
def test_untied_embeddings_are_two_tensors_that_train_apart(tie, tmp_path):
    tok = build_tokenizer(["Question: 1+2=3. What is 2+2?\nAnswer:\n#### 4"] * 3, 300, numbers_whole=10)
    cfg, _ = tiny_configs(len(tok), len(tok), tie_word_embeddings=tie)["student"]
    model = load_model(save_random_model(cfg, tok, tmp_path / "m"))
    emb_in, emb_out = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    assert model.config.tie_word_embeddings is tie and (emb_in is emb_out) is tie
    before = emb_in.detach().clone(), emb_out.detach().clone()
    # one step that trains the input side only: a tied output embedding moves with it, an untied one not
    opt = torch.optim.SGD([emb_in], lr=1.0)
    model(torch.tensor([[1, 5, 6, 7]]), labels=torch.tensor([[1, 5, 6, 7]])).loss.backward()
    opt.step()
    assert not torch.equal(emb_in, before[0])
    assert torch.equal(emb_out, before[1]) is not tie


def test_a_saved_qwen2_model_loads_its_whole_number_tokenizer_as_built(tmp_path):
    """AutoTokenizer would read a qwen2 directory with Qwen2Tokenizer, whose pre-tokenizer splits digits."""
    tok = build_tokenizer(["Question: 12+57=10. What is 3+4?"] * 3, 300, numbers_whole=P)
    cfg, _ = tiny_configs(len(tok), len(tok))["student"]
    assert cfg.model_type == "qwen2"
    loaded = load_tokenizer(save_random_model(cfg, tok, tmp_path / "m"))
    assert loaded.tokenize("22+57=20") == ["22", "+", "57", "=", "20"]


def test_word_level_makes_each_binding_line_one_token_carrying_its_names_value():
    recs = binding.generate_programs(60, seed=4, depth=1)
    tok = build_tokenizer([format_example(r).text for r in recs], 1000, word_level=True)
    for rec in recs[:20]:
        ex = tokenize_example(tok, rec)
        words = tok.convert_ids_to_tokens(ex["input_ids"][:-1])  # but the EOS
        *lines, _, _, query = rec["question"].split()  # ..., "What", "is", "m?"
        assert words == ["Question:", *lines, "What", "is", query, "Answer:", "####", rec["answer"][-1]]
        resolved = {n: root for root, names in binding.chains_of(rec["question"]) for n in names}
        on = (ex["field:name"] != IGNORE).nonzero().flatten()
        assert [words[i] for i in on] == [*lines, query]  # every line and the query: one row each
        # a line token carries its name's value (a link's two names resolve alike), the query its own
        assert [int(ex["field:value"][i]) for i in on] == [resolved[w[0]] for w in [*lines, query]]
    assert tok.decode(tok("#### 7", add_special_tokens=False)["input_ids"]) == "#### 7"
    with pytest.raises(ValueError, match="word_level excludes"):
        build_tokenizer(["a b"], 100, word_level=True, numbers_whole=10)


def test_compose_lines_sums_a_name_vector_and_a_value_vector():
    tok = build_tokenizer(["a=b. c=d. a=d. c=b. a=3. q?"], 100, word_level=True)
    vocab = tok.get_vocab()
    emb = torch.randn(len(tok), 16)
    before = emb.clone()
    binding.compose_lines(emb, vocab)
    e = {w: emb[i] for w, i in vocab.items()}
    # additive in the two parts: a=b + c=d == a=d + c=b, and a=b - a=d == c=b - c=d (the value's direction)
    assert torch.allclose(e["a=b."] + e["c=d."], e["a=d."] + e["c=b."], atol=1e-6)
    assert not torch.allclose(e["a=b."], e["a=d."])
    lines = [vocab[w] for w in ("a=b.", "c=d.", "a=d.", "c=b.", "a=3.")]
    others = [i for i in range(len(tok)) if i not in lines]
    assert torch.equal(emb[others], before[others])  # only the line tokens are set
    with pytest.raises(ValueError, match="no line tokens"):
        binding.compose_lines(emb, {"a": 0, "b": 1})
