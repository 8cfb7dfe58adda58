"""Where a process stands among a run's processes, read from each engine's own variables.

A `train` process learns that it is one of several from the variables its launcher sets,
each backend's own:

    JAX         KERAS_DISTRIBUTION_JOB_ADDRESSES (the coordinator, host:port),
                KERAS_DISTRIBUTION_NUM_PROCESSES, KERAS_DISTRIBUTION_PROCESS_ID
                (read by `keras.distribution.initialize`, which starts `jax.distributed`)
    PyTorch     MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK (set by `torchrun`; read by
                `torch.distributed.init_process_group`)
    TensorFlow  TF_CONFIG (`tf.distribute.MultiWorkerMirroredStrategy`'s)

With none of them set, a run is one process. This module checks the variables and
writes them for `launch`; it imports no backend, so the command line reads the cluster
while it checks its flags. Joining and the collectives are in `collectives`; how a model
trains over the processes is in `distributed_fit`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import signal
import socket
import threading

from keras_transformer.defaults import MAX_INT
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
        listed = address.split(",") if address else []
        if address and not listed[0].strip():
            raise ClusterError(f"KERAS_DISTRIBUTION_JOB_ADDRESSES starts with an empty address ({address!r}): the "
                               "first is the coordinator's host:port.")
        address = listed[0] if listed else address
    elif backend == "torch" and ("WORLD_SIZE" in environ or "RANK" in environ):
        host, port, count, index = (environ.get(v) for v in TORCH_VARIABLES)
        names = ("MASTER_ADDR:MASTER_PORT", "WORLD_SIZE", "RANK")
        address = f"{host}:{port}" if host and port else None
    elif backend == "tensorflow" and environ.get("TF_CONFIG"):
        config = tf_config(environ["TF_CONFIG"])
        address, count, index = config.addresses[0], len(config.addresses), config.process_id
        names = (config.names[0], "the number of TF_CONFIG's processes", "this process's place in TF_CONFIG")
    else:
        return Cluster(backend)
    count = _integer(count, names[1], minimum=1)
    index = _integer(index, names[2], minimum=0)
    if backend == "jax" and len(listed) > 1 and len(listed) != count:
        # A list names every process; `keras.distribution.initialize` checks its length
        # too, but with a ValueError once the backend has loaded.
        raise ClusterError(f"KERAS_DISTRIBUTION_JOB_ADDRESSES lists {len(listed)} processes but "
                           f"KERAS_DISTRIBUTION_NUM_PROCESSES is {count}: give the coordinator's host:port alone, "
                           "or one host:port per process.")
    if index >= count:
        raise ClusterError(f"{names[2]}={index} is out of range: {names[1]}={count} processes are numbered 0 to "
                           f"{count - 1}.")
    cluster = Cluster(backend, count, index, address)
    if cluster.distributed:
        # Under torchrun its agent, not process 0, already listens on MASTER_PORT.
        _check_address(address, names[0], listen=cluster.chief and "TORCHELASTIC_RUN_ID" not in environ)
        if backend == "tensorflow":
            _check_tf_processes(config)
    return cluster


def _integer(value, name: str, minimum: int) -> int:
    """A count or an index: a variable's ASCII digits, or a JSON integer (TF_CONFIG's)."""
    if value is None:
        needs = "the number of processes" if minimum else "its own index among them, from 0"
        raise ClusterError(f"{name} is not set: each process of a multi-process run needs {needs}.")
    if isinstance(value, int) and not isinstance(value, bool):
        number = value
    elif isinstance(value, str) and value.isascii() and value.isdigit():
        number = int(value)
    else:
        raise ClusterError(f"{name} must be an integer >= {minimum}; got {value!r}.")
    if number < minimum:
        raise ClusterError(f"{name} must be an integer >= {minimum}; got {number}.")
    if number > MAX_INT:
        raise ClusterError(f"{name} must be at most {MAX_INT} (the engines count processes in C ints); "
                           f"got {number}.")
    return number


@dataclasses.dataclass(frozen=True)
class TFConfig:
    """A TF_CONFIG's processes, in the order MultiWorkerMirroredStrategy numbers them: the
    `chief` job's one task first if there is one (as on Vertex AI), then the `worker` job's
    tasks; without a `chief` job (as `launch` writes it, and TensorFlow's tutorials), worker
    0 is the chief.

    Attributes:
        addresses: Each process's `host:port`; the first is the coordinator's.
        names: Where each address is in TF_CONFIG (`"TF_CONFIG's cluster.worker[1]"`).
        process_id: This process's place among them.
        task: This process's task in TF_CONFIG's words (`"task.index (1)"`).
    """

    addresses: list
    names: list
    process_id: int
    task: str


def tf_config(text: str) -> TFConfig:
    """The processes of a TF_CONFIG that lists a `worker` job, and maybe a `chief` job of
    one task (the jobs MultiWorkerMirroredStrategy trains with), checked."""
    try:
        config = json.loads(text)
    except ValueError as e:
        raise ClusterError(f"TF_CONFIG is not a cluster description (not JSON: {e}).") from None
    cluster, task = (config.get(key) if isinstance(config, dict) else None for key in ("cluster", "task"))
    if not isinstance(cluster, dict) or not isinstance(task, dict):
        raise ClusterError("TF_CONFIG is not a cluster description: it needs a \"cluster\" and a \"task\" object, "
                           'as in {"cluster": {"worker": ["host:port", ...]}, "task": {"type": "worker", "index": 0}}.')
    # An "evaluator" job (a side process that evaluates checkpoints; TensorFlow's cluster
    # specs allow one) is not among the processes that train, as for the strategy.
    others = sorted(set(cluster) - {"chief", "worker", "evaluator"})
    if others or not set(cluster) & {"chief", "worker"}:
        raise ClusterError(f"TF_CONFIG's cluster must list its processes under \"worker\" (and one under \"chief\", "
                           f"or worker 0 is the chief): MultiWorkerMirroredStrategy trains with no other job; got "
                           f"{others or 'no chief or worker job'}.")
    if task.get("type") == "evaluator":
        raise ClusterError("TF_CONFIG's task.type is 'evaluator': `train` runs in the processes that train (chief and "
                           "workers); evaluate a run's checkpoints with `keras-transformer evaluate`.")
    jobs = {}
    for job in ("chief", "worker"):
        tasks = cluster.get(job, [])
        if not isinstance(tasks, list) or not all(isinstance(t, str) for t in tasks):
            raise ClusterError(f"TF_CONFIG's cluster.{job} must be a list of \"host:port\" strings; got {tasks!r}.")
        jobs[job] = tasks
    if len(jobs["chief"]) > 1:
        raise ClusterError(f"TF_CONFIG's cluster.chief must list one process; got {len(jobs['chief'])}.")
    addresses = jobs["chief"] + jobs["worker"]
    if not addresses:
        raise ClusterError("TF_CONFIG's cluster lists no process: give each process's host:port under \"worker\".")
    repeated = sorted({a for a in addresses if addresses.count(a) > 1})
    if repeated:
        raise ClusterError(f"TF_CONFIG's cluster lists {repeated[0]} more than once: each process listens on its "
                           "own host:port.")
    kind = task.get("type", "worker")
    if kind not in ("chief", "worker") or not jobs[kind]:
        jobs_given = " or ".join(repr(job) for job in ("chief", "worker") if jobs[job])
        raise ClusterError(f"TF_CONFIG's task.type must be {jobs_given or repr('worker')}; got {kind!r}.")
    index = _integer(task.get("index"), "TF_CONFIG's task.index", minimum=0)
    if index >= len(jobs[kind]):
        count = len(jobs[kind])
        numbered = "index 0" if count == 1 else f"numbered 0 to {count - 1}"
        raise ClusterError(f"TF_CONFIG's task.index={index} is out of range: cluster.{kind} lists {count} "
                           f"process{'es' if count > 1 else ''} ({numbered}).")
    names = [f"TF_CONFIG's cluster.{job}[{i}]" for job in ("chief", "worker") for i in range(len(jobs[job]))]
    process_id = index if kind == "chief" else len(jobs["chief"]) + index
    return TFConfig(addresses, names, process_id, f"task.index ({index})" if kind == "worker" else "chief task")


def tf_task_taken(config: TFConfig) -> str:
    """Why this process's own TF_CONFIG port can be taken (TensorFlow listens there), a clause."""
    return f"another process was given the same {config.task}, or another program uses the port"


def _check_tf_processes(config: TFConfig) -> None:
    """Every address of TF_CONFIG is a `host:port`, and this process's own (it listens there:
    TensorFlow's gRPC server) resolves and, on this machine, is free."""
    for address, name in zip(config.addresses, config.names):
        _check_form(address, name, "a host:port")
    if config.process_id:  # process 0's is the coordinator's, already checked
        why = tf_task_taken(config)
        _check_address(config.addresses[config.process_id], config.names[config.process_id], listen=True,
                       whose="this process's", taken=f"{why[:1].upper()}{why[1:]}.")


def _check_address(address: str | None, name: str, listen: bool, whose: str = "the coordinator's",
                   taken: str = "Choose a free port.") -> None:
    """`host:port` that resolves; on the process that will listen on it, a free port.
    `whose` address it is and what to say of a port `taken` go into the messages."""
    if not address:
        raise ClusterError(f"{name} is not set: the processes of a run need the coordinator's host:port.")
    host, port = _check_form(address, name)
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as e:
        raise ClusterError(f"{whose} host {host!r} ({name}) does not resolve: {e.strerror}.") from None
    local = {"localhost", "0.0.0.0", "::", socket.gethostname()}
    if listen and (host in local or any(info[4][0].startswith("127.") or info[4][0] == "::1" for info in infos)):
        error = _bind_error(infos[0][0], infos[0][4])
        if error:
            raise ClusterError(f"{whose} port {address} ({name}) cannot be used: {error.strerror}. {taken}")


def host_and_port(address: str | None) -> tuple[str, str]:
    """`host:port` split at its last colon, an IPv6 host's brackets dropped (`[::1]:29500`)."""
    host, _, port = (address or "").rpartition(":")
    return host.strip("[]"), port


def _check_form(address: str, name: str, what: str = "the coordinator's host:port") -> tuple[str, int]:
    """The host and the port of `host:port`, checked."""
    host, port = host_and_port(address)
    if "://" in address:  # the engines take host:port, not a URL
        raise ClusterError(f"{name} must be {what}, without a scheme; got {address!r}.")
    if not host or not (port.isascii() and port.isdigit()) or not 0 < int(port) < 65536:
        raise ClusterError(f"{name} must be {what}; got {address!r}.")
    return host, int(port)


def check_launch_port(backend: str, num_processes: int, port: int) -> None:
    """Refuse a `launch --port` out of range or in use on this machine (TensorFlow's
    workers listen on the ports after it too), once, before any process starts."""
    ports = range(port, port + (num_processes if backend == "tensorflow" else 1))
    if ports[-1] > 65535:
        workers = " (each TensorFlow worker listens on the next port)" if len(ports) > 1 else ""
        raise ClusterError(f"--port must be in [1, {65536 - len(ports)}]{workers}; got {port}.")
    for each in ports:
        _check_address(f"localhost:{each}", "--port", listen=True)


def free_port(count: int = 1) -> int:
    """A TCP port nothing listens on now (for a launch on this machine); with `count`, the
    first of that many consecutive free ports (TensorFlow's workers each listen on one)."""
    while True:
        with socket.socket() as s:
            s.bind(("localhost", 0))
            first = s.getsockname()[1]
        if first + count - 1 <= 65535 and all(_is_free(first + i) for i in range(1, count)):
            return first


def _is_free(port: int) -> bool:
    return _bind_error(socket.AF_INET, ("localhost", port)) is None


def _bind_error(family, address) -> OSError | None:
    """What binding a listening socket to `address` would raise, as the engines bind theirs:
    with `SO_REUSEADDR`, so that the connections of a run that just ended (a killed
    coordinator's, in TIME_WAIT for a minute) do not keep its relaunch off the port; a
    socket that listens there still does."""
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as error:
            return error
    return None


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


@contextlib.contextmanager
def sigterm_kept():
    """Keep this process's SIGTERM handling through the start of JAX's or TensorFlow's
    multi-process engine (`jax.distributed.initialize`, `MultiWorkerMirroredStrategy`):
    each installs a handler of its own (XLA's and TensorFlow's coordination service's
    preemption notifier) for training loops that poll a preemption sync point
    (`jax.experimental.multihost_utils.reached_preemption_sync_point`,
    `tf.distribute.experimental.PreemptionCheckpointHandler`) and save at an agreed step.
    `train` polls none, so a scheduler's SIGTERM, or the one `launch` passes on, was
    swallowed and the processes trained on to the end; with the handler as before,
    SIGTERM ends them and the run resumes from its last epoch, as on PyTorch. A SIGTERM
    that comes meanwhile waits, blocked, and is handled as before once the engine runs."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    before = signal.getsignal(signal.SIGTERM)
    blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    try:
        yield
    finally:
        if before is not None:  # None: a handler set outside Python, left as it is
            signal.signal(signal.SIGTERM, before)
        signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
