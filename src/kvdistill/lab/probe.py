"""Linear probes of a model's cache: which layer's K, V or hidden state carries a fact about a token.

A KV loss can only transfer what the teacher's cache holds at the rows the loss reads. This module
measures that: for every layer it collects, at the tokens that have a target, four kinds of features

    k_pre   the key before the rotary embedding (at layer 0 a function of the token alone)
    k_post  the key as cached (RoPE applied: the position is mixed in)
    v       the value
    hidden  the layer's output (the residual stream the next layer reads)

(K and V also per KV head), and fits a linear probe from each to the target on the tokens of one set
of items, scored on the tokens of *other* items. Items, not tokens, are split: tokens of one problem
share their numbers, and a probe trained on half of a problem's tokens could memorise it.

Every score comes with two references: the majority class (classification) or the train mean
(regression, R² = 0 up to the test/train mean shift), and a shuffled-label control, the same probe
fitted on the train labels permuted over the train rows (so rows get other items' labels) and scored
on the true test labels: a score the control reaches too is what a linear map of those features
can fit to anything, not what the features carry.

Targets (`parse_target`), read from the formatted text or from a task's per-token fields:
    next_answer_token  id of the next token, where that token is part of the final answer (after ####)
    number_value       integer value of the number a token belongs to (e.g. both tokens of "33": 33)
    field:<name>       a per-token field the task wrote (`fields.py`)
Rows (`parse_rows`): all | prompt | reasoning | answer | results (tokens of a number written right
after "=" or "####", i.e. what a step or the answer computes) | field:<name> (tokens where the field
is non-zero).

The probe is ridge regression, closed form, one batched Cholesky solve for all layers (or all
layer x head pairs) of a kind. Classification is ridge on one-hot targets (argmax of the fitted
scores), not logistic regression: it is the same single solve for any number of classes, needs no
learning rate or iteration count, is deterministic, and as a linear read-out test it ranks layers as
logistic probes do; a few hundred L-BFGS steps per layer x kind x model would cost more than the
forward passes and add an optimiser whose convergence would itself need checking.

Beside the probes, `layout_scores` (`kvdistill layout`): how cyclic a model's code of the numbers
0..p-1 is, what a probe cannot see (p distinct tokens decode from any code).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor, nn

from kvdistill import fields as token_fields
from kvdistill.cache import ANSWER, PROMPT, REASONING, capture_pre_rope_keys, forward_with_kv
from kvdistill.data import DEFAULT_TEMPLATE, DataError, DistillCollator, format_example, prompt_text
from kvdistill.fields import IGNORE
from kvdistill.models import model_device

KINDS = ("k_pre", "k_post", "v", "hidden")
TARGETS = ("next_answer_token", "number_value")  # and field:<name>
ROWS = ("all", "prompt", "reasoning", "answer", "results")  # and field:<name>
READOUTS = ("classification", "regression")
# ridge strengths tried on an inner split of the train items (features standardised, loss a mean over rows,
# so one grid suits any width and row count); the best per layer is refitted on all train items
LAMBDAS = (1e-4, 1e-3, 1e-2, 1e-1, 1.0, 10.0, 100.0)
INNER_FRACTION = 0.75  # train items of the inner split that picks the ridge strength
SHUFFLES = 5  # label permutations the shuffled control averages over
_SEGMENTS = {"prompt": PROMPT, "reasoning": REASONING, "answer": ANSWER}
# fields this module writes from the text itself (a task's own fields cannot take these names: "probe." prefix)
NUMBER, RESULT, FINAL = "probe.number", "probe.result", "probe.final"
_NUMBER_RE = re.compile(r"\d+(?:,\d{3})*(?:\.\d+)?")


def _name_or_field(value: str, names: Sequence[str], what: str, field_means: str) -> tuple[str, str | None]:
    """`value` one of `names` -> (value, None); `"field:<name>"` -> ("field", name); else ValueError."""
    if value in names:
        return value, None
    if value.startswith("field:") and len(value) > len("field:"):
        return "field", value.removeprefix("field:")
    raise ValueError(f"{what} {value!r} is not one of {names} or field:<name> ({field_means})")


def parse_target(target: str) -> tuple[str, str | None]:
    """`"number_value"` -> ("number_value", None); `"field:value"` -> ("field", "value"); else ValueError."""
    return _name_or_field(target, TARGETS, "target", "a per-token field of the data")


def parse_rows(rows: str) -> tuple[str, str | None]:
    """`"answer"` -> ("answer", None); `"field:mask"` -> ("field", "mask"); else ValueError."""
    return _name_or_field(rows, ROWS, "rows", "tokens where that field is non-zero")


# ----------------------------------------------------------------------------- targets from the text


def text_spans(text: str, question_offset: int, final: str) -> dict[str, list[list[int]]]:
    """The probe's own fields of a formatted `text`, as spans relative to the question (as `fields.py` reads them).

    `NUMBER`: every integer in the text with its value (a number with a non-zero fractional part has
    no integer value and is left out); `RESULT`: 1 on numbers written right after "=" or "####";
    `FINAL`: 1 on the final answer, the last `len(final)` characters. Numbers before the question
    (in the prompt template) cannot be placed by `fields.tokens_of` and are left out.
    """
    number, result = [], []
    for m in _NUMBER_RE.finditer(text):
        start, end = m.start() - question_offset, m.end() - question_offset
        whole, _, frac = m.group().replace(",", "").partition(".")
        if start < 0 or frac.strip("0"):
            continue
        number.append([start, end, int(whole)])
        if text[: m.start()].rstrip().endswith(("=", "####")):
            result.append([start, end, 1])
    end = len(text) - question_offset
    return {NUMBER: number, RESULT: result, FINAL: [[end - len(final), end, 1]] if final else []}


def with_text_fields(record: Mapping[str, Any], template: str = DEFAULT_TEMPLATE, tokenizer: Any = None,
                     use_chat_template: bool = False, need: Sequence[str] = ()) -> dict[str, Any]:
    """`record` with the probe's fields (`text_spans`) added to its `token_fields`.

    The text is formatted as the collator formats it (same template, same chat template), so the spans
    land on the tokens the model reads. `need`: the task fields a target or row mask reads; a record
    without one gets it empty (no rows there) so that every record of a batch has the same fields.
    """
    f = format_example(record, template, tokenizer if use_chat_template else None)
    question = prompt_text(record)
    answer = f.text[f.reasoning_end:]  # a prompt/completion record's completion is all final answer
    final = (answer.partition("####")[2] if "question" in record else answer).strip()
    fields = dict(token_fields.freeze(record.get(token_fields.FIELD_KEY) or {}))
    fields.update({name: () for name in need if name not in fields})
    fields.update(text_spans(f.text, f.text.rfind(question, 0, f.prompt_end), final))  # after any few-shot prefix
    return {**record, token_fields.FIELD_KEY: token_fields.freeze(fields)}


def token_targets(batch: Mapping[str, Any], target: str) -> Tensor:
    """Each token's target `[B, T]` long, `IGNORE` where it has none.

    Args:
        batch: a `DistillCollator` batch of records from `with_text_fields` (`input_ids`,
            `attention_mask [B, T]`, `token_fields: {name: [B, T]}`).
        target: see `parse_target`.
    """
    kind, name = parse_target(target)
    per_token = batch.get("token_fields", {})
    if kind == "next_answer_token":
        ids, final = batch["input_ids"], per_token[FINAL]  # [B, T]
        nxt = torch.full_like(ids, IGNORE)
        nxt[:, :-1] = torch.where(final[:, 1:] == 1, ids[:, 1:], IGNORE)  # the token at t+1, where it is an answer's
        return nxt
    return per_token[NUMBER if kind == "number_value" else name].clone()


def row_mask(batch: Mapping[str, Any], rows: str) -> Tensor:
    """Which tokens are probed `[B, T]` bool (padding never is)."""
    kind, name = parse_rows(rows)
    real = batch["attention_mask"].bool()  # [B, T]
    if kind == "all":
        return real
    if kind in _SEGMENTS:
        return real & (batch["segment_ids"] == _SEGMENTS[kind])
    field = batch["token_fields"][RESULT if kind == "results" else name]  # [B, T]
    return real & (field != 0) & (field != IGNORE)


# ----------------------------------------------------------------------------- features


@torch.no_grad()
def layer_states(model: nn.Module, input_ids: Tensor, attention_mask: Tensor, kinds: Sequence[str] = KINDS
                 ) -> dict[str, Tensor]:
    """Per-layer features of one batch from one forward pass.

    Returns:
        `{"k_pre", "k_post", "v": [L, B, H, T, D], "hidden": [L, B, T, d]}` (the kinds asked for);
        hidden is each decoder layer's output (the embeddings are dropped, as in `layer-map`).
        A model without a key projection to hook (GPT-2) has no RoPE: its k_pre is its cached key.
    """
    with capture_pre_rope_keys(model) as pre:
        _, kv = forward_with_kv(model, input_ids, attention_mask, output_hidden_states="hidden" in kinds,
                                logits=False)
    out = {"k_pre": torch.stack(pre) if len(pre) == kv.num_layers else kv.keys, "k_post": kv.keys, "v": kv.values}
    if "hidden" in kinds:
        out["hidden"] = kv.hidden_states[1:]  # [L, B, T, d]
    return {k: out[k] for k in kinds}


@dataclass
class ProbeRows:
    """The probed token rows of a dataset: features per kind, their targets and the item each row is from.

    Attributes:
        features: `{kind: [L, N, H, D]}` for k_pre / k_post / v, `[L, N, d]` for hidden (float32, CPU).
        labels: `[N]` long targets.
        items: `[N]` index of the record each row comes from.
        num_items: how many records were read (some may have no rows).
    """

    features: dict[str, Tensor]
    labels: Tensor
    items: Tensor
    num_items: int


@torch.no_grad()
def collect_rows(
    model: nn.Module,
    tokenizer: Any,
    records: Sequence[Mapping[str, Any]],
    target: str,
    rows: str = "all",
    *,
    kinds: Sequence[str] = KINDS,
    batch_size: int = 8,
    max_length: int = 512,
    template: str = DEFAULT_TEMPLATE,
    use_chat_template: bool = False,
    progress: bool | None = None,
    desc: str = "probe",
) -> ProbeRows:
    """Run `model` over `records` batch by batch and keep the features of the rows that have a target.

    Only the kept rows are stored (a few per record for answer targets), so memory grows with the rows
    probed, not with the tokens read. A target or row field no record carries is a `DataError`.
    """
    from tqdm.auto import tqdm

    need = [name for kind, name in (parse_target(target), parse_rows(rows)) if kind == "field"]
    for name in need:
        if not any(name in dict(token_fields.freeze(r.get(token_fields.FIELD_KEY) or {})) for r in records):
            raise DataError(f"no record carries the per-token field {name!r} that --target/--rows {target}/{rows} "
                            f"reads; write it in the records' {token_fields.FIELD_KEY} or probe another target")
    records = [with_text_fields(r, template, tokenizer, use_chat_template, need) for r in records]
    collate = DistillCollator(tokenizer, max_length, template, use_chat_template)
    device = model_device(model)
    was_training = model.training
    model.eval()
    feats: dict[str, list[Tensor]] = {k: [] for k in kinds}
    labels, items = [], []
    try:
        starts = range(0, len(records), batch_size)
        for i in tqdm(starts, desc=desc, unit="batch", disable=None if progress is None else not progress):
            batch = collate(records[i : i + batch_size])
            y = token_targets(batch, target)  # [B, T]
            keep = row_mask(batch, rows) & (y != IGNORE)  # [B, T]
            if not keep.any():
                continue
            states = layer_states(model, batch["input_ids"].to(device), batch["attention_mask"].to(device), kinds)
            keep_d = keep.to(device)
            for kind, x in states.items():
                x = x.transpose(2, 3) if x.dim() == 5 else x  # [L, B, T, H, D] or [L, B, T, d]
                feats[kind].append(x[:, keep_d].float().cpu())  # [L, n, H, D] or [L, n, d]
            labels.append(y[keep])
            items.append((torch.arange(keep.shape[0]) + i)[:, None].expand_as(keep)[keep])  # [n]
    finally:
        model.train(was_training)
    if not labels:
        raise DataError(f"no token of the {len(records)} records has target {target!r} at rows {rows!r}; "
                        "choose other --rows, or data whose text has that target")
    return ProbeRows({k: torch.cat(v, dim=1) for k, v in feats.items()}, torch.cat(labels), torch.cat(items),
                     len(records))


# ----------------------------------------------------------------------------- the probe


def split_items(num_items: int, train_fraction: float, seed: int = 0) -> Tensor:
    """Which items are train items `[num_items]` bool: a seeded random `train_fraction` of them."""
    g = torch.Generator().manual_seed(seed)
    n_train = min(max(round(num_items * train_fraction), 1), num_items - 1) if num_items > 1 else num_items
    train = torch.zeros(num_items, dtype=torch.bool)
    train[torch.randperm(num_items, generator=g)[:n_train]] = True
    return train


def ridge(X: Tensor, Y: Tensor, lambdas: Sequence[float]) -> Tensor:
    """Ridge weights `W = argmin (1/n)·‖X W − Y‖² + λ‖W‖²` for a batch of problems and several λ (no
    intercept: centre first).

    Args:
        X: `[G, n, F]` features (G independent problems, e.g. layers).
        Y: `[n, C]` targets shared by all problems, or `[G, n, C]`.
        lambdas: the Λ ridge strengths.

    Returns:
        `[Λ, G, F, C]`: the normal equations `(XᵀX/n + λI) W = XᵀY/n`, their Gram built once, one
        batched Cholesky solve over G per λ.
    """
    n, F = X.shape[1:]
    A = X.mT @ X / n  # [G, F, F]
    B = X.mT @ Y / n  # [G, F, C]
    eye = torch.eye(F, dtype=X.dtype, device=X.device)
    # Cholesky, as A + λI is symmetric positive definite (λ > 0): the batched LU of `linalg.solve` in
    # torch 2.13's CPU build (MKL) fails on 2 threads ("SLASWP parameter 6") and takes minutes a call
    return torch.stack([torch.cholesky_solve(B, torch.linalg.cholesky(A + lam * eye)) for lam in lambdas])


def _fit_predict(X: Tensor, Y: Tensor, fit: Tensor, test: Tensor, lambdas: Sequence[float]) -> Tensor:
    """Centre on the `fit` rows (the intercept), solve for every λ, predict the `test` rows: `[Λ, G, n_test, C]`."""
    Xf = X[:, fit]  # [G, n_fit, F]
    x_mean, y_mean = Xf.mean(1, keepdim=True), Y[fit].mean(0)  # [G, 1, F], [C]
    W = ridge(Xf - x_mean, Y[fit] - y_mean, lambdas)  # [Λ, G, F, C]
    return (X[:, test] - x_mean) @ W + y_mean


def _score(pred: Tensor, y: Tensor, classification: bool) -> Tensor:
    """Accuracy (argmax of the class scores vs the class index; -1, a class unseen in training, is always
    wrong) or R² of `pred [..., n, C]` against `y [n]`: `[...]`."""
    if classification:
        return (pred.argmax(-1) == y).double().mean(-1)
    resid = ((pred[..., 0] - y) ** 2).sum(-1)  # [G]
    return 1 - resid / ((y - y.mean()) ** 2).sum().clamp_min(torch.finfo(y.dtype).tiny)


def fit_probe(
    X: Tensor,
    labels: Tensor,
    items: Tensor,
    train_items: Tensor,
    *,
    classification: bool = True,
    seed: int = 0,
    shuffles: int = SHUFFLES,
    lambdas: Sequence[float] = LAMBDAS,
) -> dict[str, Any]:
    """Fit and score a linear probe on every one of G feature sets at once (e.g. the layers of a kind).

    The true labels and `shuffles` permutations of the train labels are the right-hand sides of the
    same normal equations, so the controls cost no extra solve: `2·len(lambdas)` batched solves in all.

    Args:
        X: `[G, N, F]` features of N rows.
        labels: `[N]` targets (class ids, or numbers for regression).
        items: `[N]` the item each row is from.
        train_items: `[I]` bool, which items are train items (`split_items`); rows of the others are test rows.
        classification: accuracy of ridge on one-hot classes (the classes of the train rows) vs R².
        seed: the inner split (choice of λ) and the label permutations.
        shuffles: permutations of the train labels the control averages over (one is noisy: where the
            features cluster by class, a permuted probe maps each cluster to one random class).

    Returns:
        `{"score": [G], "shuffled": [G], "lambda": [G], "baseline": float, "n_train": int, "n_test": int,
        "n_train_items": int, "n_test_items": int}`: the held-out score, the mean held-out score of the
        same probe fitted on permuted train labels, the chosen ridge strength, and the majority-class /
        train-mean score.

    Raises:
        ValueError: too few rows or items to fit and score (the message names the counts).
    """
    train = train_items[items]  # [N]
    test = ~train
    n_train_items, n_test_items = items[train].unique().numel(), items[test].unique().numel()
    if n_train_items < 2 or n_test_items < 1:
        raise ValueError(f"rows from {n_train_items} train and {n_test_items} test items; a probe needs >= 2 train "
                         "and >= 1 test items with rows")
    X = X.double()
    # standardise on the train rows: one λ grid for every width; a constant feature stays 0
    X = X / X[:, train].std(1, keepdim=True).clamp_min(1e-8)  # [G, N, F]
    if classification:
        classes = labels[train].unique()  # sorted
        if classes.numel() < 2:
            raise ValueError(f"the train rows hold one class only ({classes.tolist()}); a probe needs >= 2")
        pos = torch.searchsorted(classes, labels).clamp_max(classes.numel() - 1)
        y = torch.where(classes[pos] == labels, pos, -1)  # [N] class index, -1 unseen in training
        Y = torch.nn.functional.one_hot(y.clamp_min(0), classes.numel()).double()  # [N, C] (test rows unused)
        baseline = (y[test] == Y[train].sum(0).argmax()).double().mean().item()
    else:
        y = labels.double()
        Y = y[:, None]  # [N, 1]
        baseline = _score(y[train].mean().expand(1, int(test.sum()), 1), y[test], False).item()
    g = torch.Generator().manual_seed(seed)
    # variant 0 the true labels, 1..S the train labels permuted over the train rows (rows get other items'
    # labels: meaning gone, marginal kept); test rows keep their true labels in every variant
    perms = [torch.arange(int(train.sum()))] + [torch.randperm(int(train.sum()), generator=g) for _ in range(shuffles)]
    ys = y[None].repeat(len(perms), 1)  # [S+1, N]
    ys[:, train] = torch.stack([y[train][p] for p in perms])
    Ys = torch.cat([Y.clone().index_put_((train,), Y[train][p]) for p in perms], dim=-1)  # [N, (S+1)·C]
    C = Y.shape[1]
    train_ids = items[train].unique()
    n_inner = max(1, round(INNER_FRACTION * train_ids.numel()))
    inner_ids = train_ids[torch.randperm(train_ids.numel(), generator=g)[:n_inner]]
    inner = torch.isin(items, inner_ids)  # [N]
    if int((train & ~inner).sum()) == 0:  # one item held out for λ at least
        inner = inner & (items != inner_ids[0])
    val = train & ~inner

    def scores(fit: Tensor, rows: Tensor) -> Tensor:
        """Held-out score of every λ, variant and problem: `[Λ, S+1, G]`."""
        pred = _fit_predict(X, Ys, fit, rows, lambdas).unflatten(-1, (len(perms), C))  # [Λ, G, n, S+1, C]
        return torch.stack([_score(pred[..., s, :], ys[s, rows], classification) for s in range(len(perms))], 1)

    best = scores(inner, val).argmax(0)  # [S+1, G]: the λ each variant and problem picks on the inner split
    held_out = scores(train, test).gather(0, best[None])[0]  # [S+1, G]
    return {"score": held_out[0].float(), "shuffled": held_out[1:].mean(0).float(),
            "lambda": torch.tensor(lambdas)[best[0]].float(), "baseline": baseline,
            "n_train": int(train.sum()), "n_test": int(test.sum()), "n_train_items": n_train_items,
            "n_test_items": n_test_items}


def probe_rows(rows: ProbeRows, train_fraction: float = 0.7, *, classification: bool = True, seed: int = 0,
               heads: bool = True) -> dict[str, dict[str, Any]]:
    """Probe every layer of every kind in `rows` (and every KV head of K and V with `heads`).

    Returns:
        `{kind: fit_probe result over the L layers, plus "heads": fit_probe result over L·H, each [L, H]}`.
    """
    train_items = split_items(rows.num_items, train_fraction, seed)
    out: dict[str, dict[str, Any]] = {}
    for kind, x in rows.features.items():
        per_layer = x.flatten(2) if x.dim() == 4 else x  # [L, N, H·D] or [L, N, d]
        res = fit_probe(per_layer, rows.labels, rows.items, train_items, classification=classification, seed=seed)
        if heads and x.dim() == 4:
            L, N, H, D = x.shape
            per_head = x.permute(0, 2, 1, 3).reshape(L * H, N, D)  # [L·H, N, D]
            h = fit_probe(per_head, rows.labels, rows.items, train_items, classification=classification, seed=seed)
            res["heads"] = {k: h[k].view(L, H) for k in ("score", "shuffled", "lambda")}
        out[kind] = res
    return out


# ----------------------------------------------------------------------------- number layout (`kvdistill layout`)
#
# A linear probe cannot show how numbers are laid out: p distinct tokens decode perfectly from any code,
# trained or not. What grokking modular arithmetic leaves instead is a code of the numbers that is sparse
# in the Fourier basis of the operation's cycle (Nanda et al. 2023): for a + b mod p the cycle 0, 1, ...,
# p-1; for a * b mod p the nonzero numbers as powers of a primitive root g, g^0, ..., g^(p-2) (a product is
# a sum of exponents).

LAYOUT_CODES = ("embed", "k_pre", "v")  # the token's embedding and its layer-0 pre-RoPE key and value


def cycle_order(p: int, generator: int | None = None) -> list[int]:
    """The numbers in cycle order: `0..p-1`, or `generator^k mod p` for k in `0..p-2` (a ValueError when
    `generator` is not a primitive root of p, i.e. its powers miss a nonzero number)."""
    if generator is None:
        return list(range(p))
    order = [pow(generator, k, p) for k in range(p - 1)]
    if len(set(order)) != p - 1 or 0 in order:
        raise ValueError(f"{generator} is not a primitive root mod {p} (its powers give {len(set(order) - {0})} of the "
                         f"{p - 1} nonzero numbers); pick one whose powers give them all")
    return order


@torch.no_grad()
def layer0_codes(model: nn.Module, ids: Tensor) -> dict[str, Tensor]:
    """`{"embed", "k_pre", "v"}: [n, d]` of the tokens `ids [n]`, each read alone: layer 0's pre-RoPE key and
    value of a token depend on that token only (heads concatenated)."""
    ids = ids.to(model_device(model))[:, None]  # [n, 1]: one single-token sequence per number
    states = layer_states(model, ids, torch.ones_like(ids), kinds=("k_pre", "v"))  # [L, n, H, 1, D]
    codes = {kind: states[kind][0, :, :, 0].flatten(1) for kind in ("k_pre", "v")}  # [n, H*D]
    return {"embed": model.get_input_embeddings()(ids)[:, 0], **codes}


def layout_scores(codes: Tensor, top: int = 2) -> dict[str, Any]:
    """How cyclic a code of numbers in cycle order is. `codes [n, d]`, centred over the numbers.

    share: the fraction of the code's power in its `top` strongest nonzero frequencies (a code made of
        `top` frequencies gives 1; a random one about `top / (n // 2)`, `uniform`). Power per frequency
        counts both conjugate terms (Parseval: the shares of all frequencies sum to 1 for any n).
    circulant_r2: R² of the code's Gram matrix by its mean over each cyclic distance (a - b) mod n.
    """
    n = codes.shape[0]
    f = (codes - codes.mean(0)).double()  # [n, d]
    power = torch.fft.rfft(f, dim=0).abs().pow(2).sum(1)[1:]  # [n // 2]: frequencies 1..n // 2
    if n % 2 == 0:
        power[:-1] *= 2  # every frequency but n / 2 stands for itself and its conjugate
    else:
        power *= 2
    strongest = power.sort(descending=True)
    gram = f @ f.T  # [n, n]
    idx = torch.arange(n, device=f.device)
    diff = (idx[:, None] - idx[None, :]) % n  # [n, n]
    # each cyclic distance k holds exactly n cells of the Gram matrix: its mean is their sum over n
    means = gram.new_zeros(n).index_add_(0, diff.flatten(), gram.flatten()) / n  # [n]
    circulant = means[diff]  # [n, n]
    r2 = 1 - ((gram - circulant) ** 2).sum() / ((gram - gram.mean()) ** 2).sum()
    return {"share": float(strongest.values[:top].sum() / power.sum()),
            "frequencies": (strongest.indices[:top] + 1).tolist(), "uniform": top / len(power),
            "circulant_r2": float(r2)}
