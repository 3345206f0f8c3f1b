"""The floor under the second moment that QAdam and 1-bit Adam freeze after their warm-up.

After the warm-up the second moment ``v`` no longer moves, while the momentum keeps changing.
A coordinate whose ``v`` froze at zero or near it (a dead unit, an embedding row not seen in the
warm-up) but whose averaged momentum is non-zero (it becomes active later, or compression puts
noise on it: sign compression cannot send a zero) would step by ``m / eps``, ``1e8`` times its
momentum, and the model diverges. So the step divides by ``sqrt(max(v_hat, floor))``, where per
parameter tensor ``floor = VARIANCE_FLOOR * mean(v_hat)`` over that tensor, or over the whole
model where the tensor's mean is zero. ``v_hat`` is the bias-corrected ``v / (1 - b2**t)``.

The ratio is relative, so it needs no tuning to the loss's scale: a coordinate with a typical
momentum for its tensor steps at most ``1 / sqrt(VARIANCE_FLOOR)`` (10) times the tensor's typical
Adam step, and coordinates at or above the floor step exactly as before. Measured on the tests'
CNN and embedding + attention models (tests/test_adam_convergence_*.py): a ratio of 1e-3
already lets late-activated units grow 2.5-5x past Adam's weights, 1e-2 and 1e-1 both train as
well as Adam. The warm-up is plain Adam and never floors.
"""

VARIANCE_FLOOR = 0.01
