"""Attention and mask functions of "Attention Is All You Need", in `keras.ops`.

Everything here works on the TensorFlow, JAX and PyTorch backends, eagerly, under
`jax.jit` / `tf.function`, and on symbolic Keras tensors.

Tensor layout follows `keras.ops.dot_product_attention`: queries, keys and values are
`(B, T, h, d_k)` (batch, positions, heads, head size). Masks are boolean and `True`
means "may attend".
"""

from __future__ import annotations

import math

import keras
import numpy as np
from keras import ops

from keras_transformer import _checks, _compat
from keras_transformer.defaults import PAD_ID

__all__ = [
    "scaled_dot_product_attention",
    "windowed_attention",
    "band_mask",
    "padding_mask",
    "causal_mask",
    "combine_masks",
    "check_token_ids",
]


def padding_mask(token_ids, pad_id: int = PAD_ID):
    """Boolean mask that is `True` at real tokens and `False` at padding.

    Args:
        token_ids: Integer tensor of token ids, shape `(B, T)`.
        pad_id: The id used for padding. Defaults to `0`.

    Returns:
        A boolean tensor of shape `(B, T)`.

    Example:

    >>> import numpy as np
    >>> from keras import ops
    >>> m = padding_mask(np.array([[5, 7, 0, 0]]))
    >>> ops.convert_to_numpy(m).tolist()
    [[True, True, False, False]]
    """
    return ops.not_equal(token_ids, pad_id)


def causal_mask(query_length, key_length=None, offset=0):
    """Lower-triangular mask: query position `i` may attend to key `j` iff `j <= i + offset`.

    This is the decoder's "masking out (setting to -inf) all values in the input of the
    softmax which correspond to illegal connections" (paper, section 3.2.3).

    Args:
        query_length: Number of query positions `T_q` (int or scalar tensor).
        key_length: Number of key positions `T_k`. Defaults to `query_length`.
        offset: Position of the first query, e.g. the cache index during incremental
            decoding. Defaults to `0`.

    Returns:
        A boolean tensor of shape `(T_q, T_k)`.

    Example:

    >>> from keras import ops
    >>> ops.convert_to_numpy(causal_mask(3)).astype(int).tolist()
    [[1, 0, 0], [1, 1, 0], [1, 1, 1]]
    """
    _check_lengths(query_length=query_length, key_length=key_length)
    if key_length is None:
        key_length = query_length
    q_pos = ops.arange(query_length, dtype="int32") + ops.cast(offset, "int32")
    k_pos = ops.arange(key_length, dtype="int32")
    return ops.greater_equal(ops.expand_dims(q_pos, 1), ops.expand_dims(k_pos, 0))


def _check_lengths(**lengths) -> None:
    """Refuse a number of positions given as a Python value that is not an integer >= 0
    (`causal_mask(2.5)` was 3 x 3); a tensor (a traced length) passes."""
    _checks.counts("keras_transformer: ", **{k: v for k, v in lengths.items() if v is not None and not ops.is_tensor(v)})


def combine_masks(*masks):
    """Logical AND of the masks that are not `None`; `None` if all are `None`.

    Masks must broadcast against each other (e.g. `(B, 1, 1, T_k)` and `(T_q, T_k)`).
    """
    result = None
    for mask in masks:
        if mask is None:
            continue
        mask = _checks.boolean_mask("keras_transformer: ", "mask", mask)
        result = mask if result is None else ops.logical_and(result, mask)
    return result


def _large_negative(dtype):
    # A finite stand-in for -inf: a row whose keys are all masked then gets a uniform
    # softmax (finite output) instead of NaN, the same as the fused kernels of every
    # backend do. float16 tops out at 65504, so use a smaller magnitude there.
    return -3e4 if keras.backend.standardize_dtype(dtype) == "float16" else -1e9


