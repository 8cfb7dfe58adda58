"""Backend workarounds: the only backend-aware code of the library.

Each function says what it works around and why; layers and models call these instead
of testing `keras.backend.backend()` themselves.
"""

from __future__ import annotations

import collections
import contextvars

import keras


def symbolic_ids_under_tf_distribute(ids):
    """Undo one Keras behaviour on TensorFlow: under a `tf.distribute` strategy, `fit`
    first builds the model from a symbolic batch made by averaging the replicas' first
    batches, which turns integer ids into floats (Keras' `tf.distribute` trainer
    reduces the first batch with a MEAN before `build`; seen with Keras 3.8-3.13).

    Only shapes matter there, so in that one place (a graph traced in the strategy's
    cross-replica context) float ids become int32. Float ids anywhere else still reach
    `check_token_ids` and are refused.
    """
    if keras.backend.backend() != "tensorflow" or "float" not in keras.backend.standardize_dtype(ids.dtype):
        return ids
    import tensorflow as tf

    if tf.distribute.has_strategy() and tf.distribute.in_cross_replica_context() and not tf.executing_eagerly():
        return tf.cast(ids, "int32")
    return ids


def compile_function(fn, variables):
    """`fn(*tensors)` compiled for the running backend, reading `variables` at call time.

    * JAX: `jax.jit` of a stateless version of `fn`: the variables' current values are
      arguments, not constants baked into the program, so weights changed after
      compilation (more training, loading a checkpoint) are used.
    * TensorFlow: `tf.function(jit_compile=True)`; variables are read at run time.
    * PyTorch: `fn` itself, eager, except what it runs through `recorded` and
      `while_loop`, which is recorded once per signature and replayed (`_Recorder`;
      the records stay with the returned function).
    """
    backend = keras.backend.backend()
    if backend == "jax":
        import jax

        variables = list(variables)

        def stateless(values, *args):
            with keras.StatelessScope(state_mapping=list(zip(variables, values))):
                return fn(*args)

        jitted = jax.jit(stateless)
        return lambda *args: jitted([v.value for v in variables], *args)
    if backend == "tensorflow":
        import tensorflow as tf

        return tf.function(fn, jit_compile=True, reduce_retracing=True)
    recorder = _Recorder(variables)

    def recorded(*args):
        with recorder:
            return fn(*args)

    return recorded


