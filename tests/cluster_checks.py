"""Model parallel across processes (JAX), run as 2 processes of 2 virtual CPU devices each:
`python tests/cluster_checks.py PROCESS_ID PORT` prints JSON.

The 4 devices form a 2 x 2 (batch x model) mesh with `kt.distribution.model_parallel`:
each process holds one row of the batch axis (its half of every batch) and both halves
of every split weight. Two `model.fit` steps on the global batch, against the same
model trained on one device in process 0 afterwards.
"""

import json
import os
import sys

import numpy as np


def main(process_id: int, port: int) -> dict:
    # Set here, not at import: pytest imports this file (for doctests) in its own process.
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count=2".strip()
    os.environ["KERAS_BACKEND"] = "jax"
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    from tests.distributed_checks import BATCH, SIZES, data

    import jax

    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    import keras

    keras.distribution.initialize(f"localhost:{port}", num_processes=2, process_id=process_id)
    import keras_transformer as kt

    x, y = data()  # two global batches of BATCH rows
    half = BATCH // 2
    rows = np.concatenate([np.arange(b * BATCH + process_id * half, b * BATCH + (process_id + 1) * half)
                           for b in range(2)])
    local_x, local_y = {k: v[rows] for k, v in x.items()}, y[rows]

    def fit(model, inputs, labels, batch):
        import tensorflow as tf

        model.compile(optimizer=keras.optimizers.Adam(1e-3),
                      loss=keras.losses.SparseCategoricalCrossentropy(from_logits=True))
        losses = []
        record = keras.callbacks.LambdaCallback(on_train_batch_end=lambda b, logs: losses.append(float(logs["loss"])))
        model.fit(tf.data.Dataset.from_tensor_slices((inputs, labels)).batch(batch), epochs=1, verbose=0,
                  callbacks=[record])
        return losses

    keras.utils.set_random_seed(0)
    single = kt.models.Transformer(**SIZES)  # on this process's first device
    single.build()
    mesh = keras.distribution.DeviceMesh((2, 2), ["batch", "model"], jax.devices())
    # Each process feeds its own half of every global batch.
    keras.distribution.set_distribution(kt.distribution.model_parallel(mesh, SIZES["num_heads"], SIZES["d_ff"],
                                                                       auto_shard_dataset=False))
    sharded = kt.models.Transformer(**SIZES)
    sharded.build()
    sharded.set_weights(single.get_weights())
    query = next(v for v in sharded.weights if v.path.endswith("encoder_block_0/self_attention/query_dense/kernel"))
    result = {"process_devices": [d.id for d in jax.local_devices()], "devices": len(jax.devices()),
              "query_shards": [tuple(s.data.shape) for s in query.value.addressable_shards],
              "sharded_fit": fit(sharded, local_x, local_y, half)}
    if process_id == 0:
        keras.distribution.set_distribution(None)
        result["single_fit"] = fit(single, x, y, BATCH)
    return result


if __name__ == "__main__":
    print(json.dumps(main(int(sys.argv[1]), int(sys.argv[2]))), flush=True)
    import jax

    # Leave together: process 0 hosts the coordination service and trains once more, and a
    # process that exits while the other still runs makes the service abort that other one.
    jax.distributed.shutdown()
