"""A training run's settings and their validation. Imports no backend: the command line
reads the defaults for `--help` and checks every flag before anything is loaded."""

from __future__ import annotations

import dataclasses
import math
import numbers
import re
import sys

from keras_transformer.defaults import HOLDOUT, MAX_INT, PRESETS, VALIDATION_BEAM_SIZE
from keras_transformer.tools.corpus_kinds import CORPORA, CORPUS_FILES

MIXED_PRECISION = ("bfloat16", "float16")
# The range of each real-valued setting: (as `--help` and the errors say it, test).
REAL_RANGES = {
    "learning_rate_scale": ("> 0", lambda v: v > 0),
    "label_smoothing": ("in [0, 1)", lambda v: 0 <= v < 1),
    "dropout": ("in [0, 1)", lambda v: 0 <= v < 1),
    "stop_at_exact_match": ("in (0, 1]", lambda v: 0 < v <= 1),
}


# A setting's Python type, by its field's annotation: (what passes, as errors say it). An
# integer is a Python int (config.json holds it), a real number an int or a float.
_TYPES = {"int": (int, "an integer"), "float": ((int, float), "a number"), "bool": (bool, "True or False"),
          "str": (str, "a string")}


class RunError(Exception):
    """A problem found before training starts; the CLI prints it and exits with status 2."""


def say(line: str) -> None:
    """Write `line` and its newline to stderr in one write, flushed.

    `print` writes the text and the newline apart, which under `PYTHONUNBUFFERED` (common in
    containers) are two writes: the lines of processes that share a stderr (`launch`'s)
    came out joined, one process's line run into the other's."""
    sys.stderr.write(line + "\n")
    sys.stderr.flush()


def busy_error(output_dir) -> RunError:
    """The refusal of a second `train` on a directory whose `train.lock` is held."""
    return RunError(f"another `train` is running on {output_dir}; wait for it to finish or stop it.")


def _setting(default, help: str, group: str, **flag):
    """A `TrainConfig` field and its command-line flag, written once: the flag is
    `--field-name`; `help` is its help text; `flag` holds more of `add_argument`'s
    arguments (`choices`, `metavar`, `type` where the default is `None`),
    `shown_default`, what `--help` prints where the default is `None`, and `own_range`
    for an integer whose whole range `validate` checks, past `MAX_INT` (the seed's)."""
    return dataclasses.field(default=default, metadata={"help": help, "group": group, **flag})


CORPUS, MODEL, TRAINING = "corpus", "model", "training"


