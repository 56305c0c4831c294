"""Options that each work alone but not together are refused in one line, before anything loads."""

import pytest

from kvdistill.config import ConfigError
from kvdistill.train.config import parse_config

ON_POLICY = {"lmbda": 1.0, "logit_kd_weight": 1.0, "logit_kd_kind": "jsd", "kv_weight": 0.0, "max_new_tokens": 12}


def test_on_policy_with_an_lm_loss_on_transfer_records_is_refused(base_args, tiny_world):
    """On-policy rows are unlabelled like transfer records: transfer_lm_weight would put an LM loss on the
    student's own samples (train/model.py: transfer_lm weighs every unlabelled row)."""
    transfer = {"transfer_data": str(tiny_world.data_dir), "transfer_lm_weight": 1.0}
    with pytest.raises(ConfigError, match=r"lmbda > 0 with transfer_lm_weight > 0 .* own samples"):
        parse_config(base_args(**ON_POLICY, **transfer))
    # each alone, and sequence-level KD (a teacher's text) with it, stand
    assert parse_config(base_args(**{**ON_POLICY, **transfer, "lmbda": 0.0, "seq_kd": "true"})).seq_kd
    assert parse_config(base_args(**{**ON_POLICY, **transfer, "lmbda": 0.0})).transfer_lm_weight == 1.0
    assert parse_config(base_args(**ON_POLICY)).transfer_lm_weight == 0.0
