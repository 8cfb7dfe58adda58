"""`keras-transformer launch --processes N -- train ...`: N processes of one run on this machine.

Each process gets the variables its backend's engine reads (see
`keras_transformer.tools.cluster`) and runs the command after `--`; process 0 (the chief)
writes the run directory and prints the progress, the others print only their errors
(each error or warning line once for all the processes).
On a cluster, start one process per host (or per accelerator) with those variables set
by the scheduler, or with `torchrun` on PyTorch: `launch` is the one-machine case.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading
import time

from keras_transformer.tools.cluster import check_launch_port, free_port, launch_environment
from keras_transformer.tools.commands.common import add_command, at_least
from keras_transformer.tools.config import RunError, say

# What a child runs: the installed command's entry point, with the arguments after `--`.
_CHILD = "import sys, keras_transformer_cli; sys.exit(keras_transformer_cli.main(sys.argv[1:]))"
# The variable that gives each process launch's own process id (see `end_with_launcher`).
LAUNCHER = "KERAS_TRANSFORMER_LAUNCHER"


def end_with_launcher(environ=None) -> None:
    """In a process `launch` started (its id in `LAUNCHER`): have this process get SIGTERM
    when `launch` ends, however it ends. A SIGKILL of `launch` cannot be passed on, and
    each process runs in a group of its own, so without this they would go on training
    with nobody waiting for them (the run resumes from its last epoch, as after any
    stop). Linux's parent-death signal (`prctl(PR_SET_PDEATHSIG)`); elsewhere nothing.
    `train` asks for it before it loads a backend. A variable this process did not get
    from a running `launch` (its parent is another, alive) is left alone."""
    launcher = (os.environ if environ is None else environ).get(LAUNCHER, "")
    if not launcher.isdigit() or not sys.platform.startswith("linux"):
        return
    if os.getppid() != int(launcher):
        if not _alive(int(launcher)):  # `launch` ended before this process got here
            os.kill(os.getpid(), signal.SIGTERM)
        return
    import ctypes  # only in a process `launch` started
    import ctypes.util

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    if libc.prctl(1, signal.SIGTERM, 0, 0, 0) == 0 and os.getppid() != int(launcher):  # 1: PR_SET_PDEATHSIG
        os.kill(os.getpid(), signal.SIGTERM)  # `launch` ended while the request was made


def _alive(pid: int) -> bool:
    """Whether process `pid` runs (one that ended but is not yet reaped is a zombie: not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


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
    # Starts processes and waits: the library (Keras, a backend: seconds) is theirs to load.
    p.set_defaults(handler=run, check=check, loads_library=False)


def check(args) -> dict:
    command = args.train_argv[1:] if args.train_argv[:1] == ["--"] else args.train_argv
    if command[:1] != ["train"]:
        got = repr(" ".join(command)) if command else "no command"
        raise RunError(f"launch runs `train` in several processes: give `-- train [flags]`; got {got}.")
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

    config, output_dir = train.settings(cli.parse(command))
    train.check_run_dir(output_dir, config)


# What stops a run: Ctrl-C, a scheduler's or `kill`'s SIGTERM, a closed terminal's SIGHUP.
_FORWARDED = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def run(args) -> int:
    """Start the processes, each in a process group of its own, and wait for them. A
    signal that stops the run reaches `launch` alone (a Ctrl-C reaches the terminal's
    foreground group, and `kill` one process), so `launch` passes each one on once to
    each process (a Ctrl-C stops `train` cleanly, as in one process) and exits 128 + the
    first signal's number once they have ended: no process is left training on its own
    (nor after a SIGKILL of `launch`: see `end_with_launcher`)."""
    port = args.port or free_port(args.processes if args.backend == "tensorflow" else 1)
    children, readers, received, passed = [], [], [], {}  # passed: how many of the signals each process got
    said = _Said()

    def forward(signum, frame):  # a second Ctrl-C is passed on too, as a second one
        received.append(signum)
        for child in children:
            if child.poll() is None:
                passed[child.pid] = len(received)
                child.send_signal(signum)

    previous = {s: signal.signal(s, forward) for s in _FORWARDED}
    try:
        for index in range(args.processes):
            if received:
                break
            env = {**os.environ, **launch_environment(args.backend, args.processes, index, port),
                   LAUNCHER: str(os.getpid())}
            # The chief writes its standard output to this terminal, the others' comes through
            # `_pass_on`; every process's standard error does, each of the command's own lines
            # once (a mistake in the corpus is found by every process, in the same words).
            children.append(subprocess.Popen([sys.executable, "-c", _CHILD, *args.child_argv], env=env, process_group=0,
                                             stdout=subprocess.PIPE if index else None, stderr=subprocess.PIPE))
            streams = [(children[-1].stdout, None)] if index else []
            for stream, out in streams + [(children[-1].stderr, sys.stderr)]:
                readers.append(threading.Thread(target=_pass_on, args=(stream, out, said), daemon=True))
                readers[-1].start()
            if passed.get(children[-1].pid, 0) < len(received):  # a signal came while it started
                passed[children[-1].pid] = len(received)
                children[-1].send_signal(received[-1])
        status = _wait(children, received)
        for reader in readers:  # what they printed last (their pipes are closed: they have ended)
            reader.join(timeout=5)
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
    if received:
        name = signal.Signals(received[0]).name
        say(f"keras-transformer launch: {name}: passed on to the {len(children)} processes, which have ended; "
            "the same launch resumes the run from its last epoch.")
        return 128 + received[0]
    return status


# JAX's CPU collectives (gloo) print `[Gloo] Rank i is connected to ...` on standard output
# in every process, a piece at a time: from several processes at once the lines run into
# each other. The chief's is the one shown.
_GLOO_CONNECTED = b"[Gloo] Rank "


class _Said:
    """The command's error and warning lines passed on so far, from every process: each is
    passed on once. (Other lines are each process's own: `interrupted` says that this
    process, too, stopped.)"""

    def __init__(self):
        self.lines, self.lock = set(), threading.Lock()

    def first(self, line: str) -> bool:
        """Whether `line` is new: not an error or warning of the command's, or not said before."""
        if not (line.startswith("keras-transformer ") and (": error: " in line or ": warning: " in line)):
            return True
        with self.lock:
            new = line not in self.lines
            self.lines.add(line)
        return new


def _pass_on(stream, out=None, said: _Said | None = None) -> None:
    """Write what a process prints (a byte stream) to `out` (this process's standard output
    by default) a whole line at a time, without gloo's line, and, with `said`, each of the
    command's own lines once for all the processes. Once `out` is closed (`launch ... |
    head`), the rest is read and dropped: the process never waits on a full pipe."""
    out = out or sys.stdout
    for line in stream:
        text = line.decode(errors="replace")
        if out is not None and not line.startswith(_GLOO_CONNECTED) and (said is None or said.first(text)):
            try:
                out.write(text)
                out.flush()
            except (OSError, ValueError):  # a closed pipe, or a closed file
                out = None


# Seconds the other processes get to stop by themselves once one has failed (on JAX and
# PyTorch they do, at their next collective, naming the lost process), then SIGTERM, and
# SIGKILL after as many again (a process may be inside an engine that does not notice a
# lost peer for longer): `torchrun`'s agent stops the others too.
STOP_OTHERS_AFTER = 30.0


def _wait(children, received=(), stop_after: float = STOP_OTHERS_AFTER) -> int:
    """The first failure's status once every child has ended (0 if all succeeded). A child
    ended by a signal is named, but for one `launch` passed on (in `received`) or sent
    itself: `stop_after` seconds after a first failure, the children still running are
    stopped, with one line."""
    status, failed_at, first, stopped = 0, None, None, set()
    pending = dict(enumerate(children))
    while pending:
        for index, child in list(pending.items()):
            code = child.poll()
            if code is None:
                continue
            del pending[index]
            if code < 0 and -code not in received and index not in stopped:
                name = signal.Signals(-code).name
                say(f"keras-transformer launch: process {index} was killed by {name}")
            if code != 0 and not status:
                status, failed_at = (1 if code < 0 else code), time.monotonic()
                first = index
        if pending and failed_at is not None and not received:
            waited = time.monotonic() - failed_at
            if waited >= stop_after and not stopped:
                stopped.update(pending)
                names = ", ".join(str(i) for i in sorted(pending))
                which = f"process{'es' if len(pending) > 1 else ''} {names}"
                say(f"keras-transformer launch: process {first} failed; stopping {which}, still running "
                    f"{stop_after:g} s later.")
                for child in pending.values():
                    child.terminate()
            elif waited >= 2 * stop_after:
                for child in pending.values():
                    child.kill()
        time.sleep(0.2)
    return status
