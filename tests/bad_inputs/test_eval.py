"""`kvdistill eval` refuses bad input in one line, and leaves no `items.jsonl` / `summary.json` behind.

Each case: `pytest.param(argv builder, substrings of the error line, id=...)`.
"""

from __future__ import annotations

import pytest
import torch

SUBPROCESS = pytest.mark.subprocess
NO_CUDA = pytest.mark.skipif(torch.cuda.is_available(), reason="the case is about a machine without CUDA")
LONG_QUESTION = "Tom has 3 apples and gives 1 away, then buys 2 more at the shop. " * 76  # > 1,300 tokens


def ev(c, model=None, **overrides) -> list:
    """`kvdistill eval` args: 2 questions of the world's test split, short generations, into `c.out`."""
    args = {"model": model or c.world.student, "data": c.world.data, "limit": 2, "max_new_tokens": 4,
            "output_dir": c.out, **overrides}
    return ["eval", *(x for k, v in args.items() if v is not None for x in (f"--{k}", v)), "--no_progress"]


CASES = [
    pytest.param(lambda c: ev(c, limit=0), ("--limit must be >= 1, got 0", "leave it out"), id="limit_0"),
    pytest.param(lambda c: ev(c, limit=-5), ("--limit must be >= 1, got -5", "leave it out"), id="limit_negative",
                 marks=SUBPROCESS),
    pytest.param(lambda c: ev(c, max_new_tokens=0), ("--max_new_tokens must be >= 1",), id="max_new_tokens_0"),
    pytest.param(lambda c: ["eval", "--data", c.world.data], ("no model", "pass --model"), id="no_model"),
    pytest.param(lambda c: ev(c, model=c.tmp / "no_such_model"), ("no such model directory", "save_pretrained"),
                 id="model_dir_missing"),
    pytest.param(lambda c: ev(c, model=c.file("model.safetensors", "weights")),
                 ("model.safetensors is a file, not a model directory", "config.json"), id="model_path_is_a_file"),
    pytest.param(lambda c: ev(c, model=c.model(drop=("tokenizer.json", "tokenizer_config.json"))),
                 ("student_copy holds no tokenizer", "save_pretrained"), id="model_without_tokenizer"),
    pytest.param(lambda c: ev(c, model=c.model(truncate="model.safetensors")),
                 ("its weights are damaged or incomplete", "save or copy the model again"),
                 id="model_truncated_safetensors"),
    pytest.param(lambda c: ev(c, model=c.model(truncate="tokenizer.json")),
                 ("could not load tokenizer", "JSONDecodeError", "check that it holds config.json, the tokenizer"),
                 id="model_truncated_tokenizer"),
    pytest.param(lambda c: ev(c, dtype="fp8"), ("unknown dtype 'fp8'", "choose one of"), id="unknown_dtype"),
    pytest.param(lambda c: ev(c, chat_template="maybe"), ("chat_template='maybe' is not one of",),
                 id="unknown_chat_template"),
    pytest.param(lambda c: ev(c, chat_template="on"), ("the tokenizer has no chat template", "use auto or off"),
                 id="chat_template_on_without_one"),
    pytest.param(lambda c: ev(c, split="validation"), ("no validation.jsonl", "write one"), id="split_missing"),
    pytest.param(lambda c: ev(c, data=c.data('{"question": "2+2?"', split="test")),
                 ("test.jsonl line 4 is not valid JSON", "fix or remove that line"), id="data_malformed_jsonl"),
    pytest.param(lambda c: ev(c, limit=None, data=c.data({"answer": "#### 4"}, split="test")),
                 ("test.jsonl line 4 has no 'question' value", "give every record one"),
                 id="data_record_without_question"),
    pytest.param(lambda c: ev(c, model=c.world.gpt2, limit=None,  # GPT-2 indexes past its position table
                              data=c.data({"question": LONG_QUESTION, "answer": "#### 4"}, split="test")),
                 ("question 3 of", "plus --max_new_tokens 4 is longer than the 512 positions",
                  "leave questions this long out of the data"), id="prompt_longer_than_the_model"),
    pytest.param(lambda c: ev(c, model=c.world.gpt2, limit=None, max_length=4096,
                              data=c.data({"question": "How many?", "answer": f"{LONG_QUESTION}\n#### 4"}, split="test")),
                 ("record 3 of", "with its answer, for the perplexity) is longer than the 512 positions",
                  "set --max_length <= 512, or pass --no_perplexity"), id="perplexity_example_longer_than_the_model"),
    pytest.param(lambda c: ev(c, output_dir=c.file("out", "a file")), ("output_dir", "is a file, not a directory"),
                 id="output_dir_is_a_file"),
    pytest.param(lambda c: ev(c), ("output_dir", "is not writable (File too large)", "free space"),
                 id="output_dir_full", marks=pytest.mark.subprocess(fsize_limit=4096)),
    pytest.param(lambda c: ev(c, device="cuda"), ("sees no CUDA GPU", "--device cpu"), id="device_without_cuda",
                 marks=NO_CUDA),
]


@pytest.mark.parametrize("argv, expect", CASES)
def test_eval_refuses(argv, expect, refused):
    refused(argv, expect)
