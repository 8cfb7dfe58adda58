"""Embeddings and the sinusoidal positional encoding (paper, sections 3.4 and 3.5)."""

from __future__ import annotations

import math

import keras
from keras import ops

from keras_transformer import _checks
from keras_transformer import ops as kt_ops
from keras_transformer._compat import symbolic_ids_under_tf_distribute
from keras_transformer.defaults import PAD_ID


@keras.saving.register_keras_serializable(package="keras_transformer")
class SinusoidalPositionalEncoding(keras.layers.Layer):
    """The paper's sinusoidal positional encoding (section 3.5), interleaved sin/cos.

    `PE[pos, 2i] = sin(pos / max_wavelength^(2i / d_model))` and
    `PE[pos, 2i + 1] = cos(pos / max_wavelength^(2i / d_model))`. Even channels hold
    sines and odd channels cosines, as written in the paper (tensor2tensor, fairseq
    and Flax concatenate the two halves instead). For any fixed offset k, `PE[pos + k]`
    is a linear function (a rotation per sin/cos pair) of `PE[pos]`, which is why the
    paper expected it to help attend by relative position. No weights; any length.

    Args:
        max_wavelength: The base of the geometric progression of wavelengths.
            Defaults to `10000`.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: `(B, T, d_model)`; only its shape is used.
        start_index: Position of the first row, e.g. the decoding step. An int or a
            scalar tensor. Defaults to `0`.

    Returns:
        The encoding broadcast to the shape of `inputs`, `(B, T, d_model)`.

    Example:

    >>> import numpy as np
    >>> pe = SinusoidalPositionalEncoding()(np.zeros((1, 3, 4), "float32"))
    >>> np.round(np.asarray(pe)[0, 1], 4).tolist()  # sin(1), cos(1), sin(0.01), cos(0.01)
    [0.8415, 0.5403, 0.01, 1.0]
    """

    def __init__(self, max_wavelength: float = 10000, **kwargs):
        super().__init__(**kwargs)
        self.max_wavelength = _checks.numbers_above(f"Layer '{self.name}': ", 1, max_wavelength=max_wavelength)
        self.supports_masking = True  # the encoding of a padded position is still its position's
        self.built = True

    def call(self, inputs, start_index=0):
        if not hasattr(start_index, "dtype"):  # a Python position: a count (a tensor's is the caller's)
            _checks.counts(f"Layer '{self.name}': ", start_index=start_index)
        shape = ops.shape(inputs)
        length, d_model = shape[-2], inputs.shape[-1]
        positions = ops.cast(ops.arange(length), "float32") + ops.cast(start_index, "float32")
        # One frequency per sin/cos pair: 1 / max_wavelength^(2i / d_model).
        num_pairs = (d_model + 1) // 2
        exponents = ops.arange(num_pairs, dtype="float32") * (2.0 / d_model)
        inv_freq = ops.power(ops.cast(self.max_wavelength, "float32"), -exponents)
        angles = ops.expand_dims(positions, 1) * ops.expand_dims(inv_freq, 0)  # (T, d/2)
        # Interleave: (T, d/2, 2) -> (T, 2 * ceil(d/2)), then drop a trailing cos if d is odd.
        encoding = ops.reshape(ops.stack([ops.sin(angles), ops.cos(angles)], axis=-1), (length, 2 * num_pairs))
        encoding = encoding[:, :d_model]
        return ops.broadcast_to(ops.cast(encoding, self.compute_dtype), shape)

    def get_config(self):
        config = super().get_config()
        config.update({"max_wavelength": self.max_wavelength})
        return config

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)


