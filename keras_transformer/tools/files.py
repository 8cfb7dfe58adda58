"""Files of the tools: where a run directory keeps its model, what an export may replace,
and the run's lock. Whatever must never be seen half-written is written through
`keras_transformer.tools.atomic`.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import pathlib
import tempfile

from keras_transformer.tools import atomic


# The names `train` writes in its output directory (and their temporary names): it
# touches nothing else there, and no command writes its output over them.
RUN_FILES = (
    "config.json", "tokenizer", "data.json", "state", "checkpoints", "best", "model.keras", "log.csv",
    "tensorboard", "curves.png", "metrics.json", "train.lock",
)


# Those of them that are directories; the others are files.
RUN_DIRECTORIES = ("tokenizer", "state", "checkpoints", "best", "tensorboard")


def misplaced_run_file(directory: pathlib.Path) -> str | None:
    """One sentence on the first of the run's names in `directory` that is a directory where
    the run keeps a file, or a file where it keeps a directory (`train` never writes either),
    or `None`. The lock is not among them: taking it says what is wrong with it."""
    for name in RUN_FILES:
        path = directory / name
        if name == "train.lock" or not path.exists() or path.is_dir() == (name in RUN_DIRECTORIES):
            continue
        found, kept = ("a directory", "a file") if path.is_dir() else ("a file", "a directory")
        return f"{path} is {found}, where a run keeps {kept}: it is not what `train` wrote there"
    return None


def run_name(name: str) -> bool:
    """Whether `name`, in a run directory, is one of the run's own (`RUN_FILES`, or the
    temporary name `train` writes one through)."""
    return atomic.target_name(name) in RUN_FILES


class RunDirError(ValueError):
    """A run directory or checkpoint that cannot be used; the CLI exits with status 2."""


def input_problem(path, streams: bool = False) -> str | None:
    """What keeps `path` from being read as an input file, in one sentence, or `None`.

    Without `streams`, a regular file only: a training corpus is read by every process of
    a run and again when a run resumes, which a pipe cannot give twice. With `streams`, a
    pipe or a device too (read once). Checked before a backend loads, and again by the
    reader."""
    path = pathlib.Path(path)
    try:
        path.stat()
    except FileNotFoundError:
        if str(path) == "-" and not streams:  # standard input, as translate and evaluate read "-"
            return ("- (standard input) cannot be a corpus: a corpus is read again by every process of a run and "
                    "when a run resumes; write it to a file")
        return f"File not found: {path}"
    except OSError as e:  # a name past 255 bytes, a loop of links
        return f"{path}: {e.strerror or e}"
    if path.is_dir():
        return f"{path} is a directory, not a file"
    if not streams and not path.is_file():
        return (f"Not a regular file: {path} (a corpus is read again by every process of a run and when a run "
                "resumes; write it to a file)")
    return None


def reader_gone(stream) -> bool:
    """Whether `stream` is a pipe whose reading end was closed (its descriptor polls as an
    error): `keras-transformer ... | head` after `head` has ended."""
    import select

    try:
        poller = select.poll()
        poller.register(stream.fileno(), select.POLLOUT)
        return any(event & select.POLLERR for _, event in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # not a file with a descriptor
        return False


def kind_of_tokenizer(settings: dict) -> str:
    """The tokenizer kind a `tokenizer.json` names: "wordpiece" for the files written
    before SentencePiece existed, which hold no kind."""
    return settings.get("kind", "wordpiece")


def tokenizer_kind(directory) -> str | None:
    """The kind of the tokenizer in `directory` (see `kind_of_tokenizer`), or None if its
    `tokenizer.json` cannot be read: loading the run reports that. Needs no backend."""
    try:
        return str(kind_of_tokenizer(json.loads((pathlib.Path(directory) / "tokenizer.json").read_text("utf-8"))))
    except (OSError, ValueError, AttributeError):
        return None


def load_run_tokenizer(directory):
    """The tokenizer a run directory holds; a damaged one is a `RunDirError` naming the
    file and what to do (the CLI prints it as one line, status 2)."""
    from keras_transformer.tools.text.tokenizer import Tokenizer, TokenizerError

    try:
        return Tokenizer.load(directory)
    except TokenizerError as e:
        raise RunDirError(str(e)) from None


def run_model_file(run_dir, model: str = "final") -> pathlib.Path:
    """The model file of a run directory written by `train`, checked to exist.

    Needs no backend, so the command line reports a wrong `--run-dir` before one loads.

    Args:
        run_dir: A directory written by `train`.
        model: `"final"` (`model.keras`, the averaged checkpoints) or `"best"`
            (`best/model.keras`, the best epoch by the run's validation score).

    Raises:
        RunDirError: The directory or the model file is missing.
    """
    run_dir = pathlib.Path(run_dir)
    if model not in ("final", "best"):
        raise ValueError(f"`model` must be 'final' or 'best'. Received: model={model!r}")
    model_file = run_dir / "model.keras" if model == "final" else run_dir / "best" / "model.keras"
    if not run_dir.is_dir():
        raise RunDirError(f"No run directory at {run_dir}: a run directory is what `train` writes (its "
                          f"--output-dir){_runs_beside(run_dir)}.")
    if model == "best" and not model_file.is_file():
        raise RunDirError(f"No best model at {model_file}: only runs trained with --validate-translations keep one.")
    if not model_file.is_file():
        raise RunDirError(f"No model at {model_file} (train first, or give a run directory that finished).")
    return model_file


def json_object(path) -> dict:
    """The JSON object in `path` (a run's config.json, data.json); `ValueError` when the
    file is not UTF-8, not JSON or holds another JSON value (`[]`, `null`: a hand edit),
    `OSError` when it cannot be read."""
    value = json.loads(pathlib.Path(path).read_text(encoding="utf-8"))
    if not isinstance(value, dict):
        raise ValueError(f"JSON {json.dumps(value)[:40]}, not an object")
    return value


def run_setting(run_dir, name: str):
    """One setting of the run in `run_dir` as its `config.json` holds it; `None` when it
    holds no such setting or cannot be read (a model copied without its config)."""
    try:
        return json_object(pathlib.Path(run_dir) / "config.json").get(name)
    except (OSError, ValueError):  # missing, not UTF-8 or JSON, not an object
        return None


def _runs_beside(run_dir: pathlib.Path) -> str:
    """`; runs/ holds a, b`: the run directories beside a missing one, to choose from."""
    parent = run_dir.parent
    try:
        runs = sorted(p.name for p in parent.iterdir() if (p / "config.json").is_file())
    except OSError:  # no such folder, or not one this process may list
        return ""
    if not runs:
        return ""
    return f"; {parent.as_posix()}/ holds {', '.join(runs[:5])}{', ...' if len(runs) > 5 else ''}"


def creation_problem(path, run_dir=None) -> str | None:
    """Why this process cannot write `path` (a file or folder, with the folders above it
    that are missing): one of the files of the run in `run_dir`, a file where a folder
    must be, or a folder it may not write in; `None` when nothing is in the way. What
    `path` itself is, its callers check."""
    path = pathlib.Path(path).absolute()
    if run_dir is not None:
        real, run = pathlib.Path(os.path.realpath(path)), pathlib.Path(os.path.realpath(run_dir))
        if real == run:
            return "it is the run directory itself"
        if real.is_relative_to(run) and run_name(real.relative_to(run).parts[0]):
            return f"it is the run's own {real.relative_to(run).parts[0]}, which this would overwrite"
    if path.exists() and not (path.is_file() or path.is_dir()):  # followed through links, like a write
        return ("it is not a regular file or a folder (a device, a pipe or a socket), and the output is written "
                "under a temporary name and renamed into place")
    place = next(p for p in (path, *path.parents) if os.path.lexists(p))  # the nearest that exists
    try:  # it exists; followed, a link may lead round in a loop or (a folder above) to nothing
        os.stat(place)
    except OSError as e:  # an output that is a link to a file not yet there is written through
        if place != path or e.errno == errno.ELOOP:
            return f"{place} is a link that cannot be followed ({e.strerror or e})"
    if place != path and not os.path.isdir(place):
        return f"{place} is a file, not a directory"
    folder = place if os.path.isdir(place) else place.parent  # a file is replaced beside itself
    if not os.access(folder, os.W_OK | os.X_OK):
        return f"{folder} is not writable by this user"
    try:  # what permissions do not tell (a read-only or special file system such as /proc)
        descriptor, probe = tempfile.mkstemp(dir=folder, prefix=".keras-transformer-probe-")
        os.close(descriptor)
        os.unlink(probe)
    except OSError as e:
        return f"nothing can be written in {folder} ({e.strerror or e})"
    return None


# The directories the tools write as a whole (`atomic.atomic_write`), by kind: the file that marks
# an earlier one, which a new one replaces, and what to call them.
WHOLE_DIRECTORIES = {
    "savedmodel": ("saved_model.pb", "SavedModel export", "SavedModel"),
    "ctranslate2": ("model.bin", "CTranslate2 export", "CTranslate2 model"),
    "tokenizer": ("tokenizer.json", "saved tokenizer", "tokenizer"),
}


def replacement_problem(path, kind: str) -> str | None:
    """Why a directory of `kind` (see `WHOLE_DIRECTORIES`), written as a whole, may not be
    written at `path`: a file, or a directory that holds anything but an earlier one of
    its kind (whose files the write would delete). `None` when it may."""
    mark, earlier, name = WHOLE_DIRECTORIES[kind]
    if os.path.exists(path) and not os.path.isdir(path):
        return f"is a file; give a directory for the {name}"
    names = sorted(os.listdir(path)) if os.path.isdir(path) else []
    if names and mark not in names:
        shown = ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")
        return (f"holds files that are not a {earlier} ({shown}); the {name} replaces the whole directory: "
                "give a new or empty one")
    return None


def check_replacement(path, kind: str) -> None:
    """Raise `ValueError` if a directory of `kind` may not be written at `path` (`replacement_problem`)."""
    problem = replacement_problem(path, kind)
    if problem:
        raise ValueError(f"{path} {problem}")


@contextlib.contextmanager
def lock(path, busy: Exception):
    """Hold an exclusive lock on the file `path` (created if missing) for the block.

    Raises `busy` if another process holds it, `RunDirError` if `path` cannot be opened
    (a directory in its place, no permission). The lock is the operating system's
    (`flock`): it goes away with the process, however the process ends.
    """
    import fcntl

    try:
        handle = open(path, "a")
    except OSError as e:
        raise RunDirError(f"{path} cannot be opened as the run's lock file ({e.strerror or e}): "
                          "if no `train` runs on this directory, remove it and run again.") from None
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        try:
            yield
        finally:
            fcntl.flock(handle.fileno(), fcntl.LOCK_UN)


def lock_held(path) -> bool:
    """Whether another process holds the `lock` on the file `path`; a missing file is
    not created (and not held)."""
    import fcntl

    try:
        handle = open(path)
    except OSError:
        return False
    with handle:
        try:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        fcntl.flock(handle.fileno(), fcntl.LOCK_UN)
        return False


def load_npz(path):
    """`np.load` of an `.npz` archive; any other file raises `zipfile.BadZipFile` (NumPy
    would read it as a pickle and suggest allowing pickles)."""
    import zipfile

    import numpy as np

    if not zipfile.is_zipfile(path):
        raise zipfile.BadZipFile("not an .npz archive: damaged, cut short or another kind of file")
    return np.load(path)
