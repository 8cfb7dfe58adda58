"""Training in several processes: `keras_transformer.tools.cluster`, `keras-transformer launch`.

The processes run on this machine, as on a cluster: JAX through `keras.distribution`
(XLA's CPU collectives over gloo), PyTorch through `torch.distributed` (gloo) and
`DistributedDataParallel`. Each run here is real `keras-transformer train` processes.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import os
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings

import keras
import numpy as np
import pytest

from keras_transformer.tools import cli, cluster
from keras_transformer.tools.cluster import Cluster, ClusterError
from keras_transformer.tools.config import TrainConfig
from tests.conftest import only_on

BACKEND = keras.backend.backend()
CHILD = "import sys, keras_transformer_cli; sys.exit(keras_transformer_cli.main(sys.argv[1:]))"
# A 1-layer model for a few steps, dropout 0 so that the runs are deterministic. The token
# budget gives every bucket an even batch size: one process and two get the same batches.
# 400 pairs of the numbers corpus in a TSV file, 20 held out for validation and 20 for test.
SETTINGS = ["--preset", "tiny", "--num-layers", "1", "--holdout", "20", "--batch-tokens", "384", "--dropout", "0",
            "--vocab-size", "200", "--quiet"]
FLAGS: list[str] = []


@pytest.fixture(scope="module", autouse=True)
def corpus_file(tmp_path_factory):
    from keras_transformer.tools.text.corpora import numbers_corpus

    path = tmp_path_factory.mktemp("corpus") / "pairs.tsv"
    path.write_text("".join(f"{s}\t{t}\n" for s, t in numbers_corpus(train_size=440, seed=0).train), encoding="utf-8")
    FLAGS[:] = ["--tsv", str(path), *SETTINGS]
    return path


def _env(process_id: int, num_processes: int, port: int, chief_job: bool = False) -> dict:
    environ = cluster.launch_environment(BACKEND, num_processes, process_id, port)
    if chief_job and BACKEND == "tensorflow":
        environ["TF_CONFIG"] = json.dumps(_with_a_chief_job(json.loads(environ["TF_CONFIG"])))
    return {**os.environ, "KERAS_BACKEND": BACKEND, "TF_CPP_MIN_LOG_LEVEL": "3", **environ}


def _with_a_chief_job(config: dict) -> dict:
    """The same processes as TF_CONFIG writes them with a `chief` job (as Vertex AI does):
    worker 0 becomes the chief's one task, worker i worker i - 1."""
    first, *rest = config["cluster"]["worker"]
    index = config["task"]["index"]
    task = {"type": "chief", "index": 0} if index == 0 else {"type": "worker", "index": index - 1}
    return {"cluster": {"chief": [first], "worker": rest}, "task": task}


def _start(argv, env=None) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", CHILD, *argv], env=env or {**os.environ, "KERAS_BACKEND": BACKEND},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _errors(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if "error:" in line]


def _losses(run) -> list[float]:
    with open(run / "log.csv", newline="") as f:
        return [float(row["loss"]) for row in csv.DictReader(f)]


def _weights(run) -> dict:
    with np.load(run / "state" / "state.npz") as data:
        return {k: data[k] for k in data.files if k.startswith("model_")}


def test_two_processes_train_like_one_and_a_killed_one_stops_the_other_and_the_launch_resumes(tmp_path):
    """Two processes started by hand; one is killed once an epoch's state is written: the other
    stops within 60 s with one line, and the same command under `launch` resumes the run and
    ends where one process trained on the same global batches ends. (On TensorFlow the two
    started by hand have TF_CONFIG's `chief` job, `launch` writes workers only: the same
    processes, in the same order.)"""
    steps = ["--steps", "4", "--steps-per-epoch", "1"]
    run, port = tmp_path / "two", cluster.free_port()
    argv = ["train", "--output-dir", str(run), *FLAGS, *steps]
    chief, worker = (_start(argv, _env(i, 2, port, chief_job=True)) for i in (0, 1))
    deadline = time.time() + 300
    while not (run / "state" / "state.npz").exists():  # an epoch has ended
        assert time.time() < deadline and chief.poll() is None, chief.communicate()[1][-3000:]
        time.sleep(0.05)
    os.kill(worker.pid, signal.SIGKILL)
    killed = time.time()
    _, err = chief.communicate(timeout=120)
    assert time.time() - killed < 60
    assert chief.returncode == 1, err[-3000:]
    errors = _errors(err)
    assert len(errors) == 1 and "process 1 stopped answering" in errors[0], err[-3000:]
    # The collectives of `train` are traced once (TensorFlow warned of each eager call, then of retracing).
    assert "eagerly has significant overhead" not in err and "retracing" not in err, err[-3000:]
    worker.communicate()
    assert not (run / "metrics.json").exists()

    relaunch = _start(["launch", "--processes", "2", "--", *argv])
    # One process on the same global batches, in this process while the two train.
    assert cli.main(["train", "--output-dir", str(tmp_path / "one"), *FLAGS, *steps]) == 0
    out, err = relaunch.communicate(timeout=600)
    assert relaunch.returncode == 0, err[-3000:]
    assert "resuming" in out
    if BACKEND == "jax":  # gloo's line (each process prints it, a piece at a time): once, whole
        assert re.findall(r"^.*Gloo.*$", out, re.M) == [
            "[Gloo] Rank 0 is connected to 1 peer ranks. Expected number of connected peer ranks is : 1"], out
    assert len(_losses(run)) == 4
    one_weights, two_weights = _weights(tmp_path / "one"), _weights(run)
    assert one_weights.keys() == two_weights.keys()
    # One epoch is one step: log.csv holds each step's loss. JAX computes the loss of the
    # global batch, as one process does; on TensorFlow and PyTorch each process's loss is
    # its tokens' share of the global batch's mean (the strategy sums them; on PyTorch
    # scaled by the processes, whose gradients DistributedDataParallel averages).
    np.testing.assert_allclose(_losses(run), _losses(tmp_path / "one"), rtol=1e-5)
    # Adam's update is m / (sqrt(v) + 1e-9): a gradient at rounding level (the sums of two
    # processes are added in another order) still moves a weight by about the learning
    # rate, ~1e-5 here. A wrong split of the batches moves them by 1e-3 and more.
    worst = max(float(np.max(np.abs(one_weights[k] - two_weights[k]))) for k in one_weights)
    assert worst < 1e-4, worst
    # Only the chief wrote the run directory; the files of a finished run are all there.
    for name in ("config.json", "tokenizer", "data.json", "model.keras", "metrics.json", "log.csv", "curves.png"):
        assert (run / name).exists(), name
    # model.keras holds the optimizer's state, as one process's does (it held an unbuilt
    # optimizer, and Keras warned at every load: "Skipping variable loading for optimizer").
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        two_model = keras.saving.load_model(run / "model.keras")
    one_model = keras.saving.load_model(tmp_path / "one" / "model.keras")
    one_state, two_state = ([keras.ops.convert_to_numpy(v) for v in m.optimizer.variables]
                            for m in (one_model, two_model))
    assert len(one_state) == len(two_state) > 2 and int(two_state[0]) == 4  # the iterations, then Adam's moments
    for one, two in zip(one_state, two_state):
        np.testing.assert_allclose(two, one, rtol=1e-3, atol=1e-6)