@keras.saving.register_keras_serializable(package="keras_transformer")
class SinusoidalEmbedding(keras.layers.Layer):
    """Token embedding × sqrt(d_model) plus the sinusoidal encoding, then dropout.

    Paper, sections 3.4 and 3.5: "In the embedding layers, we multiply those weights by
    sqrt(d_model)", and "we apply dropout to the sums of the embeddings and the
    positional encodings". The same weight matrix serves as the pre-softmax linear
    transformation: `logits(x) = x E^T` (section 3.4, weight tying).

    The weights are initialised from `N(0, d_model^-0.5)`, so that the scaled
    embeddings have unit variance, on the scale of the encoding.

    Args:
        vocab_size: Number of tokens.
        d_model: Embedding width d_model.
        dropout: Dropout rate on the sum. Defaults to `0.0`; the models use `0.1`.
        scale: Multiply the embeddings by sqrt(d_model). Defaults to `True`.
        max_wavelength: See `SinusoidalPositionalEncoding`. Defaults to `10000`.
        embeddings_initializer: Defaults to `RandomNormal(stddev=d_model ** -0.5)`.
        mask_zero: Give the output a Keras mask, `True` where the id is not 0 (the pad
            id), as `keras.layers.Embedding(mask_zero=True)` does: the layers of this
            library read it as their padding mask, and Keras' own layers and losses as
            theirs. Defaults to `False` (masks are arguments). The tied logits
            (`reverse=True`) keep their input's mask.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        token_ids: Integer `(B, T)`. Ids outside `[0, vocab_size)` raise a
            `ValueError` when the ids are concrete (eager execution).
        start_index: Position of the first token, for incremental decoding.
            Defaults to `0`.
        reverse: If `True`, `token_ids` is instead a `(B, T, d_model)` tensor and the
            layer returns the tied logits `(B, T, vocab_size)`. Defaults to `False`.
        training: Whether dropout is active.

    Returns:
        `(B, T, d_model)`.

    Example:

    >>> import numpy as np
    >>> emb = SinusoidalEmbedding(vocab_size=10, d_model=8)
    >>> x = emb(np.array([[4, 5, 6]]))
    >>> tuple(x.shape), tuple(emb.logits(x).shape)
    ((1, 3, 8), (1, 3, 10))
    """

    def __init__(
        self,
        vocab_size: int,
        d_model: int,
        dropout: float = 0.0,
        scale: bool = True,
        max_wavelength: float = 10000,
        embeddings_initializer=None,
        mask_zero: bool = False,
        **kwargs,
    ):
        super().__init__(**kwargs)
        vocab_size, d_model = _checks.positive_ints(f"Layer '{self.name}': ", vocab_size=vocab_size, d_model=d_model)
        dropout = _checks.rates(f"Layer '{self.name}': ", dropout=dropout)
        self.vocab_size = vocab_size
        self.d_model = d_model
        self.dropout = dropout
        self.scale = _checks.flags(f"Layer '{self.name}': ", scale=scale)
        self.max_wavelength = max_wavelength
        self.mask_zero = _checks.flags(f"Layer '{self.name}': ", mask_zero=mask_zero)
        if embeddings_initializer is None:
            embeddings_initializer = keras.initializers.RandomNormal(stddev=d_model**-0.5)
        self.embeddings_initializer = keras.initializers.get(embeddings_initializer)
        self.position_encoding = SinusoidalPositionalEncoding(
            max_wavelength, name="position_encoding", dtype=self.dtype_policy
        )
        self.dropout_layer = keras.layers.Dropout(dropout, name="dropout", dtype=self.dtype_policy)

    def build(self, token_ids_shape=None):
        self.embeddings = self.add_weight(
            name="embeddings",
            shape=(self.vocab_size, self.d_model),
            initializer=self.embeddings_initializer,
        )
        self.built = True

    def call(self, token_ids, start_index=0, reverse=False, training=None):
        if reverse:
            return self._project(token_ids)
        token_ids = symbolic_ids_under_tf_distribute(token_ids)
        kt_ops.check_token_ids(token_ids, self.vocab_size, name="token_ids", layer=self)
        x = ops.take(ops.cast(self.embeddings, self.compute_dtype), token_ids, axis=0)
        if self.scale:
            x = x * ops.cast(math.sqrt(self.d_model), self.compute_dtype)
        x = x + self.position_encoding(x, start_index=start_index)
        return self.dropout_layer(x, training=training)

    def logits(self, x):
        """The tied pre-softmax projection: `x E^T`, `(B, T, d_model) -> (B, T, vocab_size)`.

        Same as `self(x, reverse=True)`; works on symbolic tensors in Functional models.
        """
        return self(x, reverse=True)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "vocab_size": self.vocab_size,
                "d_model": self.d_model,
                "dropout": self.dropout,
                "scale": self.scale,
                "max_wavelength": self.max_wavelength,
                "embeddings_initializer": keras.initializers.serialize(self.embeddings_initializer),
                "mask_zero": self.mask_zero,
            }
        )
        return config

    def compute_mask(self, token_ids, previous_mask=None):
        dtype = getattr(token_ids, "dtype", None)
        if dtype is not None and not keras.backend.is_int_dtype(dtype):  # the tied logits (reverse=True)
            return previous_mask
        return ops.not_equal(token_ids, PAD_ID) if self.mask_zero else None

    def compute_output_shape(self, token_ids_shape):
        return tuple(token_ids_shape) + (self.d_model,)

    def compute_output_spec(self, token_ids, start_index=0, reverse=False, training=None):
        if reverse:
            shape = tuple(token_ids.shape)[:-1] + (self.vocab_size,)
        else:
            shape = self.compute_output_shape(token_ids.shape)
        return keras.KerasTensor(shape, dtype=self.compute_dtype)

    def _project(self, x):
        # (B, T, d_model) @ (d_model, V) -> (B, T, V)
        x = ops.cast(x, self.compute_dtype)
        return ops.matmul(x, ops.transpose(ops.cast(self.embeddings, self.compute_dtype)))
