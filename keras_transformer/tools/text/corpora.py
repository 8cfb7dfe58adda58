"""Parallel corpora: a built-in one that needs no download, and readers for real ones.

* `numbers_corpus`: numbers written as words in two languages (with `num2words`),
  English -> German by default: "forty-two thousand and seven" ->
  "zweiundvierzigtausendsieben" needs reordering ("two and forty") and compounding.
* `read_parallel_files`: two aligned plain-text files, one sentence per line,
  optionally gzip-compressed, as Multi30k, WMT and IWSLT ship them.
* `read_tsv`: tab-separated pairs (the Tatoeba / Anki format); extra columns, such as
  Anki's attribution, are ignored.

Readers raise `CorpusError` with the file and line of any problem. Empty lines are
skipped and counted; `split_pairs` drops repeated pairs (counted) and keeps every
translation of a source sentence in one split.
"""

from __future__ import annotations

import dataclasses
import gzip
import hashlib
import os
import pathlib
import re
import zlib
from typing import Iterator

import numpy as np

from keras_transformer.defaults import HOLDOUT
from keras_transformer.tools import files

Pair = tuple[str, str]


class CorpusError(ValueError):
    """A corpus that cannot be read: the message names the file and line."""


@dataclasses.dataclass
class Corpus:
    """Sentence pairs split into train / validation / test, and what reading skipped."""

    train: list[Pair]
    validation: list[Pair]
    test: list[Pair]
    skipped_empty: int = 0
    duplicates_dropped: int = 0
    description: str = ""

    def reversed(self) -> "Corpus":
        """The same corpus in the other direction: every pair's target becomes its source."""
        swap = lambda pairs: [(t, s) for s, t in pairs]  # noqa: E731
        return dataclasses.replace(
            self, train=swap(self.train), validation=swap(self.validation), test=swap(self.test),
            description=f"{self.description}, reversed",
        )

    def digest(self, splits=("train", "validation", "test")) -> str:
        """A SHA-256 digest of the pairs of `splits`, split by split: the same corpus read
        the same way gives the same digest (the processes of a run compare all of it; a run
        keeps its training split's in data.json, to notice a corpus file that changed)."""
        h = hashlib.sha256()
        for split in splits:
            for source, target in getattr(self, split):
                h.update(source.encode("utf-8") + b"\t" + target.encode("utf-8") + b"\n")
            h.update(b"\0")  # no text holds one: the splits' boundaries count
        return h.hexdigest()

    def summary(self) -> str:
        return (f"{self.description}: {len(self.train)} train, {len(self.validation)} validation, {len(self.test)} "
                f"test pairs; {self.skipped_empty} {_EMPTY}, {self.duplicates_dropped} repeated pairs dropped")


def numbers_corpus(
    train_size: int = 50_000,
    validation_size: int = 1_000,
    test_size: int = 1_000,
    max_number: int = 999_999,
    source_lang: str = "en",
    target_lang: str = "de",
    seed: int = 0,
) -> Corpus:
    """Numbers written as words in a source and a target language.

    Deterministic: the same arguments give the same pairs. Every number below 100 is in
    the training split (they are the building blocks every larger number is made of);
    the others are drawn without replacement, with equal shares for each count of
    digits, and assigned to one split only, so no number is in two splits.

    Args:
        train_size: Number of training pairs. Defaults to `50000`.
        validation_size: Defaults to `1000`.
        test_size: Defaults to `1000`.
        max_number: Largest number. Defaults to `999999`.
        source_lang: A `num2words` language code. Defaults to `"en"`.
        target_lang: Defaults to `"de"`.
        seed: Defaults to `0`.

    Example:

    >>> corpus = numbers_corpus(train_size=200, validation_size=10, test_size=10)
    >>> dict(corpus.train)["forty-two"]
    'zweiundvierzig'
    """
    held_out = validation_size + test_size
    if train_size < 100 or held_out + train_size > max_number + 1:
        raise ValueError(f"Need train_size >= 100 and train + held-out sizes <= max_number + 1. Received: "
                         f"train_size={train_size}, validation_size={validation_size}, test_size={test_size}, "
                         f"max_number={max_number}")
    rng = np.random.default_rng(seed)
    numbers = rng.permutation(sorted(_draw_numbers(rng, train_size - 100 + held_out, max_number)))
    test, validation = numbers[:test_size], numbers[test_size:held_out]
    train = np.concatenate([np.arange(100), numbers[held_out:]])

    source_words, target_words = _NumberWords(source_lang), _NumberWords(target_lang)

    def pairs(ns):
        return [(source_words(int(n)), target_words(int(n))) for n in ns]

    return Corpus(
        pairs(rng.permutation(train)), pairs(validation), pairs(test),
        description=f"numbers {source_lang}->{target_lang} (0..{max_number}, seed {seed})",
    )