@dataclasses.dataclass
class TrainConfig:
    """Everything that defines a run. Two runs with equal configs are the same run.

    Each field is also a `keras-transformer train` flag (`--field-name`), generated
    from the field's metadata (`_setting`): adding a setting is adding a field here.
    """

    corpus: str = _setting(
        "numbers", "; ".join(f"{k.name}: {k.help}" for k in CORPORA.values()) + ". Implied by the files given.",
        CORPUS, choices=tuple(CORPORA), implied=True)
    source_file: str | None = _setting(None, "Source side, one sentence per line (plain or .gz).", CORPUS, type=str)
    target_file: str | None = _setting(None, "Target side, aligned line by line with --source-file.", CORPUS,
                                       type=str)
    tsv: str | None = _setting(None, "Tab-separated 'source<TAB>target' pairs (Tatoeba / Anki format).", CORPUS,
                               type=str)
    holdout: int | None = _setting(
        None, "Pairs held out for validation and again for test (files / tsv).", CORPUS, type=int,
        shown_default=f"{HOLDOUT}, or a tenth of a corpus of fewer than {10 * HOLDOUT:,} distinct pairs")
    train_size: int = _setting(50_000, "Training pairs of the numbers corpus.", CORPUS)
    tokenizer: str = _setting(
        "sentencepiece", "sentencepiece: translations come back as ordinary text (spacing and punctuation as "
        "written). wordpiece: BERT's split, spaces around punctuation in the output.", CORPUS,
        choices=("sentencepiece", "wordpiece"))
    vocab_size: int = _setting(2000, "Largest shared vocabulary size.", CORPUS)
    min_frequency: int = _setting(
        20, "WordPiece: fewest occurrences of a pair of pieces to merge it into a vocabulary piece.", CORPUS)
    lower_case: bool = _setting(False, "Lower-case text before tokenizing.", CORPUS)
    reverse: bool = _setting(
        False, "Translate the other way: the TSV's second column (or --target-file, or German numbers) is the "
        "source.", CORPUS)
    max_length: int = _setting(64, "Longest sentence in tokens; longer pairs are dropped.", CORPUS)
    preset: str = _setting(
        "tiny", "Model sizes: base and big are the paper's (Table 3); small (3+3 layers, d_model 256) suits real "
        "corpora on a CPU; tiny, the numbers corpus.", MODEL, choices=tuple(sorted(PRESETS)))
    num_layers: int | None = _setting(None, "Override the preset's N.", MODEL, type=int)
    d_model: int | None = _setting(None, "Override the preset's d_model.", MODEL, type=int)
    num_heads: int | None = _setting(None, "Override the preset's h.", MODEL, type=int)
    d_ff: int | None = _setting(None, "Override the preset's d_ff.", MODEL, type=int)
    dropout: float | None = _setting(None, "Override the preset's P_drop.", MODEL, type=float)
    norm_first: bool = _setting(
        False, "Pre-norm: LayerNorm before each sub-layer (x + Sublayer(LayerNorm(x))) and once after each stack, "
        "instead of the paper's post-norm. Steadier for deep stacks and high learning rates (Xiong et al., "
        "2020).", MODEL)
    steps: int = _setting(
        1250, "Total optimizer steps (updates), exactly: a last epoch past them is cut short.", TRAINING)
    accumulate_steps: int = _setting(
        1, "Average the gradients of N batches into each update: N times --batch-tokens per step (the paper's "
        "~25,000 target tokens on small hardware).", TRAINING, metavar="N")
    steps_per_epoch: int = _setting(125, "Steps between evaluations, checkpoints and log rows.", TRAINING)
    batch_tokens: int = _setting(
        4096, "Token budget per batch and side (the paper used about 25000).", TRAINING)
    warmup_steps: int | None = _setting(
        None, "Warm-up steps.", TRAINING, type=int,
        shown_default="4000 (the paper) for base/big, 1000 for small, 400 for tiny")
    learning_rate_scale: float = _setting(1.0, "Factor on the paper's learning-rate formula.", TRAINING)
    label_smoothing: float = _setting(0.1, "eps_ls.", TRAINING)
    average_checkpoints: int = _setting(
        5, "Average K epoch checkpoints into the final model (paper 6.1: the last 5).", TRAINING, metavar="K")
    average_from: str = _setting(
        "last", "Which K to average: the last K epochs (the paper) or the K with the best validation BLEU (needs "
        "--validate-translations).", TRAINING, choices=("last", "best"))
    validate_translations: int = _setting(
        0, "Translate the first N validation pairs every epoch; log val_bleu, val_chrf and val_exact_match, and "
        "keep the best epoch in OUTPUT_DIR/best/.", TRAINING, metavar="N")
    validation_beam_size: int = _setting(
        VALIDATION_BEAM_SIZE, "Beam size of those translations (1: greedy, the fastest).", TRAINING, metavar="K")
    stop_at_exact_match: float | None = _setting(
        None, "Stop once the validation exact match reaches SHARE (0-1), e.g. 0.99. Needs "
        "--validate-translations. Epochs are then ranked by exact match, not BLEU (best/, --early-stopping, "
        "--average-from best).", TRAINING, type=float, metavar="SHARE")
    stop_checks: int = _setting(
        1, "Stop only when --stop-at-exact-match is reached on N epochs in a row: one check of a few hundred "
        "pairs can pass by luck.", TRAINING, metavar="N")
    early_stopping: int | None = _setting(
        None, "Stop after N epochs in a row without a better validation BLEU (needs --validate-translations).",
        TRAINING, type=int, metavar="N")
    mixed_precision: str | None = _setting(
        None, "Compute in this precision, keep weights in float32 (Keras' mixed policy; float16 scales the "
        "loss). Saved with the run: resume, evaluate and export use it.", TRAINING, type=str, choices=MIXED_PRECISION)
    seed: int = _setting(0, "Random seed (data order, initialisation).", TRAINING, own_range=True)

    def validate(self) -> None:
        """Check every setting at once; raise `RunError` naming each flag that is wrong.

        Called before anything is read or written, so a typo never leaves a run
        directory behind.
        """
        problems = self._type_problems()
        if problems:  # the checks below compare values of their types
            raise RunError("; ".join(problems) + ".")

        def need(ok, message):
            if not ok:
                problems.append(message)

        problems.extend(self._corpus_problems())
        need(self.preset in PRESETS, f"--preset must be one of {sorted(PRESETS)}; got {self.preset!r}")
        positive = ("steps", "steps_per_epoch", "batch_tokens", "max_length", "average_checkpoints", "holdout", "accumulate_steps",
                    "validation_beam_size", "early_stopping", "stop_checks", "num_layers", "d_model", "num_heads", "d_ff", "warmup_steps")
        for name in positive:
            value = getattr(self, name)
            need(value is None or value >= 1, f"--{_flag(name)} must be >= 1; got {value}")
        need(self.tokenizer in ("sentencepiece", "wordpiece"),
             f"--tokenizer must be sentencepiece or wordpiece; got {self.tokenizer!r}")
        need(self.vocab_size >= 5, f"--vocab-size must be >= 5 (the 4 reserved tokens [PAD] [UNK] [START] [END] "
                                   f"and at least one more); got {self.vocab_size}")
        need(self.min_frequency >= 0, f"--min-frequency must be >= 0; got {self.min_frequency}")
        need(0 <= self.seed < 2**32, f"--seed must be in [0, 2**32); got {self.seed}")
        need(self.max_length != 1, "--max-length must be >= 2 (a token and [END]); got 1")
        need(self.batch_tokens >= self.max_length,
             f"--batch-tokens ({self.batch_tokens}) must be >= --max-length ({self.max_length})")
        problems.extend(self._real_number_problems())
        need(self.validate_translations >= 0, f"--validate-translations must be >= 0; got {self.validate_translations}")
        need(self.average_from in ("last", "best"), f"--average-from must be last or best; got {self.average_from!r}")
        need(self.mixed_precision in (None, *MIXED_PRECISION),
             f"--mixed-precision must be one of {', '.join(MIXED_PRECISION)}; got {self.mixed_precision!r}")
        for flag, used in (("--early-stopping", self.early_stopping is not None),
                           ("--average-from best", self.average_from == "best")):
            if used:
                need(self.validate_translations > 0, f"{flag} needs --validate-translations N > 0 (it ranks epochs "
                                                     "by their validation BLEU)")
        if self.stop_at_exact_match is not None:
            need(self.validate_translations > 0, "--stop-at-exact-match needs --validate-translations N > 0")
        need(self.stop_checks <= 1 or self.stop_at_exact_match is not None,
             f"--stop-checks {self.stop_checks} needs --stop-at-exact-match")
        need(self.validation_beam_size == VALIDATION_BEAM_SIZE or self.validate_translations > 0,
             f"--validation-beam-size {self.validation_beam_size} needs --validate-translations N > 0")
        if self.preset in PRESETS:
            model = self.model_config()
            if min(model["d_model"], model["num_heads"]) >= 1 and model["d_model"] % model["num_heads"]:
                problems.append(
                    f"--d-model ({model['d_model']}) must be divisible by --num-heads ({model['num_heads']})"
                )
        if problems:
            raise RunError("; ".join(problems) + ".")

    def __post_init__(self):
        # NumPy's numbers (a sweep over `np.arange`) as Python's, which config.json can hold.
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if isinstance(value, numbers.Integral) and not isinstance(value, (bool, int)):
                setattr(self, field.name, int(value))
            elif isinstance(value, numbers.Real) and not isinstance(value, (numbers.Integral, float)):
                setattr(self, field.name, float(value))

    def _type_problems(self) -> list:
        """Each setting of another Python type than its field's (mistakes of the Python API:
        the command line's parser gives every flag its type): an integer setting that is not
        an `int` (a bool, a float, a string) or is past `MAX_INT`, a real one that is not a
        number, a switch that is not a bool, a name that is not a string."""
        problems = []
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), field.type.split(" | ")[0]
            if value is None and field.type.endswith("| None"):
                continue
            wanted, said = _TYPES[kind]
            if isinstance(value, bool) != (kind == "bool") or not isinstance(value, wanted):
                problems.append(f"--{_flag(field.name)} must be {said}; got {value!r}")
            elif kind == "int" and value > MAX_INT and not field.metadata.get("own_range"):
                problems.append(f"--{_flag(field.name)} must be at most {MAX_INT}; got {value}")
        return problems

    def _corpus_problems(self) -> list:
        """The corpus's own checks, the files of another corpus given with it, and the
        settings this run would ignore (`--tsv` with `--source-file` and `--target-file`,
        `--holdout` with the numbers corpus, `--min-frequency` with SentencePiece)."""
        if self.corpus not in CORPORA:
            return [f"--corpus must be one of {', '.join(CORPORA)}; got {self.corpus!r}"]
        empty = [name for name in CORPUS_FILES if getattr(self, name) == ""]
        if empty:  # not "no file" (an unset variable in `--tsv "$CORPUS"`): the parser refuses it too
            return [f"--{_flag(name)} must name a file; got ''" for name in empty]
        problems = list(CORPORA[self.corpus].check(self))
        for kind in CORPORA.values():
            problems += [f"--{_flag(name)} is read by --corpus {kind.name}, and this run reads --corpus "
                         f"{self.corpus}: give the files of one corpus" for name in kind.implied_by
                         if kind.name != self.corpus and getattr(self, name)]
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for name, (readers, this_run) in self.unread_settings().items():
            if getattr(self, name) != defaults[name]:
                problems.append(f"--{_flag(name)} is read by {readers} only, and this run {this_run}")
        return problems

    def unread_settings(self) -> dict:
        """The settings this run ignores, each with what reads them and what this run
        has instead: those only other corpora read (`CorpusKind.reads`), and
        `--min-frequency` beside SentencePiece."""
        unread = {}
        for name in dict.fromkeys(name for kind in CORPORA.values() for name in kind.reads):
            readers = [kind.name for kind in CORPORA.values() if name in kind.reads]
            if self.corpus not in readers:
                unread[name] = (f"--corpus {' and '.join(readers)}", f"reads --corpus {self.corpus}")
        if self.tokenizer != "wordpiece":
            unread["min_frequency"] = ("--tokenizer wordpiece", f"uses --tokenizer {self.tokenizer}")
        return unread

    def _real_number_problems(self) -> list:
        """Each NaN or infinite setting, once ("nan" and "inf" parse as floats), then the
        settings outside their range (`REAL_RANGES`)."""
        infinite = sorted(f.name for f in dataclasses.fields(self)
                          if isinstance(getattr(self, f.name), float) and not math.isfinite(getattr(self, f.name)))
        problems = [f"--{_flag(name)} must be a finite number; got {getattr(self, name)}" for name in infinite]
        for name, (text, ok) in REAL_RANGES.items():
            value = getattr(self, name)
            if value is not None and name not in infinite and not ok(value):
                problems.append(f"--{_flag(name)} must be {text}; got {value}")
        return problems

    def run_name(self) -> str:
        """The name of the run's default `--output-dir` (under `runs/`): the corpus, then
        `reverse` for the other direction, then the preset. `numbers-tiny`; `pairs-small`
        for `--tsv pairs.tsv.gz --preset small`; `train.en-de-reverse-base` for
        `--source-file train.en --target-file train.de --reverse --preset base`.
        Characters other than letters, digits, `.`, `-` and `_` become `_`; a file whose name
        leaves no letter or digit (`.gz`) gives the corpus's name (`tsv`)."""
        kind = CORPORA[self.corpus]
        corpus = re.sub(r"[^\w.-]", "_", kind.name_of(self) if kind.name_of else "").lstrip(".")
        if not any(c.isalnum() for c in corpus):
            corpus = kind.name
        return "-".join([corpus, *(["reverse"] if self.reverse else []), self.preset])

    def model_config(self) -> dict:
        """The `Transformer`'s arguments: the preset's sizes, then every other setting of
        the model group that is set (not `None`), under its field name."""
        config = dict(PRESETS[self.preset])
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if field.metadata["group"] == MODEL and field.name != "preset" and value is not None:
                config[field.name] = value
        return config

    def best_metric(self) -> str:
        """The validation score that ranks epochs for `best/`, `--early-stopping` and
        `--average-from best`: exact match when the run stops at an exact-match target
        (its goal, and the one score that means something for one-word references), else
        BLEU."""
        return "exact_match" if self.stop_at_exact_match is not None else "bleu"

    def epochs(self) -> int:
        """The run's epochs: `--steps` in `--steps-per-epoch` updates, the last one cut
        short when they do not divide (`checkpoints.StepBudget`)."""
        return math.ceil(self.steps / self.steps_per_epoch)

    def steps_after(self, epochs: int) -> int:
        """The updates done once `epochs` epochs have ended: a run shorter than an epoch,
        and a last epoch cut short, count their own steps."""
        return min(epochs * min(self.steps_per_epoch, self.steps), self.steps)

    def batches_per_epoch(self) -> int:
        """The batches `fit` reads in an epoch: each update is `--accumulate-steps` of them.
        A run shorter than `--steps-per-epoch` is one epoch of its steps (so that the
        progress bar counts to `--steps`)."""
        return min(self.steps_per_epoch, self.steps) * self.accumulate_steps

    def effective_warmup(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return {"tiny": 400, "small": 1000}.get(self.preset, 4000)


def _flag(name: str) -> str:
    return name.replace("_", "-")
