"""The commands of `keras-transformer`, one module each: `add_parser(sub)` adds its flags,
`check(args)` refuses mistakes before any backend loads (`RunError`) and returns what it
derives from the flags (a dict, or `None`), `run(args)` does the work with the flags and
those values in one namespace; no function writes to the parsed flags. Every module imports
only the settings modules at import time."""

from keras_transformer.tools.commands import demo, evaluate, export, launch, train, translate

# In the order `--help` lists them.
COMMANDS = (train, launch, evaluate, translate, export, demo)

__all__ = ["COMMANDS", "demo", "evaluate", "export", "launch", "train", "translate"]
