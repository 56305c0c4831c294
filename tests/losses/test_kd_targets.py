"""The positions logit KD reads (`kd_targets`, option `logit_kd_rows`), and the KD sum over them by hand."""

import pytest
import torch
import torch.nn.functional as F

from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING
from kvdistill.fields import IGNORE
from kvdistill.losses import LABELLED, kd_targets, logit_kd_sum

P, R, A = PROMPT, REASONING, ANSWER
# row 0 right-padded, row 1 full, row 2 left-padded (its first real token follows a pad: nobody predicts it)
SEG = torch.tensor([[P, P, R, A, A, PAD], [P, P, P, R, A, A], [PAD, PAD, P, R, A, A]])
MASK = (SEG != PAD).long()  # [B, T]
IDS = torch.arange(18).reshape(3, 6) + 10  # [B, T] token ids, each its own
LABELS = IDS.masked_fill((SEG == P) | (SEG == PAD), -100)  # as tokenize_example labels them
NAME = torch.tensor([[1, 0, IGNORE, 1, 0, IGNORE], [0, 1, 1, IGNORE, 0, 1], [1, 1, 0, 1, IGNORE, 1]])


def _targets(rows: str) -> list[list[int]]:
    """Which tokens are targets: 1 where kd_targets keeps the token id, 0 where it is -100 (nothing else)."""
    out = kd_targets(rows, IDS, LABELS, MASK, SEG, {"name": NAME})
    assert ((out == IDS) | (out == -100)).all()
    return (out != -100).long().tolist()


def test_labels_are_the_labels_themselves():
    """The default hands `labels` on as it is: the loss reads the very tensor it read before the option."""
    assert kd_targets(LABELLED, IDS, LABELS, MASK, SEG) is LABELS


@pytest.mark.parametrize("rows,expected", [
    # every real token but the first one of its row (no position predicts it)
    ("all", [[0, 1, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 1, 1, 1]]),
    # a selection names the rows whose own distribution is distilled: the token after each is the target
    # (a row whose next token is padding, or the last, has none)
    ("answer", [[0, 0, 0, 0, 1, 0], [0, 0, 0, 0, 0, 1], [0, 0, 0, 0, 0, 1]]),
    ("prompt,reasoning", [[0, 1, 1, 1, 0, 0], [0, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0]]),
    # the binding configs' rows (evidence_binding.yaml relation_rows): field > 0, IGNORE never
    ("field:name", [[0, 1, 0, 0, 1, 0], [0, 0, 1, 1, 0, 0], [0, 0, 0, 0, 1, 0]]),
])
def test_row_selections_by_hand(rows, expected):
    assert _targets(rows) == expected


def test_a_missing_field_names_the_option():
    with pytest.raises(ValueError, match="logit_kd_rows field:other: the batch has no token field"):
        kd_targets("field:other", IDS, LABELS, MASK, SEG, {"name": NAME})


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl"])
def test_all_rows_is_the_mean_over_every_position_with_a_next_token(kind):
    """`all`: the sum over positions t of each row whose token t + 1 is real, of D(teacher_t || student_t)."""
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(3, 6, 9, generator=g), torch.randn(3, 6, 9, generator=g)  # [B, T, V]
    targets = kd_targets("all", IDS, LABELS, MASK, SEG)
    total = logit_kd_sum(s, t, targets, kind, 1.0)
    count = (targets[:, 1:] != -100).sum()
    # by hand: the real positions 0..n-2 of each row predict its real tokens 1..n-1
    positions = [(b, i) for b in range(3) for i in range(6) if MASK[b, i] and i + 1 < 6 and MASK[b, i + 1]]
    assert len(positions) == int(count) == 4 + 5 + 3
    ls = torch.stack([s[b, i].log_softmax(-1) for b, i in positions])  # [n, V]
    lt = torch.stack([t[b, i].log_softmax(-1) for b, i in positions])
    # F.kl_div(input=log q, target=log p) = KL(p || q): forward KL(t || s), reverse KL(s || t)
    per = F.kl_div(ls, lt, log_target=True, reduction="none") if kind == "forward_kl" else \
        F.kl_div(lt, ls, log_target=True, reduction="none")
    torch.testing.assert_close(total / count, per.sum(-1).mean())
