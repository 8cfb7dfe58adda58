"""Training in several processes, on each backend's own distributed engine.

A `train` process learns that it is one of several from the variables its launcher sets,
each backend's own:

    JAX         KERAS_DISTRIBUTION_JOB_ADDRESSES (the coordinator, host:port),
                KERAS_DISTRIBUTION_NUM_PROCESSES, KERAS_DISTRIBUTION_PROCESS_ID
                (read by `keras.distribution.initialize`, which starts `jax.distributed`)
    PyTorch     MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK (set by `torchrun`; read by
                `torch.distributed.init_process_group`)
    TensorFlow  TF_CONFIG (`tf.distribute.MultiWorkerMirroredStrategy`'s)

With none of them set, a run is one process and nothing here loads a backend.

In a cluster, JAX trains with `keras.distribution.DataParallel` over the devices of every
process (the global batch is assembled from each process's rows by Keras); PyTorch wraps
the model in `torch.nn.parallel.DistributedDataParallel`, whose forward pass Keras' own
`train_step` runs (so `model.fit`, its callbacks and its metrics stay as they are), and
which averages the gradients in the backward pass. The collectives are the engines': no
process talks to another except through them.

This module imports no backend at import time: the command line reads the cluster from
the environment while it checks its flags.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import socket
import sys
import threading

from keras_transformer.tools.config import RunError

__all__ = ["Cluster", "ClusterError", "from_environment"]

# Seconds a process waits for the others to join before it gives up (`--cluster-timeout`).
JOIN_TIMEOUT = 120

JAX_VARIABLES = ("KERAS_DISTRIBUTION_JOB_ADDRESSES", "KERAS_DISTRIBUTION_NUM_PROCESSES", "KERAS_DISTRIBUTION_PROCESS_ID")
TORCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "WORLD_SIZE", "RANK")


class ClusterError(RunError):
    """The cluster's settings are wrong, or its processes disagree: status 2, before training."""


@dataclasses.dataclass(frozen=True)
class Cluster:
    """Where this process stands among the run's processes.

    Attributes:
        backend: The Keras backend (`"jax"`, `"torch"`, `"tensorflow"`).
        num_processes: Processes in the run. Defaults to `1`.
        process_id: This one's index, `0 <= process_id < num_processes`; process 0 is
            the chief, the only one that writes the run directory. Defaults to `0`.
        address: The coordinator's `host:port` (`None` for one process).
    """

    backend: str
    num_processes: int = 1
    process_id: int = 0
    address: str | None = None

    @property
    def distributed(self) -> bool:
        return self.num_processes > 1

    @property
    def chief(self) -> bool:
        return self.process_id == 0

    @property
    def name(self) -> str:
        return f"process {self.process_id} of {self.num_processes}"

    def others(self) -> str:
        """The processes other than this one, in words ("process 1", "processes 1-3")."""
        ids = [i for i in range(self.num_processes) if i != self.process_id]
        return f"process {ids[0]}" if len(ids) == 1 else f"one of processes {', '.join(map(str, ids))}"


def from_environment(backend: str, environ=None) -> Cluster:
    """The cluster the launcher described in `environ` (default `os.environ`), checked.

    Raises:
        ClusterError: a variable that is malformed or out of range, a coordinator host
            that does not resolve, or (for process 0 on this machine) a port in use.
    """
    environ = os.environ if environ is None else environ
    if backend == "jax" and any(v in environ for v in JAX_VARIABLES):
        address, count, index = (environ.get(v) for v in JAX_VARIABLES)
        names = JAX_VARIABLES
        address = address.split(",")[0] if address else address
    elif backend == "torch" and "WORLD_SIZE" in environ:
        host, port, count, index = (environ.get(v) for v in TORCH_VARIABLES)
        names = ("MASTER_ADDR:MASTER_PORT", "WORLD_SIZE", "RANK")
        address = f"{host}:{port}" if host and port else None
    elif backend == "tensorflow" and environ.get("TF_CONFIG"):
        address, count, index = _tf_config(environ["TF_CONFIG"])
        names = ("TF_CONFIG's cluster.worker[0]", "the number of TF_CONFIG's workers", "TF_CONFIG's task.index")
    else:
        return Cluster(backend)
    count = _integer(count, names[1], minimum=1)
    index = _integer(index, names[2], minimum=0)
    if index >= count:
        raise ClusterError(f"{names[2]}={index} is out of range: {names[1]}={count} processes are numbered 0 to "
                           f"{count - 1}.")
    cluster = Cluster(backend, count, index, address)
    if cluster.distributed:
        # Under torchrun its agent, not process 0, already listens on MASTER_PORT.
        _check_address(address, names[0], listen=cluster.chief and "TORCHELASTIC_RUN_ID" not in environ)
    return cluster


