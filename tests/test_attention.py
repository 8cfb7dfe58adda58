import re

import keras
import numpy as np
import pytest

import keras_transformer as kt
from tests import reference as ref
from tests.conftest import mha_weights, randomize_weights, to_numpy


def _layer(num_heads=2, d_model=8, t_q=5, t_k=None, **kwargs):
    layer = kt.layers.MultiHeadAttention(num_heads, **kwargs)
    layer.build((None, t_q, d_model), (None, t_k or t_q, d_model))
    randomize_weights(layer)
    return layer


def test_self_attention_matches_reference_and_default_head_size():
    layer = _layer(num_heads=4, d_model=16)
    assert tuple(layer.query_dense.kernel.shape) == (16, 16)  # h * d_k with d_k = 16 / 4
    assert tuple(layer.output_dense.kernel.shape) == (16, 16)
    x = np.random.default_rng(0).normal(size=(2, 5, 16)).astype("float32")
    out, scores = layer(x, x, return_attention_scores=True)
    expected, expected_w = ref.multi_head_attention(x.astype("float64"), x.astype("float64"), mha_weights(layer), 4)
    np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5)
    np.testing.assert_allclose(to_numpy(scores), expected_w, atol=1e-5)


def test_cross_attention_with_key_padding_matches_reference():
    layer = _layer(num_heads=2, d_model=8, t_q=4, t_k=6)
    rng = np.random.default_rng(1)
    y = rng.normal(size=(2, 4, 8)).astype("float32")
    x = rng.normal(size=(2, 6, 8)).astype("float32")
    key_mask = np.array([[1, 1, 1, 1, 0, 0], [1, 1, 1, 1, 1, 1]], bool)
    out, scores = layer(y, x, value_mask=key_mask, return_attention_scores=True)
    expected, _ = ref.multi_head_attention(y, x, mha_weights(layer), 2, key_mask[:, None, None, :])
    np.testing.assert_allclose(to_numpy(out), expected, atol=1e-5)
    assert np.all(to_numpy(scores)[0, :, :, 4:] == 0.0)


def test_causal_mask_blocks_future_positions():
    layer = _layer()
    x = np.random.default_rng(2).normal(size=(1, 5, 8)).astype("float32")
    out = to_numpy(layer(x, x, use_causal_mask=True))
    expected, _ = ref.multi_head_attention(x, x, mha_weights(layer), 2, ref.causal(5, 5)[None, None])
    np.testing.assert_allclose(out, expected, atol=1e-5)
    # Changing a later position does not change earlier outputs.
    x2 = x.copy()
    x2[0, 3:] += 5.0
    out2 = to_numpy(layer(x2, x2, use_causal_mask=True))
    np.testing.assert_allclose(out[0, :3], out2[0, :3], atol=1e-5)
    assert not np.allclose(out[0, 3:], out2[0, 3:], atol=1e-3)


def test_explicit_attention_mask_and_query_mask_combine():
    layer = _layer()
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    attn = rng.random((2, 5, 5)) > 0.4
    attn[..., 0] = True
    qmask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]], bool)
    out = to_numpy(layer(x, x, attention_mask=attn, query_mask=qmask))
    mask = attn[:, None] & qmask[:, None, :, None]
    expected, _ = ref.multi_head_attention(x, x, mha_weights(layer), 2, mask)
    np.testing.assert_allclose(out, expected, atol=1e-5)


def test_cache_call_is_correct():
    """Step-by-step decoding with a preallocated cache equals the full causal pass."""
    layer = _layer(num_heads=2, d_model=8, t_q=6)
    x = np.random.default_rng(4).normal(size=(2, 6, 8)).astype("float32")
    full = to_numpy(layer(x, x, use_causal_mask=True))
    max_length = 9  # longer than needed: unfilled slots must be masked
    cache = layer.init_cache(2, max_length)
    assert [tuple(c.shape) for c in cache] == [(2, 2, max_length, 4)] * 2  # keys, values: (B, h, L, d)
    steps = []
    for i in range(6):
        xi = x[:, i : i + 1]
        out, cache = layer(xi, xi, use_causal_mask=True, cache=cache, cache_index=i)
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)
    # The cache holds the projected keys and values of the six positions and zeros after.
    for filled, projected in zip(cache, layer.compute_key_value(x)):
        filled = to_numpy(filled)
        np.testing.assert_allclose(filled[:, :, :6], to_numpy(projected).transpose(0, 2, 1, 3), atol=1e-5)
        assert np.all(filled[:, :, 6:] == 0)


def test_cache_prefill_then_step():
    layer = _layer(num_heads=2, d_model=8, t_q=5)
    x = np.random.default_rng(5).normal(size=(1, 5, 8)).astype("float32")
    full = to_numpy(layer(x, x, use_causal_mask=True))
    cache = layer.init_cache(1, 5)
    first, cache = layer(x[:, :3], x[:, :3], use_causal_mask=True, cache=cache, cache_index=0)
    rest, cache = layer(x[:, 3:], x[:, 3:], use_causal_mask=True, cache=cache, cache_index=3)
    np.testing.assert_allclose(np.concatenate([to_numpy(first), to_numpy(rest)], 1), full, atol=1e-5)


