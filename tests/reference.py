"""The paper's equations in plain NumPy (float64), independent of Keras.

Each function follows one equation or figure of "Attention Is All You Need" and takes
its weights as arguments, so tests can copy weights out of the Keras layers and compare.
Masks are boolean, True = may attend; a masked logit is set to -1e9 (a query with no
allowed key gets the mean of the values, as in the library).
"""

from __future__ import annotations

import numpy as np


def softmax(x, axis=-1):
    x = x - x.max(axis=axis, keepdims=True)
    e = np.exp(x)
    return e / e.sum(axis=axis, keepdims=True)


def attention(q, k, v, mask=None):
    """Eq. 1: softmax(Q K^T / sqrt(d_k)) V, over the last two axes (..., T, d)."""
    d_k = q.shape[-1]
    logits = q @ np.swapaxes(k, -1, -2) / np.sqrt(d_k)
    if mask is not None:
        logits = np.where(mask, logits, -1e9)
    weights = softmax(logits)
    return weights @ v, weights


def multi_head_attention(query, value, w, num_heads, mask=None):
    """Section 3.2.2: MultiHead(Q, K, V) = Concat(head_1..head_h) W^O.

    `w` maps "wq", "bq", "wk", "bk", "wv", "bv", "wo", "bo" to the projections, with
    kernels stored as (in, out) so that x @ W. head_i uses columns i*d_k:(i+1)*d_k.
    `mask` broadcasts to (B, h, T_q, T_k).
    """
    def heads(x, kernel, bias):
        y = x @ kernel + bias  # (B, T, h*d)
        b, t, hd = y.shape
        return y.reshape(b, t, num_heads, hd // num_heads).transpose(0, 2, 1, 3)  # (B, h, T, d)

    q = heads(query, w["wq"], w["bq"])
    k = heads(value, w["wk"], w["bk"])
    v = heads(value, w["wv"], w["bv"])
    out, weights = attention(q, k, v, mask)
    b, h, t, d = out.shape
    concat = out.transpose(0, 2, 1, 3).reshape(b, t, h * d)
    return concat @ w["wo"] + w["bo"], weights


def feed_forward(x, w1, b1, w2, b2):
    """Eq. 2: FFN(x) = max(0, x W1 + b1) W2 + b2."""
    return np.maximum(0.0, x @ w1 + b1) @ w2 + b2


def layer_norm(x, gamma, beta, eps):
    mean = x.mean(-1, keepdims=True)
    var = x.var(-1, keepdims=True)
    return (x - mean) / np.sqrt(var + eps) * gamma + beta


def positional_encoding(length, d_model, start=0, max_wavelength=10000.0):
    """Section 3.5: PE(pos, 2i) = sin(pos / 10000^(2i/d)), PE(pos, 2i+1) = cos(...)."""
    pe = np.zeros((length, d_model))
    for pos in range(length):
        for j in range(d_model):
            i = j // 2
            angle = (pos + start) / max_wavelength ** (2 * i / d_model)
            pe[pos, j] = np.sin(angle) if j % 2 == 0 else np.cos(angle)
    return pe


def embed(token_ids, embeddings, start=0):
    """Section 3.4 + 3.5: E[token] * sqrt(d_model) + PE (dropout is the identity here)."""
    d_model = embeddings.shape[1]
    return embeddings[token_ids] * np.sqrt(d_model) + positional_encoding(token_ids.shape[1], d_model, start)


def causal(t_q, t_k):
    return np.tril(np.ones((t_q, t_k), bool))


def sublayer(x, fn, norm, norm_first, eps):
    """Section 5.4: LayerNorm(x + Sublayer(x)) (post-norm), or x + Sublayer(LayerNorm(x))."""
    if norm_first:
        return x + fn(layer_norm(x, *norm, eps))
    return layer_norm(x + fn(x), *norm, eps)


def encoder_block(x, w, num_heads, key_mask=None, norm_first=False, eps=1e-6):
    """Section 3.1, encoder layer. `w` holds "self_attention", "ffn" and the two norms."""
    mask = None if key_mask is None else key_mask[:, None, None, :]
    x = sublayer(x, lambda y: multi_head_attention(y, y, w["self_attention"], num_heads, mask)[0],
                 w["self_attention_norm"], norm_first, eps)
    return sublayer(x, lambda y: feed_forward(y, *w["ffn"]), w["feed_forward_norm"], norm_first, eps)


def decoder_block(y, x, w, num_heads, target_mask=None, source_mask=None, norm_first=False, eps=1e-6):
    """Section 3.1, decoder layer: masked self-attention, encoder-decoder attention, FFN."""
    t = y.shape[1]
    self_mask = causal(t, t)[None, None]
    if target_mask is not None:
        self_mask = self_mask & target_mask[:, None, None, :]
    cross_mask = None if source_mask is None else source_mask[:, None, None, :]
    y = sublayer(y, lambda z: multi_head_attention(z, z, w["self_attention"], num_heads, self_mask)[0],
                 w["self_attention_norm"], norm_first, eps)
    if x is not None:
        y = sublayer(y, lambda z: multi_head_attention(z, x, w["cross_attention"], num_heads, cross_mask)[0],
                     w["cross_attention_norm"], norm_first, eps)
    return sublayer(y, lambda z: feed_forward(z, *w["ffn"]), w["feed_forward_norm"], norm_first, eps)


def transformer(source_ids, target_ids, w, num_heads, pad_id=0, norm_first=False, eps=1e-6):
    """Figure 1 with tied weights: logits = Decoder(Encoder(embed(src)), embed(tgt)) E^T."""
    E = w["embeddings"]
    src_mask, tgt_mask = source_ids != pad_id, target_ids != pad_id
    x = embed(source_ids, E)
    for block in w["encoder"]:
        x = encoder_block(x, block, num_heads, src_mask, norm_first, eps)
    if norm_first:
        x = layer_norm(x, *w["encoder_final_norm"], eps)
    y = embed(target_ids, E)
    for block in w["decoder"]:
        y = decoder_block(y, x, block, num_heads, tgt_mask, src_mask, norm_first, eps)
    if norm_first:
        y = layer_norm(y, *w["decoder_final_norm"], eps)
    return y @ E.T