def scaled_dot_product_attention(
    query,
    key,
    value,
    mask=None,
    dropout: float = 0.0,
    training=None,
    seed=None,
    return_attention_scores: bool = False,
    heads_first: bool = False,
):
    """Scaled dot-product attention, `softmax(Q K^T / sqrt(d_k)) V` (paper, eq. 1).

    Section 3.2.1 of the paper. When no dropout is applied and no attention weights are
    requested, this calls `keras.ops.dot_product_attention`, which dispatches to fused
    kernels (cuDNN / flash attention) where the backend and hardware have them (when
    d_v = d_k, as in the paper); otherwise
    the weights are computed explicitly, with the softmax in float32.

    Args:
        query: `(B, T_q, h, d_k)` queries.
        key: `(B, T_k, h, d_k)` keys.
        value: `(B, T_k, h, d_v)` values.
        mask: Optional boolean mask, `True` = may attend, broadcastable to
            `(B, h, T_q, T_k)`. A query whose keys are all masked receives the mean of
            the values (a finite output) rather than NaN. Defaults to `None`.
        dropout: Dropout rate on the attention weights. Defaults to `0.0`.
        training: Whether dropout is active. Defaults to `None` (inactive).
        seed: Seed or `keras.random.SeedGenerator` for dropout. Defaults to `None`.
        return_attention_scores: Also return the attention weights
            `(B, h, T_q, T_k)`. Defaults to `False`.
        heads_first: `key` and `value` are laid out `(B, h, T_k, d)`, as a decoding
            cache keeps them (`MultiHeadAttention.init_cache`), and are read in that
            layout. Defaults to `False`.

    Returns:
        The attended values, `(B, T_q, h, d_v)`; with `return_attention_scores=True`,
        the tuple `(values, weights)`.

    Example:

    >>> import numpy as np
    >>> q = np.random.default_rng(0).normal(size=(2, 5, 4, 8)).astype("float32")
    >>> out = scaled_dot_product_attention(q, q, q)
    >>> tuple(out.shape)
    (2, 5, 4, 8)
    """
    _check_attention(query, key, value, mask, heads_first)
    dropout = _checks.rates("keras_transformer: ", dropout=dropout)
    d_k = query.shape[-1]
    scale = 1.0 / math.sqrt(d_k)
    if mask is not None:
        mask = _checks.boolean_mask("keras_transformer: ", "mask", mask)
        while len(mask.shape) < 4:
            mask = ops.expand_dims(mask, 0)
    use_dropout = dropout > 0.0 and bool(training)
    # The fused kernels need d_v == d_k; the paper's d_v = d_k always qualifies.
    fusable = key.shape[-1] == value.shape[-1]
    if fusable and not use_dropout and not return_attention_scores:
        if not heads_first:
            return ops.dot_product_attention(query, key, value, mask=mask, scale=scale)
        if _compat.fused_attention_reads_heads_first():
            key, value = (ops.transpose(x, (0, 2, 1, 3)) for x in (key, value))
            return ops.dot_product_attention(query, key, value, mask=mask, scale=scale)

    compute_dtype = keras.backend.standardize_dtype(query.dtype)
    # (B, h, T_q, T_k): one score per query/key pair and head.
    kv = "bhkd" if heads_first else "bkhd"
    scores = ops.einsum(f"bqhd,{kv}->bhqk", query, key)
    scores = ops.cast(scores, "float32") * scale
    if mask is not None:
        scores = ops.where(mask, scores, _large_negative("float32"))
    # One key: its weight is 1, masked or not (Keras warns about a softmax over one value).
    weights = ops.ones_like(scores) if scores.shape[-1] == 1 else ops.softmax(scores, axis=-1)
    weights = ops.cast(weights, compute_dtype)
    dropped = weights
    if use_dropout:
        dropped = keras.random.dropout(weights, dropout, seed=seed)
    outputs = ops.einsum(f"bhqk,{kv}->bqhd", dropped, value)
    if return_attention_scores:
        return outputs, weights
    return outputs


