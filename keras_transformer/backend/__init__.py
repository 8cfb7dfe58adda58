"""Per-backend adapters of the library, one module per job.

* `compile`: a search compiled for the running backend (`jax.jit`, XLA-compiled
  `tf.function`, or the PyTorch search of `torch_decoding`) and the bounded store of
  compiled searches a model keeps.
* `torch_decoding`: PyTorch decoding on `torch.export`: the encoder call and one loop
  iteration of a search, exported once per shape and replayed with the weights of the
  moment as arguments.
* `torch_graph`: the passes that clean the exported graphs before they are replayed
  (public `torch.fx` operations).
* `export_output`: what `torch.export` prints while it exports, held back per thread and
  written afterwards, less the dumps of a failed export (the search warns once instead).

Small workarounds of an engine's bug live in `keras_transformer._compat`, each with the
upstream issue it works around. Layers and models never test the backend themselves.
"""
