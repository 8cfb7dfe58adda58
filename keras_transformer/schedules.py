"""The paper's optimizer: Adam with a linear warm-up and inverse square-root decay."""

from __future__ import annotations

import keras
from keras import ops

from keras_transformer import _checks
from keras_transformer.optimizers import Adam

__all__ = ["TransformerSchedule", "transformer_optimizer"]


@keras.saving.register_keras_serializable(package="keras_transformer")
class TransformerSchedule(keras.optimizers.schedules.LearningRateSchedule):
    """`lrate = scale * d_model^-0.5 * min(step^-0.5, step * warmup_steps^-1.5)` (eq. 3).

    Paper, section 5.3: the rate grows linearly for the first `warmup_steps` steps and
    then decays with the inverse square root of the step number; it peaks at
    `step = warmup_steps`. Steps are counted from 1 (Keras' optimizer step 0 is the
    paper's step 1).

    Args:
        d_model: Model width.
        warmup_steps: Defaults to `4000`, the paper's value.
        scale: Extra factor on the formula. Defaults to `1.0`.

    Example:

    >>> schedule = TransformerSchedule(d_model=512, warmup_steps=4000)
    >>> round(float(schedule(3999)), 7)  # the peak: 512^-0.5 * 4000^-0.5
    0.0006988
    """

    def __init__(self, d_model: int, warmup_steps: int = 4000, scale: float = 1.0):
        d_model, warmup_steps = _checks.positive_ints(d_model=d_model, warmup_steps=warmup_steps)
        scale = _checks.positive_numbers(scale=scale)  # a rate of 0 trains nothing, a negative one climbs the loss
        self.d_model = d_model
        self.warmup_steps = warmup_steps
        self.scale = scale

    def __call__(self, step):
        step = ops.cast(step, "float32") + 1.0
        rate = ops.minimum(ops.power(step, -0.5), step * self.warmup_steps**-1.5)
        return self.scale * self.d_model**-0.5 * rate

    def get_config(self):
        return {"d_model": self.d_model, "warmup_steps": self.warmup_steps, "scale": self.scale}


def transformer_optimizer(d_model: int, warmup_steps: int = 4000, scale: float = 1.0, **kwargs) -> keras.optimizers.Adam:
    """Adam(beta_1=0.9, beta_2=0.98, epsilon=1e-9) on `TransformerSchedule` (section 5.3).

    A `keras_transformer.optimizers.Adam`: Keras' Adam, whose update runs in PyTorch's
    fused Adam on the PyTorch backend (same results, fewer passes over memory). Extra keyword arguments go to the optimizer
    (e.g. `clipnorm`).
    """
    return Adam(
        TransformerSchedule(d_model, warmup_steps, scale), beta_1=0.9, beta_2=0.98, epsilon=1e-9, **kwargs
    )