def test_precomputed_cross_attention_cache():
    layer = _layer(t_q=3, t_k=4)
    rng = np.random.default_rng(6)
    y, x = rng.normal(size=(2, 3, 8)).astype("float32"), rng.normal(size=(2, 4, 8)).astype("float32")
    direct = to_numpy(layer(y, x))
    kv = layer.compute_cache(x)
    # `value` beside the cache is another tensor: the keys and values must come from the cache.
    other = np.zeros_like(x)
    assert not np.allclose(to_numpy(layer(y, other)), direct, atol=1e-3)
    cached, _ = layer(y, other, cache=kv)
    np.testing.assert_allclose(to_numpy(cached), direct, atol=1e-6)


def test_dropout_on_weights_only_in_training():
    layer = _layer(dropout=0.5)
    x = np.random.default_rng(7).normal(size=(2, 5, 8)).astype("float32")
    a, b = to_numpy(layer(x, x)), to_numpy(layer(x, x, training=False))
    np.testing.assert_allclose(a, b)
    assert not np.allclose(to_numpy(layer(x, x, training=True)), a, atol=1e-4)


def test_all_padding_keys_give_finite_outputs():
    for policy in ["float32", "mixed_float16", "mixed_bfloat16"]:
        layer = kt.layers.MultiHeadAttention(2, dtype=policy)
        x = np.random.default_rng(8).normal(size=(2, 4, 8)).astype("float32")
        key_mask = np.array([[0, 0, 0, 0], [1, 1, 0, 0]], bool)
        out = layer(x, x, value_mask=key_mask)
        assert np.isfinite(to_numpy(out)).all(), policy
        out, w = layer(x, x, value_mask=key_mask, return_attention_scores=True)
        assert np.isfinite(to_numpy(out)).all() and np.isfinite(to_numpy(w)).all(), policy


@pytest.mark.parametrize(
    "query_shape, value_shape, kwargs, match",
    [
        ((2, 5, 8), (2, 5, 6), {}, r"same width d_model.*query.shape=\(2, 5, 8\).*value.shape=\(2, 5, 6\)"),
        ((2, 5, 10), (2, 5, 10), {"num_heads": 4}, r"divisible.*d_model=10.*num_heads=4"),
        ((2, 8), (2, 8), {}, r"`query` must have rank 3.*query.shape=\(2, 8\)"),
        # A value of batch 1 was broadcast to the queries' 2 (JAX logging an error on the way).
        ((2, 5, 8), (1, 5, 8), {}, r"`query` and `value` must have the same batch size.*value.shape=\(1, 5, 8\)"),
        ((2, 5, 8), (3, 5, 8), {}, r"`query` and `value` must have the same batch size"),
    ],
)
def test_bad_shapes_raise_value_error_naming_layer(query_shape, value_shape, kwargs, match):
    layer = kt.layers.MultiHeadAttention(kwargs.pop("num_heads", 2), name="my_attention", **kwargs)
    with pytest.raises(ValueError, match="my_attention") as info:
        layer(np.zeros(query_shape, "float32"), np.zeros(value_shape, "float32"))
    assert re.search(match, str(info.value)), str(info.value)


def test_key_dim_given_allows_any_width():
    layer = kt.layers.MultiHeadAttention(4, key_dim=3, value_dim=5)
    out = layer(np.zeros((1, 2, 10), "float32"), np.zeros((1, 3, 10), "float32"))
    assert tuple(out.shape) == (1, 2, 10)
    assert tuple(layer.value_dense.kernel.shape) == (10, 20)
    assert tuple(layer.output_dense.kernel.shape) == (20, 10)


@pytest.mark.parametrize("bad, match", [
    (dict(num_heads=0), r"`num_heads` must be a positive integer\. Received: num_heads=0"),
    (dict(num_heads=True), r"`num_heads` must be a positive integer\. Received: num_heads=True"),
    (dict(num_heads=2, key_dim=0), r"`key_dim` must be a positive integer or None\. Received: key_dim=0"),
    (dict(num_heads=2, dropout=1.0), r"`dropout` must be in \[0, 1\)\. Received: dropout=1\.0"),
])
def test_bad_constructor_arguments(bad, match):
    with pytest.raises(ValueError, match="Layer 'mha': " + match):
        kt.layers.MultiHeadAttention(**bad, name="mha")


def test_cache_with_value_dim_other_than_key_dim():
    layer = _layer(num_heads=2, d_model=8, t_q=4, key_dim=3, value_dim=5)
    x = np.random.default_rng(8).normal(size=(2, 4, 8)).astype("float32")
    full = to_numpy(layer(x, x, use_causal_mask=True))
    cache = layer.init_cache(2, 6)
    assert [tuple(c.shape) for c in cache] == [(2, 2, 6, 3), (2, 2, 6, 5)]
    steps = []
    for i in range(4):
        out, cache = layer(x[:, i : i + 1], x[:, i : i + 1], use_causal_mask=True, cache=cache, cache_index=i)
        steps.append(to_numpy(out))
    np.testing.assert_allclose(np.concatenate(steps, axis=1), full, atol=1e-5)


