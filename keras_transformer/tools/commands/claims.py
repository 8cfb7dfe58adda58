"""`keras-transformer table1` and `design-notes`: forwarded, flags and all, to the
measurement scripts of `keras_transformer.claims`."""

from __future__ import annotations

import importlib

# The measurement scripts own their flags: `parse` hands them everything after the command.
COMMANDS = {"table1": "table1", "design-notes": "notes"}
HELP = {
    "table1": "Measure the paper's Table 1 (cost, sequential operations, path length of self-attention, "
              "restricted attention, recurrence, convolution).",
    "design-notes": "Measure the paper's design notes (1/sqrt(d_k) scaling, dot-product vs additive attention, "
                    "sinusoidal vs learned positions).",
}


def add_parser(sub) -> None:
    for command, help_text in HELP.items():
        sub.add_parser(command, help=help_text + " (--help for its flags)", add_help=False)


def run(command: str, argv) -> int:
    return importlib.import_module(f"keras_transformer.claims.{COMMANDS[command]}").main(argv)
