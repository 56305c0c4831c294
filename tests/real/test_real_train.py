"""The real pair end to end: Gemma-3-270m teaches SmolLM2-135M-Instruct through K/V and cross-vocabulary logits.

Short sequences and a few steps on one fixed batch: the loss falls, the KV cosine rises, the console stays
one short line a step, training from a capture equals training from the live teacher, and the saved student
reloads and generates. Each run is seconds a step on one core.
"""

import json

import pytest
import torch

from kvdistill import cli
from kvdistill.models import load_model, load_tokenizer
from kvdistill.runs import METRICS

pytestmark = [pytest.mark.real, pytest.mark.slow]

RECORDS = [
    {"question": "Ann has 3 pens. She buys 4 more. How many pens?", "answer": "3 + 4 = 7.\n#### 7"},
    {"question": "Bo has 9 cups. He breaks 2. How many cups?", "answer": "9 - 2 = 7.\n#### 7"},
]


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("real_data")
    for split in ("train", "test"):
        (root / f"{split}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS))
    return root


def _argv(real_pair, data_dir, out, **kw) -> list[str]:
    args = {"student": real_pair["student"], "teachers": f"[{{path: {real_pair['teacher']}, name: gemma}}]",
            "data": str(data_dir), "output_dir": str(out), "max_length": 48, "max_steps": 6,
            "per_device_train_batch_size": 2, "learning_rate": 1e-4, "aligner_learning_rate": 3e-3,
            "kv_weight": 1.0, "kv_warmup_steps": 0, "logit_kd_weight": 0.5, "logging_steps": 1,
            "save_steps": 1000, "use_cpu": True, "seed": 0, "disable_tqdm": True, **kw}
    return ["train", *(x for k, v in args.items() for x in (f"--{k}", str(v)))]


def _rows(out) -> list[dict]:
    return [json.loads(x) for x in (out / METRICS).read_text().splitlines() if '"loss"' in x]


def test_real_pair_trains_reloads_and_generates(real_pair, data_dir, tmp_path, capsys):
    out = tmp_path / "run"
    assert cli.main(_argv(real_pair, data_dir, out)) == 0
    printed = capsys.readouterr()
    rows = _rows(out)
    assert len(rows) == 6
    assert rows[-1]["loss"] < rows[0]["loss"]  # one fixed batch: the student fits it
    assert rows[-1]["cos_sim/gemma"] > rows[0]["cos_sim/gemma"] + 0.05  # the projector learns the teacher's K/V
    assert any(k.startswith("cos_layer/gemma/") for k in rows[0])  # per-layer figures: in the file ...
    steps = [line for line in printed.out.splitlines() if line.startswith("step ")]
    assert len(steps) >= 6 and all(len(line) < 240 and "cos_layer" not in line for line in steps)  # ... not on screen
    # what each side reads and how the logits teach, said before the first step
    assert "cross-vocabulary logit KD" in printed.err and "tokens are in both vocabularies" in printed.err
    assert "teacher gemma reads prompt_template" in printed.out and "(it has no chat template)" not in printed.out

    student, tok = load_model(out, dtype="fp32"), load_tokenizer(out)
    ids = tok("Question: Ann has 3 pens. She buys 4 more. How many pens?\nAnswer:", return_tensors="pt")
    with torch.no_grad():
        gen = student.generate(**ids, max_new_tokens=8, do_sample=False, pad_token_id=tok.pad_token_id)
    assert gen.shape[1] > ids["input_ids"].shape[1] and tok.decode(gen[0, ids["input_ids"].shape[1]:]).strip()


# three CLI runs of the real pair (~38 s); capture = live is tested on the tiny families in tests/train/test_capture.py
@pytest.mark.extended
def test_real_pair_from_a_capture_equals_the_live_teacher(real_pair, data_dir, tmp_path, capsys):
    kw = {"max_steps": 2, "logit_kd_weight": 0}  # 262,144-wide logits would make the capture 1 MB a token
    live = tmp_path / "live"
    assert cli.main(_argv(real_pair, data_dir, live, **kw)) == 0
    captured = tmp_path / "captured"
    argv = _argv(real_pair, data_dir, captured, teacher_capture=str(tmp_path / "cap"), **kw)
    assert cli.main(["capture", *argv[1:]]) == 0
    assert cli.main(argv) == 0
    capsys.readouterr()
    a, b = _rows(live), _rows(captured)
    for key in ("loss", "kv_loss", "cos_sim/gemma"):
        torch.testing.assert_close([r[key] for r in b], [r[key] for r in a], rtol=1e-4, atol=1e-5)


def test_real_pair_on_policy(real_pair, data_dir, tmp_path, capsys):
    """lmbda 1: the student samples its own completion each step and both models read it."""
    out = tmp_path / "onpolicy"
    assert cli.main(_argv(real_pair, data_dir, out, max_steps=2, lmbda=1.0, max_new_tokens=8)) == 0
    capsys.readouterr()
    rows = _rows(out)
    assert len(rows) == 2 and all(r["on_policy"] == 1.0 for r in rows)
    assert all(torch.isfinite(torch.tensor([r["loss"], r["kv_loss"], r["logit_kd"]])).all() for r in rows)
