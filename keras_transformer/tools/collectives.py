"""The engines' process group: joining it, the collectives `train` uses, leaving it.

Every function takes the `Cluster` and does nothing (or the one-process thing) when it
is one process. The collectives are the engines' own: JAX's
`multihost_utils.process_allgather`, `torch.distributed`'s `all_gather`/`all_reduce`, the
TensorFlow strategy's `gather`; no process talks to another except through them. A
process that stops answering surfaces as a failed collective: `stop_if_lost` turns that
into one line and status 1.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import sys
import threading
import time

from keras_transformer.tools.cluster import (JOIN_TIMEOUT, Cluster, ClusterError, host_and_port, sigterm_kept,
                                             tf_config, tf_task_taken)
from keras_transformer.tools.config import say
from keras_transformer.tools.files import reader_gone


def join(cluster: Cluster, timeout: float = JOIN_TIMEOUT) -> None:
    """Start the backend's engine and wait for every process, at most `timeout` seconds.

    The others not all there in time, one line and status 1 (the engines wait far longer,
    or abort the process, so a timer gives up first); nothing answering at the
    coordinator's address, status 2. TensorFlow: `_join_tensorflow`; SIGTERM: `sigterm_kept`."""
    if not cluster.distributed:
        return
    if cluster.backend == "tensorflow":
        _join_tensorflow(cluster, timeout)
        return
    done = threading.Event()

    def give_up():
        if done.is_set():
            return
        _exit(cluster, *not_formed(cluster, timeout, cluster.chief or answers(cluster.address)))

    timer = threading.Timer(timeout, give_up)
    timer.daemon = True
    timer.start()
    try:
        if cluster.backend == "jax":
            import jax
            import keras

            # The collectives of XLA's CPU client between processes (GPUs and TPUs have their own).
            jax.config.update("jax_cpu_collectives_implementation", "gloo")
            with sigterm_kept():
                keras.distribution.initialize()  # reads KERAS_DISTRIBUTION_*
        else:
            _join_torch(cluster, timeout)
    finally:
        done.set()
        timer.cancel()


def _join_tensorflow(cluster: Cluster, timeout: float) -> None:
    """`MultiWorkerMirroredStrategy` from TF_CONFIG, given up on after `timeout` seconds.

    The strategy waits for every worker inside TensorFlow's context initialization without
    releasing the GIL, so no Python timer runs there (TensorFlow's own registration timeout
    is an hour). Instead, a process other than the chief first waits for the chief's gRPC
    port to answer (the chief opens it before it waits for the others): nothing there in
    time is a wrong address or a chief that never started, status 2. The wait inside
    TensorFlow is then bounded by `faulthandler`'s watchdog, a thread of C that needs no
    GIL: it ends the process with status 1 at the deadline, and `_watchdog`'s small process
    prints the one line.
    """
    import tensorflow as tf

    deadline = time.monotonic() + timeout
    if not cluster.chief:
        while not answers(cluster.address, timeout=1.0):
            if time.monotonic() >= deadline:
                _exit(cluster, *not_formed(cluster, timeout, answered=False))
            time.sleep(0.25)
    global _STRATEGY
    with _watchdog(_line(cluster, not_formed(cluster, timeout, answered=True)[0]), deadline - time.monotonic()):
        try:
            with sigterm_kept():
                _STRATEGY = tf.distribute.MultiWorkerMirroredStrategy()  # reads TF_CONFIG
        except tf.errors.UnknownError as e:
            if "Could not start gRPC server" not in str(e):
                raise
            # Another process holds this one's port: the same task.index given twice, or
            # another program there (the chief's port is checked before the backend loads).
            config = tf_config(os.environ["TF_CONFIG"])
            _exit(cluster, f"TensorFlow could not listen at {config.addresses[cluster.process_id]}, this process's "
                           f"address in TF_CONFIG: {tf_task_taken(config)}", 2)
        try:
            barrier(cluster, "joined")  # the strategy's first collective waits for every worker
        except tf.errors.OpError as e:
            # Worker lists of different lengths: TensorFlow forms the group and its first
            # collective fails in every process ("... is joining a group with size3, but
            # that group has size 2").
            if "joining a group with size" in str(e):
                _exit(cluster, "the processes were started for different numbers of processes (the worker lists "
                               "of their TF_CONFIG differ): give every process the same cluster.worker list", 2)
            # Another process ended while the group formed (the first to meet that mismatch
            # exits, and a process still waiting for the group then loses the connection).
            _exit(cluster, f"the processes did not form a group: another process ended as they joined, and its own "
                           f"line says why (worker lists of different lengths in TF_CONFIG end them there; "
                           f"{type(e).__name__})", 2)


