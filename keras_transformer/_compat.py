"""Backend workarounds: the only backend-aware code of the library.

Each function says what it works around and why; layers and models call these instead
of testing `keras.backend.backend()` themselves.
"""

from __future__ import annotations

import collections

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


def compile_function(fn, variables):
    """`fn(*tensors)` compiled for the running backend, reading `variables` at call time.

    * JAX: `jax.jit` of a stateless version of `fn`: the variables' current values are
      arguments, not constants baked into the program, so weights changed after
      compilation (more training, loading a checkpoint) are used.
    * TensorFlow: `tf.function(jit_compile=True)`; variables are read at run time.
    * PyTorch: `fn` itself (eager).
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        variables = list(variables)

        def stateless(values, *args):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return fn(*args)

        jitted = jax.jit(stateless)
        return lambda *args: jitted([v.value for v in variables], *args)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True, reduce_retracing=True)
    return fn


class FunctionCache:
    """A bounded least-recently-used store of compiled functions, owned by one model.

    Keys are the static arguments a function was compiled for (search kind, sizes);
    the oldest entry is dropped past `max_entries`, and all go with the model. A plain
    class rather than a `dict`, so that Keras' attribute tracking leaves it alone.
    """

    def __init__(self, max_entries: int = 8):
        self.max_entries = max_entries
        self._functions: collections.OrderedDict = collections.OrderedDict()

    def get(self, key, make):
        """The function stored under `key`, made by `make()` the first time."""
        if key in self._functions:
            self._functions.move_to_end(key)
        else:
            self._functions[key] = make()
            while len(self._functions) > self.max_entries:
                self._functions.popitem(last=False)
        return self._functions[key]

    def __len__(self) -> int:
        return len(self._functions)

    def clear(self) -> None:
        self._functions.clear()


@keras.saving.register_keras_serializable(package="keras_transformer")
class Adam(keras.optimizers.Adam):
    """`keras.optimizers.Adam`, with the PyTorch update done by one fused kernel.

    Keras' Adam on the torch backend updates the variables with a chain of `torch._foreach_*`
    calls, each of which writes a temporary per variable (`g * g`, `m * alpha`,
    `sqrt(v)`, `+ epsilon`, the quotient): about a third of a training step at the base
    size, against a tenth for `torch.optim.Adam` (profiled with py-spy; reported with the
    benchmarks). Here the torch backend calls `torch._fused_adam_`, the kernel behind
    `torch.optim.Adam(fused=True)`, which reads and writes each tensor once.

    The arithmetic is Keras': `m <- b1 m + (1 - b1) g`, `v <- b2 v + (1 - b2) g^2`,
    `w <- w - lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + epsilon)`. The fused kernel
    adds its epsilon to the bias-corrected `sqrt(v / (1 - b2^t))`, so it is given
    `epsilon / sqrt(1 - b2^t)`, which makes the two updates equal. Other backends, and
    `amsgrad=True`, use Keras' own update.
    """

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if keras.backend.backend() != "torch" or self.amsgrad:
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        import torch

        with torch.no_grad():
            step = float(keras.ops.convert_to_numpy(self.iterations)) + 1.0
            bias_correction_2 = 1.0 - float(self.beta_2) ** step
            index = [self._get_variable_index(v) for v in trainable_variables]
            torch._fused_adam_(
                [v.value for v in trainable_variables],
                [keras.ops.convert_to_tensor(g).contiguous() for g in grads],  # the kernel reads flat memory
                [self._momentums[i].value for i in index],
                [self._velocities[i].value for i in index],
                [],
                [torch.tensor(step)] * len(index),
                lr=float(keras.ops.convert_to_numpy(learning_rate)),
                beta1=float(self.beta_1),
                beta2=float(self.beta_2),
                weight_decay=0.0,  # Keras applies its weight decay before this update
                eps=float(self.epsilon) / bias_correction_2**0.5,
                amsgrad=False,
                maximize=False,
            )