def _check_attention(query, key, value, mask=None, heads_first: bool = False) -> None:
    """Refuse queries, keys, values and a mask that attention cannot pair up, where their
    sizes are known (a key of another depth failed inside an einsum, a mask of the wrong
    length inside the backend's broadcasting)."""
    layout = "(batch, heads, positions, depth)" if heads_first else "(batch, positions, heads, depth)"
    shapes = {name: tuple(x.shape) for name, x in (("query", query), ("key", key), ("value", value))}
    for name, shape in shapes.items():
        if len(shape) != 4:
            expected = "(batch, positions, heads, depth)" if name == "query" else layout
            raise ValueError(f"keras_transformer: `{name}` must have rank 4, {expected}. Received: {name}.shape={shape}")
    q, k, v = shapes.values()
    if heads_first:  # as (B, T, h, d)
        k, v = (k[0], k[2], k[1], k[3]), (v[0], v[2], v[1], v[3])

    def differ(*sizes):
        return len({size for size in sizes if size is not None}) > 1

    if differ(q[0], k[0], v[0]) or differ(q[2], k[2], v[2]) or differ(k[1], v[1]) or differ(q[3], k[3]):
        raise ValueError("keras_transformer: `query`, `key` and `value` must have one batch size and one number of "
                         "heads, `key` and `value` one length, `query` and `key` one depth; `key` and `value` are "
                         f"{layout}. Received: query.shape={shapes['query']}, key.shape={shapes['key']}, "
                         f"value.shape={shapes['value']}")
    if mask is None:
        return
    shape, expected = tuple(mask.shape), (q[0], q[2], q[1], k[1])
    if len(shape) > 4 or any(size not in (None, 1, want) and want is not None
                             for size, want in zip(shape[::-1], expected[::-1])):
        raise ValueError("keras_transformer: `mask` must be broadcastable to (batch, heads, query positions, key "
                         f"positions) = {expected}. Received: mask.shape={shape}")


def check_window(window, where: str = "keras_transformer") -> int | None:
    """Refuse a restricted-attention window that is not an integer >= 1 (or None); returns
    it as a Python int (NumPy's integers count). The rule is `_checks.window`'s."""
    return _checks.window(f"{where}: ", window)


def _required_window(window) -> int:
    if window is None:
        raise ValueError("keras_transformer: `window` must be an integer >= 1. Received: window=None")
    return check_window(window)


def band_mask(query_length, key_length, window: int, causal: bool = False, offset=0):
    """Restricted attention's mask: query `i` may attend to key `j` iff `|i + offset - j| <= window`
    (and `j <= i + offset` if `causal`). Shape `(T_q, T_k)`.

    Example:

    >>> from keras import ops
    >>> ops.convert_to_numpy(band_mask(4, 4, window=1)).astype(int).tolist()
    [[1, 1, 0, 0], [1, 1, 1, 0], [0, 1, 1, 1], [0, 0, 1, 1]]
    """
    _check_lengths(query_length=query_length, key_length=key_length)
    window = _required_window(window)
    q_pos = ops.arange(query_length, dtype="int32") + ops.cast(offset, "int32")
    k_pos = ops.arange(key_length, dtype="int32")
    distance = ops.expand_dims(q_pos, 1) - ops.expand_dims(k_pos, 0)  # i - j
    mask = ops.less_equal(ops.abs(distance), window)
    if causal:
        mask = ops.logical_and(mask, ops.greater_equal(distance, 0))
    return mask


