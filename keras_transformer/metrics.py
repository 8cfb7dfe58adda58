"""Metrics over non-padding target tokens: accuracy and perplexity."""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer import _checks
from keras_transformer.defaults import PAD_ID
from keras_transformer.losses import label_log_probs


class _MaskedMean(keras.metrics.Metric):
    """Running sum / count over positions whose label is not `pad_id`."""

    def __init__(self, pad_id: int = PAD_ID, name=None, **kwargs):
        super().__init__(name=name, **kwargs)
        pad_id = _checks.counts(f"Metric '{self.name}': ", pad_id=pad_id)
        self.pad_id = pad_id
        self.total = self.add_variable(shape=(), initializer="zeros", name="total")
        self.count = self.add_variable(shape=(), initializer="zeros", name="count")

    def _values(self, y_true, y_pred):
        raise NotImplementedError

    def update_state(self, y_true, y_pred, sample_weight=None):
        _checks.labels_and_logits(f"Metric '{self.name}': ", y_true, y_pred)
        y_true = ops.cast(y_true, "int32")
        mask = ops.cast(ops.not_equal(y_true, self.pad_id), "float32")
        if sample_weight is not None:
            mask = mask * ops.cast(sample_weight, "float32")
        values = self._values(y_true, ops.cast(y_pred, "float32"))
        self.total.assign_add(ops.sum(values * mask))
        self.count.assign_add(ops.sum(mask))

    def reset_state(self):
        self.total.assign(0.0)
        self.count.assign(0.0)

    def _mean(self):
        return self.total / ops.maximum(self.count, 1.0)

    def get_config(self):
        return {**super().get_config(), "pad_id": self.pad_id}


@keras.saving.register_keras_serializable(package="keras_transformer")
class MaskedAccuracy(_MaskedMean):
    """Token accuracy (argmax of the logits equals the label) over non-pad labels.

    Example:

    >>> import numpy as np
    >>> m = MaskedAccuracy()
    >>> m.update_state(np.array([[4, 5, 0]]), np.eye(6, dtype="float32")[[[4, 1, 0]]])
    >>> float(m.result())
    0.5
    """

    def __init__(self, pad_id: int = PAD_ID, name: str = "accuracy", **kwargs):
        super().__init__(pad_id=pad_id, name=name, **kwargs)

    def _values(self, y_true, logits):
        return ops.cast(ops.equal(ops.cast(ops.argmax(logits, axis=-1), "int32"), y_true), "float32")

    def result(self):
        return self._mean()


@keras.saving.register_keras_serializable(package="keras_transformer")
class Perplexity(_MaskedMean):
    """`exp` of the mean (unsmoothed) negative log-likelihood over non-pad labels.

    Example:

    >>> import numpy as np
    >>> m = Perplexity()
    >>> m.update_state(np.array([[1, 2]]), np.zeros((1, 2, 4), "float32"))  # uniform over 4
    >>> round(float(m.result()), 4)
    4.0
    """

    def __init__(self, pad_id: int = PAD_ID, name: str = "perplexity", **kwargs):
        super().__init__(pad_id=pad_id, name=name, **kwargs)

    def _values(self, y_true, logits):
        return -label_log_probs(ops.log_softmax(logits, axis=-1), y_true)

    def result(self):
        return ops.exp(self._mean())