def _integer(text, name: str, minimum: int) -> int:
    try:
        value = int(text)
    except (TypeError, ValueError):
        raise ClusterError(f"{name} must be an integer >= {minimum}; got {text!r}.") from None
    if value < minimum:
        raise ClusterError(f"{name} must be an integer >= {minimum}; got {value}.")
    return value


def _tf_config(text: str):
    try:
        config = json.loads(text)
        workers = list(config["cluster"]["worker"])
        index = config["task"]["index"]
        if config["task"].get("type", "worker") != "worker":
            raise ClusterError(f"TF_CONFIG's task.type must be 'worker'; got {config['task']['type']!r}.")
    except (ValueError, KeyError, TypeError) as e:
        raise ClusterError(f"TF_CONFIG is not a cluster description ({type(e).__name__}: {e}).") from None
    return (workers[0] if workers else None), len(workers), index


def _check_address(address: str | None, name: str, listen: bool) -> None:
    """`host:port` that resolves; on the process that will listen on it, a free port."""
    host, _, port = (address or "").rpartition(":")
    if not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ClusterError(f"{name} must be the coordinator's host:port; got {address!r}.")
    try:
        infos = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ClusterError(f"the coordinator's host {host!r} ({name}) does not resolve: {e.strerror}.") from None
    local = {"localhost", "0.0.0.0", "::", socket.gethostname()}
    if listen and (host in local or any(info[4][0].startswith("127.") or info[4][0] == "::1" for info in infos)):
        with socket.socket(infos[0][0], socket.SOCK_STREAM) as s:
            try:
                s.bind(infos[0][4])
            except OSError as e:
                raise ClusterError(f"the coordinator's port {address} ({name}) cannot be used: {e.strerror}. "
                                   "Choose a free port.") from None


def free_port() -> int:
    """A TCP port nothing listens on now (for a launch on this machine)."""
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


def launch_environment(backend: str, num_processes: int, process_id: int, port: int) -> dict:
    """The variables that make a process `process_id` of `num_processes` on this machine."""
    address = f"localhost:{port}"
    if backend == "jax":
        values = (address, num_processes, process_id)
        return dict(zip(JAX_VARIABLES, map(str, values)))
    if backend == "torch":  # what `torchrun --nproc-per-node N` sets
        return {"MASTER_ADDR": "localhost", "MASTER_PORT": str(port), "WORLD_SIZE": str(num_processes),
                "RANK": str(process_id), "LOCAL_RANK": str(process_id), "LOCAL_WORLD_SIZE": str(num_processes)}
    # TensorFlow's gRPC workers each listen on a port: `port` for the chief, the next for the others.
    workers = [f"localhost:{port + i}" for i in range(num_processes)]
    return {"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": process_id}})}


# --- in the cluster: every function below loads the backend's engine -----------------------------

