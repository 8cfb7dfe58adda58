"""How a model trains over a cluster's processes, on each backend's engine.

JAX trains with `keras.distribution.DataParallel` over the devices of every process (the
global batch is assembled from each process's rows by Keras). PyTorch wraps the model in
`torch.nn.parallel.DistributedDataParallel`, whose forward pass Keras' own `train_step`
runs (so `model.fit`, its callbacks and its metrics stay as they are), and which averages
the gradients in the backward pass. TensorFlow runs `MultiWorkerMirroredStrategy` with
TensorFlow's multi-worker loop (`fit_with_strategy`), since Keras' `fit` does not run
under it. What only the chief does (validation BLEU, the final save) runs on a
one-process copy (`alone`, `LocalCopy`).
"""

from __future__ import annotations

import contextlib

from keras_transformer.tools import collectives
from keras_transformer.tools.cluster import Cluster

def scope(cluster: Cluster):
    """Where a model is built and compiled: the TensorFlow strategy's scope in a cluster."""
    if cluster.distributed and cluster.backend == "tensorflow":
        return collectives.strategy().scope()
    return contextlib.nullcontext()


def devices_per_process(cluster: Cluster) -> int:
    """The devices each process splits its rows over (its local replicas)."""
    if not cluster.distributed:
        return 1
    if cluster.backend == "jax":
        import jax

        return jax.local_device_count()
    if cluster.backend == "tensorflow":
        return max(1, collectives.strategy().num_replicas_in_sync // cluster.num_processes)
    return 1  # one DistributedDataParallel process per device


def set_data_parallel(cluster: Cluster) -> None:
    """Before the model is built: JAX's `DataParallel` over every process's devices."""
    if cluster.distributed and cluster.backend == "jax":
        import jax
        import keras

        keras.distribution.set_distribution(
            keras.distribution.DataParallel(devices=jax.devices(), auto_shard_dataset=False))


def wrap_model(cluster: Cluster, model) -> None:
    """After the model is built (PyTorch): Keras' `train_step` runs the forward pass of a
    `DistributedDataParallel` around the model, which starts with process 0's weights and
    averages the gradients over the processes in `backward`."""
    if not (cluster.distributed and cluster.backend == "torch"):
        return
    import torch
    from torch.nn.parallel import DistributedDataParallel

    from keras_transformer.losses import LabelSmoothedCrossEntropy

    class Forward(torch.nn.Module):
        """The model's `call` as a module, for DDP to wrap (DDP calls `forward`)."""

        def __init__(self):
            super().__init__()
            self.model = model

        def forward(self, inputs, training=None):
            return type(model).call(model, inputs, training=training)

    ddp = DistributedDataParallel(Forward(), device_ids=[torch.cuda.current_device()] if collectives.torch_cuda() else None)

    def call(inputs, training=None):
        return ddp(inputs, training=training)

    # An attribute of the instance: `Layer.__call__` (and so `train_step`) reaches DDP.
    object.__setattr__(model, "call", call)
    loss = getattr(model, "loss", None)
    if isinstance(loss, LabelSmoothedCrossEntropy):
        loss.sum_over_processes = _torch_sum_over_processes


def _torch_sum_over_processes(count):
    """A scalar tensor summed over the processes, and their number (for the loss)."""
    import torch.distributed as dist

    everyone = count.detach().clone()
    dist.all_reduce(everyone)
    return everyone, dist.get_world_size()


def unwrap_model(model) -> None:
    """Undo `wrap_model` (the model's own `call` again, a loss of this process alone)."""
    if "call" in vars(model):
        object.__delattr__(model, "call")
    loss = getattr(model, "loss", None)
    if "sum_over_processes" in getattr(loss, "__dict__", {}):
        del loss.sum_over_processes


@contextlib.contextmanager
def alone(cluster: Cluster):
    """Inside: Keras' distribution is off, so that `fit`, `evaluate` and new models on this
    process are its own (for what only the chief does)."""
    if not cluster.distributed or cluster.backend != "jax":
        yield
        return
    import keras

    previous = keras.distribution.distribution()
    keras.distribution.set_distribution(None)
    try:
        yield
    finally:
        keras.distribution.set_distribution(previous)


class LocalCopy:
    """Called, the model as a plain one-process model with its current weights (or the
    model itself in a one-process run).

    For what only the chief does (translate the validation set, save, test): on JAX the
    cluster's weights span every process, and a computation on them is one that all
    processes must run. The copy is built once by `build()` (inside `alone`) and given
    the model's weights at each call. Use it inside `alone(cluster)`.
    """

    def __init__(self, cluster: Cluster, model, build):
        self.cluster, self.model, self.build = cluster, model, build
        self._copy = None

    def __call__(self, optimizer: bool = False):
        """The copy; with `optimizer`, its optimizer holds the model's optimizer's state too
        (for the model that is saved: a one-process run's `model.keras` holds it, and Keras
        warns at every load of one whose optimizer it cannot fill)."""
        if not self.cluster.distributed:
            return self.model
        if self._copy is None:
            with alone(self.cluster):
                self._copy = self.build()
        self._copy.set_weights(self.model.get_weights())
        if optimizer:
            target = self._copy.optimizer
            if not target.built:
                with alone(self.cluster):
                    target.build(self._copy.trainable_variables)
            for mine, theirs in zip(target.variables, self.model.optimizer.variables, strict=True):
                mine.assign(theirs.numpy())
        return self._copy


def fit_with_strategy(model, cluster: Cluster, train_data, steps_per_epoch: int, epochs: int, initial_epoch: int,
                      validation_data, callbacks, verbose) -> None:
    """`model.fit` for `MultiWorkerMirroredStrategy`, which Keras' own `fit` does not run
    under (keras-team/keras#20585): TensorFlow's documented multi-worker loop, running the
    model's own `train_step` and `test_step` with `strategy.run` and averaging their
    metrics over the workers with `strategy.reduce`, with Keras' callbacks called as
    `fit` calls them. Each worker's dataset is its own slice of every batch.
    """
    import keras
    import tensorflow as tf

    strategy = collectives.strategy()
    callbacks = keras.callbacks.CallbackList(callbacks, add_history=True, add_progbar=verbose != 0, model=model,
                                             verbose=verbose, epochs=epochs, steps=steps_per_epoch)

    def distributed(dataset):
        return strategy.distribute_datasets_from_function(lambda context: dataset)

    def run(step):
        @tf.function
        def function(iterator):
            results = strategy.run(step, args=(next(iterator),))
            return {k: strategy.reduce(tf.distribute.ReduceOp.MEAN, v, axis=None) for k, v in results.items()}

        return function

    train_function, test_function = run(model.train_step), run(model.test_step)
    batches = iter(distributed(train_data))
    model.stop_training = False
    callbacks.on_train_begin()
    logs = {}
    for epoch in range(initial_epoch, epochs):
        model.reset_metrics()
        callbacks.on_epoch_begin(epoch)
        for step in range(steps_per_epoch):
            callbacks.on_train_batch_begin(step)
            logs = train_function(batches)
            callbacks.on_train_batch_end(step, logs)
            if model.stop_training:
                break
        logs = {k: float(v) for k, v in logs.items()}
        if validation_data is not None:
            model.reset_metrics()
            validation = iter(distributed(validation_data))
            results = {}
            for _ in range(int(validation_data.cardinality())):
                results = test_function(validation)
            logs.update({f"val_{k}": float(v) for k, v in results.items()})
        callbacks.on_epoch_end(epoch, logs)
        if model.stop_training:
            break
    callbacks.on_train_end(logs)