def test_processes_that_disagree_are_refused_before_training(tmp_path):
    port = cluster.free_port()
    argv = ["train", "--output-dir", str(tmp_path / "run"), *FLAGS, "--steps", "4", "--steps-per-epoch", "2"]
    # On JAX and TensorFlow process 1 is also told 3 processes. JAX's coordinator counts process
    # 0's 2, and process 1 trained on a third of every batch; TensorFlow's first collective
    # failed in both, a traceback. (PyTorch's processes compare the count when they join:
    # test_a_process_with_a_taken_index_or_another_count_is_refused_at_once.)
    count = 2 if BACKEND == "torch" else 3
    message = {"jax": "the processes disagree on the number of processes: process 1's differs",
               "tensorflow": "the processes were started for different numbers of processes (the worker lists of "
                             "their TF_CONFIG differ)",
               "torch": "the processes disagree on --seed: process 1's differs"}[BACKEND]
    processes = [_start(argv + (["--seed", "1"] if i else []), _env(i, count if i else 2, port)) for i in (0, 1)]
    named = []
    for process in processes:
        _, err = process.communicate(timeout=300)
        assert process.returncode == 2, err[-3000:]
        errors = _errors(err)
        assert len(errors) == 1, err[-3000:]
        named.append(message in errors[0])
        # On TensorFlow the first process to meet the mismatch ends, and one still waiting for
        # the group may lose the connection first (under load): it says so and points at the other's line.
        assert named[-1] or (BACKEND == "tensorflow" and "another process ended as they joined" in errors[0]), err
    assert any(named)
    assert not (tmp_path / "run" / "state").exists()


@pytest.mark.parametrize("process_id, status, message", [
    # The chief alone: its worker never arrived (a fault: status 1).
    (0, 1, "process 1 never arrived"),
    # A worker alone: nothing listens on the coordinator's port (a setting to fix: status 2).
    (1, 2, "nothing answers at the coordinator's address localhost:"),
])
def test_a_process_left_alone_is_named_within_the_timeout(tmp_path, process_id, status, message):
    argv = ["train", "--output-dir", str(tmp_path / "run"), *FLAGS, "--cluster-timeout", "1"]
    start = time.time()
    alone = _start(argv, _env(process_id, 2, cluster.free_port()))
    _, err = alone.communicate(timeout=120)
    assert alone.returncode == status and time.time() - start < 60, err[-3000:]
    errors = _errors(err)
    assert len(errors) == 1 and message in errors[0], err[-3000:]


def test_a_coordinator_that_answers_is_told_from_one_that_does_not():
    import socket

    from keras_transformer.tools import collectives

    with socket.socket() as server:
        server.bind(("localhost", 0))
        server.listen()
        address = f"localhost:{server.getsockname()[1]}"
        assert collectives.answers(address)
    assert not collectives.answers(address)  # closed now
    assert not collectives.answers("localhost:notaport")


def test_a_cluster_that_did_not_form_names_each_cause_the_process_can_have_met():
    from keras_transformer.tools import collectives

    chief, worker = (Cluster("jax", 2, i, "localhost:29500") for i in (0, 1))
    message, status = collectives.not_formed(worker, 3, answered=False)
    assert status == 2 and message.startswith("nothing answers at the coordinator's address localhost:29500")
    # Something answers, but the cluster did not form: process 0 is missing, or the address
    # is some other program's (a worker pointed at a web server waited out the timeout).
    message, status = collectives.not_formed(worker, 3, answered=True)
    assert status == 1 and "process 0 never arrived, two processes were given the same index, or what " \
                           "answers at localhost:29500 is not process 0's coordinator" in message, message
    message, status = collectives.not_formed(chief, 3, answered=True)  # the chief answers itself
    assert status == 1 and message.endswith("process 1 never arrived (or two processes were given the same index). "
                                            "Run the same launch again to resume"), message


@pytest.mark.skipif(BACKEND != "torch", reason=(
    "PyTorch only (its process group's store): on JAX the coordination service aborts the chief and the first "
    "process from C++ (SIGABRT: '1 unexpectedly tried to connect with a different incarnation'), before any "
    "Python runs; on TensorFlow a taken index is a taken port, test_a_tensorflow_process_whose_port_is_taken..."))
