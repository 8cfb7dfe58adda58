"""Multi-head attention (paper, section 3.2.2)."""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer import _checks, _compat
from keras_transformer import ops as kt_ops


@keras.saving.register_keras_serializable(package="keras_transformer")
class MultiHeadAttention(keras.layers.Layer):
    """Multi-head attention, `Concat(head_1, ..., head_h) W^O` (paper, section 3.2.2).

    `head_i = Attention(Q W_i^Q, K W_i^K, V W_i^V)` with scaled dot-product attention
    (eq. 1). The per-head projections of all `h` heads are held in one
    `keras.layers.Dense` per role: `query_dense` and `key_dense` with kernels
    `(d_model, h * d_k)`, `value_dense` with `(d_model, h * d_v)` and `output_dense`
    with `(h * d_v, d_model)`.

    The same layer serves the three uses in the paper (section 3.2.3): encoder
    self-attention (`query` = `value`), encoder-decoder attention (queries from the
    decoder, keys and values from the encoder output) and masked decoder
    self-attention (`use_causal_mask=True`).

    Symbols: `num_heads` = h, `key_dim` = d_k, `value_dim` = d_v, the width of `query`
    = d_model.

    Args:
        num_heads: Number of heads h.
        key_dim: Size d_k of each query/key head. Defaults to `d_model // num_heads`
            (the paper's choice, so total cost matches single-head attention).
        value_dim: Size d_v of each value head. Defaults to `key_dim`.
        dropout: Dropout rate on the attention weights. The paper applies dropout
            only to sub-layer outputs; this is an extra regulariser. Defaults to `0.0`.
        use_bias: Whether the four projections have biases. Defaults to `True`.
        window: Restricted self-attention (paper, Table 1): each query attends only to
            keys within this distance r, computed block-wise in O(n * r * d) time and
            memory (see `keras_transformer.ops.windowed_attention`). Self-attention
            only: `query` and `value` must be the same tensor. Defaults to `None`
            (full attention).
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        query: `(B, T_q, d_model)`.
        value: `(B, T_k, d_model)`. For self-attention pass the same tensor as `query`.
        key: `(B, T_k, d_model)`. Defaults to `value`.
        attention_mask: Boolean mask, `True` = may attend, shape `(B, T_q, T_k)` or
            `(B, h, T_q, T_k)`. Defaults to `None`.
        query_mask: Boolean `(B, T_q)` padding mask of the queries. Defaults to the
            query's Keras mask (e.g. `keras.layers.Embedding(mask_zero=True)`'s), if any.
        value_mask: Boolean `(B, T_k)` padding mask of the keys and values. Defaults to
            the value's Keras mask. The output carries the query's Keras mask.
        use_causal_mask: Forbid attending to later positions (decoder self-attention).
            Defaults to `False`.
        cache: The layer's cache, `(keys, values)` of `L` positions, `(B, h, L, d_k)`
            and `(B, h, L, d_v)` (see "The cache" below).
            With `cache_index`, the keys and values of the `T_q` new positions are
            written into it at `cache_index` and the queries attend over the filled
            part (incremental decoding). Without `cache_index` it holds precomputed
            keys and values (`compute_cache`), e.g. the projected encoder output
            during decoding, and `value` is not projected. Defaults to `None`.
        cache_index: Position of the first query inside the cache (int or scalar
            tensor). Defaults to `None`.
        return_attention_scores: Also return the attention weights. Defaults to
            `False`.
        training: Whether dropout is active.

    Returns:
        `(B, T_q, d_model)`; then, if requested, the weights `(B, h, T_q, T_k)`; then,
        if `cache` was given, the (updated) cache. Several results come as a tuple.

    The cache:
        Two tensors per layer, `(keys, values)`, head-major: `keys[b, i, j]` is the
        projected key of head `i` at position `j`, `(B, h, L, d_k)`, and `values`
        likewise `(B, h, L, d_v)`. That is the layout the attention's products read,
        so a decoding step writes one position in place and reads the cache as it is:
        kept `(B, L, h, d)` (the projections' own layout), every step copied each
        layer's whole cache into the head-major layout, about half of a beam search's
        step at the `small` preset on a CPU. `init_cache` makes an empty one for
        self-attention (`L` = the longest output), `compute_cache` a full one for
        encoder-decoder attention (`L` = the source length). Only this layer reads or
        writes inside it; the rest carries it (beam search reorders its rows).

    Example:

    >>> import numpy as np
    >>> mha = MultiHeadAttention(num_heads=2)
    >>> x = np.random.default_rng(0).normal(size=(3, 5, 8)).astype("float32")
    >>> out, weights = mha(x, x, use_causal_mask=True, return_attention_scores=True)
    >>> tuple(out.shape), tuple(weights.shape)
    ((3, 5, 8), (3, 2, 5, 5))

    References:
        Vaswani et al., "Attention Is All You Need", 2017,
        https://arxiv.org/abs/1706.03762
    """

    def __init__(
        self,
        num_heads: int,
        key_dim: int | None = None,
        value_dim: int | None = None,
        dropout: float = 0.0,
        use_bias: bool = True,
        window: int | None = None,
        **kwargs,
    ):
        super().__init__(**kwargs)
        window = kt_ops.check_window(window, f"Layer '{self.name}'")
        where = f"Layer '{self.name}': "
        num_heads = _checks.positive_ints(where, num_heads=num_heads)
        key_dim, value_dim = _checks.positive_ints(where, optional=True, key_dim=key_dim, value_dim=value_dim)
        dropout = _checks.rates(where, dropout=dropout)
        self.num_heads = num_heads
        self.key_dim = key_dim
        self.value_dim = value_dim
        self.dropout = dropout
        self.use_bias = _checks.flags(where, use_bias=use_bias)
        self.window = window
        self.seed_generator = keras.random.SeedGenerator() if dropout > 0 else None
        self.supports_masking = True

    def __call__(self, query, value=None, key=None, **kwargs):
        # Checked here, on the caller's objects, before Keras converts the inputs.
        if self.window is not None and (value is not query or (key is not None and key is not query)):
            raise ValueError(
                f"Layer '{self.name}': `window` restricts self-attention, where a distance "
                "between query and key positions means something; in cross-attention it "
                "does not. Pass the same tensor as `query` and `value`. Received: "
                f"query.shape={tuple(query.shape)}, value.shape="
                f"{None if value is None else tuple(value.shape)}"
            )
        return super().__call__(query, value, key=key, **kwargs)

    def build(self, query_shape, value_shape, key_shape=None):
        query_shape = tuple(query_shape)
        value_shape = tuple(value_shape)
        key_shape = value_shape if key_shape is None else tuple(key_shape)
        for arg, shape in (("query", query_shape), ("value", value_shape), ("key", key_shape)):
            if len(shape) != 3:
                raise ValueError(f"Layer '{self.name}': `{arg}` must have rank 3, (batch, positions, d_model). "
                                 f"Received: {arg}.shape={shape}")
        d_model = query_shape[-1]
        if d_model is None:
            raise ValueError(f"Layer '{self.name}': the last dimension (d_model) of `query` must be known. "
                             f"Received: query.shape={query_shape}")
        if value_shape[-1] != d_model or key_shape[-1] != d_model:
            raise ValueError(
                f"Layer '{self.name}': `query`, `key` and `value` must have the same width d_model. Received: "
                f"query.shape={query_shape}, key.shape={key_shape}, value.shape={value_shape}"
            )
        if key_shape[1] is not None and value_shape[1] is not None and key_shape[1] != value_shape[1]:
            raise ValueError(
                f"Layer '{self.name}': `key` and `value` must have the same number of "
                f"positions. Received: key.shape={key_shape}, value.shape={value_shape}"
            )
        if self.key_dim is None and d_model % self.num_heads != 0:
            raise ValueError(
                f"Layer '{self.name}': d_model must be divisible by `num_heads` when "
                f"`key_dim` is not given. Received: d_model={d_model} "
                f"(query.shape={query_shape}), num_heads={self.num_heads}"
            )
        self._d_model = d_model
        self._key_dim = self.key_dim or d_model // self.num_heads
        self._value_dim = self.value_dim or self._key_dim
        h = self.num_heads

        def dense(units, name):
            return keras.layers.Dense(
                units, use_bias=self.use_bias, name=name, dtype=self.dtype_policy
            )

        self.query_dense = dense(h * self._key_dim, "query_dense")
        self.query_dense.build(query_shape)
        self.key_dense = dense(h * self._key_dim, "key_dense")
        self.key_dense.build(key_shape)
        self.value_dense = dense(h * self._value_dim, "value_dense")
        self.value_dense.build(value_shape)
        self.output_dense = dense(d_model, "output_dense")
        self.output_dense.build(query_shape[:-1] + (h * self._value_dim,))
        self.input_spec = keras.InputSpec(ndim=3, axes={-1: d_model})  # checks `query` in later calls too
        self.built = True

    def call(
        self,
        query,
        value,
        key=None,
        attention_mask=None,
        query_mask=None,
        value_mask=None,
        use_causal_mask: bool = False,
        cache=None,
        cache_index=None,
        return_attention_scores: bool = False,
        training=None,
    ):
        if cache is not None:
            self._check_cache(cache, cache_index, query)
        # Row b of the queries attends to row b of the keys and values: one batch size.
        self._check_batch(query, [("cache", cache[0])] if cache is not None else [("value", value), ("key", key)])
        # (B, T_q, h, d_k)
        q = self._split_heads(self.query_dense(query), self._key_dim)
        if cache is not None:
            if cache_index is not None:  # the new positions' keys and values, written in
                cache = tuple(
                    _compat.update_along(old, cache_index, ops.cast(self._heads_first(new), old.dtype), axis=2)
                    for old, new in zip(cache, self.compute_key_value(value, key))
                )
            # (B, h, L, d_k), (B, h, L, d_v): precomputed (e.g. the projected encoder output) or the filled cache.
            k, v = cache
        else:
            k, v = self.compute_key_value(value, key)  # (B, T_k, h, d_k), (B, T_k, h, d_v)

        if self.window is not None and cache is None:
            if attention_mask is not None or return_attention_scores:
                raise ValueError(
                    f"Layer '{self.name}': with `window`, attention is computed block-wise and no (T_q, T_k) matrix "
                    "exists, so `attention_mask` and `return_attention_scores` are not available; use `value_mask` "
                    f"for padding. Received: attention_mask={attention_mask is not None}, "
                    f"return_attention_scores={return_attention_scores}"
                )
            if value_mask is not None:
                value_mask = _checks.boolean_mask(f"Layer '{self.name}': ", "value_mask", value_mask)
            attended = kt_ops.windowed_attention(q, k, v, self.window, key_mask=value_mask, causal=use_causal_mask,
                                                 dropout=self.dropout, training=training, seed=self.seed_generator)
            return self._merge_heads(attended)

        mask = self._attention_mask(
            q, k, 1 if cache is None else 2, attention_mask, query_mask, value_mask, use_causal_mask,
            None if cache is None else cache_index,
        )
        attended = kt_ops.scaled_dot_product_attention(
            q, k, v, mask=mask, dropout=self.dropout, training=training, seed=self.seed_generator,
            return_attention_scores=return_attention_scores, heads_first=cache is not None,
        )
        results = attended if return_attention_scores else (attended,)
        results = (self._merge_heads(results[0]),) + tuple(results[1:]) + (() if cache is None else (cache,))
        return results[0] if len(results) == 1 else results

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "num_heads": self.num_heads,
                "key_dim": self.key_dim,
                "value_dim": self.value_dim,
                "dropout": self.dropout,
                "use_bias": self.use_bias,
                "window": self.window,
            }
        )
        return config

    def compute_output_shape(self, query_shape, value_shape, key_shape=None):
        return tuple(query_shape)[:-1] + (tuple(query_shape)[-1],)

    def compute_output_spec(self, query, value, key=None, cache=None, return_attention_scores=False, **kwargs):
        outputs = keras.KerasTensor(
            self.compute_output_shape(query.shape, value.shape), dtype=self.compute_dtype
        )
        results = (outputs,)
        if return_attention_scores:
            key_length = cache[0].shape[2] if cache is not None else value.shape[1]
            results += (
                keras.KerasTensor(
                    (query.shape[0], self.num_heads, query.shape[1], key_length),
                    dtype=self.compute_dtype,
                ),
            )
        if cache is not None:
            results += (tuple(keras.KerasTensor(c.shape, dtype=c.dtype) for c in cache),)
        return results[0] if len(results) == 1 else results

    def init_cache(self, batch_size, max_length, dtype=None):
        """An empty self-attention cache of `max_length` positions.

        Args:
            batch_size: B (an int or a scalar tensor).
            max_length: L, the most positions the cache will hold.
            dtype: Defaults to the layer's compute dtype.

        Returns:
            `(keys, values)`: zeros `(batch_size, h, max_length, d_k)` and
            `(batch_size, h, max_length, d_v)`, preallocated so that every decoding
            step has the same shapes (and compiles once).
        """
        self._check_built("init_cache")
        dtype = dtype or self.compute_dtype
        return tuple(ops.zeros((batch_size, self.num_heads, max_length, dim), dtype=dtype)
                     for dim in (self._key_dim, self._value_dim))

    def compute_cache(self, value, key=None):
        """The projected keys and values of `value` (and `key`), as a full cache.

        During decoding the encoder output is projected once per layer with this method
        and passed as `cache` (without `cache_index`) at every step.

        Returns:
            `(keys, values)`, `(B, h, T_k, d_k)` and `(B, h, T_k, d_v)`.
        """
        self._check_built("compute_cache")
        return tuple(self._heads_first(x) for x in self.compute_key_value(value, key))

    def compute_key_value(self, value, key=None):
        """Project `key` and `value` into heads: `(B, T_k, h, d_k)`, `(B, T_k, h, d_v)`."""
        key = value if key is None else key
        k = self._split_heads(self.key_dense(key), self._key_dim)
        v = self._split_heads(self.value_dense(value), self._value_dim)
        return k, v

    def _check_built(self, method):
        if not self.built:
            raise ValueError(
                f"Layer '{self.name}': `{method}` needs the layer's sizes; build it first "
                "(call it once, or `build(query_shape, value_shape)`). Received: an unbuilt layer"
            )

    def _check_batch(self, query, others):
        """One batch size where known (a value of batch 1 beside queries of batch 2 was broadcast)."""
        for name, x in others:
            batches = (query.shape[0], x.shape[0] if x is not None and len(x.shape) else None)
            if None not in batches and batches[0] != batches[1]:
                raise ValueError(f"Layer '{self.name}': `query` and `{name}` must have the same batch size: row b of "
                                 f"the queries attends to row b of the keys and values. Received: query.shape="
                                 f"{tuple(query.shape)}, {name}.shape={tuple(x.shape)}")

    def _check_cache(self, cache, cache_index, query):
        if not isinstance(cache, (tuple, list)) or len(cache) != 2 or any(len(c.shape) != 4 for c in cache):
            got = [tuple(c.shape) for c in cache] if isinstance(cache, (tuple, list)) else tuple(cache.shape)
            raise ValueError(f"Layer '{self.name}': `cache` must be `(keys, values)`, `(B, h, L, d_k)` and "
                             f"`(B, h, L, d_v)`, as `init_cache` and `compute_cache` make them. Received: {got}")
        if cache_index is not None:
            _checks.cache_position(f"Layer '{self.name}': ", cache_index, query.shape[1], cache[0].shape[2])

    @staticmethod
    def _heads_first(x):
        # (B, T, h, d) -> (B, h, T, d)
        return ops.transpose(x, (0, 2, 1, 3))

    def _merge_heads(self, attended):
        # (B, T_q, h, d_v) -> (B, T_q, h * d_v) -> (B, T_q, d_model)
        batch, length = ops.shape(attended)[0], ops.shape(attended)[1]
        attended = ops.reshape(attended, (batch, length, self.num_heads * self._value_dim))
        return self.output_dense(attended)

    def _split_heads(self, x, head_dim):
        # (B, T, h * d) -> (B, T, h, d)
        batch, length = ops.shape(x)[0], ops.shape(x)[1]
        return ops.reshape(x, (batch, length, self.num_heads, head_dim))

    def _check_mask(self, name, mask, expected):
        """A padding mask must be `(B, T)` for the positions it masks; known sizes must match."""
        shape = tuple(mask.shape)
        if len(shape) != 2 or any(a is not None and b is not None and a != b for a, b in zip(shape, expected)):
            raise ValueError(
                f"Layer '{self.name}': `{name}` must have shape (batch, positions) = {expected}. "
                f"Received: {name}.shape={shape}"
            )

    def _attention_mask(self, q, k, time_axis, attention_mask, query_mask, value_mask, use_causal_mask, cache_index):
        """Combine the masks into one boolean tensor broadcastable to (B, h, T_q, T_k);
        the keys' positions are `k`'s `time_axis`; `cache_index` is where the queries'
        positions start in a cache being filled (None without a cache)."""
        q_len, k_len, k_static = ops.shape(q)[1], ops.shape(k)[time_axis], k.shape[time_axis]
        masks, where = [], f"Layer '{self.name}': "
        if attention_mask is not None:
            shape, expected = tuple(attention_mask.shape), (q.shape[0], q.shape[1], k_static)
            rank = len(shape)
            if rank not in (3, 4) or any(a not in (None, 1, b) and b is not None for a, b in
                                         zip(shape[:1] + shape[-2:], expected)):
                raise ValueError(
                    f"Layer '{self.name}': `attention_mask` must have shape "
                    f"(B, T_q, T_k) or (B, h, T_q, T_k), (B, T_q, T_k) = {expected}. "
                    f"Received: attention_mask.shape={shape}"
                )
            mask = _checks.boolean_mask(where, "attention_mask", attention_mask)
            masks.append(ops.expand_dims(mask, 1) if rank == 3 else mask)
        if query_mask is not None:
            self._check_mask("query_mask", query_mask, (q.shape[0], q.shape[1]))
            masks.append(ops.reshape(_checks.boolean_mask(where, "query_mask", query_mask), (-1, 1, q_len, 1)))
        if value_mask is not None:
            # With a cache, the keys are the cache's positions: (B, max_length).
            self._check_mask("value_mask", value_mask, (q.shape[0], k_static))
            masks.append(ops.reshape(_checks.boolean_mask(where, "value_mask", value_mask), (-1, 1, 1, k_len)))
        if cache_index is not None:
            # Only positions written so far are valid keys: j < cache_index + T_q.
            filled = ops.arange(k_len, dtype="int32") < ops.cast(cache_index, "int32") + q_len
            masks.append(ops.reshape(filled, (1, 1, 1, k_len)))
        offset = 0 if cache_index is None else cache_index
        if use_causal_mask:
            causal = kt_ops.causal_mask(q_len, k_len, offset=offset)
            masks.append(ops.reshape(causal, (1, 1, q_len, k_len)))
        if self.window is not None:  # decoding with a cache: one row of the band per query
            band = kt_ops.band_mask(q_len, k_len, self.window, offset=offset)
            masks.append(ops.reshape(band, (1, 1, q_len, k_len)))
        return kt_ops.combine_masks(*masks)
