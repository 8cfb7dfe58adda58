"""`keras-transformer`: command-line entry point.

Each command lives in `keras_transformer.tools.commands` (`add_parser`, `check`, `run`);
this module parses, runs the command's checks before any backend loads, and turns
mistakes into one `error:` line. The Keras backend is whatever `KERAS_BACKEND` says
(TensorFlow when unset). Errors in the input (missing or misaligned files, bad flags, a
conflicting output directory) print one message and exit with status 2 before any
training starts.
"""

from __future__ import annotations

import argparse
import contextlib
import difflib
import functools
import os
import re
import sys
import tempfile
import warnings

# Only the settings modules, which import no backend: `--help` and argument checks stay fast.
from keras_transformer.tools import commands, files
from keras_transformer.tools.config import RunError, say
from keras_transformer.tools.files import RunDirError


class _Parser(argparse.ArgumentParser):
    """Usage mistakes are one line, `keras-transformer COMMAND: error: ...`, and status 2."""

    commands: dict[str, argparse.ArgumentParser] = {}  # the parser of each command, by name

    def error(self, message):
        self.exit(2, f"{self.prog}: error: {self._hinted(message)} (see {self.prog} --help)\n")

    def _hinted(self, message: str) -> str:
        """The program's own mistakes with what was probably meant: a misspelt command
        (`trian`), or a flag before the command that is not one of the program's
        (`--vers`, which argparse reported as a missing COMMAND)."""
        if not self.commands or "COMMAND" not in message:
            return message
        # The flags given before the command that are not the program's own (`--steps 3
        # train`: '3' is no command).
        argv, own = getattr(self, "argv", []), _flags(self)
        first = next((i for i, a in enumerate(argv) if not a.startswith("-")), len(argv))
        unknown = [a for a in argv[:first] if a.startswith("-") and a.split("=")[0] not in own]
        if unknown:
            hint = _near_misses(self, unknown) or "; a command's flags come after the COMMAND"
            return f"unrecognized arguments: {' '.join(unknown)}{hint}"
        wrong = re.search(r"invalid choice: '([^']*)'", message)
        near = wrong and difflib.get_close_matches(wrong.group(1), list(self.commands), n=1, cutoff=0.6)
        return f"{message}; did you mean {near[0]}?" if near else message

    def parse_args(self, args=None, namespace=None):
        # A flag the command lacks is the command's mistake: argparse would say it in the
        # name of the whole program (`keras-transformer: error: ...`, see its --help).
        self.argv = list(sys.argv[1:] if args is None else args)
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            command = self.commands.get(getattr(parsed, "command", None), self)
            command.error(f"unrecognized arguments: {' '.join(extra)}{_near_misses(command, extra)}")
        return parsed


def _near_misses(parser: argparse.ArgumentParser, extra: list[str]) -> str:
    """`; did you mean --flag?` for unknown flags that begin one of the command's flags, are
    one of them with more after a dash, or are spelled close to one. (Flags are never
    abbreviated: argparse took `--learning-rate 1e-4` for `--learning-rate-scale 1e-4`, a
    ten-thousandth of the paper's rate.)"""
    flags = sorted(f for f in _flags(parser) if f.startswith("--") and f != "--help")
    hints = {}
    for given in (a.split("=", 1)[0] for a in extra if a.startswith("--")):
        near = ([f for f in flags if f.startswith(given)] or [f for f in flags if given.startswith(f + "-")]
                or difflib.get_close_matches(given, flags, n=1, cutoff=0.8))
        if 0 < len(near) <= 3:
            hints[given] = " or ".join(near)
    if len(hints) == 1:
        return f"; did you mean {next(iter(hints.values()))}?"
    return "; did you mean " + ", ".join(f"{f} (not {g})" for g, f in hints.items()) + "?" if hints else ""


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    """Every option string of `parser`, as its help lists them (`-v, --verbose`; no argparse
    internals)."""
    return {flag for line in parser.format_help().splitlines() if line.startswith("  -")
            for flag in re.findall(r"(?<![\w-])--?[a-z][a-z0-9-]*", line.split("  ")[1])}


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="keras-transformer",
        allow_abbrev=False,
        description="The Transformer of 'Attention Is All You Need' on TensorFlow, JAX or PyTorch "
                    "(set KERAS_BACKEND).",
    )
    parser.add_argument("-v", "--verbose", action="store_true",
                        help="Show TensorFlow's and XLA's start-up log lines.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {_version()}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for command in commands.COMMANDS:
        command.add_parser(sub)
    parser.commands = sub.choices
    return parser


def _version() -> str:
    """The installed distribution's version, read from its metadata (no import of the package)."""
    from importlib import metadata

    try:
        return metadata.version("keras-transformer")
    except metadata.PackageNotFoundError:  # run from a source tree that was not installed
        return "(not installed)"


def parse(argv=None):
    """Parse the command line (no backend is imported). `--help` and usage mistakes exit
    here, with status 0 and 2."""
    return build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))


