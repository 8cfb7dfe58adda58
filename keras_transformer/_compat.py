"""Small workarounds of the engines' bugs and gaps, each with its reason and when it can go.

Layers and models call these instead of testing `keras.backend.backend()` themselves.
The larger per-backend adapters (compiling a search, PyTorch decoding on `torch.export`)
live in `keras_transformer.backend`; `docs/architecture.md` lists every backend-aware
place of the package.
"""

from __future__ import annotations

import contextlib

import keras


def symbolic_ids_under_tf_distribute(ids):
    """Undo one Keras behaviour on TensorFlow: under a `tf.distribute` strategy, `fit`
    first builds the model from a symbolic batch made by averaging the replicas' first
    batches, which turns integer ids into floats (Keras' `tf.distribute` trainer
    reduces the first batch with a MEAN before `build`; seen with Keras 3.8-3.13).

    Only shapes matter there, so in that one place (a graph traced in the strategy's
    cross-replica context) float ids become int32. Float ids anywhere else still reach
    `check_token_ids` and are refused.
    """
    if keras.backend.backend() != "tensorflow" or "float" not in keras.backend.standardize_dtype(ids.dtype):
        return ids
    import tensorflow as tf

    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context() and not tf.executing_eagerly():
        return tf.cast(ids, "int32")
    return ids


def slice_along(x, start, length: int, axis: int):
    """`x[..., start:start + length, ...]` on `axis`, with `start` an int or a scalar tensor.

    `keras.ops.slice` on PyTorch turns a tensor start into a Python int (a device sync,
    and a value no graph capture can keep); there it is an `index_select`.
    """
    if keras.backend.backend() == "torch":
        import torch

        start = keras.ops.convert_to_tensor(start, "int64")
        return torch.index_select(x, axis, start + torch.arange(length, device=x.device))
    starts = [0] * len(x.shape)
    starts[axis] = start
    sizes = list(keras.ops.shape(x))
    sizes[axis] = length
    return keras.ops.slice(x, starts, sizes)


def update_along(x, start, update, axis: int):
    """`x` with `update` written at `start` on `axis` (a new tensor), `start` an int or a
    scalar tensor: `keras.ops.slice_update`, and on PyTorch an `index_copy` (see
    `slice_along`; exported, `slice_update` copied `x` and wrote into the copy through
    index grids: greedy search's token write was eight operations more per step).

    On Keras' numpy backend `slice_update` writes into `x` and returns it (Keras 3.15:
    `inputs[mesh] = updates`; its other backends return a new tensor), so `x` is copied
    first: a beam search took a cache written so for one its step had returned unchanged
    and never reordered it, giving hypotheses with wrong scores. Can go when Keras' numpy
    `slice_update` copies (`test_decoding.py` runs a beam search on the numpy backend);
    would report to keras-team/keras."""
    backend = keras.backend.backend()
    if backend == "torch":
        import torch

        start = keras.ops.convert_to_tensor(start, "int64")
        positions = start + torch.arange(update.shape[axis], device=x.device)
        return torch.index_copy(x, axis, positions, update)
    if backend == "numpy":
        x = keras.ops.copy(x)
    starts = [0] * len(x.shape)
    starts[axis] = start
    return keras.ops.slice_update(x, starts, update)


def take_rows(x, rows):
    """`keras.ops.take(x, rows, axis=0)` for `rows` known to be in range (a beam
    search's reordering of its hypotheses).

    On JAX `keras.ops.take` is `jnp.take` in its default mode, `"fill"`, which checks
    each index and then selects over the whole result: for a beam search's cache, one
    more pass over every layer's keys and values per step. Here JAX clips the indices
    instead (the same rows when they are in range). `keras.ops.take` has no `mode`
    argument; would report to keras-team/keras.
    """
    if keras.backend.backend() == "jax":
        import jax.numpy as jnp

        return jnp.take(x, rows, axis=0, mode="clip")
    return keras.ops.take(x, rows, axis=0)


def fused_attention_reads_heads_first() -> bool:
    """Whether `keras.ops.dot_product_attention` reads keys and values laid out `(B, h, T, d)`
    without copying them.

    It takes `(B, T, h, d)`. On PyTorch it transposes them to the `(B, h, T, d)` of
    `torch.nn.functional.scaled_dot_product_attention` (views: no copy), so a decoding
    cache kept `(B, h, T, d)` goes through the fused kernel as two views. On JAX and
    TensorFlow it lowers to einsums that would copy such a cache into `(B, T, h, d)` and
    back at every step; there the attention over a cache is computed in its own layout.
    """
    return keras.backend.backend() == "torch"


@contextlib.contextmanager
def state_kept_if_a_loop_fails(model):
    """Around `fit`, `evaluate` and `predict`: a call that fails leaves the model's
    variables holding values, as on TensorFlow and PyTorch.

    Keras' JAX trainer detaches the variables from their values while its loop runs
    (`_purge_model_variables`, to save memory) and reattaches the state of the last step
    when the loop ends (`jax_state_sync`). A call that fails in its first step (targets
    of the wrong shape, inputs the model refuses) has no such state: the model is left
    without its weights, and the next call, or a save, fails with "'NoneType' object is
    not callable" (Keras 3.15.1; keras-team/keras#21019 reattaches a state after `fit`
    only, and only when a step ran). Here the values of before the call are held
    (references: no copy) and, when it fails, Keras' own reattaching runs and each
    variable still without a value gets its held one back (a step that ran donated its
    state's buffers, and Keras reattached that step's state). Can go when Keras' JAX
    `evaluate` and `predict` reattach on failure and `fit` keeps the values when no step
    ran (`test_a_failed_fit_evaluate_or_predict_keeps_the_weights` fails without it).
    """
    if keras.backend.backend() != "jax":
        yield
        return
    optimizer = getattr(model, "optimizer", None)
    variables = [*model.variables, *model.metrics_variables, *(optimizer.variables if optimizer else ())]
    held = [(variable, variable.value) for variable in {id(v): v for v in variables}.values()]
    try:
        yield
    except BaseException:
        model.jax_state_sync()
        for variable, value in held:
            if _detached(variable) and not value.is_deleted():
                variable.assign(value)
        raise


def _detached(variable) -> bool:
    """Whether Keras' JAX trainer set `variable`'s value aside: reading it then calls its
    initializer, spent (`None`) once the variable was initialized."""
    try:
        variable.value
    except TypeError:
        return True
    return False
