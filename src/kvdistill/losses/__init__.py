"""Every loss term of kvdistill, on plain tensors; the training model only weights and sums them.

| module | terms |
|---|---|
| `kv` | projected KV matching: mse, smooth_l1, cosine, mercator, hybrid, structural (`KVLoss`) |
| `relation` | MiniLMv2-style self-relation KL over time, no projector (`RelationKVLoss`) |
| `attention` | attention-map KL: the teacher's softmax(Q Kᵀ/√d) matched by the student's (`AttentionMapLoss`) |
| `logits` | the student's LM cross-entropy, logit KD (forward/reverse KL, generalized JSD), the positions it reads (`kd_targets`) |
| `chunked` | CE + logit KD (any vocabulary) from hidden states a chunk of tokens at a time (`chunked_head_loss`) |
| `cross_vocab` | logit KD across tokenizers: shared boundaries, shared tokens, ULD sorted probabilities |
| `hidden` | CODI hidden-state alignment at the answer marker |
"""

from kvdistill.losses.attention import AttentionMapLoss, aligned_attention_loss
from kvdistill.losses.chunked import KDTeacher, chunked_head_loss, resolve_chunk_tokens
from kvdistill.losses.cross_vocab import (
    cross_vocab_div,
    cross_vocab_kd_sum,
    shared_boundaries,
    vocab_intersection,
)
from kvdistill.losses.hidden import answer_position, codi_sum
from kvdistill.losses.kv import LOSSES, KVLoss, aligned_kv_loss, build_kv_loss
from kvdistill.losses.logits import (
    LABELLED,
    LOGIT_KD_KINDS,
    generalized_jsd,
    kd_targets,
    logit_kd_sum,
    token_ce_sum,
)
from kvdistill.losses.relation import RelationKVLoss

__all__ = [
    "LABELLED",
    "LOGIT_KD_KINDS",
    "LOSSES",
    "AttentionMapLoss",
    "KDTeacher",
    "KVLoss",
    "RelationKVLoss",
    "aligned_attention_loss",
    "aligned_kv_loss",
    "answer_position",
    "build_kv_loss",
    "chunked_head_loss",
    "codi_sum",
    "cross_vocab_div",
    "cross_vocab_kd_sum",
    "generalized_jsd",
    "kd_targets",
    "logit_kd_sum",
    "resolve_chunk_tokens",
    "shared_boundaries",
    "token_ce_sum",
    "vocab_intersection",
]
