"""Linear CKA: textbook facts, streaming == one-shot, unbiased HSIC, outliers, top-k and monotonic maps."""

from __future__ import annotations

import itertools

import pytest
import torch

from kvdistill.align.cka import (
    StreamingCKA,
    center_gram,
    cka_matrix,
    drop_first_tokens,
    gram,
    hsic_matrix,
    linear_cka,
    normalize_weights,
    pool_features,
    topk_layer_map,
)

DEBIASED = [False, True]


def _ref_cka(x: torch.Tensor, y: torch.Tensor) -> float:
    """Feature-space definition (Kornblith et al. eq. 5): ‖YcᵀXc‖²_F / (‖XcᵀXc‖_F ‖YcᵀYc‖_F)."""
    x, y = x.double(), y.double()
    x, y = x - x.mean(0), y - y.mean(0)
    return float((y.T @ x).norm() ** 2 / ((x.T @ x).norm() * (y.T @ y).norm()))


def _ref_hsic1(x: torch.Tensor, y: torch.Tensor) -> float:
    """Unbiased HSIC of Song et al. (2012), eq. 5, written out literally."""
    kx, ky = x.double() @ x.double().T, y.double() @ y.double().T
    n = kx.shape[0]
    kx.fill_diagonal_(0)
    ky.fill_diagonal_(0)
    one = torch.ones(n, 1, dtype=torch.float64)
    term = torch.trace(kx @ ky) + (one.T @ kx @ one) * (one.T @ ky @ one) / ((n - 1) * (n - 2))
    term = term - 2 / (n - 2) * (one.T @ kx @ ky @ one)
    return float(term / (n * (n - 3)))


def _ref_debiased_cka(x, y) -> float:
    return _ref_hsic1(x, y) / (_ref_hsic1(x, x) * _ref_hsic1(y, y)) ** 0.5


@pytest.mark.parametrize("debiased", DEBIASED)
@pytest.mark.parametrize("n,d", [(40, 8), (12, 50)])
def test_cka_of_x_with_itself_is_one(debiased, n, d):
    x = torch.randn(n, d) * 3 + 100.0  # a large offset must not matter
    assert linear_cka(x, x, debiased=debiased).item() == pytest.approx(1.0, abs=1e-9)
    # and through the streaming accumulator, many minibatches
    acc = StreamingCKA(minibatch_size=6, debiased=debiased)
    acc.update(x[None], x[None])
    assert acc.compute().item() == pytest.approx(1.0, abs=1e-9)


@pytest.mark.parametrize("debiased", DEBIASED)
def test_symmetric(debiased):
    x, y = torch.randn(3, 30, 7), torch.randn(4, 30, 5)
    y[1] = x[0] @ torch.randn(7, 5) + 0.1 * y[1]
    torch.testing.assert_close(cka_matrix(x, y, debiased=debiased), cka_matrix(y, x, debiased=debiased).T)


@pytest.mark.parametrize("debiased", DEBIASED)
def test_invariant_to_orthogonal_isotropic_scaling_and_translation(debiased):
    x = torch.randn(50, 6, dtype=torch.float64)
    y = torch.tanh(x @ torch.randn(6, 9, dtype=torch.float64)) + 0.3 * torch.randn(50, 9, dtype=torch.float64)
    q, _ = torch.linalg.qr(torch.randn(9, 9, dtype=torch.float64))
    base = linear_cka(x, y, debiased=debiased)
    for y2 in (y @ q, 7.5 * y, 0.01 * y @ q + 3.0):
        torch.testing.assert_close(linear_cka(x, y2, debiased=debiased), base, atol=1e-10, rtol=0)


@pytest.mark.parametrize("debiased", DEBIASED)
def test_not_invariant_to_arbitrary_invertible_linear_map(debiased):
    x = torch.randn(200, 5, dtype=torch.float64)
    a = torch.diag(
        torch.tensor([1.0, 1.0, 1.0, 1.0, 50.0], dtype=torch.float64)
    )  # invertible, not orthogonal
    assert linear_cka(x, x @ a, debiased=debiased).item() < 0.9