class _Recorder:
    """Records functions once per input signature and replays them (PyTorch).

    `torch.fx`'s `make_fx` runs a function once and records the ATen operations it
    performs; `torch.jit.trace` turns the record into a TorchScript graph, which runs
    without Python between operations (the FX record itself is replayed where
    TorchScript is not available). Replaying skips the Python of Keras' layers and ops
    around each operation: most of a small decoding step's time on this backend.

    A recorder is active while a function made by `compile_function` runs; `recorded`
    and `while_loop` use the active one. The variables' values, read once per call, are
    inputs of every record, so weights changed after recording (more training, a loaded
    checkpoint) are used. Tensor arguments are inputs too; other arguments (ints,
    floats, `None`) are part of the signature. Anything else a function reads is
    recorded as a constant, and a function that branches on a tensor's value cannot be
    recorded (`make_fx` raises).

    A loop (`while_loop`) is one record of its body followed by its condition, run on
    the flat list of loop tensors until the condition is false, and the KV cache is
    written in place inside it (`update_along`): per decoding step, one graph call and
    one read of a boolean.
    """

    use_torchscript = True

    def __init__(self, variables):
        self.variables = list(variables)
        self.records = FunctionCache()
        self.values = None

    def __enter__(self):
        self.values = [v.value for v in self.variables]
        self._token = _recorder.set(self)
        return self

    def __exit__(self, *exc_info):
        _recorder.reset(self._token)
        self.values = None

    def replayable(self, fn):
        """`fn`, recorded on its first call per signature and replayed after."""
        import torch
        from torch.utils import _pytree as pytree

        def replay(*args):
            found = self._find(fn, args)
            if found is None:  # an argument that cannot be a signature: run as it is
                return fn(*args)
            graph, out_spec, tensors = found
            with torch.no_grad():
                return pytree.tree_unflatten(list(graph(*self.values, *tensors)), out_spec)

        return replay

    def loop(self, cond, body, loop_vars):
        """`keras.ops.while_loop(cond, body, loop_vars)` with one record of "`body`, then
        `cond` of its result" replayed on flat tensors: no Python between iterations but
        the loop itself (no eager `cond`, no nest flattening per step)."""
        import torch
        from torch.utils import _pytree as pytree

        loop_vars = tuple(keras.tree.map_structure(keras.ops.convert_to_tensor, tuple(loop_vars)))
        if not bool(cond(*loop_vars)):
            return loop_vars

        def step(*loop_vars):
            new = tuple(body(*loop_vars))
            return new, cond(*new)

        # Records are found by name and signature: the loop's name is its body's and condition's.
        step.__qualname__ = f"loop({body.__qualname__}, {cond.__qualname__})"
        graph, out_spec, tensors = self._find(step, loop_vars)  # every loop variable is a tensor here
        # The loop's own dense copies: the body may write into them in place
        # (`update_along`), which must not reach the caller's tensors, nor a broadcast view.
        tensors = [x.clone(memory_format=torch.contiguous_format) for x in tensors]
        kinds = [(x.shape, x.dtype) for x in tensors]
        with torch.no_grad():
            *tensors, keep_going = graph(*self.values, *tensors)
            if [(x.shape, x.dtype) for x in tensors] != kinds:  # a body that reshapes: step by step
                new_vars, _ = pytree.tree_unflatten([*tensors, keep_going], out_spec)
                return keras.ops.while_loop(cond, self.replayable(body), new_vars) if bool(keep_going) else new_vars
            while bool(keep_going):
                *tensors, keep_going = graph(*self.values, *tensors)
        new_vars, _ = pytree.tree_unflatten([*tensors, keep_going], out_spec)
        return new_vars

    def _find(self, fn, args):
        """`(graph, out_spec, tensor_args)` of `fn` for these arguments, recorded on the
        first call per signature; `None` if an argument cannot be part of a signature."""
        import torch
        from torch.utils import _pytree as pytree

        leaves, spec = pytree.tree_flatten(args)
        tensors = [x for x in leaves if isinstance(x, torch.Tensor)]
        signature = tuple(
            (tuple(x.shape), x.dtype, x.device) if isinstance(x, torch.Tensor) else ("static", x) for x in leaves
        )
        key = (fn.__qualname__, str(spec), signature)
        try:
            hash(key)
        except TypeError:
            return None
        graph, out_spec = self.records.get(key, lambda: self._record(fn, leaves, spec))
        return graph, out_spec, tensors

    def _record(self, fn, leaves, spec):
        import torch
        from torch.utils import _pytree as pytree

        n_values = len(self.values)
        tensor_at = [i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)]
        out_specs = []

        def flat(*inputs):
            args = list(leaves)
            for i, x in zip(tensor_at, inputs[n_values:]):
                args[i] = x
            with keras.StatelessScope(state_mapping=list(zip(self.variables, inputs[:n_values]))):
                out = fn(*pytree.tree_unflatten(args, spec))
            out_leaves, out_spec = pytree.tree_flatten(out)
            out_specs.append(out_spec)
            return tuple(out_leaves)

        # Copies: `make_fx` follows tensors by identity, so one tensor passed as two
        # arguments would become one input of the record (and the recording run may
        # write into its inputs).
        inputs = (*self.values, *(leaves[i].clone() for i in tensor_at))
        with torch.no_grad():
            graph = _make_graph(flat, inputs, self.use_torchscript)
        return graph, out_specs[0]


def _make_graph(flat, inputs, use_torchscript=True):
    """Record `flat(*inputs) -> tuple of tensors` with `make_fx`, as a TorchScript graph
    where TorchScript is available (the FX graph otherwise)."""
    import warnings

    import torch
    from torch.fx.experimental.proxy_tensor import make_fx

    graph = make_fx(flat)(*inputs)
    if use_torchscript and hasattr(torch.jit, "trace"):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # TorchScript's deprecation notice
            with torch.no_grad():
                graph = torch.jit.trace(graph, tuple(x.detach() for x in inputs), check_trace=False)
    return graph


