"""Math of the logit losses (`kvdistill.losses.logits`), against torch references."""

import pytest
import torch
import torch.nn.functional as F

from kvdistill.losses import logit_kd_sum, token_ce_sum
from kvdistill.losses.logits import generalized_jsd


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


def _trl_generalized_jsd(s_logits, t_logits, beta):
    """TRL's GKDTrainer.generalized_jsd_loss (trl/experimental/gkd), per position, as the reference."""
    s, t = s_logits.log_softmax(-1), t_logits.log_softmax(-1)
    if beta == 0:
        return F.kl_div(s, t, reduction="none", log_target=True).sum(-1)
    if beta == 1:
        return F.kl_div(t, s, reduction="none", log_target=True).sum(-1)
    b = torch.tensor(beta)
    m = torch.logsumexp(torch.stack([s + torch.log(1 - b), t + torch.log(b)]), 0)
    kl_t = F.kl_div(m, t, reduction="none", log_target=True)
    kl_s = F.kl_div(m, s, reduction="none", log_target=True)
    return (b * kl_t + (1 - b) * kl_s).sum(-1)


@pytest.mark.parametrize("beta", [0.0, 0.1, 0.5, 0.9, 1.0])
def test_generalized_jsd_equals_trl(beta):
    torch.manual_seed(0)
    s, t = torch.randn(4, 9) * 3, torch.randn(4, 9) * 3
    got = generalized_jsd(s.log_softmax(-1), t.log_softmax(-1), beta)
    torch.testing.assert_close(got, _trl_generalized_jsd(s, t, beta))
    assert (got >= -1e-6).all()
    # swapping student and teacher mirrors beta (symmetric at 0.5)
    torch.testing.assert_close(generalized_jsd(t.log_softmax(-1), s.log_softmax(-1), 1 - beta), got)


def test_logit_kd_jsd_beta_and_kind_check():
    torch.manual_seed(0)
    s, t, labels = torch.randn(2, 4, 5), torch.randn(2, 4, 5), torch.zeros(2, 4, dtype=torch.long)
    fwd = logit_kd_sum(s, t, labels, "forward_kl", 1.0)
    torch.testing.assert_close(logit_kd_sum(s, t, labels, "jsd", 1.0, beta=0.0), fwd)
    torch.testing.assert_close(logit_kd_sum(s, t, labels, "jsd", 1.0, beta=1.0),
                               logit_kd_sum(s, t, labels, "reverse_kl", 1.0))
    with pytest.raises(ValueError, match="beta"):
        logit_kd_sum(s, t, labels, "jsd", 1.0, beta=1.5)


def test_logit_kd_truncates_padded_vocab_to_the_tokenizer_size():
    """A shared tokenizer of 5 tokens, heads padded to 7 and 8 rows: the padding never enters."""
    torch.manual_seed(0)
    s, t, labels = torch.randn(2, 4, 7), torch.randn(2, 4, 8), torch.zeros(2, 4, dtype=torch.long)
    s[..., 5:], t[..., 5:] = 50.0, -50.0  # padded rows with large logits would dominate if kept
    ref = logit_kd_sum(s[..., :5], t[..., :5], labels, "forward_kl", 1.0)
    torch.testing.assert_close(logit_kd_sum(s, t, labels, "forward_kl", 1.0, vocab_size=5), ref)


@pytest.mark.parametrize("kind,beta", [("forward_kl", 0.0), ("reverse_kl", 1.0), ("jsd", 0.5)])
def test_logit_kd_sum_is_exact_to_1e6_on_long_rows(kind, beta):
    """At V 49,152 the fp32 KD sum is within 1e-6 of a float64 reference (log-probs as z - logsumexp z, TRL's
    arithmetic; torch's CPU log_softmax was ~4e-6 off here)."""
    g = torch.Generator().manual_seed(0)
    s, t = torch.randn(1, 17, 49_152, generator=g) * 4, torch.randn(1, 17, 49_152, generator=g) * 4
    labels = torch.zeros(1, 17, dtype=torch.long)
    ref = generalized_jsd(F.log_softmax(s[:, :-1].double(), -1), F.log_softmax(t[:, :-1].double(), -1), beta).sum()
    got = logit_kd_sum(s, t, labels, kind, 1.0, beta=beta)
    assert abs(float(got) - float(ref)) <= 1e-6 * float(ref)
