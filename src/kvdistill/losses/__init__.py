"""Every loss term of kvdistill, on plain tensors; the training model only weights and sums them.

| module | terms |
|---|---|
| `kv` | projected KV matching: mse, smooth_l1, cosine, mercator, hybrid, structural (`KVLoss`) |
| `relation` | MiniLMv2-style self-relation KL over time, no projector (`RelationKVLoss`) |
| `logits` | the student's LM cross-entropy, logit KD (forward/reverse KL, generalized JSD) |
| `chunked` | CE + logit KD from hidden states a chunk of tokens at a time (`chunked_head_loss`) |
| `hidden` | CODI hidden-state alignment at the answer marker |
"""

from kvdistill.losses.chunked import chunked_head_loss, resolve_chunk_tokens
from kvdistill.losses.hidden import answer_position, codi_sum
from kvdistill.losses.kv import LOSSES, KVLoss, aligned_kv_loss, build_kv_loss
from kvdistill.losses.logits import LOGIT_KD_KINDS, generalized_jsd, logit_kd_sum, token_ce_sum
from kvdistill.losses.relation import RelationKVLoss

__all__ = [
    "LOGIT_KD_KINDS",
    "LOSSES",
    "KVLoss",
    "RelationKVLoss",
    "aligned_kv_loss",
    "answer_position",
    "build_kv_loss",
    "chunked_head_loss",
    "codi_sum",
    "generalized_jsd",
    "logit_kd_sum",
    "resolve_chunk_tokens",
    "token_ce_sum",
]