def _draw_numbers(rng, wanted: int, max_number: int) -> set[int]:
    """`wanted` distinct numbers from 100 to `max_number`, equal shares per count of digits
    (3 and up), each share capped by how many such numbers exist."""
    chosen: set[int] = set()
    bands = [(10 ** (k - 1), min(10**k - 1, max_number)) for k in range(3, len(str(max_number)) + 1)]
    share = -(-wanted // max(1, len(bands)))
    for low, high in bands:
        count = min(share, high - low + 1, wanted - len(chosen))
        if count > 0:
            chosen.update(int(n) for n in rng.choice(np.arange(low, high + 1), size=count, replace=False))
    if len(chosen) < wanted:  # some bands were too small: draw the rest from all numbers
        rest = np.setdiff1d(np.arange(100, max_number + 1), np.fromiter(chosen, int))
        chosen.update(int(n) for n in rng.choice(rest, size=wanted - len(chosen), replace=False))
    return chosen


class _NumberWords:
    """`num2words(n, lang)`, built from parts for n below a million: ~20x faster.

    In the languages checked (en, de, es and others), the words of `1000 a + b` are the
    words of `1000 a` followed by what the words of `1000 + b` add to those of `1000`
    (en: "one hundred and one thousand" + " and one"; de: "einhunderteinstausend" +
    "eins"), so about 2,000 calls to `num2words` serve every number up to 999,999. The
    rule is checked against `num2words` on numbers where languages tend to be irregular;
    a language that breaks it gets plain `num2words` for every number.
    """

    _CHECKS = (1001, 1100, 2001, 21021, 100000, 101001, 111111, 200100, 500017, 999999)

    def __init__(self, lang: str):
        from num2words import num2words

        self.lang = lang
        self._num2words = num2words
        self._words: dict[int, str] = {}
        self._tails: dict[int, str] = {}
        try:
            self._by_parts = all(self._compose(n) == num2words(n, lang=lang) for n in self._CHECKS)
        except ValueError:  # the words of 1000 + b do not begin with those of 1000
            self._by_parts = False

    def _plain(self, n: int) -> str:
        if n not in self._words:
            self._words[n] = self._num2words(n, lang=self.lang)
        return self._words[n]

    def _compose(self, n: int) -> str:
        thousands, rest = divmod(n, 1000)
        if rest not in self._tails:
            one_thousand = self._plain(1000)
            with_rest = self._num2words(1000 + rest, lang=self.lang)
            if not with_rest.startswith(one_thousand):
                raise ValueError(f"{with_rest!r} does not start with {one_thousand!r}")
            self._tails[rest] = with_rest[len(one_thousand):]
        return self._plain(1000 * thousands) + self._tails[rest]

    def __call__(self, n: int) -> str:
        if n < 1000 or n >= 1_000_000 or not self._by_parts:
            return self._plain(n) if n < 1000 else self._num2words(n, lang=self.lang)
        return self._compose(n)


_GZIP_MAGIC = b"\x1f\x8b"


def _read_bytes(path: pathlib.Path, streams: bool = False) -> bytes:
    """The file's bytes, gunzipped for `.gz` or data that starts as gzip's does (no text
    does: `1f 8b` is not UTF-8); every read problem as a `CorpusError`.

    With `streams`, also a pipe or a device read once to its end (`/dev/null`, a shell's
    `<(command)`); without, a regular file only (`files.input_problem`)."""
    problem = files.input_problem(path, streams)
    if problem:
        raise CorpusError(problem)
    gzipped = path.suffix == ".gz"
    try:
        if path.is_file():
            data = path.read_bytes()
        else:  # a pipe or a device: it may never end (/dev/zero), so read it in chunks
            with open(path, "rb") as stream:
                data = read_stream(stream, path, text=not gzipped)
        gzipped = gzipped or data.startswith(_GZIP_MAGIC)
        data = gzip.decompress(data) if gzipped else data
    except (OSError, EOFError, zlib.error) as e:  # unreadable, not gzip, truncated
        raise CorpusError(f"{path} is not {'a complete gzip file' if gzipped else 'readable'} "
                          f"({type(e).__name__}: {e})") from None
    return data


def read_stream(stream, name, text: bool = True) -> bytes:
    """All of a binary stream (a pipe, a device, standard input), read in chunks. For
    `text`, a NUL byte, which no text holds, stops it with a `CorpusError` (binary data,
    or a device such as `/dev/zero` that would be read until memory runs out), unless the
    stream starts as gzip data does (checked as text once decompressed)."""
    chunks, lines = [], 0
    while chunk := stream.read(1 << 20):
        if not chunks and chunk.startswith(_GZIP_MAGIC):
            text = False  # gzip data holds NUL bytes
        if text:
            _refuse_nul(chunk, name, lines)
        chunks.append(chunk)
        lines += chunk.count(b"\n")
    return b"".join(chunks)


def _refuse_nul(data: bytes, name, lines_before: int = 0) -> None:
    """A `CorpusError` naming the line of the first NUL byte in `data`, if it holds one."""
    nul = data.find(b"\0")
    if nul >= 0:
        line = lines_before + data.count(b"\n", 0, nul) + 1
        if lines_before == 0 and data[:2] in (b"\xff\xfe", b"\xfe\xff"):  # Windows' "Unicode" text
            raise CorpusError(f"{name} is UTF-16 text (it starts with UTF-16's byte-order mark): save it as UTF-8")
        raise CorpusError(f"{name}, line {line}: a NUL byte, which text never holds: binary data, not text")


def decode_lines(data: bytes, name, first_line: int = 1) -> list[str]:
    """Split `data` into lines ending in `\\n`, `\\r\\n` or `\\r` (old Mac files) alike and
    decode each as UTF-8; a line that is not UTF-8, or one with a NUL byte, is a
    `CorpusError` naming `name` and the line (`data` starts at line `first_line`)."""
    _refuse_nul(data, name, first_line - 1)
    rows = re.split(rb"\r\n|\r|\n", data)
    if rows and rows[-1] == b"":
        rows.pop()  # the final line break
    lines = []
    for number, raw in enumerate(rows, start=first_line):
        try:
            lines.append(raw.decode("utf-8"))
        except UnicodeDecodeError as e:
            raise CorpusError(
                f"{name}, line {number}: not valid UTF-8 (byte {e.start}: {raw[e.start:e.start + 1]!r})"
            ) from None
    if lines and first_line == 1:
        lines[0] = lines[0].lstrip("\ufeff")  # a byte-order mark is not text
    return lines


def read_lines(path, streams: bool = False) -> list[str]:
    """A text file's lines (plain or `.gz`, any line ending); problems as `CorpusError`.
    With `streams`, a pipe or a device too (read once)."""
    path = pathlib.Path(path)
    return decode_lines(_read_bytes(path, streams), path)


def _lines(path: pathlib.Path, streams: bool = False) -> Iterator[tuple[int, str]]:
    """(line number, text) for each line of a file (plain or `.gz`)."""
    yield from enumerate(decode_lines(_read_bytes(path, streams), path), start=1)


def read_parallel_files(source_file, target_file, streams: bool = False) -> tuple[list[Pair], int]:
    """Read two aligned files (line i of one translates line i of the other); with
    `streams`, pipes or devices too (read once: `evaluate`'s `<(command)`).

    Returns:
        The pairs and the number of pairs skipped because either side was empty.

    Raises:
        CorpusError: a missing file, different line counts (both files and counts
            named), or undecodable bytes (file and line named).
    """
    source_file, target_file = pathlib.Path(source_file), pathlib.Path(target_file)
    sources = [t for _, t in _lines(source_file, streams)]
    targets = [t for _, t in _lines(target_file, streams)]
    if len(sources) != len(targets):
        raise CorpusError(
            f"The aligned files have different line counts: {source_file} has {_count(len(sources), 'line')}, "
            f"{target_file} has {_count(len(targets), 'line')}."
        )
    return _drop_empty(zip(sources, targets))


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" + ("" if n == 1 else "s")


def read_tsv(path) -> tuple[list[Pair], int]:
    """Read `source<TAB>target[<TAB>ignored...]` lines.

    Raises:
        CorpusError: a missing file, a line without a tab (line named), or
            undecodable bytes (line named).
    """
    path = pathlib.Path(path)
    pairs = []
    for number, text in _lines(path):
        if not text.strip():
            pairs.append(("", ""))
            continue
        fields = text.split("\t")
        if len(fields) < 2:
            raise CorpusError(
                f"{path}, line {number}: expected 'source<TAB>target', found no tab: {text[:80]!r}"
            )
        pairs.append((fields[0], fields[1]))
    return _drop_empty(pairs)


# What `_drop_empty` counts: blank lines, and lines (or line pairs) with one side blank.
_EMPTY = "lines with an empty side skipped"


def _drop_empty(pairs) -> tuple[list[Pair], int]:
    kept, skipped = [], 0
    for s, t in pairs:
        s, t = s.strip(), t.strip()
        if s and t:
            kept.append((s, t))
        else:
            skipped += 1
    return kept, skipped


def default_holdout(distinct_pairs: int, most: int = HOLDOUT) -> int:
    """Held-out pairs per split when none is asked for: `most`, or a tenth of a smaller corpus (at least 1)."""
    return min(most, max(1, distinct_pairs // 10))


def split_pairs(pairs: list[Pair], holdout: int | None = None, description: str = "", skipped_empty: int = 0,
                seed: int = 0) -> Corpus:
    """Split pairs into train / validation / test, grouped by source sentence.

    Repeated pairs are dropped (and counted). All translations of one source sentence
    go to the same split, so no validation or test sentence reaches training through
    another translation of it. The groups are taken in an order drawn with `seed`
    (from the sorted sources, so the line order of the file does not matter): test
    first until it holds at least `holdout` pairs, then validation, the rest train.
    `holdout=None` is `default_holdout` of the distinct pairs (500, or a tenth of a
    smaller corpus); the split's description then says so.

    Raises:
        CorpusError: an empty corpus, one of fewer than 6 distinct pairs, or `holdout`
            above a sixth of the pairs (both held-out splits above a third), with both numbers.
    """
    if not pairs:
        raise CorpusError(f"The corpus is empty{': ' + description if description else ''} "
                          f"({skipped_empty} {_EMPTY}).")
    distinct = list(dict.fromkeys(pairs))
    duplicates = len(pairs) - len(distinct)
    chosen, holdout = holdout is None, default_holdout(len(distinct)) if holdout is None else holdout
    if 2 * holdout > len(distinct) / 3:
        if len(distinct) < 6:
            raise CorpusError(f"{len(distinct)} distinct pairs read: a corpus needs at least 6 to hold out one for "
                              "validation and one for test.")
        raise CorpusError(f"--holdout {holdout} asks for {2 * holdout} held-out pairs (validation and test), more "
                          f"than a third of the {len(distinct)} distinct pairs read; use at most --holdout "
                          f"{len(distinct) // 6}.")
    seed_note = f"split seed {seed}"
    if chosen and holdout < HOLDOUT:
        share = "a tenth of the pairs" if holdout > 1 else "the fewest"
        seed_note += f"; no --holdout: {holdout} held out for each of validation and test, {share}"
    groups: dict[str, list[Pair]] = {}
    for pair in distinct:
        groups.setdefault(pair[0], []).append(pair)
    sources = sorted(groups)
    order = np.random.default_rng(seed).permutation(len(sources))
    splits: dict[str, list[Pair]] = {"train": [], "validation": [], "test": []}
    for index in order:
        name = "test" if len(splits["test"]) < holdout else "validation" if len(splits["validation"]) < holdout else "train"
        splits[name].extend(groups[sources[index]])
    if not splits["train"]:
        raise CorpusError(f"No training pairs left after holding out {holdout} for validation and test.")
    # Training order: as drawn (the input pipeline shuffles again).
    return Corpus(**splits, skipped_empty=skipped_empty, duplicates_dropped=duplicates,
                  description=f"{description} ({seed_note})" if description else seed_note)


def corpus_from_files(source_file=None, target_file=None, tsv=None, holdout: int | None = None,
                      seed: int = 0) -> Corpus:
    """Read a parallel-file or TSV corpus and split it (see `split_pairs`)."""
    if tsv is not None:
        pairs, skipped = read_tsv(tsv)
        description = f"TSV {os.fspath(tsv)}"
    else:
        pairs, skipped = read_parallel_files(source_file, target_file)
        description = f"{os.fspath(source_file)} / {os.fspath(target_file)}"
    return split_pairs(pairs, holdout, description, skipped, seed=seed)