class TrainStep:
    """The training step of `compile(jit_compile=True)` on PyTorch, recorded and replayed.

    Keras compiles its PyTorch step with `torch.compile`, whose TorchDynamo breaks the
    graph at every Keras layer call and fails when recompiling the pieces for new
    sequence lengths (Keras 3.15, torch 2.13). Instead, the forward pass, the loss and
    the gradients (`torch.autograd.grad`) are recorded with `make_fx` once per batch
    signature (shapes and dtypes of the inputs, as bucketing makes them) and replayed as
    one FX graph (TorchScript cannot trace the recorded backward pass), with the
    variables' values of the moment as inputs (see `_Recorder`). The optimizer's update, the loss tracker and the metrics run as in
    Keras' own step. Dropout draws new masks at every replay (PyTorch's global
    generator, as Keras' unseeded dropout does).

    The model's call must not branch on tensor values nor update non-trainable
    variables; such a model is refused when its step is recorded.
    """

    def __init__(self, model, max_signatures: int = 64):
        self.model = model
        self.records = FunctionCache(max_entries=max_signatures)

    def __call__(self, data):
        import torch
        from torch.utils import _pytree as pytree

        model = self.model
        x, y, sample_weight = keras.utils.unpack_x_y_sample_weight(data)
        trainable = list(model.trainable_variables)
        others = list(model.non_trainable_variables) + list(model.optimizer.variables)
        leaves, spec = pytree.tree_flatten((x, y, sample_weight))
        leaves = [keras.ops.convert_to_tensor(v) if hasattr(v, "shape") else v for v in leaves]
        tensors = [v for v in leaves if isinstance(v, torch.Tensor)]
        key = (
            id(model.optimizer), len(trainable), len(others), str(spec),
            tuple((tuple(v.shape), v.dtype) if isinstance(v, torch.Tensor) else v for v in leaves),
        )
        graph, out_spec = self.records.get(key, lambda: self._record(leaves, spec, trainable, others))
        with torch.no_grad():
            out = graph(*(v.value for v in trainable), *(v.value for v in others), *tensors)
        loss, y_pred, grads = pytree.tree_unflatten(list(out), out_spec)
        batch_size = next(v for v in leaves if isinstance(v, torch.Tensor)).shape[0]
        model._loss_tracker.update_state(loss, sample_weight=batch_size)  # as Keras' step does
        with torch.no_grad():
            model.optimizer.apply(list(grads), trainable)
        return model.compute_metrics(x, y, y_pred, sample_weight=sample_weight)

    def _record(self, leaves, spec, trainable, others):
        import torch
        from torch.utils import _pytree as pytree

        model = self.model
        n_trainable, n_others = len(trainable), len(others)
        tensor_at = [i for i, v in enumerate(leaves) if isinstance(v, torch.Tensor)]
        out_specs, updated = [], []

        def flat(*inputs):
            train_values = inputs[:n_trainable]
            other_values = inputs[n_trainable : n_trainable + n_others]
            args = list(leaves)
            for i, v in zip(tensor_at, inputs[n_trainable + n_others :]):
                args[i] = v
            x, y, sample_weight = pytree.tree_unflatten(args, spec)
            mapping = [*zip(trainable, train_values), *zip(others, other_values)]
            with keras.StatelessScope(state_mapping=mapping) as scope:
                y_pred = model(x, training=True)
                loss = model.compute_loss(x=x, y=y, y_pred=y_pred, sample_weight=sample_weight, training=True)
                scaled = model.optimizer.scale_loss(loss)
            updated.extend(v.path for v, value in zip(others, other_values) if scope.get_current_value(v) is not value)
            grads = torch.autograd.grad(scaled, train_values)
            out_leaves, out_spec = pytree.tree_flatten((loss, y_pred, list(grads)))
            out_specs.append(out_spec)
            return tuple(out_leaves)

        inputs = (
            *(v.value.detach().clone().requires_grad_() for v in trainable),
            *(v.value.detach().clone() for v in others),
            *(leaves[i].clone() for i in tensor_at),
        )
        graph = _make_graph(flat, inputs, use_torchscript=False)
        if updated:
            raise ValueError(
                f"Model '{model.name}': `jit_compile=True` on PyTorch records the training step, and "
                f"this model's call updates non-trainable variables ({', '.join(updated[:3])}), which a "
                "record cannot replay. Compile it with `jit_compile=False`."
            )
        return graph, out_specs[0]


_recorder = contextvars.ContextVar("keras_transformer_recorder", default=None)


def recorded(fn):
    """`fn`, recorded and replayed by the active recorder (PyTorch, inside a function
    made by `compile_function`; see `_Recorder`), else `fn` itself."""
    recorder = _recorder.get()
    return fn if recorder is None else recorder.replayable(fn)


def while_loop(cond, body, loop_vars):
    """`keras.ops.while_loop`; on PyTorch, inside a function made by `compile_function`,
    the body and the condition are recorded once per signature as one graph and replayed
    (`_Recorder.loop`).

    The body must keep the loop variables' shapes, must not branch on tensor values, nor
    read tensors other than the loop variables and the model's variables (see
    `_Recorder`).
    """
    recorder = _recorder.get()
    if recorder is None:
        return keras.ops.while_loop(cond, body, loop_vars)
    return recorder.loop(cond, body, loop_vars)


def slice_along(x, start, length: int, axis: int):
    """`x[..., start:start + length, ...]` on `axis`, with `start` an int or a scalar tensor.

    `keras.ops.slice` on PyTorch turns a tensor start into a Python int (a device sync,
    and a value no graph capture can keep); there it is an `index_select`.
    """
    if keras.backend.backend() == "torch":
        import torch

        start = keras.ops.convert_to_tensor(start, "int64")
        return torch.index_select(x, axis, start + torch.arange(length, device=x.device))
    starts = [0] * len(x.shape)
    starts[axis] = start
    sizes = list(keras.ops.shape(x))
    sizes[axis] = length
    return keras.ops.slice(x, starts, sizes)