def test_cache_needs_a_built_layer():
    with pytest.raises(ValueError, match="build it first"):
        kt.layers.MultiHeadAttention(2).init_cache(1, 4)


def test_symbolic_cache_call_specs():
    """In a Functional graph, the cached call returns the output and a cache of the cache's shape."""
    layer = kt.layers.MultiHeadAttention(2)
    x = keras.Input((1, 8))
    cache = (keras.Input((2, 6, 4)), keras.Input((2, 6, 4)))  # keys, values: (h, L, d) per row
    out, new_cache = layer(x, x, use_causal_mask=True, cache=cache, cache_index=2)
    assert tuple(out.shape) == (None, 1, 8)
    assert [tuple(c.shape) for c in new_cache] == [(None, 2, 6, 4)] * 2


def test_padding_masks_of_the_wrong_shape_are_refused():
    layer = _layer(num_heads=2, d_model=8, t_q=4, t_k=6)
    rng = np.random.default_rng(9)
    y, x = rng.normal(size=(2, 4, 8)).astype("float32"), rng.normal(size=(2, 6, 8)).astype("float32")
    with pytest.raises(ValueError, match=r"`value_mask` must have shape \(batch, positions\) = \(2, 6\)\. Received: value_mask.shape=\(2, 4\)"):
        layer(y, x, value_mask=np.ones((2, 4), bool))  # would reshape to (B=3, ...) silently with -1
    with pytest.raises(ValueError, match=r"`query_mask` must have shape .* Received: query_mask.shape=\(2, 4, 1\)"):
        layer(y, x, query_mask=np.ones((2, 4, 1), bool))
    with pytest.raises(ValueError, match=r"value_mask.shape=\(1, 6\)"):
        layer(y, x, value_mask=np.ones((1, 6), bool))
    # An attention mask: its known sizes must be the batch's, the queries' and the keys' (or 1).
    for bad in ((2, 6, 4), (3, 4, 6), (2, 2, 4, 5), (2, 4)):
        with pytest.raises(ValueError, match=rf"= \(2, 4, 6\)\. Received: attention_mask.shape={re.escape(str(bad))}"):
            layer(y, x, attention_mask=np.ones(bad, bool))
    for good in ((2, 4, 6), (1, 1, 6), (2, 2, 4, 6)):
        assert tuple(layer(y, x, attention_mask=np.ones(good, bool)).shape) == (2, 4, 8)
    # A built layer checks the query of every later call, not only the first.
    for bad, match in (((4, 8), "expected ndim=3, found ndim=2"), ((2, 4, 6), "expected axis -1 of input shape to have value 8")):
        with pytest.raises(ValueError, match=match):
            layer(np.zeros(bad, "float32"), x)


def test_an_additive_float_mask_is_refused_and_a_zero_one_mask_is_read_as_booleans():
    # 0 = attend and -1e9 = not (PyTorch's float attn_mask) was read as booleans the other way round.
    rng = np.random.default_rng(3)
    x = rng.normal(size=(2, 5, 8)).astype("float32")
    real = np.arange(5) < np.array([[3], [5]])
    additive = np.where(real, 0.0, -1e9).astype("float32")
    encoder, layer = kt.layers.Encoder(1, 2, 16, name="encoder"), kt.layers.MultiHeadAttention(2)
    says = r"must be boolean, `True` = may attend \(or 0 and 1\)\. Received: a float mask with values from -1e\+09 to 0"
    for call, name in ((lambda: encoder(x, padding_mask=additive), "Layer 'encoder': `padding_mask`"),
                       (lambda: layer(x, x, attention_mask=additive[:, None, :] + np.zeros((1, 5, 1), "float32")),
                        "`attention_mask`"),
                       (lambda: kt.ops.scaled_dot_product_attention(x[:, :, None], x[:, :, None], x[:, :, None],
                                                                     mask=additive[:, None, None, :]), "`mask`")):
        with pytest.raises(ValueError, match=f"{name} {says}.*pass `.*=mask == 0`"):
            call()
    expected = to_numpy(encoder(x, padding_mask=real))
    for same in (real.astype("float32"), real.astype("int32"), additive == 0):
        np.testing.assert_allclose(to_numpy(encoder(x, padding_mask=same)), expected, atol=1e-6)


def test_a_cache_that_is_not_keys_and_values_is_refused():
    layer = _layer(num_heads=2, d_model=8, t_q=1)
    x = np.zeros((2, 1, 8), "float32")
    keys, values = layer.init_cache(2, 4)
    for bad in (keras.ops.concatenate([keys, values], axis=-1), (keys,), (keys, values[0])):
        with pytest.raises(ValueError, match=r"`cache` must be `\(keys, values\)`"):
            layer(x, x, use_causal_mask=True, cache=bad, cache_index=0)
    with pytest.raises(ValueError, match=r"`query` and `cache` must have the same batch size.*cache.shape=\(2, 2, 4, 4\)"):
        layer(x[:1], x[:1], use_causal_mask=True, cache=(keys, values), cache_index=0)
