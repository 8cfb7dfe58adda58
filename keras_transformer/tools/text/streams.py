"""The lines of a stream as they arrive: `keras-transformer translate` on standard input.

A pipe may never end (`tail -f log | keras-transformer translate ...`) and a terminal
ends when its user says so, so standard input is not read to its end before the first
translation: its lines come in lists, each given out as soon as it is full, when the
stream has been quiet for a moment, or, from a terminal, as soon as a line is typed.
"""

from __future__ import annotations

import select
from typing import BinaryIO, Iterator

from keras_transformer.tools.text.corpora import decode_lines

_READ_SIZE = 1 << 16
QUIET_SECONDS = 0.5


def line_chunks(stream: BinaryIO, name, chunk_lines: int, interactive: bool = False) -> Iterator[list[str]]:
    """The lines of a binary stream in lists of `chunk_lines` (the last may be shorter).

    Lines end in `\\n`, `\\r\\n` or `\\r` alike and are decoded and checked as
    `corpora.decode_lines` does (a `CorpusError` names `name` and the line, counted from
    the stream's start). A list is given out when it is full, at the stream's end, when
    nothing has arrived for `QUIET_SECONDS` (a slow writer's lines do not wait for a
    full list) and, with `interactive` (a terminal), as soon as it holds a line. A NUL
    byte stops the stream at once, before the line it is on ends: a device such as
    `/dev/zero` never ends one.

    Args:
        stream: Has `read1` (`sys.stdin.buffer`, `io.BytesIO`).
        name: The stream's name in error messages.
        chunk_lines: The most lines in one list.
        interactive: Give out each line as soon as it is complete.
    """
    pending, lines, read = bytearray(), [], 0  # read: the lines decoded so far
    while True:
        if lines and _quiet(stream):
            yield lines
            lines = []
        data = stream.read1(_READ_SIZE)
        # What was pending holds no line break but perhaps a final `\r`: look from there on
        # (a long line read in many pieces is searched once).
        start = max(0, len(pending) - 1)
        pending += data
        if b"\0" in data:
            decode_lines(bytes(pending), name, first_line=read + 1)  # raises the CorpusError naming the NUL's line
        end = len(pending) if not data else _complete(pending, start)
        if end:
            decoded = decode_lines(bytes(pending[:end]), name, first_line=read + 1)
            del pending[:end]
            read, lines = read + len(decoded), lines + decoded
        while len(lines) >= chunk_lines or (lines and (interactive or not data)):
            yield lines[:chunk_lines]
            lines = lines[chunk_lines:]
        if not data:
            return


def _complete(data: bytearray, start: int) -> int:
    """How many bytes of `data` are whole lines, its last line break at or after `start`.
    A final `\\r` waits for the next read, which may begin with the `\\n` of a `\\r\\n`."""
    end = max(data.rfind(b"\n", start), data.rfind(b"\r", start))
    if end == len(data) - 1 and data.endswith(b"\r"):
        end = max(data.rfind(b"\n", start, end), data.rfind(b"\r", start, end))
    return end + 1


def _quiet(stream) -> bool:
    """Whether nothing arrives on `stream` for `QUIET_SECONDS`; `False` for a stream that
    cannot say (a regular file is always ready, an in-memory one has no descriptor)."""
    try:
        descriptor = stream.fileno()
    except (AttributeError, OSError, ValueError):  # io.UnsupportedOperation is both
        return False
    return not select.select([descriptor], [], [], QUIET_SECONDS)[0]
