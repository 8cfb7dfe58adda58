import math
import re
import warnings

import numpy as np
import pytest
from keras import ops

import keras_transformer as kt
from tests import reference as ref
from tests.conftest import BACKEND, to_numpy


def _qkv(rng, b=2, tq=5, tk=7, h=3, d=4):
    q = rng.normal(size=(b, tq, h, d)).astype("float32")
    k = rng.normal(size=(b, tk, h, d)).astype("float32")
    v = rng.normal(size=(b, tk, h, d)).astype("float32")
    return q, k, v


def _ref(q, k, v, mask=None):
    # reference works on (B, h, T, d)
    t = lambda x: np.transpose(x, (0, 2, 1, 3)).astype("float64")
    out, w = ref.attention(t(q), t(k), t(v), mask)
    return np.transpose(out, (0, 2, 1, 3)), w


@pytest.mark.parametrize("scores", [False, True])
def test_attention_matches_reference(scores):
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng)
    mask = rng.random((2, 1, 5, 7)) > 0.3
    mask[..., 0] = True
    expected, expected_w = _ref(q, k, v, mask)
    result = kt.ops.scaled_dot_product_attention(q, k, v, mask=mask, return_attention_scores=scores)
    if scores:
        result, weights = result
        np.testing.assert_allclose(to_numpy(weights), expected_w, atol=1e-5)
    np.testing.assert_allclose(to_numpy(result), expected, atol=1e-5)


def test_fused_and_explicit_paths_agree_with_fully_masked_rows():
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng)
    mask = np.ones((2, 1, 5, 7), bool)
    mask[0, :, 2, :] = False  # a query that may attend to nothing
    fused = to_numpy(kt.ops.scaled_dot_product_attention(q, k, v, mask=mask))
    explicit, _ = kt.ops.scaled_dot_product_attention(q, k, v, mask=mask, return_attention_scores=True)
    assert np.isfinite(fused).all()
    np.testing.assert_allclose(fused, to_numpy(explicit), atol=1e-5)
    # No key allowed: the mean of the values, like the reference.
    np.testing.assert_allclose(fused[0, 2], v[0].mean(axis=0), atol=1e-5)


def test_attention_over_one_key_gives_its_value_without_a_warning():
    # A one-token source (an empty sentence is its [END] alone) made every decoder's
    # cross-attention a softmax over one key, and Keras warned that it "is likely not
    # what you intended".
    rng = np.random.default_rng(5)
    q, k, v = _qkv(rng, tk=1)
    mask = np.ones((2, 1, 5, 1), bool)
    mask[1, :, 3] = False
    expected, expected_w = _ref(q, k, v, mask)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        out, weights = kt.ops.scaled_dot_product_attention(q, k, v, mask=mask, return_attention_scores=True)
        heads_first = [np.transpose(x, (0, 2, 1, 3)) for x in (k, v)]
        fused = kt.ops.scaled_dot_product_attention(q, *heads_first, mask=mask, heads_first=True)
        model = kt.models.Transformer(vocab_size=20, num_layers=1, d_model=8, num_heads=2, d_ff=8)
        model.translate(np.array([[3]]), beam_size=2, max_length=3, compile=False)
    np.testing.assert_allclose(to_numpy(weights), expected_w, atol=1e-6)
    assert np.all(to_numpy(weights) == 1.0)
    np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(fused), expected, atol=1e-5)


def test_attention_dropout_only_in_training():
    rng = np.random.default_rng(2)
    q, k, v = _qkv(rng)
    base = to_numpy(kt.ops.scaled_dot_product_attention(q, k, v))
    inference = to_numpy(kt.ops.scaled_dot_product_attention(q, k, v, dropout=0.5, training=False))
    np.testing.assert_allclose(base, inference, atol=1e-6)
    _, w = kt.ops.scaled_dot_product_attention(q, k, v, dropout=0.5, training=True, seed=3, return_attention_scores=True)
    trained = to_numpy(kt.ops.scaled_dot_product_attention(q, k, v, dropout=0.5, training=True, seed=3))
    assert not np.allclose(trained, base, atol=1e-3)
    # The weights returned are the softmax before dropout: rows sum to one.
    np.testing.assert_allclose(to_numpy(w).sum(-1), 1.0, atol=1e-5)


def test_causal_mask_values():
    m = to_numpy(kt.ops.causal_mask(3, 5, offset=2)).astype(bool)
    expected = np.array([[j <= i + 2 for j in range(5)] for i in range(3)])
    np.testing.assert_array_equal(m, expected)


def test_padding_mask():
    m = to_numpy(kt.ops.padding_mask(np.array([[3, 0, 4, 0]]), pad_id=0)).astype(bool)
    np.testing.assert_array_equal(m, [[True, False, True, False]])


def test_combine_masks_broadcasts_and_skips_none():
    a = np.array([[True, False, True]])
    b = np.array([[True], [False]])
    out = to_numpy(kt.ops.combine_masks(None, a, b)).astype(bool)
    np.testing.assert_array_equal(out, a & b)
    assert kt.ops.combine_masks(None, None) is None