def join(cluster: Cluster, timeout: float = JOIN_TIMEOUT) -> None:
    """Start the backend's engine and wait for every process, at most `timeout` seconds.

    The others not all there in time, one line and status 1 (the engines wait far longer,
    or abort the process, so a timer gives up first). On TensorFlow the strategy waits
    inside its context initialization without releasing the GIL, so the timer cannot run
    and TensorFlow's own registration timeout applies.
    """
    if not cluster.distributed:
        return
    done = threading.Event()

    def give_up():
        if not done.is_set():
            _exit_lost(cluster, f"the cluster did not form within {timeout:g} s at {cluster.address}: "
                                f"{cluster.others()} never arrived (or two processes were given the same index)")

    timer = threading.Timer(timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        if cluster.backend == "jax":
            import jax

            # The collectives of XLA's CPU client between processes (GPUs and TPUs have their own).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            import keras

            keras.distribution.initialize()  # reads KERAS_DISTRIBUTION_*
        elif cluster.backend == "tensorflow":
            import tensorflow as tf

            global _STRATEGY
            _STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
            barrier(cluster, "joined")  # the strategy's first collective waits for every worker
        else:
            import datetime

            import torch.distributed as dist

            dist.init_process_group("nccl" if _torch_cuda() else "gloo",
                                    timeout=datetime.timedelta(seconds=max(timeout, 1800)))
    finally:
        done.set()
        timer.cancel()


# TensorFlow's `MultiWorkerMirroredStrategy` of this process, once it has joined.
_STRATEGY = None


def scope(cluster: Cluster):
    """Where a model is built and compiled: the TensorFlow strategy's scope in a cluster."""
    if cluster.distributed and cluster.backend == "tensorflow":
        return _STRATEGY.scope()
    return contextlib.nullcontext()


def leave(cluster: Cluster) -> None:
    """Close this process's PyTorch process group before the interpreter exits (left open,
    gloo's threads may abort the process at exit, after the run's own last line)."""
    if cluster.distributed and cluster.backend == "torch":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _exit_lost(cluster: Cluster, reason: str) -> None:
    """One line and status 1, now: the engines' own shutdown would wait for the lost process."""
    print(f"keras-transformer train: error: {cluster.name}: {reason}. Run the same launch again to resume.",
          file=sys.stderr, flush=True)
    os._exit(1)


def lost(cluster: Cluster, error: BaseException) -> str | None:
    """What a failed collective says about the other processes, or `None` for another error.

    A process killed mid-step shows up in the others as a failed collective: gloo's
    "Connection reset/closed by peer", NCCL's "remote process exited", XLA's failed all-reduce.
    The engines raise plain `RuntimeError`s for these, so their text is what tells them apart.
    """
    text = str(error)
    signs = ("Gloo", "gloo", "Connection reset by peer", "Connection closed by peer", "NCCL", "Broken pipe",
             "coordination service", "DistBackendError", "Collective ops is aborted", "Socket closed",
             "failed to connect", "UNAVAILABLE", "is unavailable")
    if not any(sign in text for sign in signs) and type(error).__name__ != "DistBackendError":
        return None
    first = text.strip().splitlines()[0] if text.strip() else type(error).__name__
    return f"{cluster.others()} stopped answering ({first[:200]})"


@contextlib.contextmanager
def stop_if_lost(cluster: Cluster):
    """Around everything a joined process does: a lost peer is one line and status 1, now,
    wherever it shows (a training step, a barrier, the final save), never a traceback."""
    try:
        yield
    except Exception as e:
        reason = lost(cluster, e) if cluster.distributed else None
        if reason is None:
            raise
        _exit_lost(cluster, reason)


def barrier(cluster: Cluster, name: str) -> None:
    """Wait until every process reaches the barrier `name`."""
    if not cluster.distributed:
        return
    all_gather(cluster, b"")


def all_gather(cluster: Cluster, data: bytes) -> list[bytes]:
    """Every process's `data` (at most 1 KiB), in process order, through the engine."""
    if not cluster.distributed:
        return [data]
    import numpy as np

    if len(data) > 1024:
        raise ValueError(f"all_gather carries at most 1024 bytes; got {len(data)}")
    row = np.zeros(1025, np.int32)
    row[0], row[1:1 + len(data)] = len(data), np.frombuffer(data, np.uint8)
    if cluster.backend == "jax":
        from jax.experimental import multihost_utils

        rows = np.asarray(multihost_utils.process_allgather(row))
    elif cluster.backend == "tensorflow":
        import tensorflow as tf

        rows = _STRATEGY.gather(_STRATEGY.run(lambda: tf.constant(row[None])), axis=0).numpy()
    else:
        import torch
        import torch.distributed as dist

        device = "cuda" if _torch_cuda() else "cpu"
        local = torch.as_tensor(row, device=device)
        gathered = [torch.empty_like(local) for _ in range(cluster.num_processes)]
        dist.all_gather(gathered, local)
        rows = np.stack([g.cpu().numpy() for g in gathered])
    return [bytes(r[1:1 + r[0]].astype(np.uint8)) for r in rows]


def agree(cluster: Cluster, error: Exception | None) -> None:
    """Every process says whether it is ready; if one is not, all stop with status 2.

    The process with the problem raises its own `error`; the others name it.
    """
    if not cluster.distributed:
        if error is not None:
            raise error
        return
    message = b"" if error is None else str(error).encode("utf-8")[:1000]
    replies = all_gather(cluster, b"ok" if error is None else b"no" + message)
    if error is not None:
        raise error
    failed = [i for i, reply in enumerate(replies) if reply != b"ok"]
    if failed:
        first = replies[failed[0]][2:].decode("utf-8", "replace")
        raise ClusterError(f"process {failed[0]} cannot train: {first}")


def check_same(cluster: Cluster, facts: dict[str, object]) -> None:
    """Refuse to train unless every process has the same `facts` (by name: settings, corpus,
    versions; at most 128 of them), in the order given.

    Raises:
        ClusterError: naming the first fact that differs and the processes that differ.
    """
    if not cluster.distributed:
        return
    keys = list(facts)
    digest = b"".join(hashlib.sha256(json.dumps(facts[k], sort_keys=True, default=str).encode()).digest()[:8]
                      for k in keys)
    digests = all_gather(cluster, digest)
    for i, key in enumerate(keys):
        own = [d[8 * i: 8 * i + 8] for d in digests]
        differ = [p for p, d in enumerate(own) if d != own[0]]
        if differ:
            raise ClusterError(f"the processes disagree on {key}: process {differ[0]}'s differs from process 0's. "
                               "Launch every process with the same flags, files and versions.")


def data_digest(pairs) -> str:
    """A digest of sentence pairs, for `check_same`."""
    h = hashlib.sha256()
    for source, target in pairs:
        h.update(source.encode("utf-8") + b"\t" + target.encode("utf-8") + b"\n")
    return h.hexdigest()


def stop_together(cluster: Cluster, stop: bool) -> bool:
    """The chief's decision to stop, known to every process (a callback's early stop)."""
    if not cluster.distributed:
        return stop
    return all_gather(cluster, b"1" if stop else b"0")[0] == b"1"


def average(cluster: Cluster, values: dict) -> dict:
    """`values` (floats) averaged over the processes: PyTorch's metrics are each process's own
    (Keras' JAX metrics are already global)."""
    if not cluster.distributed or cluster.backend != "torch" or not values:
        return values
    import torch
    import torch.distributed as dist

    keys = sorted(values)
    local = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64,
                         device="cuda" if _torch_cuda() else "cpu")
    dist.all_reduce(local)
    return {k: float(v) / cluster.num_processes for k, v in zip(keys, local.cpu().tolist())}


def devices_per_process(cluster: Cluster) -> int:
    """The devices each process splits its rows over (its local replicas)."""
    if not cluster.distributed:
        return 1
    if cluster.backend == "jax":
        import jax

        return jax.local_device_count()
    if cluster.backend == "tensorflow":
        return max(1, _STRATEGY.num_replicas_in_sync // cluster.num_processes)
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

    ddp = DistributedDataParallel(Forward(), device_ids=[torch.cuda.current_device()] if _torch_cuda() else None)

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

    def __call__(self):
        if not self.cluster.distributed:
            return self.model
        if self._copy is None:
            with alone(self.cluster):
                self._copy = self.build()
        self._copy.set_weights(self.model.get_weights())
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

    strategy = _STRATEGY
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
