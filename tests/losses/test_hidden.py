"""Math of the CODI hidden-state loss (`kvdistill.losses.hidden`)."""

import torch
import torch.nn.functional as F

from kvdistill.cache import ANSWER, PAD, PROMPT, REASONING
from kvdistill.losses import answer_position, codi_sum


def test_answer_position_finds_the_first_answer_token():
    seg = torch.tensor([[PROMPT, REASONING, ANSWER, ANSWER], [PROMPT, REASONING, REASONING, PAD]])
    pos, has = answer_position(seg)
    assert pos.tolist()[0] == 2 and has.tolist() == [True, False]


def test_codi_sum_is_std_scaled_smooth_l1_weighted_per_sample():
    torch.manual_seed(0)
    s, t = torch.randn(3, 8, requires_grad=True), torch.randn(3, 8)
    w = torch.tensor([1.0, 0.0, 0.5])
    ref = sum(w[i] * F.smooth_l1_loss(s[i], t[i]) / t[i].std() for i in range(3))
    out = codi_sum(s, t, w)
    torch.testing.assert_close(out, ref)
    assert float(codi_sum(t, t, torch.ones(3))) == 0.0
    out.backward()
    assert s.grad[1].abs().sum() == 0 and s.grad[0].abs().sum() > 0  # weight 0: no gradient