@pytest.mark.parametrize("debiased", DEBIASED)
def test_batched_all_pairs_equals_pairwise_definition(debiased):
    x = torch.randn(3, 25, 7) + 2.0
    y = torch.randn(4, 25, 11)
    y[2, :, :7] += 2 * x[1]
    got = cka_matrix(x, y, debiased=debiased)
    ref = _ref_debiased_cka if debiased else _ref_cka
    want = torch.tensor([[ref(x[i], y[j]) for j in range(4)] for i in range(3)], dtype=torch.float64)
    torch.testing.assert_close(got, want, atol=1e-10, rtol=0)


def test_float32_grams_match_float64():
    x, y = torch.randn(3, 64, 40) * 5 + 50, torch.randn(2, 64, 30)
    torch.testing.assert_close(
        cka_matrix(x, y, dtype=torch.float32), cka_matrix(x, y, dtype=torch.float64), atol=1e-5, rtol=0
    )


@pytest.mark.parametrize("debiased", DEBIASED)
def test_streaming_float32_matches_float64_under_large_offsets(debiased):
    """float32 Grams (features centred twice, no Gram re-centring, float64 pair products) keep CKA to
    1e-7 under offsets of 1e5 (a one-pass float32 mean leaves ~1e-5 here)."""
    x, y = torch.randn(3, 1024, 32), torch.randn(4, 1024, 48)
    y[:, :, :32] += x[[0, 1, 2, 2]]
    x, y = x + 1e5 * torch.rand(1, 1, 32), y - 1e5  # massive shared activations
    got, want = StreamingCKA(1024, debiased=debiased, dtype=torch.float32), StreamingCKA(1024, debiased=debiased)
    got.update(x, y)
    want.update(x.double(), y.double())
    torch.testing.assert_close(got.compute(), want.compute(), atol=1e-7, rtol=0)


def test_gram_of_centred_features_is_already_double_centred():
    k = gram(torch.randn(2, 30, 7) + 100.0, dtype=torch.float32)  # [2, n, n]
    torch.testing.assert_close(center_gram(k), k, atol=1e-3, rtol=1e-5)  # entries ~ 7: exact to rounding
    assert k.mean(dim=-1).abs().max() < 1e-4


@pytest.mark.parametrize("debiased", DEBIASED)
def test_streaming_equals_full_batch(debiased):
    x, y = torch.randn(3, 37, 6), torch.randn(2, 37, 9)
    y[0, :, :6] += x[2]
    full = cka_matrix(x, y, debiased=debiased)
    acc = StreamingCKA(minibatch_size=None, debiased=debiased)  # keep all rows: exact full-batch CKA
    for chunk in (slice(0, 5), slice(5, 6), slice(6, 30), slice(30, 37)):
        acc.update(x[:, chunk], y[:, chunk])
    torch.testing.assert_close(acc.compute(), full, atol=1e-5, rtol=0)
    assert acc.num_rows == 37


@pytest.mark.parametrize("debiased", DEBIASED)
def test_minibatch_estimator_does_not_depend_on_update_chunking(debiased):
    x, y = torch.randn(2, 54, 4), torch.randn(3, 54, 5)
    one_shot = StreamingCKA(minibatch_size=10, debiased=debiased)
    one_shot.update(x, y)
    chunked = StreamingCKA(minibatch_size=10, debiased=debiased)
    for chunk in torch.arange(54).split([3, 14, 1, 20, 16]):
        chunked.update(x[:, chunk], y[:, chunk])
    torch.testing.assert_close(chunked.compute(), one_shot.compute(), atol=1e-5, rtol=0)
    # by hand: 5 minibatches of 10 rows and a last one of 4, each HSIC weighted by its rows
    xy, xx, yy = 0, 0, 0
    for i in range(0, 54, 10):
        kx = center_gram(gram(x[:, i : i + 10]), debiased=debiased)
        ky = center_gram(gram(y[:, i : i + 10]), debiased=debiased)
        n = kx.shape[-1]
        xy = xy + n * hsic_matrix(kx, ky, debiased=debiased)
        xx = xx + n * hsic_matrix(kx, kx, debiased=debiased).diag()
        yy = yy + n * hsic_matrix(ky, ky, debiased=debiased).diag()
    torch.testing.assert_close(
        one_shot.compute(), xy / (xx[:, None] * yy[None, :]).sqrt(), atol=1e-10, rtol=0
    )
    assert one_shot.num_minibatches == 5 and one_shot.num_rows == 54