def _print_error(args, error) -> None:
    """A mistake in the input: one `keras-transformer COMMAND: error: ...` line on stderr."""
    say(f"keras-transformer {args.command}: error: {error}")


def _show_warning(command, show, message, category, filename, lineno, file=None, line=None) -> None:
    """A warning of keras-transformer's own as one `keras-transformer COMMAND: warning: ...`
    line; any other library's as Python shows it."""
    if issubclass(category, UserWarning) and f"{os.sep}keras_transformer{os.sep}" in filename:
        say(f"keras-transformer {command}: warning: {message}")
    else:
        show(message, category, filename, lineno, file, line)


def check(args) -> int | None:
    """Check a parsed command's settings before any backend loads (values that depend on
    each other, output paths that are taken): `None` when they are good, else 2 after one
    `error:` line."""
    return checked(args)[1]


def checked(args) -> tuple[argparse.Namespace | None, int | None]:
    """`(settings, None)`: the parsed flags and what the command's `check(args)` derives
    from them (a dict: a `TrainConfig`, an output path), as the namespace its handler
    gets; or `(None, 2)` after one `error:` line. The parsed namespace is not changed."""
    checker = getattr(args, "check", None)
    try:
        check_utf8(args)
        check_backend(args.command)
        derived = checker(args) if checker is not None else None
    except (RunError, RunDirError) as e:
        _print_error(args, e)
        return None, 2
    except OSError as e:
        if e.errno is None:
            raise
        # A path the system refuses to look at (a name past 255 bytes, a loop of links).
        _print_error(args, f"{e.strerror or e}: {e.filename}" if e.filename is not None else e)
        return None, 2
    return argparse.Namespace(**{**vars(args), **(derived or {})}), None


# Positional arguments, named in an error by what they hold rather than by a flag.
_POSITIONAL = {"texts": "a TEXT to translate", "train_argv": "an argument of train"}


def check_utf8(args) -> None:
    """Refuse an argument that is not UTF-8: a file name or a text in another encoding
    (Python keeps its bytes as lone surrogates). Paths and texts go into UTF-8 files
    (config.json) and TensorFlow strings, which raised UnicodeEncodeError or "Error
    converting unicode string" from inside the command."""
    for name, value in vars(args).items():
        for item in value if isinstance(value, list) else [value]:
            if not isinstance(item, str):
                continue
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                what = _POSITIONAL.get(name, f"--{name.replace('_', '-')}")
                raise RunError(f"{what} is not UTF-8: {item.encode('utf-8', 'surrogateescape')!r}; keras-transformer "
                               "writes paths and texts as UTF-8, so rename the file or give the text in UTF-8") from None


# The backends keras-transformer runs on and is tested on; Keras also has "numpy", which
# runs the search (eagerly) but cannot train (no `fit`), and "openvino", which can do
# neither: its tensors inside the search are symbolic, and `translate` failed with "An
# OpenVINOKerasTensor is symbolic" (Keras 3.15, openvino 2026.4).
BACKENDS = ("tensorflow", "jax", "torch")
_TRAINING_COMMANDS = ("train", "demo", "launch")
_SEARCH_COMMANDS = ("translate", "evaluate")


