"""Training past one device with Keras' own engine: `keras.distribution` (JAX).

Data parallelism needs nothing from this library:

    import keras
    keras.distribution.set_distribution(keras.distribution.DataParallel())
    model = kt.models.Transformer.from_preset("base", vocab_size=37000)  # replicated
    model.fit(...)  # each device gets a slice of every batch

Model parallelism splits each layer across the `model` axis of a device mesh, the
Megatron-LM way (Shoeybi et al., 2019): the query, key and value kernels and the first
FFN kernel are split on their output dimension (so each device holds whole heads and a
slice of d_ff), the attention output and second FFN kernels on their input dimension
(each device's partial products are summed by one all-reduce per sub-layer), and the
shared embedding on the vocabulary. `layout_map` builds that map; `model_parallel`
wraps it in a `keras.distribution.ModelParallel` that also splits the batch over the
`batch` axis:

    mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], keras.distribution.list_devices())
    keras.distribution.set_distribution(kt.distribution.model_parallel(mesh, num_heads=8, d_ff=2048))
    model = kt.models.Transformer.from_preset("base", vocab_size=37000)  # created sharded

Many hosts (JAX): call `keras.distribution.initialize()` (which calls
`jax.distributed.initialize`) on every host before building the mesh, and build the
mesh from `keras.distribution.list_devices()`, which then lists every host's devices.
On a TPU VM the same code runs unchanged; on a pod slice, run the script on every host.
On TensorFlow, use `tf.distribute` strategies (`MirroredStrategy`, `TPUStrategy`) and
build and compile the model inside `strategy.scope()`.
"""

from __future__ import annotations

import keras

from keras_transformer import _checks

__all__ = ["layout_map", "model_parallel"]

# Variable-path patterns (regular expressions, as `keras.distribution.LayoutMap` takes
# them) and how each is split. Paths look like
# "transformer/encoder/encoder_block_0/self_attention/query_dense/kernel".
_SPLITS = {
    r".*attention/(query|key|value)_dense/kernel": (None, "{model}"),
    r".*attention/(query|key|value)_dense/bias": ("{model}",),
    r".*attention/output_dense/kernel": ("{model}", None),
    r".*feed_forward/inner_dense/kernel": (None, "{model}"),
    r".*feed_forward/inner_dense/bias": ("{model}",),
    r".*feed_forward/outer_dense/kernel": ("{model}", None),
    r".*embedding.*/embeddings": ("{model}", None),
}


def layout_map(device_mesh: keras.distribution.DeviceMesh, num_heads: int, d_ff: int,
               model_axis: str = "model") -> keras.distribution.LayoutMap:
    """A `LayoutMap` that splits attention heads, the FFN and the embedding over `model_axis`.

    Args:
        device_mesh: The `keras.distribution.DeviceMesh`; it must have `model_axis`.
        num_heads: Attention heads h of the model; the axis size must divide it.
        d_ff: FFN inner width of the model; the axis size must divide it.
        model_axis: The mesh axis the weights are split over. Defaults to `"model"`.

    Returns:
        A `keras.distribution.LayoutMap`; unmatched variables (LayerNorm) are replicated.
        The shared embedding is split on the vocabulary, so the model's `vocab_size`
        must be a multiple of the axis size too (JAX refuses the model's creation
        otherwise, with an `IndivisibleError` naming the shape).

    Raises:
        ValueError: if `num_heads` or `d_ff` is not a positive integer, the mesh has no
            `model_axis`, or its size does not divide `num_heads` or `d_ff`.

    Example:

    >>> import keras
    >>> mesh = keras.distribution.DeviceMesh((2, 4), ["batch", "model"], [f"cpu:{i}" for i in range(8)])
    >>> layouts = layout_map(mesh, num_heads=8, d_ff=2048)
    >>> layouts["transformer/encoder/encoder_block_0/self_attention/query_dense/kernel"].axes
    (None, 'model')
    >>> layouts["transformer/decoder/decoder_block_5/feed_forward/outer_dense/kernel"].axes
    ('model', None)
    >>> layout_map(mesh, num_heads=6, d_ff=2048)
    Traceback (most recent call last):
    ...
    ValueError: The mesh axis 'model' has 4 devices, which does not divide num_heads=6: ...
    """
    num_heads, d_ff = _checks.positive_ints(num_heads=num_heads, d_ff=d_ff)  # 0 would pass every divisibility check
    if model_axis not in device_mesh.axis_names:
        raise ValueError(f"The device mesh has no axis {model_axis!r}; its axes are {list(device_mesh.axis_names)}.")
    size = device_mesh.shape[list(device_mesh.axis_names).index(model_axis)]
    for name, value in (("num_heads", num_heads), ("d_ff", d_ff)):
        if value % size:
            raise ValueError(
                f"The mesh axis {model_axis!r} has {size} devices, which does not divide "
                f"{name}={value}: each device must hold a whole share. Use a model axis of a size "
                f"that divides both num_heads={num_heads} and d_ff={d_ff}."
            )
    layouts = keras.distribution.LayoutMap(device_mesh)
    for pattern, axes in _SPLITS.items():
        layouts[pattern] = tuple(None if a is None else a.format(model=model_axis) for a in axes)
    return layouts


def model_parallel(device_mesh: keras.distribution.DeviceMesh, num_heads: int, d_ff: int,
                   model_axis: str = "model", batch_dim_name: str = "batch",
                   auto_shard_dataset: bool = True) -> keras.distribution.ModelParallel:
    """`keras.distribution.ModelParallel` with `layout_map`'s Megatron split, the batch split
    over `batch_dim_name`. Pass it to `keras.distribution.set_distribution` before building
    the model.

    In several processes, Keras by default treats each process's `tf.data` batches as
    global ones and shards them again (`auto_shard_dataset=True`); pass `False` when each
    process already reads its own rows of every global batch.
    """
    return keras.distribution.ModelParallel(
        layout_map=layout_map(device_mesh, num_heads, d_ff, model_axis), batch_dim_name=batch_dim_name,
        auto_shard_dataset=auto_shard_dataset)

