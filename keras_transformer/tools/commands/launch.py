"""`keras-transformer launch --processes N -- train ...`: N processes of one run on this machine.

Each process gets the variables its backend's engine reads (see
`keras_transformer.tools.cluster`) and runs the command after `--`; process 0 (the chief)
writes the run directory and prints the progress, the others print only their errors.
On a cluster, start one process per host (or per accelerator) with those variables set
by the scheduler, or with `torchrun` on PyTorch: `launch` is the one-machine case.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time

from keras_transformer.tools.cluster import check_launch_port, free_port, launch_environment
from keras_transformer.tools.commands.common import add_command, at_least
from keras_transformer.tools.config import RunError

# What a child runs: the installed command's entry point, with the arguments after `--`.
_CHILD = "import sys, keras_transformer_cli; sys.exit(keras_transformer_cli.main(sys.argv[1:]))"


def add_parser(sub) -> None:
    p = add_command(
        sub,
        "launch",
        help="Run `train` in several processes on this machine (data parallel).",
        description=(
            "Start N processes of one training run on this machine, each with the variables its backend's "
            "distributed engine reads (JAX: KERAS_DISTRIBUTION_*; PyTorch: torchrun's MASTER_ADDR, MASTER_PORT, "
            "WORLD_SIZE, RANK; TensorFlow: TF_CONFIG), and wait for them. Example: keras-transformer launch --processes 2 -- train "
            "--output-dir runs/two. --batch-tokens is the global batch, split between the processes."
        ),
    )
    p.add_argument("--processes", type=at_least(1), default=2, help="How many processes.")
    p.add_argument("--port", type=at_least(1), default=None,
                   help="The coordinator's port on localhost. [default: a free one]")
    p.add_argument("train_argv", nargs=argparse.REMAINDER, metavar="-- train ...", help="train and its flags")
    p.set_defaults(handler=run, check=check)


def check(args) -> dict:
    command = args.train_argv[1:] if args.train_argv[:1] == ["--"] else args.train_argv
    if command[:1] != ["train"]:
        raise RunError(f"launch runs `train` in several processes: give `-- train [flags]`; got {' '.join(command)!r}.")
    cores = os.cpu_count() or 1
    if args.processes > cores:
        raise RunError(f"--processes {args.processes}: launch starts every process on this machine, which has {cores} "
                       f"CPU cores; use at most {cores}, or run train on each machine of a cluster (see the "
                       "distributed guide).")
    backend = os.environ.get("KERAS_BACKEND", "tensorflow")
    if args.port is not None:
        check_launch_port(backend, args.processes, args.port)
    _check_train(command)
    return {"child_argv": command, "backend": backend}


def _check_train(command) -> None:
    """`train`'s flags, checked once here as each process will check them, so that a
    mistake is one line before any process starts, not one line per process. (A wrong
    flag is argparse's message and status 2; `--help` prints train's help.)"""
    from keras_transformer.tools import cli
    from keras_transformer.tools.commands import train

    child = cli.parse(command)
    train.check_run_dir(child.output_dir, train.settings(child))


def run(args) -> int:
    port = args.port or free_port(args.processes if args.backend == "tensorflow" else 1)
    children = []
    for index in range(args.processes):
        env = {**os.environ, **launch_environment(args.backend, args.processes, index, port)}
        children.append(subprocess.Popen([sys.executable, "-c", _CHILD, *args.child_argv], env=env))
    try:
        return _wait(children)
    except KeyboardInterrupt:  # a Ctrl-C reaches every child (one process group): wait for them
        return _wait(children) or 130


def _wait(children) -> int:
    """The first failure's status once every child has ended (0 if all succeeded)."""
    status = 0
    pending = dict(enumerate(children))
    while pending:
        for index, child in list(pending.items()):
            code = child.poll()
            if code is None:
                continue
            del pending[index]
            if code < 0:
                name = signal.Signals(-code).name
                print(f"keras-transformer launch: process {index} was killed by {name}", file=sys.stderr, flush=True)
                code = 1
            status = status or code
        time.sleep(0.2)
    return status
