"""Training on several devices with Keras' and TensorFlow's own engines.

JAX: `keras.distribution` with data parallelism and with `kt.distribution`'s model
parallelism (heads and FFN split the Megatron way) on a 2 x 4 mesh. Without 8 real
devices, the script asks XLA for 8 virtual CPU devices, which is how this runs on a
laptop; on GPUs or TPUs the same code uses the real ones. TensorFlow:
`tf.distribute.MirroredStrategy` over 2 logical CPU devices. PyTorch: Keras has no
distribution API on torch; the script trains on one device and says so.

    KERAS_BACKEND=jax python examples/multi_device.py [--steps 30]
"""

import argparse
import os

os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # before JAX starts

import keras  # noqa: E402
import numpy as np  # noqa: E402

import keras_transformer as kt  # noqa: E402

SIZES = dict(vocab_size=64, num_layers=2, d_model=64, num_heads=4, d_ff=256, dropout=0.0)


def copy_data(n, length=10, seed=0):
    source = np.random.default_rng(seed).integers(4, SIZES["vocab_size"], size=(n, length)).astype("int32")
    decoder_input = np.concatenate([np.full((n, 1), 2, "int32"), source[:, :-1]], axis=1)
    return {"source_ids": source, "target_ids": decoder_input}, source


def fit(model, steps, batch=32, dataset=False):
    model.compile(optimizer=keras.optimizers.Adam(1e-3), metrics=["accuracy"],
                  loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
    x, y = copy_data(steps * batch)
    if dataset:  # tf.distribute splits tf.data batches across replicas
        import tensorflow as tf

        history = model.fit(tf.data.Dataset.from_tensor_slices((x, y)).batch(batch), epochs=1, verbose=0)
    else:
        history = model.fit(x, y, batch_size=batch, epochs=1, verbose=0)
    return history.history["loss"][-1]


def jax_main(steps):
    devices = keras.distribution.list_devices()
    print(f"{len(devices)} devices: {devices[:2]} ...")
    keras.distribution.set_distribution(keras.distribution.DataParallel(devices=devices))
    loss = fit(kt.models.Transformer(**SIZES), steps)
    print(f"data parallel over {len(devices)} devices: loss {loss:.3f}")

    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], devices[:8])
    keras.distribution.set_distribution(
        kt.distribution.model_parallel(mesh, num_heads=SIZES["num_heads"], d_ff=SIZES["d_ff"]))
    model = kt.models.Transformer(**SIZES)
    loss = fit(model, steps)
    kernel = next(v for v in model.weights if v.path.endswith("encoder_block_0/self_attention/query_dense/kernel"))
    print(f"model parallel on a 2 x 4 mesh: loss {loss:.3f}; {kernel.path} {tuple(kernel.shape)} is stored as "
          f"{len(kernel.value.addressable_shards)} shards of {kernel.value.addressable_shards[0].data.shape}")
    keras.distribution.set_distribution(None)
    return loss


def tensorflow_main(steps):
    import tensorflow as tf

    cpu = tf.config.list_physical_devices("CPU")[0]
    tf.config.set_logical_device_configuration(cpu, [tf.config.LogicalDeviceConfiguration()] * 2)
    strategy = tf.distribute.MirroredStrategy(["/cpu:0", "/cpu:1"])
    with strategy.scope():
        model = kt.models.Transformer(**SIZES)
        loss = fit(model, steps, dataset=True)
    print(f"MirroredStrategy over {strategy.num_replicas_in_sync} replicas: loss {loss:.3f}")
    return loss


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=30)
    args = parser.parse_args(argv)
    keras.utils.set_random_seed(0)
    backend = keras.backend.backend()
    if backend == "jax":
        return jax_main(args.steps)
    if backend == "tensorflow":
        return tensorflow_main(args.steps)
    print(f"Keras has no distribution API on the {backend} backend; training on one device.")
    loss = fit(kt.models.Transformer(**SIZES), args.steps)
    print(f"one device: loss {loss:.3f}")
    return loss


if __name__ == "__main__":
    main()
