"""A training run's settings and their validation. Imports no backend: the command line
reads the defaults for `--help` and checks every flag before anything is loaded."""

from __future__ import annotations

import dataclasses

from keras_transformer.defaults import PRESETS, VALIDATION_BEAM_SIZE

MIXED_PRECISION = ("bfloat16", "float16")


class RunError(Exception):
    """A problem found before training starts; the CLI prints it and exits with status 2."""


def busy_error(output_dir) -> RunError:
    """The refusal of a second `train` on a directory whose `train.lock` is held."""
    return RunError(f"another `train` is running on {output_dir}; wait for it to finish or stop it.")


@dataclasses.dataclass
class TrainConfig:
    """Everything that defines a run. Two runs with equal configs are the same run."""

    corpus: str = "numbers"  # "numbers", "files" or "tsv"
    source_file: str | None = None
    target_file: str | None = None
    tsv: str | None = None
    holdout: int = 500  # pairs held out for validation and for test (files / tsv)
    train_size: int = 50_000  # numbers corpus
    preset: str = "tiny"
    num_layers: int | None = None
    d_model: int | None = None
    num_heads: int | None = None
    d_ff: int | None = None
    dropout: float | None = None
    tokenizer: str = "sentencepiece"  # or "wordpiece"
    vocab_size: int = 2000
    min_frequency: int = 20  # fewest occurrences of a pair to become a vocabulary piece
    lower_case: bool = False
    max_length: int = 64
    reverse: bool = False  # translate the corpus's second side into its first
    batch_tokens: int = 4096
    steps: int = 1250  # optimizer updates
    accumulate_steps: int = 1  # batches whose gradients are averaged into one update
    steps_per_epoch: int = 125  # also the checkpoint interval
    warmup_steps: int | None = None  # None: 4000 (the paper) for base/big, 1000 for small, 400 for tiny
    learning_rate_scale: float = 1.0
    label_smoothing: float = 0.1
    average_checkpoints: int = 5
    average_from: str = "last"  # "last" k epochs (the paper) or the "best" k by validation BLEU
    validate_translations: int = 0  # validation pairs translated (greedy) and scored every epoch
    validation_beam_size: int = VALIDATION_BEAM_SIZE
    stop_at_exact_match: float | None = None  # stop once their exact-match share reaches this
    stop_checks: int = 1  # ... on this many epochs in a row
    early_stopping: int | None = None  # stop after this many epochs without a better validation BLEU
    mixed_precision: str | None = None  # "bfloat16" or "float16": Keras' mixed dtype policy
    seed: int = 0

    def validate(self) -> None:
        """Check every setting at once; raise `RunError` naming each flag that is wrong.

        Called before anything is read or written, so a typo never leaves a run
        directory behind.
        """
        problems = []

        def need(ok, message):
            if not ok:
                problems.append(message)

        need(self.corpus in ("numbers", "files", "tsv"), f"--corpus must be numbers, files or tsv; got {self.corpus!r}")
        if self.corpus == "files":
            need(bool(self.source_file and self.target_file), "--source-file and --target-file must be given together")
        if self.corpus == "tsv":
            need(bool(self.tsv), "--corpus tsv needs --tsv FILE")
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
        if self.corpus == "numbers":
            need(100 <= self.train_size <= 998_000, f"--train-size must be in [100, 998000] (the numbers corpus "
                                                     f"holds 10^6 numbers, 2000 of them held out); got {self.train_size}")
        need(self.max_length != 1, "--max-length must be >= 2 (a token and [END]); got 1")
        need(self.batch_tokens >= self.max_length,
             f"--batch-tokens ({self.batch_tokens}) must be >= --max-length ({self.max_length})")
        need(self.learning_rate_scale > 0, f"--learning-rate-scale must be > 0; got {self.learning_rate_scale}")
        need(0 <= self.label_smoothing < 1, f"--label-smoothing must be in [0, 1); got {self.label_smoothing}")
        need(self.dropout is None or 0 <= self.dropout < 1, f"--dropout must be in [0, 1); got {self.dropout}")
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
            need(0 < self.stop_at_exact_match <= 1,
                 f"--stop-at-exact-match must be in (0, 1]; got {self.stop_at_exact_match}")
            need(self.validate_translations > 0, "--stop-at-exact-match needs --validate-translations N > 0")
        need(self.stop_checks <= 1 or self.stop_at_exact_match is not None,
             f"--stop-checks {self.stop_checks} needs --stop-at-exact-match")
        if self.preset in PRESETS:
            model = self.model_config()
            if min(model["d_model"], model["num_heads"]) >= 1 and model["d_model"] % model["num_heads"]:
                problems.append(
                    f"--d-model ({model['d_model']}) must be divisible by --num-heads ({model['num_heads']})"
                )
        if problems:
            raise RunError("; ".join(problems) + ".")

    def model_config(self) -> dict:
        config = dict(PRESETS[self.preset])
        for key in ("num_layers", "d_model", "num_heads", "d_ff", "dropout"):
            if getattr(self, key) is not None:
                config[key] = getattr(self, key)
        return config

    def best_metric(self) -> str:
        """The validation score that ranks epochs for `best/`, `--early-stopping` and
        `--average-from best`: exact match when the run stops at an exact-match target
        (its goal, and the one score that means something for one-word references), else
        BLEU."""
        return "exact_match" if self.stop_at_exact_match is not None else "bleu"

    def effective_warmup(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return {"tiny": 400, "small": 1000}.get(self.preset, 4000)


def _flag(name: str) -> str:
    return name.replace("_", "-")
