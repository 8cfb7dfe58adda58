"""Parity with PyTorch's reference modules after copying weights (any Keras backend).

torch stores Linear weights as (out, in) and fuses the q, k, v input projections into
one `in_proj_weight` (3 d, d); Keras Dense kernels are (in, out).
"""

import numpy as np
import pytest

import keras_transformer as kt
from tests.conftest import randomize_weights, to_numpy

torch = None  # imported when this file's tests run, not when pytest collects it (see `_torch`)


@pytest.fixture(scope="module", autouse=True)
def _torch():
    """PyTorch, imported for this file's tests: imported while pytest collects, it cost
    every xdist worker of the TensorFlow and JAX suites ~2 s at its start."""
    global torch
    torch = pytest.importorskip("torch", reason="torch is part of the dev extra; parity needs it")


def _t(x):
    return torch.tensor(np.asarray(x, dtype="float32"))


def _copy_mha(keras_mha, torch_mha):
    k = lambda d: to_numpy(d.kernel, "float32")
    b = lambda d: to_numpy(d.bias, "float32")
    with torch.no_grad():
        torch_mha.in_proj_weight.copy_(_t(np.concatenate([k(keras_mha.query_dense).T, k(keras_mha.key_dense).T, k(keras_mha.value_dense).T])))
        torch_mha.in_proj_bias.copy_(_t(np.concatenate([b(keras_mha.query_dense), b(keras_mha.key_dense), b(keras_mha.value_dense)])))
        torch_mha.out_proj.weight.copy_(_t(k(keras_mha.output_dense).T))
        torch_mha.out_proj.bias.copy_(_t(b(keras_mha.output_dense)))


def _copy_norm(keras_norm, torch_norm):
    with torch.no_grad():
        torch_norm.weight.copy_(_t(to_numpy(keras_norm.gamma)))
        torch_norm.bias.copy_(_t(to_numpy(keras_norm.beta)))


def _copy_ffn(ffn, linear1, linear2):
    with torch.no_grad():
        linear1.weight.copy_(_t(to_numpy(ffn.inner_dense.kernel).T))
        linear1.bias.copy_(_t(to_numpy(ffn.inner_dense.bias)))
        linear2.weight.copy_(_t(to_numpy(ffn.outer_dense.kernel).T))
        linear2.bias.copy_(_t(to_numpy(ffn.outer_dense.bias)))


def _inputs():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(2, 6, 8)).astype("float32")
    y = rng.normal(size=(2, 5, 8)).astype("float32")
    src_mask = np.array([[1] * 6, [1, 1, 1, 1, 0, 0]], bool)
    return x, y, src_mask


def test_multi_head_attention_matches_torch():
    layer = kt.layers.MultiHeadAttention(num_heads=2)
    layer.build((None, None, 8), (None, None, 8))
    randomize_weights(layer)
    reference = torch.nn.MultiheadAttention(8, 2, batch_first=True)
    _copy_mha(layer, reference)
    x, y, src_mask = _inputs()
    out, weights = layer(y, x, value_mask=src_mask, return_attention_scores=True)
    with torch.no_grad():
        t_out, t_weights = reference(_t(y), _t(x), _t(x), key_padding_mask=torch.tensor(~src_mask), average_attn_weights=False)
    np.testing.assert_allclose(to_numpy(out), t_out.numpy(), atol=1e-5)
    np.testing.assert_allclose(to_numpy(weights), t_weights.numpy(), atol=1e-5)
    # Causal self-attention: torch's boolean attn_mask marks forbidden pairs with True.
    out = layer(y, y, use_causal_mask=True)
    causal = torch.triu(torch.ones(5, 5, dtype=torch.bool), diagonal=1)
    with torch.no_grad():
        t_out, _ = reference(_t(y), _t(y), _t(y), attn_mask=causal)
    np.testing.assert_allclose(to_numpy(out), t_out.numpy(), atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_encoder_block_matches_torch(norm_first):
    block = kt.layers.EncoderBlock(num_heads=2, d_ff=16, norm_first=norm_first)
    block.build((None, None, 8))
    randomize_weights(block, scale=0.3)
    reference = torch.nn.TransformerEncoderLayer(
        8, 2, dim_feedforward=16, dropout=0.0, activation="relu", layer_norm_eps=1e-6,
        batch_first=True, norm_first=norm_first,
    ).eval()
    _copy_mha(block.self_attention, reference.self_attn)
    _copy_ffn(block.feed_forward, reference.linear1, reference.linear2)
    _copy_norm(block.self_attention_norm, reference.norm1)
    _copy_norm(block.feed_forward_norm, reference.norm2)
    x, _, src_mask = _inputs()
    out = to_numpy(block(x, padding_mask=src_mask))
    with torch.no_grad():
        expected = reference(_t(x), src_key_padding_mask=torch.tensor(~src_mask)).numpy()
    # torch's fast path returns zeros at padded positions; compare real positions.
    np.testing.assert_allclose(out[src_mask], expected[src_mask], atol=1e-5)


@pytest.mark.parametrize("norm_first", [False, True])
def test_decoder_block_matches_torch(norm_first):
    block = kt.layers.DecoderBlock(num_heads=2, d_ff=16, norm_first=norm_first)
    block.build((None, None, 8), (None, None, 8))
    randomize_weights(block, scale=0.3)
    reference = torch.nn.TransformerDecoderLayer(
        8, 2, dim_feedforward=16, dropout=0.0, activation="relu", layer_norm_eps=1e-6,
        batch_first=True, norm_first=norm_first,
    ).eval()
    _copy_mha(block.self_attention, reference.self_attn)
    _copy_mha(block.cross_attention, reference.multihead_attn)
    _copy_ffn(block.feed_forward, reference.linear1, reference.linear2)
    _copy_norm(block.self_attention_norm, reference.norm1)
    _copy_norm(block.cross_attention_norm, reference.norm2)
    _copy_norm(block.feed_forward_norm, reference.norm3)
    x, y, src_mask = _inputs()
    out = to_numpy(block(y, x, encoder_padding_mask=src_mask))
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5)
    with torch.no_grad():
        expected = reference(_t(y), _t(x), tgt_mask=causal, memory_key_padding_mask=torch.tensor(~src_mask)).numpy()
    np.testing.assert_allclose(out, expected, atol=1e-5)