def windowed_attention(query, key, value, window: int, key_mask=None, causal: bool = False,
                       dropout: float = 0.0, training=None, seed=None):
    """Restricted self-attention (paper, Table 1): each query attends to keys within `window`.

    Computed block-wise so that no `(T, T)` tensor is formed: the sequence is cut into
    blocks of `window` positions, and the queries of block m attend to the keys of blocks
    m - 1, m and m + 1 (`3 * window` keys), masked to the band `|i - j| <= window`. Time
    and memory grow as O(n * r * d) instead of O(n^2 * d). The result equals
    `scaled_dot_product_attention` under `band_mask`.

    Args:
        query: `(B, T, h, d_k)`.
        key: `(B, T, h, d_k)`, the same length T as `query` (self-attention).
        value: `(B, T, h, d_v)`.
        window: r >= 1.
        key_mask: Optional boolean `(B, T)` key padding mask.
        causal: Also forbid keys after the query. Defaults to `False`.
        dropout: Dropout rate on the attention weights. Defaults to `0.0`.
        training: Whether dropout is active.
        seed: Seed or `keras.random.SeedGenerator` for dropout.

    Returns:
        `(B, T, h, d_v)`.

    Example:

    >>> import numpy as np
    >>> x = np.random.default_rng(0).normal(size=(1, 10, 2, 4)).astype("float32")
    >>> tuple(windowed_attention(x, x, x, window=3).shape)
    (1, 10, 2, 4)
    """
    window = _required_window(window)
    _check_attention(query, key, value)
    if len({x.shape[1] for x in (query, key, value)} - {None}) > 1:  # a distance between positions of one sequence
        raise ValueError("keras_transformer: `windowed_attention` is self-attention: `query`, `key` and `value` must "
                         f"have one length. Received: query.shape={tuple(query.shape)}, key.shape={tuple(key.shape)}")
    dropout = _checks.rates("keras_transformer: ", dropout=dropout)
    b = window  # block size
    batch, length = ops.shape(query)[0], ops.shape(query)[1]
    heads, d_k, d_v = query.shape[2], query.shape[3], value.shape[3]
    num_blocks = (length + b - 1) // b
    padded = num_blocks * b

    def pad(x, before, after):
        return ops.pad(x, [[0, 0], [before, after]] + [[0, 0]] * (len(x.shape) - 2))

    def windows(x):
        # (B, T, ...) -> (B, num_blocks, 3b, ...): for block m, positions [(m-1)b, (m+2)b).
        x = pad(x, b, padded - length + b)
        rest = tuple(x.shape[2:])
        parts = [ops.reshape(ops.slice(x, [0, s] + [0] * len(rest), (batch, padded) + rest),
                             (batch, num_blocks, b) + rest) for s in (0, b, 2 * b)]
        return ops.concatenate(parts, axis=2)

    q = ops.reshape(pad(query, 0, padded - length), (batch, num_blocks, b, heads, d_k))
    k, v = windows(key), windows(value)  # (B, M, 3b, h, d)
    valid = ops.ones((batch, length), "bool") if key_mask is None else _checks.boolean_mask(
        "keras_transformer: ", "key_mask", key_mask)
    valid = windows(valid)  # (B, M, 3b): False for padding and positions outside [0, T)

    # Relative position of key slot k to query slot q inside a block: (k - b) - q.
    distance = ops.arange(3 * b, dtype="int32")[None, :] - b - ops.arange(b, dtype="int32")[:, None]
    band = ops.less_equal(ops.abs(distance), window)
    if causal:
        band = ops.logical_and(band, ops.less_equal(distance, 0))
    mask = ops.logical_and(band[None, None, None], valid[:, None, :, None, :])  # (B, 1, M, b, 3b)

    scores = ops.einsum("bmqhd,bmkhd->bhmqk", q, k)  # (B, h, M, b, 3b)
    scores = ops.cast(scores, "float32") * (1.0 / math.sqrt(d_k))
    scores = ops.where(mask, scores, _large_negative("float32"))
    weights = ops.cast(ops.softmax(scores, axis=-1), query.dtype)
    if dropout > 0.0 and training:
        weights = keras.random.dropout(weights, dropout, seed=seed)
    out = ops.einsum("bhmqk,bmkhd->bmqhd", weights, v)  # (B, M, b, h, d_v)
    out = ops.reshape(out, (batch, padded, heads, d_v))
    return out[:, :length]


def check_token_ids(token_ids, vocab_size: int, name: str = "token_ids", layer=None):
    """Validate token ids: integer dtype always, value range when values are readable.

    Float ids are refused on every backend, eagerly or symbolically. Out-of-range ids
    are refused whenever the ids are concrete (eager execution on any backend); inside
    a compiled function (`jax.jit`, `tf.function`, `torch.compile`) the values cannot be
    read, and the check is skipped.

    Raises:
        ValueError: naming the layer, the argument and what was received.
    """
    where = f"Layer '{layer.name}'" if layer is not None else "keras_transformer"
    dtype = keras.backend.standardize_dtype(token_ids.dtype)
    if "int" not in dtype:
        raise ValueError(
            f"{where}: `{name}` must be an integer tensor of token ids. "
            f"Received: dtype={dtype}, shape={tuple(token_ids.shape)}"
        )
    values = _checks.concrete_values(token_ids)
    if values is None or values.size == 0:
        return
    low, high = int(values.min()), int(values.max())
    if low < 0 or high >= vocab_size:
        raise ValueError(
            f"{where}: `{name}` must be in [0, {vocab_size}) (vocab_size={vocab_size}). "
            f"Received: min={low}, max={high}"
        )
