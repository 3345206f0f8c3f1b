"""The floor under the second moment that QAdam and 1-bit Adam freeze after their warm-up.

After the warm-up the second moment ``v`` no longer moves, while the momentum keeps changing.
A coordinate whose ``v`` froze at zero or near it (a dead unit, an embedding row not seen in the
warm-up) but whose averaged momentum is non-zero (it becomes active later, or compression puts
noise on it: sign compression cannot send a zero) would step by ``m / eps``, ``1e8`` times its
momentum, and the model diverges. So the step divides by ``sqrt(max(v_hat, floor))``, where per
parameter tensor ``floor = VARIANCE_FLOOR * mean(v_hat)`` over that tensor, or over the whole
model where the tensor's mean is zero. ``v_hat`` is the bias-corrected ``v / (1 - b2**T)`` (below).

The ratio is relative, so it needs no tuning to the loss's scale: a coordinate with a typical
momentum for its tensor steps at most ``1 / sqrt(VARIANCE_FLOOR)`` (10) times the tensor's typical
Adam step, and coordinates at or above the floor step exactly as before. Measured on the tests'
CNN and embedding + attention models (tests/test_adam_convergence_*.py): a ratio of 1e-3
already lets late-activated units grow 2.5-5x past Adam's weights, 1e-2 and 1e-1 both train as
well as Adam. The warm-up is plain Adam and never floors.

The frozen ``v`` keeps the bias correction of the step it stopped at, ``bc2 = 1 - b2**warmup_steps``.
``v`` after ``T`` steps is ``(1 - b2) * sum(b2**(T - i) * g_i**2)``, whose expectation is
``(1 - b2**T) * E[g**2]``, so ``v / (1 - b2**T)`` estimates ``E[g**2]``; Bagua's formula divides the same
frozen ``v`` by the running ``1 - b2**t``, which grows with ``t``, so its estimate shrinks and every
coordinate's step grows by ``sqrt(bc2(t) / bc2(T))`` even where the gradients never changed: 2x by
step 40 after a 10-step warm-up, 1.13x by step 130 after 100, and toward ``1 / sqrt(1 - b2**T)``
(10x and 3.2x) late in training. Bagua's formula (``step_bound=None``) keeps the running count.

Measured on Hugging Face GPT-2 (``benchmarks/adam_growth.py``, 2 layers of width 64, lr 1e-3, a
10-step warm-up), what still grows is QAdam's: the LayerNorm biases, zero at initialization, whose
momentum (about 1e-4) lies below the resolution of the 8-bit codes of a bucket that also holds the
token embedding (a quantum of about 2.5e-3): with no error feedback, each rounding has the same sign
step after step, and divided by the biases' small frozen ``sqrt(v)`` it saturates the bound. With
the momentum averaged in full precision instead (a diagnostic, not an option), the same run stays within 1.33x
of AdamW. Error feedback on QAdam's codes, as 1-bit Adam has, would carry each rounding into the next step.
"""

VARIANCE_FLOOR = 0.01

STEP_BOUND = 1.0
"""The default bound on each coordinate's step after the warm-up, in units of the learning rate.

The floor above keeps a coordinate from stepping by ``m / eps``; it does not keep one whose ``v``
froze small, relative to the gradients it meets later, from stepping 10x Adam's step at every step
for hundreds of steps. On transformers that is common (attention and MLP projections whose
gradients grow as the layers below learn): Bagua's QAdam at lr 1e-3 after a 10-step warm-up grows
a BERT attention weight to 189 in 30 steps where Adam reaches 1.01. So the step's direction,
``(m / bc1) / (sqrt(v / bc2) + eps)``, is clipped to ``[-STEP_BOUND, STEP_BOUND]`` per coordinate:
no coordinate moves more than ``STEP_BOUND * lr`` in a step, which Adam itself rarely exceeds (its
``|m_hat| / sqrt(v_hat)`` is at most 1 for a gradient of constant sign and below it otherwise).
Coordinates inside the bound step exactly as before. ``step_bound=None`` is Bagua's formula.
"""

NEGLIGIBLE_VARIANCE = 1e-12
"""Below this fraction of the whole model's mean, a parameter tensor's mean frozen second moment counts as none.

1-bit Adam holds the momentum at zero for a tensor that had no gradient in the warm-up, because its sign codes cannot
send a zero. A tensor whose gradient is zero in exact arithmetic but rounding in float32 is the same case: BERT's
attention key bias (the softmax over keys ignores a constant added to every key's score) has a mean squared gradient
about 1e-20 of the model's, while the smallest real one, an attention query / key weight at initialization, is 1e-8
to 1e-7. Without the hold, the sign codes hand it +-scale and the frozen ``v`` divides that by about ``eps``: it grew
to millions of times AdamW's in 30 steps (Bagua's formula), and thousands of times with the step bound.
"""
