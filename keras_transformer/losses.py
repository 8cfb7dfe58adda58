"""The training loss: label-smoothed cross-entropy over non-padding tokens (section 5.4)."""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer import _checks
from keras_transformer.defaults import PAD_ID


@keras.saving.register_keras_serializable(package="keras_transformer")
class LabelSmoothedCrossEntropy(keras.losses.Loss):
    """Cross-entropy against label-smoothed targets, averaged over non-pad tokens.

    Paper, section 5.4: "we employed label smoothing of value eps_ls = 0.1". The target
    distribution is Szegedy et al.'s `q = (1 - eps) * onehot(y) + eps / V` (the same as
    Keras' `CategoricalCrossentropy(label_smoothing=eps)` on one-hot targets), and the
    loss is `-sum_k q_k log softmax(z)_k`, summed over positions whose label is not
    `pad_id` and divided by their count.

    Args:
        epsilon: Smoothing eps_ls. Defaults to `0.1`.
        pad_id: Label id that is ignored. Defaults to `0`.
        name: Defaults to `"label_smoothed_cross_entropy"`.

    Call arguments:
        y_true: Integer labels `(B, T)`.
        y_pred: Logits `(B, T, V)`.

    Example:

    >>> import numpy as np
    >>> loss = LabelSmoothedCrossEntropy(epsilon=0.0)
    >>> logits = np.log(np.array([[[0.5, 0.25, 0.25], [1 / 3, 1 / 3, 1 / 3]]], "float32"))
    >>> round(float(loss(np.array([[1, 0]]), logits)), 4)  # label 0 is padding: -log(0.25)
    1.3863
    """

    # For PyTorch's DistributedDataParallel, whose backward averages the processes'
    # gradients: `f(count) -> (count summed over the processes, number of processes)`, set
    # by `keras_transformer.tools.distributed_fit.wrap_model` while the model trains in a cluster.
    sum_over_processes = None

    def __init__(self, epsilon: float = 0.1, pad_id: int = PAD_ID, name: str = "label_smoothed_cross_entropy", **kwargs):
        super().__init__(name=name, **kwargs)
        epsilon = _checks.rates(f"Loss '{name}': ", epsilon=epsilon)
        pad_id = _checks.counts(f"Loss '{name}': ", pad_id=pad_id)
        self.epsilon = epsilon
        self.pad_id = pad_id

    def call(self, y_true, y_pred):
        _checks.labels_and_logits(f"Loss '{self.name}': ", y_true, y_pred)
        y_true = ops.cast(y_true, "int32")
        logits = ops.cast(y_pred, "float32")
        log_probs = ops.log_softmax(logits, axis=-1)  # (B, T, V)
        nll = -label_log_probs(log_probs, y_true)
        uniform = -ops.mean(log_probs, axis=-1)  # cross-entropy against eps / V on every class
        per_token = (1.0 - self.epsilon) * nll + self.epsilon * uniform
        mask = ops.cast(ops.not_equal(y_true, self.pad_id), "float32")
        # A scalar: the mean over real tokens (Keras' reduction leaves a scalar as is).
        total, count = ops.sum(per_token * mask), ops.sum(mask)
        if _replicas() > 1:
            return _share_of_replicas(total, count)
        if self.sum_over_processes is not None:
            # DDP divides the summed gradients by the processes: scaled back, each process's
            # share is its tokens' loss over every process's tokens, as under tf.distribute.
            everyone, processes = self.sum_over_processes(count)
            return total * processes / ops.maximum(everyone, 1.0)
        return total / ops.maximum(count, 1.0)

    def get_config(self):
        config = super().get_config()
        config.update({"epsilon": self.epsilon, "pad_id": self.pad_id})
        return config


def label_log_probs(log_probs, labels):
    """`log_probs` `(B, T, V)` read at `labels` `(B, T)`: NaN where a label is not in
    `[0, V)`, on every backend. Such labels are refused where their values can be read
    (`_checks.labels_and_logits`); inside a compiled step PyTorch's gather read them modulo V
    (pytorch/pytorch#196106), every backend read -1 as the last class and JAX gave NaN past
    it: a plausible loss would hide the mistake."""
    classes = log_probs.shape[-1]
    inside = ops.logical_and(ops.greater_equal(labels, 0), ops.less(labels, classes))
    picked = ops.squeeze(ops.take_along_axis(log_probs, ops.expand_dims(labels, -1), axis=-1), -1)
    return ops.where(inside, picked, float("nan"))


def _replicas() -> int:
    """Replicas in sync under a `tf.distribute` strategy (1 elsewhere, and on other backends)."""
    if keras.backend.backend() != "tensorflow":
        return 1
    import tensorflow as tf

    return tf.distribute.get_strategy().num_replicas_in_sync


def _share_of_replicas(total, count):
    """Under a `tf.distribute` strategy, this replica's share of the global batch's mean:
    its tokens' loss over the tokens of every replica (summed by the strategy). The
    strategy sums the replicas' losses' gradients (and Keras reports the sum), so the
    run is the one-replica run on the whole batch, whatever each replica's token count."""
    import tensorflow as tf

    context = tf.distribute.get_replica_context()
    if context is None:  # called across replicas, not by one of them: the plain mean
        return total / ops.maximum(count, 1.0)
    everyone = context.all_reduce(tf.distribute.ReduceOp.SUM, count)
    return total / ops.maximum(everyone, 1.0)
