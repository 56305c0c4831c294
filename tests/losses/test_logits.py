"""Math of the logit losses (`kvdistill.losses.logits`), against torch references."""

import pytest
import torch
import torch.nn.functional as F

from kvdistill.losses import logit_kd_sum, token_ce_sum


def test_token_ce_sum_equals_cross_entropy_on_labelled_next_tokens():
    torch.manual_seed(0)
    logits, labels = torch.randn(2, 5, 7), torch.randint(0, 7, (2, 5))
    labels[0, :2] = -100
    keep = labels[:, 1:] != -100
    ref = F.cross_entropy(logits[:, :-1][keep], labels[:, 1:][keep], reduction="sum")
    torch.testing.assert_close(token_ce_sum(logits, labels), ref)


def test_unknown_logit_kd_kind_is_an_error():
    x = torch.zeros(1, 2, 3)
    with pytest.raises(ValueError, match="forward_kl"):
        logit_kd_sum(x, x, torch.zeros(1, 2, dtype=torch.long), "kl", 1.0)


@pytest.mark.parametrize("kind", ["forward_kl", "reverse_kl", "jsd"])
def test_logit_kd_sum_math(kind):
    torch.manual_seed(0)
    s, t = torch.randn(3, 6, 11), torch.randn(3, 6, 11)  # [B, T, V]
    labels = torch.randint(0, 11, (3, 6))
    labels[0, :3] = -100  # a prompt: not distilled
    assert float(logit_kd_sum(t, t, labels, kind, 2.0)) == pytest.approx(0.0, abs=1e-5)
    valid = labels[:, 1:] != -100
    ls, lt = s[:, :-1].log_softmax(-1)[valid], t[:, :-1].log_softmax(-1)[valid]  # [n, V]
    ref = {  # torch's kl_div(input=log q, target=log p) = KL(p || q)
        "forward_kl": F.kl_div(ls, lt, log_target=True, reduction="sum"),
        "reverse_kl": F.kl_div(lt, ls, log_target=True, reduction="sum"),
    }
    if kind in ref:
        torch.testing.assert_close(logit_kd_sum(s, t, labels, kind, 1.0), ref[kind])
    # per-sample weights: the weighted sum of the per-sample divergences
    w = torch.tensor([0.0, 0.25, 1.0])
    per_sample = torch.stack([logit_kd_sum(s[i : i + 1], t[i : i + 1], labels[i : i + 1], kind, 1.0) for i in range(3)])
    torch.testing.assert_close(logit_kd_sum(s, t, labels, kind, 1.0, w), (w * per_sample).sum())
