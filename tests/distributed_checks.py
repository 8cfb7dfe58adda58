"""Training on several devices, run in a child process (the device count is fixed when
the backend starts): `python tests/distributed_checks.py jax|tensorflow` prints JSON.

jax: 8 virtual CPU devices (XLA_FLAGS=--xla_force_host_platform_device_count=8), a
2 x 4 (batch x model) mesh with `kt.distribution.model_parallel`; the loss and the
gradients of one training step, and the losses of two `model.fit` steps, against the
same model on one device.

tensorflow: 2 logical CPU devices and `tf.distribute.MirroredStrategy` (gradients reduced
on one device); two `model.fit` steps against the same model trained without a strategy.

Then examples/multi_device.py with 3 steps and one layer, in the same process (its output
is the "example" entry): one start of the backend with several devices for both.
"""

import json
import os
import sys

import numpy as np

SIZES = dict(vocab_size=64, num_layers=1, d_model=32, num_heads=4, d_ff=64, dropout=0.0)
BATCH, LENGTH = 8, 6


def data():
    rng = np.random.default_rng(0)
    source = rng.integers(4, SIZES["vocab_size"], size=(2 * BATCH, LENGTH)).astype("int32")
    target = rng.integers(4, SIZES["vocab_size"], size=(2 * BATCH, LENGTH)).astype("int32")
    return {"source_ids": source, "target_ids": target}, target


def fit_losses(model, x, y, as_dataset=False):
    """The running mean loss after each of two `model.fit` steps."""
    import keras

    model.compile(optimizer=keras.optimizers.Adam(1e-3),
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    batch_losses = []
    record = keras.callbacks.LambdaCallback(
        on_train_batch_end=lambda batch, logs: batch_losses.append(float(logs["loss"])))
    if as_dataset:  # tf.distribute: a tf.data pipeline keeps the int32 ids as they are
        import tensorflow as tf

        model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(BATCH), epochs=1, verbose=0, callbacks=[record])
    else:
        model.fit(x, y, batch_size=BATCH, epochs=1, shuffle=False, verbose=0, callbacks=[record])
    return batch_losses


def check_jax():
    # Added to the flags the test session sets (see tests/conftest.py).
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=8".strip()
    os.environ["KERAS_BACKEND"] = "jax"
    import jax
    import keras

    import keras_transformer as kt

    x, y = data()
    first = {k: v[:BATCH] for k, v in x.items()}
    loss_fn = keras.losses.SparseCategoricalCrossentropy(from_logits=True)

    def step(model):
        trainable = [v.value for v in model.trainable_variables]
        non_trainable = [v.value for v in model.non_trainable_variables]

        def loss(weights):
            logits, _ = model.stateless_call(weights, non_trainable, first)
            return loss_fn(y[:BATCH], logits)

        value, grads = jax.jit(jax.value_and_grad(loss))(trainable)
        return float(value), [np.asarray(g) for g in grads]

    keras.utils.set_random_seed(0)
    single = kt.models.Transformer(**SIZES)
    single.build()
    weights = single.get_weights()
    single_loss, single_grads = step(single)

    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices())
    keras.distribution.set_distribution(kt.distribution.model_parallel(mesh, SIZES["num_heads"], SIZES["d_ff"]))
    sharded = kt.models.Transformer(**SIZES)
    sharded.build()
    sharded.set_weights(weights)
    sharded_loss, sharded_grads = step(sharded)
    layouts = {v.path: (str(v.value.sharding.spec), [tuple(s.data.shape) for s in v.value.addressable_shards][0])
               for v in sharded.weights}
    sharded_fit = fit_losses(sharded, x, y)
    keras.distribution.set_distribution(None)
    single_fit = fit_losses(single, x, y)
    return {
        "devices": len(jax.devices()),
        "single_loss": single_loss, "sharded_loss": sharded_loss,
        "max_grad_difference": max(float(np.abs(a - b).max()) for a, b in zip(single_grads, sharded_grads)),
        "max_grad": max(float(np.abs(a).max()) for a in single_grads),
        "layouts": layouts, "single_fit": single_fit, "sharded_fit": sharded_fit,
    }


def check_tensorflow():
    os.environ["KERAS_BACKEND"] = "tensorflow"
    import keras
    import tensorflow as tf

    import keras_transformer as kt

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    x, y = data()
    keras.utils.set_random_seed(0)
    single = kt.models.Transformer(**SIZES)
    single.build()
    weights = single.get_weights()
    single_fit = fit_losses(single, x, y, as_dataset=True)
    # Gradients summed on one device, not by collective ops: the example that runs after
    # this check in the same process makes its own strategy with the default collectives,
    # and a second strategy's collective ops would reuse this one's keys.
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"],
                                              cross_device_ops=tf.distribute.ReductionToOneDevice())
    with strategy.scope():
        mirrored = kt.models.Transformer(**SIZES)
        mirrored.build()
        mirrored.set_weights(weights)
        mirrored_fit = fit_losses(mirrored, x, y, as_dataset=True)
    return {"replicas": strategy.num_replicas_in_sync, "single_fit": single_fit, "mirrored_fit": mirrored_fit,
            "variable_type": type(mirrored.trainable_variables[0].value).__name__}


def run_example():
    """examples/multi_device.py, short and with one layer, in this process (its devices are
    set up already): what it printed."""
    import contextlib
    import io
    import pathlib

    sys.path.insert(0, str(pathlib.Path(__file__).parent.parent / "examples"))
    import multi_device

    multi_device.SIZES["num_layers"] = 1  # each layer is seconds of tracing on TensorFlow
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        multi_device.main(["--steps", "3"])
    return printed.getvalue()


if __name__ == "__main__":
    result = {"jax": check_jax, "tensorflow": check_tensorflow}[sys.argv[1]]()
    result["example"] = run_example()
    print(json.dumps(result))
