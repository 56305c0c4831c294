"""On-policy distillation (GKD, Agarwal et al. 2024): the student is taught on text it wrote itself.

On an on-policy step the student samples one completion per prompt of the batch (HF `generate`
under no_grad, KV cache on, left padding, `scoring.generate_batch`); the student reads the ids it
sampled, and each completion is decoded to text and tokenized for every teacher with its own
tokenizer and prompt format, so every teacher scores exactly the text the student wrote and the time
aligner maps one tokenization onto another by character offsets, as for the gold text.

What a generated completion becomes:
- it ends at its first EOS id; a row that reached the token budget (`max_new_tokens`, or what
  `max_length` leaves after the prompt) is cut there. Padding `generate` put after the end, and
  special tokens sampled inside the text (a pad id that is not EOS), are not part of the text.
- a finished completion gets its EOS token back (the student is taught when to stop, as on gold
  text); a cut one does not (it did not stop there).
- segments: text before the last `####` is reasoning, the marker and what follows the answer. A
  completion without a marker is all reasoning: nothing in it is known to be the final answer, so
  answer-only terms (answer segment weights, CODI's answer position) skip that sample rather than
  read an unfinished rationale as an answer.
- the student reads the ids it sampled (its prompt's tokens, then its completion's, its EOS among
  them), not its text re-tokenized: a sample may split a text in a way the tokenizer would not (a
  small model's often do), and on-policy learning is on what the policy produced. Each token's last
  character comes from decoding the ids up to it (`sampled_tokens`). A teacher with another
  tokenizer reads the text in its own tokens, as for the gold text.
- prompt tokens are labelled -100 (no loss); every reader is cut at `max_length` tokens.

Sampling is seeded per (seed, optimizer step, rank, micro-batch) (`sampling_seed`): a resumed
run samples the same completions, and data-parallel ranks sample different ones.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import Tensor

from kvdistill.cache import PROMPT, REASONING
from kvdistill.data import (
    ANSWER_MARKER,
    DEFAULT_TEMPLATE,
    NO_CHAR,
    DataError,
    Formatted,
    end_segments,
    format_prompt,
    pad_batch,
    shared_chars,
    token_segments,
)
from kvdistill.evaluate.scoring import eos_token_ids, generate_batch
from kvdistill.models import model_device


def sampling_seed(seed: int, step: int, rank: int, micro_batch: int = 0) -> int:
    """The seed of one micro-batch's sampling, in [0, 2**63): equal arguments sample equal
    completions (a resumed run replays them), another step, rank or micro-batch samples others."""
    digest = hashlib.blake2b(f"{seed}:{step}:{rank}:{micro_batch}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


def on_policy_step(seed: int, step: int, lmbda: float) -> bool:
    """Whether optimizer step `step` learns on the student's own samples (probability `lmbda`).

    Drawn from (seed, step) alone: every rank, and a resumed run, draws the same for a step.
    """
    if lmbda <= 0 or lmbda >= 1:
        return lmbda >= 1
    g = torch.Generator().manual_seed(sampling_seed(seed, step, rank=-1))
    return bool(torch.rand((), generator=g) < lmbda)


def split_generated(new: Tensor, eos_ids: Sequence[int]) -> tuple[Tensor, Tensor]:
    """Where each generated row ends: `(lengths [B], finished [B])`.

    Args:
        new: `[B, T_new]` generated ids (prompt excluded); after a row's first EOS id `generate`
            fills in padding.
        eos_ids: the ids that end a generation.

    Returns:
        lengths: tokens before the first EOS (`T_new` when there is none); finished: it had one.
    """
    is_eos = torch.isin(new, torch.tensor(list(eos_ids), dtype=new.dtype, device=new.device))  # [B, T_new]
    finished = is_eos.any(1)
    lengths = torch.where(finished, is_eos.int().argmax(1), new.shape[1])  # argmax: the first True
    return lengths, finished


@dataclass
class Completion:
    """One generated completion: its text (special tokens dropped), whether it ended with EOS, how
    many tokens were generated before the end, and the sampled ids (its EOS last when finished)."""

    text: str
    finished: bool
    tokens: int
    ids: tuple[int, ...] = ()


@torch.no_grad()
def sample_completions(
    model: Any,
    tokenizer: Any,
    prompts: Sequence[str],
    *,
    temperature: float,
    top_p: float,
    max_new_tokens: int,
    seed: int,
    max_length: int,
    add_special_tokens: bool = True,
) -> list[Completion]:
    """Sample one completion per prompt, in one left-padded batch, seeded by `seed`.

    The global RNG is forked (the caller's random state is untouched) and the model is in eval mode
    while it samples (dropout would sample from another policy than the one being trained). The
    budget is `max_new_tokens`, lowered so the longest prompt plus its completion fits `max_length`.
    `top_k` is off (TRL's GKD setting): only `temperature` and `top_p` shape the distribution.
    """
    prompt_len = max(len(ids) for ids in tokenizer(list(prompts), add_special_tokens=add_special_tokens)["input_ids"])
    budget = min(max_new_tokens, max_length - prompt_len)
    if budget < 1:
        raise DataError(f"a prompt of {prompt_len} tokens leaves no room for a completion under max_length "
                        f"{max_length}; raise max_length or shorten the prompts")
    device = model_device(model)
    was_training = model.training
    model.eval()
    try:
        with torch.random.fork_rng(devices=[device] if device.type != "cpu" else [], device_type=device.type):
            torch.manual_seed(seed)
            new = generate_batch(model, tokenizer, prompts, max_new_tokens=budget,
                                 add_special_tokens=add_special_tokens, do_sample=True, temperature=temperature,
                                 top_p=top_p, top_k=0, use_cache=True)  # [B, T_new]
    finally:
        model.train(was_training)
    lengths, finished = split_generated(new, eos_token_ids(model, tokenizer))
    rows = [ids[: n + f] for ids, n, f in zip(new.tolist(), lengths.tolist(), finished.tolist())]  # EOS kept
    texts = tokenizer.batch_decode(rows, skip_special_tokens=True)
    return [Completion(t, bool(f), n, tuple(r)) for t, f, n, r in zip(texts, finished.tolist(), lengths.tolist(), rows)]


def write_completions(
    model: Any,
    tokenizer: Any,
    records: Sequence[Mapping[str, Any]],
    *,
    template: str = DEFAULT_TEMPLATE,
    use_chat_template: bool = False,
    **sampling: Any,
) -> list[dict]:
    """`records` with each `answer` replaced by a completion `model` samples for its question.

    Prompts are formatted for `model`'s own tokenizer (chat template included when asked), as in
    training. A returned record is `{"question", "answer": completion text, "finished", "index", "ids":
    the sampled ids in `tokenizer`'s vocabulary}` (other fields of the record, such as a teacher's own
    rationale, do not describe this text and are dropped). `sampling`: `sample_completions`'s keywords.
    """
    chat = use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    prompts = [format_prompt(str(r["question"]), template, tokenizer if chat else None) for r in records]
    done = sample_completions(model, tokenizer, prompts, add_special_tokens=not chat, **sampling)
    return [{"question": r["question"], "answer": c.text, "finished": c.finished, "index": r.get("index", i),
             "ids": list(c.ids)} for i, (r, c) in enumerate(zip(records, done))]


def completion_segments(prompt: str, completion: str) -> Formatted:
    """The prompt + completion text and its segment spans: reasoning up to the last `####`
    (trailing whitespace before the marker goes to the answer, as in `data.format_example`), the
    answer from there; no marker: all reasoning."""
    marker = completion.rfind(ANSWER_MARKER)
    reasoning = completion[:marker].rstrip() if marker >= 0 else completion
    return Formatted(prompt + completion, len(prompt), len(prompt) + len(reasoning))


def sampled_tokens(tokenizer: Any, f: Formatted, sampled: Sequence[int], chat: bool) -> tuple[list[int], Tensor, Tensor]:
    """The prompt's tokens, then the `sampled` ids (`f.text[f.prompt_end:]` is them decoded):
    `(ids, ends [T], seg [T])`, each token's last character in `f.text` and its segment.

    A sampled token's end is where the decoding of the ids up to it ends. One that adds no character
    of its own (a special token, or the first bytes of a character that a later token completes, which
    decode to U+FFFD) gets `NO_CHAR`, as a special token does in `token_segments`, and the segment of
    the character that follows it: it was sampled, so it is a target like the rest of the completion.
    """
    enc = tokenizer(f.text[: f.prompt_end], return_offsets_mapping=True, add_special_tokens=not chat)
    ends = [e - 1 if e > s else NO_CHAR for s, e in enc["offset_mapping"]]
    pieces = tokenizer.batch_decode([sampled[: k + 1] for k in range(len(sampled))], skip_special_tokens=True)
    last, own = f.prompt_end - 1, []
    for piece in pieces:
        end = min(f.prompt_end + len(piece), len(f.text)) - 1
        own.append(end if end > last and not piece.endswith("\ufffd") else NO_CHAR)
        last = max(last, own[-1])
    follows, nxt = [], len(f.text) - 1 if len(f.text) > f.prompt_end else NO_CHAR  # the next character's end
    for e in reversed(own):
        nxt = e if e >= 0 else nxt
        follows.append(nxt)
    seg = end_segments(f, torch.tensor(ends + follows[::-1], dtype=torch.long))
    return [*enc["input_ids"], *sampled], torch.tensor(ends + own, dtype=torch.long), seg


def tokenize_completion(
    tokenizer: Any,
    record: Mapping[str, Any],
    max_length: int = 512,
    template: str = DEFAULT_TEMPLATE,
    use_chat_template: bool = False,
    sampled: bool = False,
) -> dict[str, Tensor]:
    """One completion record (`write_completions`) as one reader's training features.

    `sampled`: `tokenizer` is the one that sampled the record, which is then read as its sampled
    `ids` (`sampled_tokens`); otherwise the text is tokenized, and EOS is appended to a finished completion.

    Returns:
        dict of 1-D tensors `[T]` (T <= max_length): `input_ids`, `attention_mask`, `labels`
        (-100 on the prompt), `segment_ids` (0 prompt, 1 reasoning, 2 answer), `char_ends` (each
        token's last character in the plain-prompt text, -1 for special tokens: cross-vocab logit KD
        and the time alignment pair positions by them). A token takes the segment of its last character.
    """
    chat = use_chat_template and bool(getattr(tokenizer, "chat_template", None))
    question = str(record["question"])
    prompt = format_prompt(question, template, tokenizer if chat else None)
    f = completion_segments(prompt, str(record["answer"]))
    if chat:  # char ends in the plain prompt's coordinates, as `tokenize_example` gives them: readers pair by them
        f = replace(f, shared=shared_chars(prompt, format_prompt(question, template), question, len(f.text)))
    if sampled:
        ids, ends, seg = sampled_tokens(tokenizer, f, record["ids"], chat)
    else:
        ids, ends, seg = token_segments(tokenizer, f, chat)
    ends = f.shared_ends(ends)
    ids = torch.tensor(ids, dtype=torch.long)  # [T]
    eos = record["finished"] and (sampled or tokenizer.eos_token_id is not None)  # the row ends with its EOS
    if eos and not sampled:  # sampled ids hold the EOS the model chose
        ids, seg = torch.cat([ids, ids.new_tensor([tokenizer.eos_token_id])]), torch.cat([seg, seg.new_tensor([PROMPT])])
        ends = torch.cat([ends, ends.new_tensor([NO_CHAR])])
    if eos:  # an empty completion's EOS is still the student's choice, so it is a target too (reasoning)
        seg[-1] = max(int(seg[-2]) if len(seg) > 1 else PROMPT, REASONING)
    ids, seg = ids[:max_length], seg[:max_length]
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.masked_fill(seg == PROMPT, -100),
            "segment_ids": seg, "char_ends": ends[:max_length]}


def completion_batch(
    records: Sequence[Mapping[str, Any]],
    tokenizer: Any,
    teacher_tokenizers: Mapping[str, Any],
    labelled: Tensor,
    *,
    max_length: int = 512,
    template: str = DEFAULT_TEMPLATE,
    use_chat_template: bool = False,
    sampled: bool = False,
) -> dict[str, Any]:
    """Completion records as a training batch shaped like `data.DistillCollator`'s.

    Args:
        records: `[B]` completion records (`write_completions`).
        tokenizer: the student's tokenizer.
        teacher_tokenizers: `{teacher name: tokenizer}` for the teachers that do not share the
            student's tokens (the others read the student's tensors).
        labelled: `[B]` bool, which rows get the LM loss (False for the student's own samples:
            learning its own text by CE would only reinforce it).
        sampled: the student sampled the records: it reads their sampled ids (`tokenize_completion`).

    Returns:
        the student's `input_ids, attention_mask, labels, segment_ids` `[B, T]`, `index [B]`,
        `labelled [B]` and `teacher_inputs: {name: {input_ids, attention_mask, segment_ids}}`.
    """
    def encode(tok: Any, sampled: bool = False) -> dict[str, Tensor]:
        feats = [tokenize_completion(tok, r, max_length, template, use_chat_template, sampled) for r in records]
        return pad_batch(feats, tok.pad_token_id if tok.pad_token_id is not None else 0)

    batch: dict[str, Any] = encode(tokenizer, sampled=sampled)
    batch["index"] = torch.tensor([int(r["index"]) for r in records])
    batch["labelled"] = labelled.bool().cpu()
    teacher_inputs = {}
    for name, tok in teacher_tokenizers.items():
        enc = encode(tok)
        enc.pop("labels")
        teacher_inputs[name] = enc
    if teacher_inputs:
        batch["teacher_inputs"] = teacher_inputs
    return batch