def check_backend(command: str) -> None:
    """Refuse a `KERAS_BACKEND` that Keras does not know (it raised "Unable to import
    backend : foo" with a traceback once the command had started) or, for the commands
    that train or search, one that cannot (`export` runs TensorFlow in a child process)."""
    backend = os.environ.get("KERAS_BACKEND")
    if not backend or backend in BACKENDS:  # unset or empty: Keras' own default
        return
    if backend not in ("numpy", "openvino"):
        raise RunError(f"KERAS_BACKEND={backend!r} is not a Keras backend: set it to one of {', '.join(BACKENDS)}")
    if command in _TRAINING_COMMANDS:
        raise RunError(f"KERAS_BACKEND={backend!r}: Keras' {backend} backend cannot train a model (it has no fit); "
                       f"set it to one of {', '.join(BACKENDS)}")
    if backend == "openvino" and command in _SEARCH_COMMANDS:
        raise RunError(f"KERAS_BACKEND='openvino': Keras' openvino backend cannot run the search (its tensors are "
                       f"symbolic inside it); set it to one of {', '.join(BACKENDS)}")


def interrupted(args) -> int:
    """A Ctrl-C: one line, status 130 (128 + SIGINT), wherever the command was."""
    say(f"keras-transformer {args.command}: interrupted")
    return 130


def run(args, settings: argparse.Namespace | None = None) -> int:
    """Run a parsed command: status 0 on success, 2 with one `error:` line for a mistake in
    the input, 1 with one line when the operating system refuses a read or a write (a full
    disk), 1 with a traceback for anything else unexpected. `settings` is what `checked(args)`
    gave, when the caller checked already (the installed command checks before the backend
    loads, so that a mistake is reported in a fraction of a second).

    A process of several whose `train` failed on its own ends here, at once, once it has
    said why (see `collectives.FAILED_IN_CLUSTER`); the others stop at their next
    collective, naming it."""
    status = _run(args, settings)
    collectives = sys.modules.get("keras_transformer.tools.collectives")  # loaded if train joined a cluster
    if status and collectives is not None and collectives.FAILED_IN_CLUSTER.is_set():
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(OSError, ValueError):
                stream.flush()
        os._exit(status)
    return status


def _run(args, settings):
    if settings is None:
        settings, status = checked(args)
        if status is not None:
            return status
    mistakes = (RunError, RunDirError)
    try:
        if getattr(args, "loads_library", True):  # not `launch`, whose processes load it
            from keras_transformer.tools.text.corpora import CorpusError  # the text package: TensorFlow

            mistakes += (CorpusError,)
            with quiet_backend_start(enabled=not args.verbose):
                pass  # TensorFlow (the data pipeline's) loads here, its start-up lines filtered
        with warnings.catch_warnings():
            warnings.showwarning = functools.partial(_show_warning, args.command, warnings.showwarning)
            return settings.handler(settings)
    except mistakes as e:
        _print_error(args, e)
        return 2
    except KeyboardInterrupt:
        return interrupted(args)
    except Exception as e:
        if isinstance(e, BrokenPipeError) and files.reader_gone(sys.stdout):
            _drop_unwritten(sys.stdout)
            return 1  # the reader of the output stopped reading (`| head`): nothing to report
        if isinstance(e, OSError) and e.errno is not None:
            # The system refused a read or write (a full disk, a file that went away): one line.
            paths = " -> ".join(str(f) for f in (e.filename, e.filename2) if f is not None)
            say(f"keras-transformer {args.command}: error: {e.strerror or e}{': ' + paths if paths else ''}")
            return 1
        from keras_transformer.backend.compile import out_of_memory  # Keras is loaded by now

        memory = out_of_memory(e)
        if memory:
            say(f"keras-transformer {args.command}: error: out of memory ({memory}); "
                f"{_MEMORY_ADVICE.get(args.command, 'ask for less work at once')}")
            return 1
        import traceback  # a bug, not a mistake in the input: keep the traceback

        traceback.print_exc()
        say(f"keras-transformer {args.command}: internal error (a bug in keras-transformer). Please report "
            "it with the command line and the traceback above.")
        return 1


