"""Position-wise feed-forward network (paper, section 3.3)."""

from __future__ import annotations

import keras

from keras_transformer import _checks


@keras.saving.register_keras_serializable(package="keras_transformer")
class PositionwiseFFN(keras.layers.Layer):
    """Position-wise feed-forward network, `FFN(x) = max(0, x W_1 + b_1) W_2 + b_2` (eq. 2).

    Paper, section 3.3: two linear transformations with a ReLU in between, applied to
    each position separately and identically (the same weights at every position).
    `inner_dense` maps d_model -> d_ff, `outer_dense` maps d_ff -> d_model.

    Args:
        d_ff: Inner width d_ff (2048 in the base model).
        activation: Activation between the two transformations. Defaults to `"relu"`,
            the paper's choice; any Keras activation name or callable works.
        dropout: Dropout rate on the inner activations. The paper applies dropout only
            to sub-layer outputs, so this defaults to `0.0`.
        use_bias: Whether both transformations have biases. Defaults to `True`.
        **kwargs: Base layer arguments (`name`, `dtype`, ...).

    Call arguments:
        inputs: `(B, T, d_model)`.
        training: Whether dropout is active.

    Returns:
        `(B, T, d_model)`.

    Example:

    >>> import numpy as np
    >>> ffn = PositionwiseFFN(d_ff=32)
    >>> tuple(ffn(np.zeros((2, 7, 8), "float32")).shape)
    (2, 7, 8)
    """

    def __init__(self, d_ff: int, activation="relu", dropout: float = 0.0, use_bias: bool = True, **kwargs):
        super().__init__(**kwargs)
        d_ff = _checks.positive_ints(f"Layer '{self.name}': ", d_ff=d_ff)
        dropout = _checks.rates(f"Layer '{self.name}': ", dropout=dropout)
        self.d_ff = d_ff
        self.activation = keras.activations.get(activation)
        self.dropout = dropout
        self.use_bias = _checks.flags(f"Layer '{self.name}': ", use_bias=use_bias)
        self.supports_masking = True  # position-wise: a Keras mask passes through

    def build(self, input_shape):
        input_shape = tuple(input_shape)
        if len(input_shape) < 2 or input_shape[-1] is None:
            raise ValueError(
                f"Layer '{self.name}': inputs must be (..., d_model) with a known d_model. "
                f"Received: inputs.shape={input_shape}"
            )
        d_model = input_shape[-1]
        self.inner_dense = keras.layers.Dense(
            self.d_ff, activation=self.activation, use_bias=self.use_bias,
            name="inner_dense", dtype=self.dtype_policy,
        )
        self.inner_dense.build(input_shape)
        self.inner_dropout = keras.layers.Dropout(self.dropout, name="inner_dropout", dtype=self.dtype_policy)
        self.outer_dense = keras.layers.Dense(
            d_model, use_bias=self.use_bias, name="outer_dense", dtype=self.dtype_policy
        )
        self.outer_dense.build(input_shape[:-1] + (self.d_ff,))
        self.built = True

    def call(self, inputs, training=None):
        x = self.inner_dense(inputs)  # (B, T, d_ff)
        x = self.inner_dropout(x, training=training)
        return self.outer_dense(x)  # (B, T, d_model)

    def get_config(self):
        config = super().get_config()
        config.update(
            {
                "d_ff": self.d_ff,
                "activation": keras.activations.serialize(self.activation),
                "dropout": self.dropout,
                "use_bias": self.use_bias,
            }
        )
        return config

    def compute_output_shape(self, input_shape):
        return tuple(input_shape)
