"""The corpora `keras-transformer train` reads: one `CorpusKind` each in `CORPORA`.

Adding a corpus is an entry here, with a `TrainConfig` field (`tools/config.py`) for each
new setting it reads and its reader in `tools/text/corpora.py`. Imports no backend: the
command line checks a corpus's flags before anything loads."""

from __future__ import annotations

import dataclasses
import pathlib

from typing import Callable

from keras_transformer.tools.files import input_problem


@dataclasses.dataclass(frozen=True)
class CorpusKind:
    """One entry of `CORPORA`: a corpus `keras-transformer train --corpus NAME` can read.

    Attributes:
        name: The `--corpus` value.
        help: One phrase for `--help`.
        load: `load(config) -> Corpus` from a `TrainConfig` (its fields name the files);
            it imports its reader when called, so that `--help` loads nothing.
        check: `check(config) -> list of problems` (flag mistakes, one sentence each),
            called before anything is read.
        implied_by: `TrainConfig` fields whose use implies this corpus when `--corpus`
            is not given (`--tsv FILE` means `--corpus tsv`).
        reads: Other `TrainConfig` fields that only some corpora read (`--holdout`):
            set away from their default for a corpus that does not read them, they are
            refused rather than ignored.
        name_of: `name_of(config) -> str`, the corpus in a run's default `--output-dir`
            (`TrainConfig.run_name`): its files' names; `None`: the corpus's `name`.
    """

    name: str
    help: str
    load: Callable
    check: Callable = lambda config: []
    implied_by: tuple = ()
    reads: tuple = ()
    name_of: Callable | None = None


def _corpora():
    from keras_transformer.tools.text import corpora

    return corpora


def _unreadable(**paths) -> list:
    """A problem for each corpus file that cannot be read (missing, a directory, a pipe),
    by flag, found before a backend loads: under `launch`, said once, by the launcher."""
    problems = {name: input_problem(path) for name, path in paths.items()}
    return [f"--{name.replace('_', '-')}: {problem}" for name, problem in problems.items() if problem]


def _file_name(path) -> str:
    """A corpus file's name without the suffixes of compression and of text: `deu` for
    `deu.txt`, `pairs` for `pairs.tsv.gz`, `train.en` for `train.en.gz`."""
    name = pathlib.PurePath(path).name
    for suffix in (".gz", ".tsv", ".txt"):
        name = name.removesuffix(suffix)
    return name


def _files_name(source, target) -> str:
    """Two aligned files' names in one: `train.en-de` for `train.en` and `train.de`."""
    source, target = _file_name(source), _file_name(target)
    stem, dot, extension = source.rpartition(".")
    if dot and target.startswith(stem + ".") and "." not in target[len(stem) + 1:]:
        return f"{stem}.{extension}-{target[len(stem) + 1:]}"
    return f"{source}-{target}"


def _check_numbers(config) -> list:
    if 100 <= config.train_size <= 998_000:
        return []
    return [f"--train-size must be in [100, 998000] (the numbers corpus holds 10^6 numbers, 2000 of them held "
            f"out); got {config.train_size}"]


# Every corpus `train` reads, by `--corpus` name: adding a corpus is an entry here, with
# a `TrainConfig` field for each new setting it reads (its reader in `text/corpora.py`).
CORPORA = {kind.name: kind for kind in (
    CorpusKind("numbers", "built-in English->German number words (no download)",
               lambda c: _corpora().numbers_corpus(train_size=c.train_size, seed=c.seed), _check_numbers,
               reads=("train_size",)),
    CorpusKind("files", "two aligned files, --source-file and --target-file",
               lambda c: _corpora().corpus_from_files(c.source_file, c.target_file, holdout=c.holdout, seed=c.seed),
               lambda c: (_unreadable(source_file=c.source_file, target_file=c.target_file)
                          if c.source_file and c.target_file else
                          ["--source-file and --target-file must be given together"]),
               implied_by=("source_file", "target_file"), reads=("holdout",),
               name_of=lambda c: _files_name(c.source_file, c.target_file)),
    CorpusKind("tsv", "one tab-separated file of pairs, --tsv",
               lambda c: _corpora().corpus_from_files(tsv=c.tsv, holdout=c.holdout, seed=c.seed),
               lambda c: _unreadable(tsv=c.tsv) if c.tsv else ["--corpus tsv needs --tsv FILE"],
               implied_by=("tsv",), reads=("holdout",), name_of=lambda c: _file_name(c.tsv)),
)}


# The settings that name a corpus file (`--tsv`, `--source-file`, `--target-file`).
CORPUS_FILES = tuple(dict.fromkeys(name for kind in CORPORA.values() for name in kind.implied_by))


def implied_corpus(values: dict) -> str:
    """The corpus that `values` (settings by field name) imply when `--corpus` is not
    given: the first whose `implied_by` fields are set, else `numbers`."""
    for kind in CORPORA.values():
        if any(values.get(name) for name in kind.implied_by):
            return kind.name
    return "numbers"