def update_along(x, start, update, axis: int):
    """`x` with `update` written at `start` on `axis` (a new tensor), `start` an int or a
    scalar tensor: `keras.ops.slice_update`, and on PyTorch an `index_copy` (see
    `slice_along`)."""
    if keras.backend.backend() == "torch":
        import torch

        start = keras.ops.convert_to_tensor(start, "int64")
        positions = start + torch.arange(update.shape[axis], device=x.device)
        if _recorder.get() is not None:
            # Inside a recorded search the tensor is the search's own (a cache made by
            # the same function): write in place instead of copying it at every step.
            return x.index_copy_(axis, positions, update)
        return torch.index_copy(x, axis, positions, update)
    starts = [0] * len(x.shape)
    starts[axis] = start
    return keras.ops.slice_update(x, starts, update)


class FunctionCache:
    """A bounded least-recently-used store of compiled functions, owned by one model.

    Keys are the static arguments a function was compiled for (search kind, sizes);
    the oldest entry is dropped past `max_entries`, and all go with the model. A plain
    class rather than a `dict`, so that Keras' attribute tracking leaves it alone.
    """

    def __init__(self, max_entries: int = 8):
        self.max_entries = max_entries
        self._functions: collections.OrderedDict = collections.OrderedDict()

    def get(self, key, make):
        """The function stored under `key`, made by `make()` the first time."""
        if key in self._functions:
            self._functions.move_to_end(key)
        else:
            self._functions[key] = make()
            while len(self._functions) > self.max_entries:
                self._functions.popitem(last=False)
        return self._functions[key]

    def __len__(self) -> int:
        return len(self._functions)

    def clear(self) -> None:
        self._functions.clear()


@keras.saving.register_keras_serializable(package="keras_transformer")
class Adam(keras.optimizers.Adam):
    """`keras.optimizers.Adam`, with the PyTorch update done by one fused kernel.

    Keras' Adam on the torch backend updates the variables with a chain of `torch._foreach_*`
    calls, each of which writes a temporary per variable (`g * g`, `m * alpha`,
    `sqrt(v)`, `+ epsilon`, the quotient): about a third of a training step at the base
    size, against a tenth for `torch.optim.Adam` (profiled with py-spy; reported with the
    benchmarks). Here the torch backend calls `torch._fused_adam_`, the kernel behind
    `torch.optim.Adam(fused=True)`, which reads and writes each tensor once.

    The arithmetic is Keras': `m <- b1 m + (1 - b1) g`, `v <- b2 v + (1 - b2) g^2`,
    `w <- w - lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + epsilon)`. The fused kernel
    adds its epsilon to the bias-corrected `sqrt(v / (1 - b2^t))`, so it is given
    `epsilon / sqrt(1 - b2^t)`, which makes the two updates equal. Other backends, and
    `amsgrad=True`, use Keras' own update.

    With `gradient_accumulation_steps`, the learning-rate schedule is evaluated at the
    number of updates, as `iterations` counts them (Keras evaluates it at the number of
    batches).
    """

    def _get_current_learning_rate(self):
        # With `gradient_accumulation_steps`, Keras (3.15) evaluates a schedule at the
        # count of batches (`_iterations`), not of updates (`iterations`), so the warm-up
        # would end N times too soon. The paper's schedule counts updates.
        schedule = self._learning_rate
        if self.gradient_accumulation_steps and isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            return schedule(self.iterations)
        return super()._get_current_learning_rate()

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if keras.backend.backend() != "torch" or self.amsgrad:
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        import torch

        with torch.no_grad():
            step = float(keras.ops.convert_to_numpy(self.iterations)) + 1.0
            bias_correction_2 = 1.0 - float(self.beta_2) ** step
            index = [self._get_variable_index(v) for v in trainable_variables]
            torch._fused_adam_(
                [v.value for v in trainable_variables],
                [keras.ops.convert_to_tensor(g).contiguous() for g in grads],  # the kernel reads flat memory
                [self._momentums[i].value for i in index],
                [self._velocities[i].value for i in index],
                [],
                [torch.tensor(step)] * len(index),
                lr=float(keras.ops.convert_to_numpy(learning_rate)),
                beta1=float(self.beta_1),
                beta2=float(self.beta_2),
                weight_decay=0.0,  # Keras applies its weight decay before this update
                eps=float(self.epsilon) / bias_correction_2**0.5,
                amsgrad=False,
                maximize=False,
            )