@pytest.mark.parametrize("num_processes, message", [
    (2, "another process already joined as process 1: each process needs its own index (RANK), 0 to 1."),
    (3, "this process was started for 3 processes and process 0 for 2 (WORLD_SIZE): start every process with "
        "the same count."),
])
def test_a_process_with_a_taken_index_or_another_count_is_refused_at_once(num_processes, message):
    """The process group's store holds process 0's count and counts each index: a process 1
    that finds its index already there (here the test plays the chief and the first process
    1), or that was told another number of processes, says so, status 2, without waiting
    out the cluster timeout; the chief's store is untouched but for the count. (On JAX the
    count is one of the settings the processes compare: test_processes_that_disagree...)"""
    import datetime

    import torch.distributed as dist

    port = cluster.free_port()
    store = dist.TCPStore("localhost", port, 2, is_master=True, timeout=datetime.timedelta(seconds=60),
                          wait_for_workers=False)
    store.set("keras-transformer/num_processes", "2")  # as the chief does
    assert store.add("keras-transformer/index/1", 1) == 1  # the first process 1 has arrived
    join = ("import sys; from keras_transformer.tools import cluster, collectives; "
            f"collectives.join(cluster.Cluster('torch', {num_processes}, 1, 'localhost:{port}'), timeout=100)")
    start = time.time()
    result = subprocess.run([sys.executable, "-c", join], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and time.time() - start < 60, result.stderr[-3000:]
    errors = _errors(result.stderr)
    assert errors == [f"keras-transformer train: error: process 1 of {num_processes}: {message}"], result.stderr[-3000:]
    assert store.add("keras-transformer/index/1", 0) == (2 if num_processes == 2 else 1)


@pytest.mark.skipif(BACKEND != "tensorflow", reason="TF_CONFIG and MultiWorkerMirroredStrategy are TensorFlow's")
def test_a_tensorflow_process_whose_port_is_taken_is_refused_in_one_line():
    """Two processes given the same task.index: the one that comes second finds its gRPC port
    taken (here the test holds the chief's port, which answers, and process 1's). It was
    TensorFlow's 'Could not start gRPC server' and an internal error with a traceback."""
    port = cluster.free_port(2)
    with socket.socket() as chief, socket.socket() as taken:
        for held, number in ((chief, port), (taken, port + 1)):
            held.bind(("localhost", number))
            held.listen()
        join = ("from keras_transformer.tools import cluster, collectives; "
                f"collectives.join(cluster.Cluster('tensorflow', 2, 1, 'localhost:{port}'), timeout=60)")
        start = time.time()
        result = subprocess.run([sys.executable, "-c", join], capture_output=True, text=True, timeout=120,
                                env=_env(1, 2, port))
    assert result.returncode == 2 and time.time() - start < 50, result.stderr[-3000:]
    assert _errors(result.stderr) == [
        f"keras-transformer train: error: process 1 of 2: TensorFlow could not listen at localhost:{port + 1}, this "
        f"process's address in TF_CONFIG: another process was given the same task.index (1), or another program "
        f"uses the port."], result.stderr[-3000:]


@pytest.mark.skipif(BACKEND != "jax", reason="keras.distribution.ModelParallel runs on JAX; checked in the JAX suite")
def test_model_parallel_on_a_mesh_across_two_processes_trains_like_one_device():
    """2 processes x 2 virtual devices: a 2 x 2 (batch x model) mesh with the project's layout."""
    import json
    import pathlib

    root = pathlib.Path(__file__).parent.parent
    port = cluster.free_port()
    env = {**os.environ, "PYTHONPATH": str(root), "TF_CPP_MIN_LOG_LEVEL": "3"}
    processes = [subprocess.Popen([sys.executable, str(root / "tests" / "cluster_checks.py"), str(i), str(port)],
                                  env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in (0, 1)]
    results = []
    for process in processes:
        out, err = process.communicate(timeout=300)
        assert process.returncode == 0, err[-3000:]
        results.append(json.loads(out.strip().splitlines()[-1]))
    assert results[0]["devices"] == results[1]["devices"] == 4
    own = [set(r["process_devices"]) for r in results]
    assert len(own[0]) == len(own[1]) == 2 and not own[0] & own[1]
    # d_model 32 x (4 heads x 8) split over the model axis of 2: two heads per device.
    assert results[0]["query_shards"] == [[32, 16], [32, 16]]
    np.testing.assert_allclose(results[0]["sharded_fit"], results[0]["single_fit"], rtol=1e-5, atol=1e-5)
    assert results[1]["sharded_fit"] == results[0]["sharded_fit"]  # one global loss, seen by both


@only_on("torch", "the retries' C++ log is PyTorch's store's; a JAX or TensorFlow process pointed at such an "
                  "address printed its one line and nothing else")
def test_a_coordinator_address_where_another_program_answers_is_one_line(tmp_path):
    """Another program at the coordinator's address (a wrong port): PyTorch's store retried,
    and printed a C++ stack trace each time (61 lines in 5 s) before the one line."""
    with socket.socket() as other:
        other.bind(("localhost", 0))
        other.listen(16)
        port = other.getsockname()[1]

        def answer():  # what a web server says to a request it does not understand
            with contextlib.suppress(OSError):
                while True:
                    connection, _ = other.accept()
                    with connection:
                        connection.sendall(b"HTTP/1.0 400 Bad Request\r\n\r\n")

        threading.Thread(target=answer, daemon=True).start()
        alone = _start(["train", "--output-dir", str(tmp_path / "run"), *FLAGS, "--cluster-timeout", "1"],
                       _env(1, 2, port))
        _, err = alone.communicate(timeout=120)
    assert alone.returncode == 1, err[-3000:]
    assert len(err.splitlines()) == 1 and f"what answers at localhost:{port} is not process 0's coordinator" in err, \
        err[-3000:]


def test_the_environment_describes_the_cluster_for_each_engine():
    assert cluster.from_environment("jax", {}) == Cluster("jax")
    for backend in ("jax", "torch", "tensorflow"):
        environ = cluster.launch_environment(backend, 3, 2, 29500)
        assert cluster.from_environment(backend, environ) == Cluster(backend, 3, 2, "localhost:29500")
    # Another backend's variables are not this one's.
    assert cluster.from_environment("jax", cluster.launch_environment("torch", 2, 1, 29500)) == Cluster("jax")


@pytest.mark.parametrize("backend", ["jax", "torch", "tensorflow"])
def test_bad_cluster_settings_are_one_sentence_each(backend):
    good = cluster.launch_environment(backend, 2, 1, 29500)
    out_of_range = cluster.launch_environment(backend, 2, 2, 29500)
    with pytest.raises(ClusterError, match="is out of range: .*numbered 0 to 1"):
        cluster.from_environment(backend, out_of_range)
    bad_host = {k: v.replace("localhost", "no-such-host.invalid") for k, v in good.items()}
    with pytest.raises(ClusterError, match="does not resolve"):
        cluster.from_environment(backend, bad_host)
    if backend != "tensorflow":
        count = "WORLD_SIZE" if backend == "torch" else "KERAS_DISTRIBUTION_NUM_PROCESSES"
        with pytest.raises(ClusterError, match=f"{count} must be an integer >= 1; got 'two'"):
            cluster.from_environment(backend, {**good, count: "two"})
    else:
        with pytest.raises(ClusterError, match="TF_CONFIG is not a cluster description"):
            cluster.from_environment(backend, {"TF_CONFIG": "{not json"})


@pytest.mark.parametrize("config, message", [
    ({"cluster": {"worker": [1234, 1235]}}, "cluster.worker must be a list of \"host:port\" strings"),
    ({"cluster": {"worker": "localhost:1234"}}, "cluster.worker must be a list of \"host:port\" strings"),
    ({"cluster": {"worker": ["localhost:1234"], "ps": ["localhost:1235"]}},
     "under \"worker\" \\(and one under \"chief\", .* trains with no other job; got \\['ps'\\]"),
    ({"cluster": {"chief": ["localhost:1234", "localhost:1235"]}}, "cluster.chief must list one process; got 2"),
    ({"cluster": {"worker": ["localhost:1234", "localhost:1234"]}}, "lists localhost:1234 more than once"),
    ({"cluster": {"chief": ["localhost:1234"], "worker": ["localhost:1234"]}}, "lists localhost:1234 more than once"),
    ({"task": {"type": "chief", "index": 0}}, "task.type must be 'worker'; got 'chief'"),
    ({"task": {"type": "evaluator", "index": 0}}, "task.type is 'evaluator': `train` runs in the processes that train"),
    ({"cluster": {"evaluator": ["localhost:1234"]}}, "got no chief or worker job"),
    ({"cluster": {"worker": []}}, "TF_CONFIG's cluster lists no process: give each process's host:port under"),
    ({"task": {"type": "worker", "index": True}}, "task.index must be an integer >= 0; got True"),
    ({"task": {"type": "worker", "index": 1.5}}, "task.index must be an integer >= 0; got 1.5"),
    ({"task": {"type": "worker"}}, "task.index is not set: each process of a multi-process run needs its own index"),
    ({"task": [0]}, "needs a \"cluster\" and a \"task\" object"),
])
def test_a_tf_config_that_is_not_workers_and_a_chief_is_named(config, message):
    good = json.loads(cluster.launch_environment("tensorflow", 2, 1, 29500)["TF_CONFIG"])
    with pytest.raises(ClusterError, match=message):
        cluster.from_environment("tensorflow", {"TF_CONFIG": json.dumps({**good, **config})})


def test_counts_and_ports_are_ascii_integers_the_engines_can_hold():
    good = cluster.launch_environment("torch", 2, 1, 29500)
    for value, message in [("٢", "got '٢'"), (" 2", "got ' 2'"), ("2.0", "got '2.0'"),
                           (str(10**20), "at most 2147483647")]:
        with pytest.raises(ClusterError, match=f"WORLD_SIZE must be .*{message}"):
            cluster.from_environment("torch", {**good, "WORLD_SIZE": value})
    with pytest.raises(ClusterError, match="must be the coordinator's host:port"):
        cluster.from_environment("torch", {**good, "MASTER_PORT": "٢٩٥٠٠"})
    # A URL resolved as a host named "http://localhost"; an empty first JAX address read as "not set".
    with pytest.raises(ClusterError, match=r"^MASTER_ADDR:MASTER_PORT must be the coordinator's host:port, without a "
                                           r"scheme; got 'tcp://localhost:29500'"):
        cluster.from_environment("torch", {**good, "MASTER_ADDR": "tcp://localhost"})
    jax = {**cluster.launch_environment("jax", 2, 1, 29500), "KERAS_DISTRIBUTION_JOB_ADDRESSES": ",localhost:1235"}
    with pytest.raises(ClusterError, match=r"^KERAS_DISTRIBUTION_JOB_ADDRESSES starts with an empty address"):
        cluster.from_environment("jax", jax)
    # One address per process, as many as the count (Keras' own check came after the backend loaded).
    jax["KERAS_DISTRIBUTION_JOB_ADDRESSES"] = "localhost:1235,localhost:1236,localhost:1237"
    with pytest.raises(ClusterError, match=r"^KERAS_DISTRIBUTION_JOB_ADDRESSES lists 3 processes but "
                                           r"KERAS_DISTRIBUTION_NUM_PROCESSES is 2"):
        cluster.from_environment("jax", jax)
    jax["KERAS_DISTRIBUTION_JOB_ADDRESSES"] = "localhost:1235,localhost:1236"
    assert cluster.from_environment("jax", jax).address == "localhost:1235"
    # torchrun sets all four; by hand, a missing address said "got None".
    for missing in ("MASTER_ADDR", "MASTER_PORT"):
        with pytest.raises(ClusterError, match=r"^MASTER_ADDR:MASTER_PORT is not set: the processes of a run need"):
            cluster.from_environment("torch", {k: v for k, v in good.items() if k != missing})


def test_the_chief_refuses_a_port_in_use():
    with socket.socket() as taken:
        taken.bind(("localhost", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(ClusterError, match=f"localhost:{port} .* cannot be used"):
            cluster.from_environment("jax", cluster.launch_environment("jax", 2, 0, port))
        # The other processes connect to it: not theirs to refuse.
        assert cluster.from_environment("jax", cluster.launch_environment("jax", 2, 1, port)).process_id == 1


def test_the_port_of_a_run_that_just_ended_is_taken_again():
    """A killed coordinator leaves its connections in TIME_WAIT for a minute. The engines
    listen with SO_REUSEADDR and can take the port again; the check did not, and refused the
    relaunch that resumes the run ("Address already in use. Choose a free port.")."""
    with socket.socket() as server:
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC and PyTorch's store do
        server.bind(("localhost", 0))
        server.listen()
        port = server.getsockname()[1]
        client = socket.create_connection(("localhost", port))
        accepted, _ = server.accept()
    accepted.close()  # the coordinator's side closes first: its port's connection waits
    time.sleep(0.1)
    client.close()
    for backend in ("jax", "torch"):
        assert cluster.from_environment(backend, cluster.launch_environment(backend, 2, 0, port)).chief
    cluster.check_launch_port("jax", 2, port)


def test_a_tf_config_with_a_chief_job_numbers_its_chief_first():
    # Vertex AI writes a `chief` job (TensorFlow's cluster specs allow one); it was refused.
    for index in range(3):
        workers_only = cluster.launch_environment("tensorflow", 3, index, 29500)
        with_chief = {"TF_CONFIG": json.dumps(_with_a_chief_job(json.loads(workers_only["TF_CONFIG"])))}
        expected = cluster.from_environment("tensorflow", workers_only)
        assert cluster.from_environment("tensorflow", with_chief) == expected
    chief, workers = ["localhost:29500"], ["localhost:29501", "localhost:29502"]

    def environ(kind, index, **jobs):
        return {"TF_CONFIG": json.dumps({"cluster": {"chief": chief, "worker": workers, **jobs},
                                         "task": {"type": kind, "index": index}})}

    assert not cluster.from_environment("tensorflow", environ("chief", 0, worker=[])).distributed  # one process
    # An evaluator job beside them (TensorFlow's cluster specs allow one) is not a process that trains.
    with_evaluator = cluster.from_environment("tensorflow", environ("worker", 1, evaluator=["localhost:29503"]))
    assert with_evaluator == Cluster("tensorflow", 3, 2, "localhost:29500")
    for kind, index, message in (("chief", 1, "cluster.chief lists 1 process (index 0)"),
                                 ("worker", 2, "cluster.worker lists 2 processes (numbered 0 to 1)")):
        out_of_range = f"TF_CONFIG's task.index={index} is out of range: {message}."
        with pytest.raises(ClusterError, match=re.escape(out_of_range)):
            cluster.from_environment("tensorflow", environ(kind, index))
    no_port = {"TF_CONFIG": json.dumps({"cluster": {"chief": ["localhost"], "worker": workers},
                                        "task": {"type": "worker", "index": 0}})}
    with pytest.raises(ClusterError, match=re.escape("TF_CONFIG's cluster.chief[0] must be the coordinator's")):
        cluster.from_environment("tensorflow", no_port)
    with _listening_port() as port, pytest.raises(ClusterError, match=_own_port_taken(port, "cluster.worker[0]", 0)):
        cluster.from_environment("tensorflow", environ("worker", 0, worker=[f"localhost:{port}"]))


def test_each_tensorflow_worker_is_a_host_and_port_and_its_own_is_free():
    def tf_config(workers, index):
        return {"TF_CONFIG": json.dumps({"cluster": {"worker": workers}, "task": {"type": "worker", "index": index}})}

    # Worker 1's address was not checked: it waited for the chief, then TensorFlow could not listen.
    with pytest.raises(ClusterError, match=r"^TF_CONFIG's cluster.worker\[1\] must be a host:port; got 'localhost'"):
        cluster.from_environment("tensorflow", tf_config(["localhost:29500", "localhost"], 1))
    with pytest.raises(ClusterError, match=r"^this process's host 'no-such-host.invalid' \(TF_CONFIG's "
                                           r"cluster.worker\[1\]\) does not resolve"):
        cluster.from_environment("tensorflow", tf_config(["localhost:29500", "no-such-host.invalid:29501"], 1))
    # Another worker's host is for that worker to resolve; its form is checked everywhere.
    assert cluster.from_environment("tensorflow", tf_config(["localhost:29500", "localhost:29501",
                                                             "no-such-host.invalid:29502"], 1)).process_id == 1
    with pytest.raises(ClusterError, match=r"cluster.worker\[2\] must be a host:port; got 'localhost:0'"):
        cluster.from_environment("tensorflow", tf_config(["localhost:29500", "localhost:29501", "localhost:0"], 1))
    with _listening_port() as port, pytest.raises(ClusterError, match=_own_port_taken(port, "cluster.worker[1]", 1)):
        cluster.from_environment("tensorflow", tf_config([f"localhost:{cluster.free_port()}", f"localhost:{port}"], 1))


@contextlib.contextmanager
def _listening_port():
    """A port on localhost that a socket listens on, for as long as the block runs."""
    with socket.socket() as taken:
        taken.bind(("localhost", 0))
        taken.listen()
        yield taken.getsockname()[1]


def _own_port_taken(port: int, name: str, index: int) -> str:
    return re.escape(f"this process's port localhost:{port} (TF_CONFIG's {name}) cannot be used: Address already in "
                     f"use. Another process was given the same task.index ({index}), or another program uses the port.")


def test_an_ipv6_coordinator_is_written_in_brackets_and_a_rank_alone_is_not_one_process():
    environ = {"KERAS_DISTRIBUTION_JOB_ADDRESSES": f"[::1]:{cluster.free_port()}",
               "KERAS_DISTRIBUTION_NUM_PROCESSES": "2", "KERAS_DISTRIBUTION_PROCESS_ID": "1"}
    assert cluster.from_environment("jax", environ).address == environ["KERAS_DISTRIBUTION_JOB_ADDRESSES"]
    # RANK without WORLD_SIZE trained as a single process, writing the run as its chief.
    with pytest.raises(ClusterError, match="^WORLD_SIZE is not set: each process of a multi-process run needs the "
                                           "number of processes"):
        cluster.from_environment("torch", {"RANK": "1", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"})
    # The same for a JAX process given a count and no index (it said "got None").
    with pytest.raises(ClusterError, match="^KERAS_DISTRIBUTION_PROCESS_ID is not set: each process of a "
                                           "multi-process run needs its own index among them, from 0"):
        cluster.from_environment("jax", {k: v for k, v in environ.items() if k != "KERAS_DISTRIBUTION_PROCESS_ID"})


def test_launch_refuses_a_port_out_of_range_or_in_use_once_before_starting(monkeypatch, capsys):
    from keras_transformer.tools import cli

    def launch(port, backend="jax", processes=2):
        monkeypatch.setenv("KERAS_BACKEND", backend)
        assert cli.main(["launch", "--processes", str(processes), "--port", str(port), "--", "train"]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1, err
        return err

    # More processes than this machine has cores (a typo's 100000 overflowed the port range).
    cores = os.cpu_count()
    assert f"--processes {cores + 1}: launch starts every process on this machine, which has {cores} CPU cores" in (
        launch(29500, "tensorflow", cores + 1))

    assert "--port must be in [1, 65535]; got 70000." in launch(70000)
    # TensorFlow's second worker would listen on 65536.
    assert "--port must be in [1, 65534] (each TensorFlow worker listens on the next port); got 65535" in launch(
        65535, "tensorflow")
    with socket.socket() as taken:
        taken.bind(("localhost", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert f"localhost:{port} (--port) cannot be used" in launch(port)
        assert f"localhost:{port} (--port) cannot be used" in launch(port - 1, "tensorflow")


def test_a_bad_cluster_setting_exits_2_before_any_backend_loads(tmp_path):
    from tests.test_cli_train import LAUNCHER

    env = {**os.environ, **cluster.launch_environment("jax", 2, 5, 29500), "KERAS_BACKEND": "jax"}
    result = subprocess.run([sys.executable, "-c", LAUNCHER, "train", "--output-dir", str(tmp_path / "run")],
                            capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 2, result.stderr[-2000:]
    assert _errors(result.stderr) == [
        "keras-transformer train: error: KERAS_DISTRIBUTION_PROCESS_ID=5 is out of range: "
        "KERAS_DISTRIBUTION_NUM_PROCESSES=2 processes are numbered 0 to 1."]
    assert result.stdout.strip() == "[]"  # no backend, not even Keras, was imported


LOST = """
import sys
from keras_transformer.tools.cluster import Cluster
from keras_transformer.tools.collectives import stop_if_lost
with stop_if_lost(Cluster("torch", 3, 1, "localhost:1")):
    raise RuntimeError(sys.argv[1])
"""


@only_on("tensorflow", "backend-independent (what train does with an engine's error text, no engine loaded)")
def test_a_lost_peer_anywhere_after_joining_is_one_line_and_status_1():
    # What gloo raised in the chief's last barrier when a worker died after training (seen in CI).
    gloo = "[../gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:24215. Check the logs."
    result = subprocess.run([sys.executable, "-c", LOST, gloo], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and "Traceback" not in result.stderr, result.stderr
    assert _errors(result.stderr) == [
        "keras-transformer train: error: process 1 of 3: one of processes 0, 2 stopped answering "
        f"({gloo}). Run the same launch again to resume."]
    # Any other error is not a lost process: it stays the exception it is.
    result = subprocess.run([sys.executable, "-c", LOST, "shapes differ"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 1 and result.stderr.strip().endswith("RuntimeError: shapes differ")


# A process of `processes` whose `train` fails on its own (a full disk) after joining. JAX's
# shutdown, which waits for the other processes, runs at exit (an `atexit` hook).
FAILED_ALONE = """
import atexit, sys, types
from keras_transformer.tools import cli
from keras_transformer.tools.cluster import Cluster
from keras_transformer.tools.collectives import stop_if_lost
atexit.register(lambda: print("the engine's shutdown ran", flush=True))

def train(args):
    with stop_if_lost(Cluster("jax", int(sys.argv[1]), 0, "localhost:1")):
        print("training", flush=True)
        raise OSError(28, "No space left on device", "run/checkpoints/checkpoint_000001.npz")

args = types.SimpleNamespace(command="train", verbose=False, loads_library=False, handler=train)
sys.exit(cli.run(args, args))
"""


@only_on("torch", "backend-independent (what the command line does after train's error, no engine joined)")
def test_a_process_of_several_that_fails_on_its_own_ends_at_once_after_its_line():
    """With the engine's shutdown at exit, a JAX process whose `train` failed on its own (its
    stdout closed by `launch ... | head`, a full disk) waited for the others, which waited
    for it in their next collective: both hung until JAX aborted them minutes later."""
    line = "keras-transformer train: error: No space left on device: run/checkpoints/checkpoint_000001.npz"
    for processes, shutdown in ((2, False), (1, True)):  # one process ends as any program does
        result = subprocess.run([sys.executable, "-c", FAILED_ALONE, str(processes)], capture_output=True, text=True,
                                timeout=120)
        assert result.returncode == 1 and _errors(result.stderr) == [line], result.stderr[-2000:]
        assert result.stdout.startswith("training\n")  # what it printed before is written out
        assert ("the engine's shutdown ran" in result.stdout) == shutdown, (processes, result.stdout)


def test_a_lost_peers_line_quotes_what_failed_not_tensorflows_heading():
    from keras_transformer.tools import collectives

    # The shape of what TensorFlow raised in process 1 when process 0 was killed mid-epoch; the
    # line quoted "Graph execution error:", its first line.
    error = RuntimeError("Graph execution error:\n\nDetected at node CollectiveGatherV2 defined at (most recent call "
                         "last):\n  File \"train.py\", line 1, in <module>\n\n{{function_node __inference_<lambda>_104}}"
                         " Collective ops is aborted by: Socket closed\n\t [[{{node CollectiveGatherV2}}]] "
                         "[Op:__inference_<lambda>_104]")
    assert collectives.lost(Cluster("tensorflow", 2, 1, "localhost:1"), error) == \
        "process 0 stopped answering (Collective ops is aborted by: Socket closed)"


def test_a_closed_output_is_not_a_lost_peer(monkeypatch):
    """`launch ... | head`: the chief's own writes fail once `head` has ended, with the same
    "Broken pipe" as a collective whose peer is gone; it ends as one process would (status 1,
    no line), not naming another process as lost."""
    from keras_transformer.tools import collectives

    cluster = Cluster("torch", 2, 0, "localhost:1")
    broken = BrokenPipeError(32, "Broken pipe")
    assert collectives.lost(cluster, broken) == "process 1 stopped answering ([Errno 32] Broken pipe)"
    read, write = os.pipe()
    os.close(read)  # the reader has ended
    with os.fdopen(write, "w") as closed:
        monkeypatch.setattr(sys, "stdout", closed)
        assert collectives.lost(cluster, broken) is None
        # gloo's own broken pipe (a socket to a peer) is a lost peer still.
        gloo = RuntimeError("[gloo/transport/tcp/pair.cc:598] Write failure: Broken pipe")
        assert collectives.lost(cluster, gloo) == f"process 1 stopped answering ({gloo})"
        monkeypatch.undo()


@only_on("tensorflow", "backend-independent (tf.data under every backend)")
def test_shards_of_an_epoch_are_the_training_split_once():
    """Over one pass, the rows each of 3 processes gets are every pair that fits, none twice,
    and the processes' batches have the same shapes."""
    from keras_transformer.tools.text.corpora import numbers_corpus
    from keras_transformer.tools.text.datasets import make_dataset
    from keras_transformer.tools.text.tokenizer import Tokenizer

    pairs = numbers_corpus(train_size=300, seed=0).train
    tokenizer = Tokenizer.build([s for p in pairs for s in p], 200)
    shards = [list(make_dataset(pairs, tokenizer, 200, 32, shuffle=True, seed=3, num_shards=3, shard_index=i,
                                devices_per_shard=2)) for i in range(3)]
    assert len({len(s) for s in shards}) == 1
    assert all(labels.shape[0] % 2 == 0 for batches in shards for _, labels in batches)  # 2 devices per process
    def ids(row, drop=()):
        return tuple(int(i) for i in row if i != tokenizer.pad_id and i not in drop)

    seen = []
    for batches in zip(*shards):
        assert len({labels.shape for _, labels in batches}) == 1
        for x, labels in batches:
            for source, target in zip(x["source_ids"].numpy(), labels.numpy()):
                if (target != tokenizer.pad_id).any():  # rows of padding fill a last batch
                    seen.append((ids(source), ids(target, drop=(tokenizer.end_id,))))
    sources = tokenizer.tokenize_dense([s for s, _ in pairs]).numpy()
    targets = tokenizer.tokenize_dense([t for _, t in pairs]).numpy()
    expected = [(ids(s), ids(t)) for s, t in zip(sources, targets)]
    assert len(seen) == len(expected) and sorted(seen) == sorted(expected)
    with pytest.raises(ValueError, match="shard_index"):
        make_dataset(pairs, tokenizer, 200, 32, num_shards=2, shard_index=2)


JOINED = """
import signal, sys, time
from keras_transformer.tools import cluster, collectives
collectives.join(cluster.from_environment(sys.argv[1]), timeout=100)
status = dict(line.split(":\\t") for line in open("/proc/self/status").read().splitlines() if ":\\t" in line)
caught = int(status["SigCgt"], 16) >> (signal.SIGTERM - 1) & 1  # a handler, Python's or the engine's own
print("joined", signal.getsignal(signal.SIGTERM) is signal.SIG_DFL and not caught, flush=True)
time.sleep(300)
"""


@pytest.mark.skipif(BACKEND == "torch", reason="torch.distributed sets no SIGTERM handler (test_a_signal_to_launch_"
                                               "reaches_every_process_and_none_goes_on, in the PyTorch suite)")
def test_a_sigterm_still_ends_a_process_that_joined_a_cluster():
    """JAX's and TensorFlow's engines install a SIGTERM handler of their own (for preemption
    sync points that `train` does not poll): a scheduler's SIGTERM, or the one `launch` passes
    on, was swallowed and the processes trained on to the end."""
    port = cluster.free_port(2)
    processes = [subprocess.Popen([sys.executable, "-c", JOINED, BACKEND], env=_env(i, 2, port), text=True,
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE) for i in (0, 1)]
    try:
        said = [next((line.strip() for line in process.stdout if line.startswith("joined")), "")
                for process in processes]  # after gloo's `[Gloo] Rank ...` lines
        for process in processes:
            process.send_signal(signal.SIGTERM)
        codes = [process.wait(timeout=30) for process in processes]
    finally:
        for process in processes:
            process.kill()
    assert said == ["joined True"] * 2, [process.stderr.read()[-2000:] for process in processes]
    assert codes == [-signal.SIGTERM] * 2


@only_on("torch", "launch's own code, the same on every backend; its processes are stopped while they start")
@pytest.mark.skipif(not os.path.exists(f"/proc/{os.getpid()}/task/{os.getpid()}/children"),
                    reason="needs Linux's /proc/PID/task/TID/children to find launch's processes")
@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_to_launch_reaches_every_process_and_none_goes_on(tmp_path, signum):
    """A scheduler's SIGTERM, or a Ctrl-C (SIGINT to launch alone: its processes are in
    process groups of their own), is passed on to every process; launch exits 128 + the
    signal once they have ended, and no process is left training on its own."""
    argv = ["launch", "--processes", "2", "--", "train", "--output-dir", str(tmp_path / "run"), *FLAGS, "--steps", "4"]
    launcher = subprocess.Popen([sys.executable, "-c", CHILD, *argv], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
    children, deadline = [], time.time() + 120
    while len(children) < 2:
        assert launcher.poll() is None and time.time() < deadline, launcher.communicate()[1][-3000:]
        with open(f"/proc/{launcher.pid}/task/{launcher.pid}/children") as f:
            children = f.read().split()
        time.sleep(0.02)
    # Each in a group of its own: a Ctrl-C in a terminal reaches launch's group, not theirs, and
    # each process gets the signal once, from launch.
    assert [os.getpgid(int(pid)) for pid in children] == [int(pid) for pid in children]
    time.sleep(1.0)  # the processes are loading the library
    with open(f"/proc/{launcher.pid}/maps") as f:  # which launch itself never loads
        assert "libtorch" not in f.read()
    launcher.send_signal(signum)
    _, err = launcher.communicate(timeout=120)
    assert launcher.returncode == 128 + signum, err[-3000:]
    name = signal.Signals(signum).name
    assert f"keras-transformer launch: {name}: passed on to the 2 processes, which have ended" in err, err[-3000:]
    assert "killed by" not in err and "Traceback" not in err, err[-3000:]
    if signum == signal.SIGINT:  # each process stopped as a Ctrl-C stops it alone
        assert err.count("keras-transformer train: interrupted") == 2, err[-3000:]
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")], children


@only_on("torch", "launch's own code, the same on every backend (processes that load no backend)")
def test_after_a_failure_launch_stops_the_processes_still_running(capsys):
    """A process that fails leaves the others to stop by themselves for a while (on JAX and
    PyTorch they name the lost process at their next collective); one still running then
    gets SIGTERM, and one that outlives it SIGKILL: launch ends with the first failure's
    status, never waiting on a process that waits for a peer (TensorFlow's start-up waits
    up to an hour for a worker that died)."""
    from keras_transformer.tools.commands import launch

    def child(code):
        return subprocess.Popen([sys.executable, "-c", code], process_group=0)

    stubborn = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); " \
               "time.sleep(600)"
    children = [child("import sys; sys.exit(3)"), child("import time; time.sleep(600)"),
                subprocess.Popen([sys.executable, "-c", stubborn], process_group=0, stdout=subprocess.PIPE, text=True)]
    assert children[2].stdout.readline() == "ready\n"  # its SIGTERM handler is set
    start = time.monotonic()
    assert launch._wait(children, stop_after=1.0) == 3
    assert 1.0 <= time.monotonic() - start < 10
    assert [c.returncode for c in children] == [3, -signal.SIGTERM, -signal.SIGKILL]
    err = capsys.readouterr().err
    assert err == "keras-transformer launch: process 0 failed; stopping processes 1, 2, still running 1 s later.\n", err
    # Processes that all succeed, or that end by themselves in time, are only waited for.
    children = [child("import time; time.sleep(0.5)"), child("import sys; sys.exit(0)")]
    assert launch._wait(children, stop_after=1.0) == 0 and capsys.readouterr().err == ""
    children = [child("import sys; sys.exit(1)"), child("import time, sys; time.sleep(0.3); sys.exit(1)")]
    assert launch._wait(children, stop_after=5.0) == 1 and capsys.readouterr().err == ""


LAUNCHER_KILLED = """
import os, subprocess, sys, time
variable, code, seconds, *argv = sys.argv[1:]
child = subprocess.Popen([sys.executable, "-c", code, *argv], process_group=0, stdout=subprocess.DEVNULL,
                         stderr=subprocess.DEVNULL, env={**os.environ, variable: str(os.getpid())})
print(child.pid, flush=True)
time.sleep(float(seconds))
os.kill(os.getpid(), 9)
"""


def _running(pid: int) -> bool:
    """Whether process `pid` runs (an orphan that ended may stay a zombie until reaped)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@only_on("torch", "launch's own code, the same on every backend")
def test_launch_passes_on_what_the_processes_print_by_whole_lines_without_gloos_and_its_own_once():
    from keras_transformer.tools.commands import launch

    out = io.StringIO()
    launch._pass_on(io.BytesIO(b"[Gloo] Rank 1 is connected to 1 peer ranks. Expected number of connected peer "
                               b"ranks is : 1\na line, then one not UTF-8: \xff\nthe last, unfinished"), out)
    assert out.getvalue() == "a line, then one not UTF-8: \ufffd\nthe last, unfinished"
    out.close()  # `launch ... | head` has ended: the rest is read, and dropped
    stream = io.BytesIO(b"one\ntwo\n")
    launch._pass_on(stream, out)
    assert stream.read() == b""
    # Standard error: each of the command's errors and warnings once for all the processes (a
    # mistake in the corpus was one line per process), any other line as often as it comes.
    said, err = launch._Said(), io.StringIO()
    for _ in range(2):
        launch._pass_on(io.BytesIO(b"keras-transformer train: error: x.tsv, line 1: no tab\n"
                                   b"keras-transformer train: interrupted\nTraceback\n"), err, said)
    assert err.getvalue() == ("keras-transformer train: error: x.tsv, line 1: no tab\n"
                              + "keras-transformer train: interrupted\nTraceback\n" * 2)


def test_a_process_launch_started_ends_when_launch_is_killed(tmp_path):
    from keras_transformer.tools.commands.launch import LAUNCHER

    # `kill -9` of launch cannot be passed on, and each process is in a group of its own:
    # they went on training with nobody waiting for them. Killed while its process loads
    # a backend, and before that process has started.
    for seconds in (1.5, 0.0):
        argv = ["train", "--output-dir", str(tmp_path / f"run{seconds}"), "--steps", "100000", "--quiet"]
        launcher = subprocess.run([sys.executable, "-c", LAUNCHER_KILLED, LAUNCHER, CHILD, str(seconds), *argv],
                                  capture_output=True, text=True, timeout=60)
        assert launcher.returncode == -signal.SIGKILL, launcher.stderr[-2000:]
        pid = int(launcher.stdout.split()[0])
        try:
            deadline = time.monotonic() + 20
            while _running(pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            assert not _running(pid), f"the process outlived launch by 20 s (killed {seconds} s after it started)"
        finally:
            if _running(pid):
                os.kill(pid, signal.SIGKILL)
    # The variable from elsewhere (its process alive, and not this one's parent): left alone,
    # not taken for a launch that has ended.
    result = subprocess.run([sys.executable, "-c", CHILD, "train", "--steps", "0"], capture_output=True, text=True,
                            timeout=60, env={**os.environ, LAUNCHER: "1"})
    assert result.returncode == 2 and "--steps must be >= 1" in result.stderr, (result.returncode, result.stderr)


def test_launch_runs_only_train_and_says_so_before_any_backend_loads(tmp_path, capsys):
    from tests.test_cli_train import LAUNCHER

    assert cli.main(["launch", "--processes", "2"]) == 2  # no command at all
    assert _errors(capsys.readouterr().err) == ["keras-transformer launch: error: launch runs `train` in several "
                                                "processes: give `-- train [flags]`; got no command."]

    result = subprocess.run([sys.executable, "-c", LAUNCHER, "launch", "--processes", "2", "--", "evaluate"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    assert _errors(result.stderr) == ["keras-transformer launch: error: launch runs `train` in several processes: "
                                      "give `-- train [flags]`; got 'evaluate'."]
    assert result.stdout.strip() == "[]"
    # train's own mistakes too: one line from launch, not one from each process it would start.
    result = subprocess.run([sys.executable, "-c", LAUNCHER, "launch", "--processes", "2", "--", "train",
                             "--output-dir", str(tmp_path / "run"), "--vocab-size", "3"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout.strip() == "[]", result.stderr[-2000:]
    errors = _errors(result.stderr)
    assert len(errors) == 1 and errors[0].startswith("keras-transformer launch: error: --vocab-size must be"), errors
    assert not (tmp_path / "run").exists()
    # A run of other settings in --output-dir: found before any process starts (the chief
    # and each worker said so after joining, one line each).
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "config.json").write_text(json.dumps(dataclasses.asdict(TrainConfig(steps=40))))
    result = subprocess.run([sys.executable, "-c", LAUNCHER, "launch", "--processes", "2", "--", "train",
                             "--output-dir", str(tmp_path / "other")], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and result.stdout.strip() == "[]", result.stderr[-2000:]
    errors = _errors(result.stderr)
    assert len(errors) == 1 and "other holds a run with a different config (steps: saved 40, now" in errors[0], errors


def test_launch_checks_trains_flags_once_before_starting_a_process(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(subprocess, "Popen", lambda *a, **k: pytest.fail("a process was started"))
    assert cli.main(["launch", "--processes", "2", "--", "train", "--steps", "0"]) == 2
    assert capsys.readouterr().err == "keras-transformer launch: error: --steps must be >= 1; got 0.\n"
    # A corpus file that cannot be read: said once, here, not by each process once it has loaded a backend.
    missing = tmp_path / "missing.tsv"
    assert cli.main(["launch", "--processes", "2", "--", "train", "--tsv", str(missing)]) == 2
    assert capsys.readouterr().err == f"keras-transformer launch: error: --tsv: File not found: {missing}.\n"
    assert cli.main(["launch", "--processes", "2", "--", "train", "--source-file", str(tmp_path),
                     "--target-file", str(missing)]) == 2
    assert capsys.readouterr().err == (f"keras-transformer launch: error: --source-file: {tmp_path} is a directory, "
                                       f"not a file; --target-file: File not found: {missing}.\n")
    with pytest.raises(SystemExit) as exit_:  # argparse's own message for a flag train lacks
        cli.main(["launch", "--processes", "2", "--", "train", "--processes", "2"])
    assert exit_.value.code == 2
    assert capsys.readouterr().err == ("keras-transformer train: error: unrecognized arguments: --processes 2 "
                                       "(see keras-transformer train --help)\n")
