"""A training run's settings and their validation. Imports no backend: the command line
reads the defaults for `--help` and checks every flag before anything is loaded."""

from __future__ import annotations

import dataclasses

from keras_transformer.defaults import PRESETS


class RunError(Exception):
    """A problem found before training starts; the CLI prints it and exits with status 2."""


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
    vocab_size: int = 2000
    min_frequency: int = 20  # fewest occurrences of a pair to become a vocabulary piece
    lower_case: bool = False
    max_length: int = 64
    batch_tokens: int = 4096
    steps: int = 1250
    steps_per_epoch: int = 125  # also the checkpoint interval
    warmup_steps: int | None = None  # None: 4000 (the paper) for base/big, 400 for tiny
    learning_rate_scale: float = 1.0
    label_smoothing: float = 0.1
    average_checkpoints: int = 5
    seed: int = 0

    def validate(self) -> None:
        if self.corpus not in ("numbers", "files", "tsv"):
            raise RunError(f"Unknown corpus {self.corpus!r}; expected numbers, files or tsv.")
        if self.corpus == "files" and not (self.source_file and self.target_file):
            raise RunError("--source-file and --target-file must be given together.")
        if self.preset not in PRESETS:
            raise RunError(f"Unknown preset {self.preset!r}; expected one of {sorted(PRESETS)}.")
        if self.vocab_size < 5:
            raise RunError(
                f"--vocab-size {self.vocab_size} is too small: the 4 reserved tokens "
                "[PAD] [UNK] [START] [END] need ids 0..3, and at least one more token is needed."
            )
        for name in ("steps", "steps_per_epoch", "batch_tokens", "max_length", "average_checkpoints"):
            if getattr(self, name) < 1:
                raise RunError(f"--{name.replace('_', '-')} must be >= 1; got {getattr(self, name)}.")
        if self.batch_tokens < self.max_length:
            raise RunError(f"--batch-tokens ({self.batch_tokens}) must be >= --max-length ({self.max_length}).")

    def model_config(self) -> dict:
        config = dict(PRESETS[self.preset])
        for key in ("num_layers", "d_model", "num_heads", "d_ff", "dropout"):
            if getattr(self, key) is not None:
                config[key] = getattr(self, key)
        return config

    def effective_warmup(self) -> int:
        if self.warmup_steps is not None:
            return self.warmup_steps
        return 400 if self.preset == "tiny" else 4000