def test_too_short_last_minibatch_is_skipped_with_a_warning():
    x = torch.randn(1, 23, 3)
    acc = StreamingCKA(minibatch_size=10, debiased=True)
    acc.update(x, x + 0.1 * torch.randn_like(x))
    with pytest.warns(UserWarning, match="skipping the last 3"):
        assert 0.9 < acc.compute().item() <= 1.0


def test_compute_is_idempotent_and_update_can_continue():
    x, y = torch.randn(1, 30, 3), torch.randn(1, 30, 3)
    acc = StreamingCKA(minibatch_size=8)
    acc.update(x[:, :13], y[:, :13])
    first = acc.compute()
    torch.testing.assert_close(acc.compute(), first)
    acc.update(x[:, 13:], y[:, 13:])
    ref = StreamingCKA(minibatch_size=8)
    ref.update(x, y)
    torch.testing.assert_close(acc.compute(), ref.compute())


def test_debiased_hsic_is_unbiased_on_random_data():
    # y = x W + noise: the population HSIC of linear kernels is ‖Cov(x, y)‖²_F = ‖W‖²_F.
    g = torch.Generator().manual_seed(1)
    reps, n, d = 4000, 8, 3
    w = torch.tensor([[1.0, 0.5, 0.0], [0.0, -1.0, 0.0], [0.0, 0.0, 0.0]], dtype=torch.float64)
    x = torch.randn(reps, n, d, generator=g, dtype=torch.float64)
    y = x @ w + torch.randn(reps, n, d, generator=g, dtype=torch.float64)
    kx, ky = gram(x), gram(y)  # [reps, n, n]

    def mean_hsic(debiased: bool) -> float:
        a, b = center_gram(kx, debiased=debiased), center_gram(ky, debiased=debiased)
        norm = n * (n - 3) if debiased else (n - 1) ** 2
        return float((a * b).sum(dim=(-2, -1)).mean() / norm)

    truth = float(w.pow(2).sum())  # 2.25
    unbiased, biased = mean_hsic(True), mean_hsic(False)
    assert unbiased == pytest.approx(truth, rel=0.06)
    assert abs(biased - truth) > 3 * abs(unbiased - truth)  # the plain estimator is visibly off at n = 8
    # and the literal formula agrees with the U-centred form on one minibatch
    one = hsic_matrix(center_gram(kx[:1], debiased=True), center_gram(ky[:1], debiased=True), debiased=True)
    assert float(one) == pytest.approx(_ref_hsic1(x[0], y[0]), abs=1e-10)


def test_constant_layer_gets_zero_similarity():
    x = torch.randn(2, 20, 4)
    x[1] = 3.0
    s = cka_matrix(x, torch.randn(1, 20, 4))
    assert torch.isfinite(s).all() and s[1, 0] == 0


def test_needs_enough_rows():
    with pytest.raises(ValueError, match="at least 4"):
        cka_matrix(torch.randn(1, 3, 2), torch.randn(1, 3, 2), debiased=True)
    acc = StreamingCKA(debiased=True)
    with pytest.raises(ValueError, match="before any update"):
        acc.compute()


# --------------------------------------------------------------------------- features


def test_pool_features_masks_padding():
    h = torch.randn(2, 3, 5, 4)  # [L, B, T, d]
    mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [0, 1, 1, 1, 0]])
    tokens = pool_features(h, mask, "tokens")
    assert tokens.shape == (2, 11, 4)
    mean = pool_features(h, mask, "mean")
    torch.testing.assert_close(mean[:, 0], h[:, 0, :3].mean(1))
    torch.testing.assert_close(mean[:, 2], h[:, 2, 1:4].mean(1))
    garbage = h.clone()
    garbage[:, mask == 0] = 1e6
    torch.testing.assert_close(pool_features(garbage, mask, "tokens"), tokens)
    torch.testing.assert_close(pool_features(garbage, mask, "mean"), mean)
    # bf16 input is accumulated in float32
    assert pool_features(h.bfloat16(), mask, "mean").dtype == torch.float32
    with pytest.raises(ValueError, match="pooling"):
        pool_features(h, mask, "max")


