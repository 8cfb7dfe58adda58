"""Adam as Keras computes it, with PyTorch's fused update on the PyTorch backend.

On TensorFlow and JAX, `Adam` is `keras.optimizers.Adam` (plus the schedule fix below).
On PyTorch, Keras' Adam updates the variables with a chain of multi-tensor operations
that each write a temporary per variable (`g * g`, `m * alpha`, `sqrt(v)`, `+ epsilon`,
the quotient): about a third of a training step at the base size, against a tenth for
`torch.optim.Adam` (profiled with py-spy). There the update is `torch.optim.adam.adam`,
the public functional form of `torch.optim.Adam`, with `fused=True` where PyTorch has a
fused kernel for the parameters' device (CPU and CUDA), else `foreach=True`; its step
counts are tensors on the parameters' device, as the fused kernel requires.
"""

from __future__ import annotations

import keras

__all__ = ["Adam"]


@keras.saving.register_keras_serializable(package="keras_transformer")
class Adam(keras.optimizers.Adam):
    """`keras.optimizers.Adam`; on PyTorch its update runs in `torch.optim.adam.adam`.

    The arithmetic is Keras': `m <- b1 m + (1 - b1) g`, `v <- b2 v + (1 - b2) g^2`,
    `w <- w - lr sqrt(1 - b2^t) / (1 - b1^t) * m / (sqrt(v) + epsilon)`. PyTorch's Adam
    adds its epsilon to the bias-corrected `sqrt(v / (1 - b2^t))`, so it is given
    `epsilon / sqrt(1 - b2^t)`, which makes the two updates equal. `amsgrad=True` uses
    Keras' own update on every backend.

    With `gradient_accumulation_steps`, the learning-rate schedule is evaluated at the
    number of updates, as `iterations` counts them (Keras 3.15 evaluates it at the number
    of batches, so the warm-up would end N times too soon; the paper's schedule counts
    updates).

    Keras members used (no public equivalent; each is checked by
    `tests/test_optimizer.py`, which fails when Keras renames or stops calling it):
    `_backend_update_step` (the one call that receives every gradient of a step: the
    hook for a multi-tensor update), `_momentums` / `_velocities` / `_get_variable_index`
    (Adam's slots), `_learning_rate` / `_get_current_learning_rate` (the schedule fix).
    Keras documents `update_step(gradient, variable, learning_rate)`, one variable at
    a time, which cannot call a fused kernel once per step.
    """

    def _get_current_learning_rate(self):
        schedule = self._learning_rate
        if self.gradient_accumulation_steps and isinstance(schedule, keras.optimizers.schedules.LearningRateSchedule):
            return schedule(self.iterations)
        return super()._get_current_learning_rate()

    def _backend_update_step(self, grads, trainable_variables, learning_rate):
        if keras.backend.backend() != "torch" or self.amsgrad:
            return super()._backend_update_step(grads, trainable_variables, learning_rate)
        import torch
        import torch.optim.adam as torch_adam

        params = [v.value for v in trainable_variables]
        device = params[0].device
        updates_done = float(keras.ops.convert_to_tensor(self.iterations))
        step = updates_done + 1.0  # t of this update
        index = [self._get_variable_index(v) for v in trainable_variables]
        fused = device.type in ("cpu", "cuda") and all(p.dtype in (torch.float32, torch.float16, torch.bfloat16)
                                                      for p in params)
        with torch.no_grad():
            torch_adam.adam(
                params,
                [keras.ops.convert_to_tensor(g).contiguous() for g in grads],
                [self._momentums[i].value for i in index],
                [self._velocities[i].value for i in index],
                [],
                # PyTorch adds 1 to each step count before the update, as its Adam does.
                [torch.tensor(updates_done, dtype=torch.float32, device=device) for _ in index],
                foreach=None if fused else True,
                fused=fused or None,
                amsgrad=False,
                beta1=float(self.beta_1),
                beta2=float(self.beta_2),
                lr=float(learning_rate),
                weight_decay=0.0,  # Keras applies its weight decay before this update
                eps=float(self.epsilon) / (1.0 - float(self.beta_2) ** step) ** 0.5,
                maximize=False,
            )