# The process that prints a watchdog's line: it reads what `faulthandler` writes when the
# time is up (the threads' tracebacks, not shown) and prints the line instead; an end of
# input with nothing read (the wait ended in time, or the process was killed) prints nothing.
_SPEAKER = "import sys\nif sys.stdin.buffer.read(1):\n    sys.stderr.write(sys.argv[1] + '\\n')\n"


@contextlib.contextmanager
def _watchdog(line: str, seconds: float):
    """End this process with status 1 and `line` on stderr if the block takes longer than
    `seconds`, even while a C library holds the GIL (`faulthandler.dump_traceback_later`,
    whose `exit=True` is `_exit(1)`)."""
    import faulthandler
    import subprocess

    speaker = subprocess.Popen([sys.executable, "-I", "-S", "-c", _SPEAKER, line], stdin=subprocess.PIPE,
                               stdout=subprocess.DEVNULL)
    faulthandler.dump_traceback_later(max(seconds, 0.1), exit=True, file=speaker.stdin)
    try:
        yield
    finally:
        faulthandler.cancel_dump_traceback_later()
        speaker.stdin.close()
        speaker.wait()


def not_formed(cluster: Cluster, timeout: float, answered: bool) -> tuple[str, int]:
    """What a process says, and its status, when the cluster did not form within `timeout`
    seconds; `answered`: something accepted a connection at the coordinator's address (the
    chief's own)."""
    if not answered:
        # Nothing listens where the coordinator should: a wrong address or port (or a
        # process 0 that never started), which the settings can fix: status 2.
        return (f"nothing answers at the coordinator's address {cluster.address} (tried for {timeout:g} s): "
                f"check the address and port, and that process 0 is started"), 2
    # A fault (status 1): a process missing, or, for the others, a wrong address where some other
    # program listens (a process can tell that from a coordinator only through the engine's handshake).
    causes = (" (or two processes were given the same index)" if cluster.chief else
              f", two processes were given the same index, or what answers at {cluster.address} is not "
              f"process 0's coordinator (check the address)")
    return _resumable(f"the cluster did not form within {timeout:g} s at {cluster.address}: {cluster.others()} "
                      f"never arrived{causes}"), 1


def _join_torch(cluster: Cluster, timeout: float) -> None:
    """`torch.distributed.init_process_group` on a `TCPStore` this process opens itself, as
    the `env://` rendezvous would, so that each process first counts itself in the store:
    a second process given an index already taken (`RANK`) learns it at once and says so
    (status 2) instead of waiting out the timeout. The processes that formed the cluster
    go on: a duplicate can arrive at any time, even after training has started, so
    stopping them would depend on its timing. Under `torchrun`, whose agent owns the store
    and gives every process its own rank, the usual `env://` rendezvous."""
    import datetime

    import torch.distributed as dist

    backend = "nccl" if torch_cuda() else "gloo"
    wait = datetime.timedelta(seconds=max(timeout, 1800))
    if "TORCHELASTIC_RUN_ID" in os.environ:
        dist.init_process_group(backend, timeout=wait)
        return
    host, port = host_and_port(cluster.address)
    store = dist.TCPStore(host, int(port), cluster.num_processes, is_master=cluster.chief,
                          timeout=wait, wait_for_workers=False)
    # Told another number of processes than process 0, a process would wait for ones that never
    # come, or leave one out: it refuses at once (status 2; process 0 waits out the timeout).
    if cluster.chief:
        store.set("keras-transformer/num_processes", str(cluster.num_processes))
    elif (chief_count := int(store.get("keras-transformer/num_processes"))) != cluster.num_processes:
        _exit(cluster, f"this process was started for {cluster.num_processes} processes and process 0 for "
                       f"{chief_count} (WORLD_SIZE): start every process with the same count", 2)
    if store.add(f"keras-transformer/index/{cluster.process_id}", 1) > 1:
        _exit(cluster, f"another process already joined as process {cluster.process_id}: each process needs "
                       f"its own index (RANK), 0 to {cluster.num_processes - 1}", 2)
    dist.init_process_group(backend, store=store, rank=cluster.process_id, world_size=cluster.num_processes,
                            timeout=wait)


# TensorFlow's `MultiWorkerMirroredStrategy` of this process, once it has joined.
_STRATEGY = None


