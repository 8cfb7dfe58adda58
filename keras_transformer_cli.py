"""The `keras-transformer` command: the command line is read before the library loads.

`import keras_transformer` imports Keras and a backend, which takes seconds; `--help`
and a mistyped flag should not wait for that. So the package object is created without
running its `__init__` while the parser loads (the parser needs only
`keras_transformer.defaults`, `keras_transformer.tools.config` and the command modules,
which import no backend), and its `__init__` runs once the arguments are known to be good
(never for `launch`, which starts processes that load it).
"""

from __future__ import annotations

import importlib.util
import sys


def main(argv=None) -> int:
    if "keras_transformer" in sys.modules:  # already imported: nothing to defer
        from keras_transformer.tools import cli

        return cli.main(argv)
    spec = importlib.util.find_spec("keras_transformer")
    package = importlib.util.module_from_spec(spec)
    sys.modules["keras_transformer"] = package
    from keras_transformer.tools import cli

    cli.open_closed_standard_streams()
    args = cli.parse(argv)  # --help and usage mistakes exit here
    settings, status = cli.checked(args)  # so do mistakes in the settings, before the backend loads
    if status is not None:
        return status
    if not getattr(args, "loads_library", True):  # `launch`: its processes load it
        return cli.run(args, settings)
    try:
        with cli.quiet_backend_start(enabled=not args.verbose):
            spec.loader.exec_module(package)  # the library: Keras and the backend
    except KeyboardInterrupt:  # Ctrl-C while the backend loads: as during the command
        return cli.interrupted(args)
    return cli.run(args, settings)


if __name__ == "__main__":
    sys.exit(main())