# --------------------------------------------------------------------------- top-k maps


def test_topk_rows_sum_to_one_with_k_entries():
    s = torch.rand(5, 7)
    m = topk_layer_map(s, k=3)
    torch.testing.assert_close(m.sum(1), torch.ones(5))
    assert ((m > 0).sum(1) == 3).all()
    top = s.topk(3, dim=1)
    torch.testing.assert_close(
        m.gather(1, top.indices), (top.values / top.values.sum(1, keepdim=True)).float()
    )


def test_weights_plain_and_softmax():
    s = torch.tensor([[0.6, 0.2, -0.1]])
    torch.testing.assert_close(normalize_weights(s), torch.tensor([[0.75, 0.25, 0.0]], dtype=torch.float64))
    torch.testing.assert_close(normalize_weights(s, 0.1), torch.softmax(s.double() / 0.1, -1))
    torch.testing.assert_close(
        normalize_weights(torch.tensor([[-1.0, -2.0]])), torch.full((1, 2), 0.5).double()
    )


def test_identity_similarity_gives_identity_map():
    s = torch.eye(4) * 0.5 + 0.4
    assert torch.equal(topk_layer_map(s, k=1), torch.eye(4))
    assert torch.equal(topk_layer_map(s, k=1, monotonic=True), torch.eye(4))


def _is_monotone(m: torch.Tensor) -> bool:
    rows = [sorted((r > 0).nonzero().flatten().tolist()) for r in m]
    return all(all(b >= a for a, b in zip(r0, r1)) for r0, r1 in itertools.pairwise(rows))


@pytest.mark.parametrize("k", [1, 2, 3])
def test_monotonic_map_is_monotone_and_optimal(k):
    g = torch.Generator().manual_seed(k)
    for _ in range(5):
        s = torch.rand(4, 5, generator=g, dtype=torch.float64)
        m = topk_layer_map(s, k=k, monotonic=True)
        assert _is_monotone(m) and ((m > 0).sum(1) == k).all()
        score = float((s * (m > 0)).sum())
        # brute force over every assignment of sorted k-subsets to the 4 rows
        subsets = list(itertools.combinations(range(5), k))
        best = max(
            sum(float(s[row, list(c)].sum()) for row, c in enumerate(assign))
            for assign in itertools.product(subsets, repeat=4)
            if all(all(b >= a for a, b in zip(c0, c1)) for c0, c1 in itertools.pairwise(assign))
        )
        assert score == pytest.approx(best)


def test_monotonic_keeps_an_already_monotone_top_k():
    s = torch.eye(6, 8) + torch.eye(6, 8).roll(1, dims=1) * 0.5 + 0.01 * torch.rand(6, 8)
    assert torch.equal(topk_layer_map(s, k=2, monotonic=True), topk_layer_map(s, k=2))
    s[3] = torch.tensor(
        [1.0, 0.9, 0, 0, 0, 0, 0, 0]
    )  # row 3 prefers shallow layers: plain top-k breaks order
    assert not _is_monotone(topk_layer_map(s, k=2))
    assert _is_monotone(topk_layer_map(s, k=2, monotonic=True))


def test_topk_rejects_bad_k():
    with pytest.raises(ValueError, match="1 <= k"):
        topk_layer_map(torch.rand(2, 3), k=4)


# --------------------------------------------------------------------------- outliers (real LMs)