def _drop_unwritten(stream) -> None:
    """Point `stream`'s descriptor at the null device, so that what is left in its buffer is
    dropped at exit instead of raising BrokenPipeError again (Python's advice in the
    `signal` module's notes on SIGPIPE)."""
    null = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(null, stream.fileno())
    finally:
        os.close(null)


# What each command can be asked to do with less memory.
_LESS_DECODING = "give a smaller --batch-size, --beam-size or --max-input-length"
_LESS_TRAINING = "give a smaller --batch-tokens (or --max-length, or a smaller model)"
_MEMORY_ADVICE = {"translate": _LESS_DECODING, "evaluate": _LESS_DECODING, **dict.fromkeys(_TRAINING_COMMANDS, _LESS_TRAINING)}


def main(argv=None) -> int:
    """`keras-transformer ...` (the installed command starts at `keras_transformer_cli.main`,
    which parses before the library is imported)."""
    open_closed_standard_streams()
    return run(parse(argv))


def open_closed_standard_streams() -> None:
    """A standard stream the command was started without (`<&-`, `>&-`, `2>&-`) is opened
    on the null device, as if redirected there. Python leaves such a stream `None`: `train`
    and `translate` failed inside on it, and the first file the command opened would have
    taken the free descriptor, so that what was meant for the terminal (TensorFlow's log,
    written to descriptor 2) went into that file."""
    for descriptor, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(descriptor)
            continue
        except OSError:
            pass
        null = os.open(os.devnull, os.O_RDWR)  # the lowest free descriptor: this one
        if null != descriptor:
            os.dup2(null, descriptor)
            os.close(null)
        stream = open(descriptor, mode, encoding="utf-8", closefd=False)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


# Lines that TensorFlow's and XLA's C++ code writes to the standard error stream while it
# loads, before any logging level applies: CPU feature notes, CUDA probing on a machine
# without a GPU ("failed call to cuInit"). Not errors of the user's command. Each with
# the TF_CPP_MIN_LOG_LEVEL that hides it: 1 info, 2 warnings and the errors of CUDA
# probing (a user who asks for quiet gets it on a machine without a GPU).
_START_UP_NOISE = (
    (re.compile(r"^I0000 |^To enable the following instructions: "), 1),
    (re.compile(r"^[WE]0000 |^WARNING: All log messages before absl::InitializeLog\(\)"), 2),
)


def _is_start_up_noise(line: str, level: int = 3) -> bool:
    """Whether `line` is one of TensorFlow's start-up lines that `TF_CPP_MIN_LOG_LEVEL=level`
    hides (see `_START_UP_NOISE`)."""
    return any(pattern.match(line) and level >= hidden_at for pattern, hidden_at in _START_UP_NOISE)


@contextlib.contextmanager
def quiet_backend_start(enabled: bool = True):
    """Import TensorFlow and Keras with their start-up lines filtered out of stderr.

    The C++ libraries write to file descriptor 2 directly, so the descriptor is pointed at
    a temporary file for the duration and what it caught is written back afterwards, less
    the start-up noise. Off with `-v`. A `TF_CPP_MIN_LOG_LEVEL` of the user's is applied to
    these lines (`0` shows them all, `1` hides the information lines, `2` and `3` all of
    them); unset, it is `3`. PyTorch's C++ log (`TORCH_CPP_LOG_LEVEL`) is kept to its errors
    unless the user set it: a process of a cluster whose coordinator address reaches another
    program printed a C++ stack trace per retry of `torch.distributed`'s store.
    """
    if not enabled:
        yield
        return
    os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    try:
        level = int(os.environ.setdefault("TF_CPP_MIN_LOG_LEVEL", "3"))
    except ValueError:
        level = 0
    if level <= 0:
        yield
        return
    sys.stderr.flush()
    saved = os.dup(2)
    with tempfile.TemporaryFile() as caught:
        os.dup2(caught.fileno(), 2)
        try:
            import tensorflow as tf

            tf.config.list_physical_devices()  # device probing happens here
            import keras  # noqa: F401  (the backend's own start-up)

            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)
            caught.seek(0)
            for line in caught.read().decode("utf-8", "replace").splitlines(keepends=True):
                if not _is_start_up_noise(line, level):
                    sys.stderr.write(line)

