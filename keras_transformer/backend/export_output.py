"""What `torch.export` prints while it exports a search's programs, held back per thread.

When an export fails, `keras_transformer.backend.compile` runs the search eagerly with one
warning that gives the reason; what PyTorch prints about the failure on the way (the
partial graph, pytorch/pytorch#146298, and its symbolic-shape diagnostics) would say it
again in hundreds of lines. `without_failure_dumps` holds what the exporting thread
writes to `sys.stderr` and what it logs through PyTorch's symbolic-shapes logger, and
writes it when the export ends, less those dumps if it failed. Other threads' output goes
through at once.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import sys
import threading


class _Stderr:
    """`sys.stderr` while threads export: what an exporting thread writes is held back (see
    `without_failure_dumps`), what the others write goes through."""

    def __init__(self, stream):
        self.stream = stream

    def write(self, text):
        held = _HELD.get(threading.get_ident())
        if held is None:
            return self.stream.write(text)
        held.append(text)
        return len(text)

    def __getattr__(self, name):
        return getattr(self.stream, name)


class _HeldRecords(logging.Filter):
    """On PyTorch's symbolic-shapes logger while threads export: an exporting thread's
    records are held back with its stderr text, the others' go through."""

    def filter(self, record):
        held = _HELD.get(record.thread)
        if held is None:
            return True
        held.append(record)
        return False


_HELD: dict = {}  # thread -> what it wrote (text) and logged (records) while it exported
_STDERR = {"stream": None}  # the stderr `_Stderr` stands in front of
_STDERR_LOCK = threading.Lock()
_RECORDS = _HeldRecords()
# What export logs when it meets a data-dependent value it cannot decide ("Unable to find
# user code corresponding to {u0}"), with a handler of its own: the diagnostics of a
# failure the fallback's one warning already names.
_GUARD_LOGGER = "torch.fx.experimental.symbolic_shapes"


@contextlib.contextmanager
def without_failure_dumps():
    """Around an export: the partial graph `torch.export` prints on stderr when an export
    fails on a data-dependent value (hundreds of lines; pytorch/pytorch#146298 added it as
    a debugging aid) is dropped, and so are the symbolic-shape records PyTorch logs about
    that value, since the search then runs eagerly with one warning that gives the
    failure. What else the exporting thread wrote meanwhile (export's own warnings), and
    those records if the export succeeded, are written when it ends; other threads'
    output is never held."""
    me = threading.get_ident()
    guard_logger = logging.getLogger(_GUARD_LOGGER)
    with _STDERR_LOCK:
        if not _HELD:
            _STDERR["stream"] = sys.stderr
            sys.stderr = _Stderr(sys.stderr)
            guard_logger.addFilter(_RECORDS)
        _HELD[me] = held = []
        stream = _STDERR["stream"]
    failed, graph = False, None
    try:
        yield
    except Exception as error:
        failed, graph = True, getattr(error, "partial_fx_graph", None)
        raise
    finally:
        with _STDERR_LOCK:
            del _HELD[me]
            if not _HELD:
                guard_logger.removeFilter(_RECORDS)
                if isinstance(sys.stderr, _Stderr):
                    sys.stderr = stream
        _write_held(held, stream, failed, graph)


def _write_held(held: list, stream, failed: bool, graph) -> None:
    """What an exporting thread wrote and logged, in order, less what describes its failure."""
    for is_text, items in itertools.groupby(held, key=lambda item: isinstance(item, str)):
        if is_text:  # one string: `print` writes its text and its newline apart
            text = "".join(items)
            if graph is not None:
                text = text.replace(f"{graph}\n", "")  # printed once by each of export's two wrappers
            if text:
                stream.write(text)
        elif not failed:
            for record in items:
                logging.getLogger(record.name).handle(record)