def _layered_pair(B=6, T=20, L=4, r=6, seed=0):
    """Student `[L, B, T, 16]` and teacher `[L, B, T, 24]` where layer l of both is a random linear image
    of the same latent `Z_l` (independent across l) plus noise: the true map is the identity."""
    g = torch.Generator().manual_seed(seed)
    z = torch.randn(L, B, T, r, generator=g)  # [L, B, T, r]
    xs = z @ torch.randn(L, r, 16, generator=g)[:, None] + 0.1 * torch.randn(L, B, T, 16, generator=g)
    xt = z @ torch.randn(L, r, 24, generator=g)[:, None] + 0.1 * torch.randn(L, B, T, 24, generator=g)
    return xs, xt  # [L, B, T, d_s], [L, B, T, d_t]


def _map(xs, xt, mask, **kw):
    acc = StreamingCKA(minibatch_size=None, standardize=kw.pop("standardize", False))
    acc.update(pool_features(xs, mask), pool_features(xt, mask))
    S = acc.compute()
    return S, topk_layer_map(S, k=1)


def test_planted_massive_first_token_makes_the_map_degenerate_and_dropping_it_recovers_the_diagonal():
    xs, xt = _layered_pair()
    L, B, T = xs.shape[:3]
    mask = torch.ones(B, T, dtype=torch.long)
    S, M = _map(xs, xt, mask)
    assert torch.equal(M, torch.eye(L)) and S.diag().min() > 0.6  # the clean pair: the diagonal
    # an attention sink: the first token of every sample carries one huge vector, in every layer
    xs[:, :, 0] += 1000.0 * torch.randn(16)
    xt[:, :, 0] += 1000.0 * torch.randn(24)
    S, _ = _map(xs, xt, mask)
    assert S.min() > 0.99  # every pair "identical": the map says nothing
    S, M = _map(xs, xt, drop_first_tokens(mask, 1))
    assert torch.equal(M, torch.eye(L)) and S.diag().min() > 0.6
    assert (S - S.diag().diag()).max() < 0.2


def test_planted_massive_channel_makes_the_map_degenerate_and_standardizing_recovers_the_diagonal():
    xs, xt = _layered_pair()
    L, B, T = xs.shape[:3]
    mask = torch.ones(B, T, dtype=torch.long)
    shared = torch.randn(B, T)  # one channel per model carries the same large signal in every layer
    xs[..., 0] += 300.0 * shared
    xt[..., 0] += 300.0 * shared
    S, _ = _map(xs, xt, mask)
    assert S.min() > 0.99
    S, M = _map(xs, xt, mask, standardize=True)
    assert torch.equal(M, torch.eye(L))
    assert S.diag().min() > (S - S.diag().diag()).max() + 0.3


@pytest.mark.parametrize("debiased", DEBIASED)
def test_standardized_cka_is_invariant_to_channel_scales(debiased):
    x, y = torch.randn(2, 50, 8), torch.randn(3, 50, 6)
    x[..., :4] += y[:2, :, :4]  # some similarity to preserve
    scale = torch.rand(8) * 100 + 0.01  # [d] per-channel scale
    plain = cka_matrix(x, y, debiased=debiased)
    assert not torch.allclose(cka_matrix(x * scale, y, debiased=debiased), plain, atol=1e-3)
    std = cka_matrix(x, y, debiased=debiased, standardize=True)
    torch.testing.assert_close(cka_matrix(x * scale + 7.0, y, debiased=debiased, standardize=True), std)
    # a constant channel stays out (no division by zero); the streaming accumulator agrees
    x[..., 0] = 3.0
    acc = StreamingCKA(minibatch_size=None, debiased=debiased, standardize=True)
    acc.update(x, y)
    torch.testing.assert_close(acc.compute(), cka_matrix(x[..., 1:], y, debiased=debiased, standardize=True))


def test_drop_first_tokens_counts_valid_tokens_on_either_padding_side():
    right = torch.tensor([[1, 1, 1, 0], [1, 1, 1, 1]])
    left = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]])
    assert drop_first_tokens(right, 1).tolist() == [[False, True, True, False], [False, True, True, True]]
    assert drop_first_tokens(left, 2).tolist() == [[False, False, False, True], [False, False, True, True]]
    assert torch.equal(drop_first_tokens(right, 0), right.bool())