def strategy():
    """This process's `MultiWorkerMirroredStrategy` (TensorFlow, once joined)."""
    return _STRATEGY


def leave(cluster: Cluster) -> None:
    """Close this process's PyTorch process group before the interpreter exits (left open,
    gloo's threads may abort the process at exit, after the run's own last line)."""
    if cluster.distributed and cluster.backend == "torch":
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def torch_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _resumable(reason: str) -> str:
    """A fault's line: the run resumes where it stopped when it is started again."""
    return f"{reason}. Run the same launch again to resume"


def _exit(cluster: Cluster, message: str, status: int) -> None:
    say(_line(cluster, message))
    os._exit(status)


def _line(cluster: Cluster, message: str) -> str:
    return f"keras-transformer train: error: {cluster.name}: {message}."


def answers(address: str | None, timeout: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at `host:port` (the coordinator's).

    Asked only once joining has timed out, to tell a wrong address from a missing process;
    the connection is closed at once, before any engine's handshake.
    """
    import socket

    host, port = host_and_port(address)
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except (OSError, ValueError):
        return False


def lost(cluster: Cluster, error: BaseException) -> str | None:
    """What a failed collective says about the other processes, or `None` for another error.

    A process killed mid-step shows up in the others as a failed collective: gloo's
    "Connection reset/closed by peer", NCCL's "remote process exited", XLA's failed all-reduce.
    The engines raise plain `RuntimeError`s for these, so their text is what tells them apart.
    """
    if isinstance(error, BrokenPipeError) and reader_gone(sys.stdout):
        return None  # this process's own output was closed (`launch ... | head`): no peer is lost
    text = str(error)
    signs = ("Gloo", "gloo", "Connection reset by peer", "Connection closed by peer", "NCCL", "Broken pipe",
             "coordination service", "DistBackendError", "Collective ops is aborted", "Socket closed",
             "failed to connect", "UNAVAILABLE", "is unavailable")
    if not any(sign in text for sign in signs) and type(error).__name__ != "DistBackendError":
        return None
    # The line that says what failed: TensorFlow's starts "Graph execution error:", then the
    # node's traceback, before it, and the line names its function (`{{function_node ...}}`).
    lines = [re.sub(r"\{\{[^}]*\}\}\s*", "", line).strip() for line in text.splitlines()]
    lines = [line for line in lines if line]
    said = next((line for line in lines if any(sign in line for sign in signs)), lines[0] if lines else "")
    return f"{cluster.others()} stopped answering ({said[:200] or type(error).__name__})"


@contextlib.contextmanager
def stop_if_lost(cluster: Cluster):
    """Around everything a joined process does: a lost peer is one line and status 1, now,
    wherever it shows (a training step, a barrier, the final save), never a traceback."""
    try:
        yield
    except Exception as e:
        if not cluster.distributed:
            raise
        reason = lost(cluster, e)
        if reason is None:
            FAILED_IN_CLUSTER.set()
            raise
        _exit(cluster, _resumable(reason), 1)  # now: the engines' shutdown would wait for the lost process


# Set when an error other than a lost peer ends `train` in a process of several; `cli.run`
# then ends the process at once: a normal exit runs the engine's shutdown, which waits for the
# others (JAX's), while they wait for this one at their next collective (both hung for minutes).
FAILED_IN_CLUSTER = threading.Event()


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
        rows = _tensorflow_gather(row)
    else:
        import torch
        import torch.distributed as dist

        device = "cuda" if torch_cuda() else "cpu"
        local = torch.as_tensor(row, device=device)
        gathered = [torch.empty_like(local) for _ in range(cluster.num_processes)]
        dist.all_gather(gathered, local)
        rows = np.stack([g.cpu().numpy() for g in gathered])
    return [bytes(r[1:1 + r[0]].astype(np.uint8)) for r in rows]


_GATHER = None


def _tensorflow_gather(row):
    """Every process's `row`, stacked, through the strategy's gather: a `tf.function` traced
    once (run eagerly, each call logged TensorFlow's warning about the overhead of an eager
    collective, and a new function per call its warnings about retracing)."""
    global _GATHER
    import tensorflow as tf

    if _GATHER is None:
        _GATHER = tf.function(lambda row: _STRATEGY.gather(_STRATEGY.run(lambda r: r[None], args=(row,)), axis=0))
    return _GATHER(tf.constant(row)).numpy()


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
                         device="cuda" if torch_cuda() else "cpu")
    dist.all_reduce(local)
    return {k: float(v) / cluster.num_processes for k, v in zip(keys, local.cpu().tolist())}