@pytest.mark.parametrize("d_k", [4, 64, 512])
def test_scaling_gives_unit_variance_logits(d_k):
    # Section 3.2.1, footnote 4: for unit-variance q, k, q.k has variance d_k, so
    # q.k / sqrt(d_k) has variance 1. The library's logits, read from its weights over two
    # keys: log(w_1 / w_0) = l_1 - l_0, the difference of two logits (variance 2 if scaled).
    rng = np.random.default_rng(d_k)
    n = 20000
    q = rng.normal(size=(n, 1, 1, d_k)).astype("float32")
    k = rng.normal(size=(n, 2, 1, d_k)).astype("float32")
    _, weights = kt.ops.scaled_dot_product_attention(q, k, k, return_attention_scores=True)
    weights = to_numpy(weights).astype("float64")[:, 0, 0, :]  # (n, 2)
    difference = np.log(weights[:, 1]) - np.log(weights[:, 0])
    np.testing.assert_allclose(difference, ((q[:, 0, 0] * (k[:, 1, 0] - k[:, 0, 0])).sum(-1)) / math.sqrt(d_k),
                               atol=2e-3, rtol=2e-3)
    assert abs(difference.var() / 2 - 1.0) < 0.05


def test_attention_refuses_inputs_it_cannot_pair_up():
    # A key of another depth failed inside an einsum, a mask of the wrong length inside the
    # backend's broadcasting (JAX logging an error first), and a dropout of 1 or -1 ran.
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng)  # (2, 5, 3, 4) queries, (2, 7, 3, 4) keys and values
    attention = kt.ops.scaled_dot_product_attention
    for args, kwargs, message in (
        ((q[0], k[0], v[0]), {}, "`query` must have rank 4, (batch, positions, heads, depth)"),
        ((q, k[..., :2], v), {}, "`query` and `key` one depth"),
        ((q, k[:1], v), {}, "one batch size"),
        ((q, k[:, :, :2], v), {}, "one number of heads"),
        ((q, k, v[:, :6]), {}, "`key` and `value` one length"),
        ((q, k, v), {"mask": np.ones((2, 1, 5, 6), bool)}, "broadcastable to (batch, heads, query positions, key "
                                                            "positions) = (2, 3, 5, 7)"),
        ((q, k, v), {"dropout": 1.0}, "`dropout` must be in [0, 1)"),
        ((q, k, v), {"dropout": -0.5}, "`dropout` must be in [0, 1)"),
        # Keys and values laid out (B, h, T, d), as a decoding cache keeps them.
        ((q, k, v), {"heads_first": True}, "are (batch, heads, positions, depth)"),
    ):
        with pytest.raises(ValueError, match=re.escape(message)):
            attention(*args, **kwargs)
    heads_first = np.transpose(k, (0, 2, 1, 3))
    np.testing.assert_allclose(to_numpy(attention(q, heads_first, heads_first, heads_first=True)),
                               to_numpy(attention(q, k, k)), atol=1e-5)
    with pytest.raises(ValueError, match=re.escape("`windowed_attention` is self-attention")):
        kt.ops.windowed_attention(q, k, v, window=2)
    # Lengths given as Python values: causal_mask(2.5) was a 3 x 3 mask.
    for mask, message in ((lambda: kt.ops.causal_mask(2.5), "`query_length` must be an integer >= 0"),
                          (lambda: kt.ops.causal_mask(3, -1), "`key_length` must be an integer >= 0"),
                          (lambda: kt.ops.band_mask(4, 4, None), "`window` must be an integer >= 1"),
                          (lambda: kt.ops.band_mask(4, 4, -1), "`window` must be an integer >= 1")):
        with pytest.raises(ValueError, match=re.escape(message)):
            mask()


def test_check_token_ids_rejects_floats_and_out_of_range():
    with pytest.raises(ValueError, match="integer"):
        kt.ops.check_token_ids(np.zeros((1, 2), "float32"), 10)
    with pytest.raises(ValueError, match=r"max=10"):
        kt.ops.check_token_ids(np.array([[1, 10]], "int32"), 10)
    with pytest.raises(ValueError, match=r"min=-1"):
        kt.ops.check_token_ids(ops.convert_to_tensor(np.array([[-1, 3]], "int32")), 10)
    kt.ops.check_token_ids(ops.convert_to_tensor(np.array([[0, 9]], "int32")), 10)


def test_take_rows_is_take_for_rows_in_range():
    # A beam search's reordering (`_compat.take_rows`): on JAX without `jnp.take`'s bounds
    # check, the same rows as `keras.ops.take` wherever they are in range.
    from keras_transformer import _compat

    x = np.arange(5 * 2 * 3, dtype="float32").reshape(5, 2, 3)
    rows = np.array([4, 0, 0, 3, 1, 2], "int32")
    np.testing.assert_array_equal(to_numpy(_compat.take_rows(x, rows)), x[rows])


@pytest.mark.skipif(BACKEND != "torch", reason="TorchDynamo is PyTorch's; jax.jit and tf.function give the check "
                    "tracers, which it skips on every backend (test_check_token_ids_rejects_floats_and_out_of_range)")
def test_checking_ids_inside_torch_compile_breaks_no_graph():
    # Reading the ids' values under Dynamo was a graph break (and a wait for the device) at
    # every embedding of a model compiled with Keras' jit_compile=True: fullgraph refuses one.
    import torch

    embed = torch.compile(lambda ids: (kt.ops.check_token_ids(ids, 10), ids * 2)[1], fullgraph=True)
    ids = ops.convert_to_tensor(np.array([[0, 9]], "int32"))
    np.testing.assert_array_equal(to_numpy(embed(ids)), [[0, 18]])
