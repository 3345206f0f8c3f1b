"""Search of a larger grid of settings: optuna's TPE sampler narrows it, successive halving decides.

Successive halving samples every candidate of its first round, which grows with the product of
the knobs' values (five bucket sizes, hierarchical or flat and three ring thresholds are 30
settings, about 180 samples). Optuna's tree-structured Parzen estimator proposes settings knob by
knob from the samples so far, through its ask/tell interface, so a budget that grows with the
*sum* of the knobs' values suffices to find the fast region. Its choice is not trusted on single
samples, which are noisy on a shared machine: the fastest few settings by median go on to a
:class:`~bagua_common.tuning.successive_halving.SuccessiveHalving` final that samples each of them again.
A setting whose sample failed is out for good in both phases.

optuna is an optional extra (``pip install "bagua-jax[autotune]"``); :func:`larger_grid_search`
returns None without it, and the tuner falls back to successive halving over the whole grid.
"""

from __future__ import annotations

import importlib.util
import math
import statistics
from collections.abc import Mapping, Sequence
from typing import Any

from bagua_common.tuning.successive_halving import SuccessiveHalving

# Grids up to this many settings are searched by successive halving alone.
LARGER_GRID = 12
# Settings the TPE phase hands on to the final.
FINALISTS = 4


class TpeThenHalving:
    """Ask/tell over the indices of ``settings`` (dicts of knob values, a full grid), as SuccessiveHalving.

    The TPE phase takes ``2 * samples_per_round`` samples per knob value (the sum over knobs) and
    at least one per finalist; the final is successive halving over the :data:`FINALISTS` settings
    with the lowest median, with ``samples_per_round`` and ``eta``. ``seed`` fixes the sampler.
    """

    def __init__(
        self, settings: Sequence[Mapping[str, Any]], *, samples_per_round: int = 3, eta: int = 2, seed: int = 0
    ) -> None:
        import optuna

        optuna.logging.set_verbosity(optuna.logging.WARNING)
        self._optuna = optuna
        self._settings = [dict(s) for s in settings]
        self._knobs = {name: _distinct(s[name] for s in self._settings) for name in self._settings[0]}
        self._study = optuna.create_study(direction="minimize", sampler=optuna.samplers.TPESampler(seed=seed))
        self._budget = max(FINALISTS, 2 * samples_per_round * sum(len(v) for v in self._knobs.values()))
        self._samples_per_round, self._eta = samples_per_round, eta
        self._samples: dict[int, list[float]] = {}
        self._failed: set[int] = set()
        self._trials: dict[int, Any] = {}
        self._told = 0
        self._final: SuccessiveHalving[int] | None = None

    @property
    def done(self) -> bool:
        """True once the final has one setting left (or every setting failed)."""
        return self._final is not None and self._final.done

    @property
    def best(self) -> int:
        """The winning setting's index; a RuntimeError before the search is done or when every setting failed."""
        if self._final is None:
            raise RuntimeError("tpe search: the search is not done yet")
        return self._final.best

    @property
    def failed(self) -> frozenset[int]:
        """The settings excluded because a sample failed."""
        return frozenset(self._failed | (self._final.failed if self._final else set()))

    def medians(self) -> dict[int, float]:
        """Every sampled setting's median over both phases, but for those that failed."""
        medians = {i: statistics.median(s) for i, s in self._samples.items() if s}
        if self._final is not None:
            medians.update(self._final.medians())
        return {i: m for i, m in medians.items() if i not in self.failed}

    def ask(self) -> int:
        """The index of the setting whose next sample the search needs."""
        if self.done:
            raise RuntimeError("tpe search: the search is done; read best")
        if self._final is not None:
            return self._final.ask()
        for _ in range(len(self._settings)):
            index = self._suggest()
            if index not in self._failed:
                return index
            self._study.tell(self._trials.pop(index), state=self._optuna.trial.TrialState.FAIL)
        # The sampler keeps proposing failed settings: take the least sampled of the others.
        alive = [i for i in range(len(self._settings)) if i not in self._failed]
        self._study.enqueue_trial(self._settings[min(alive, key=lambda i: len(self._samples.get(i, [])))])
        return self._suggest()

    def _suggest(self) -> int:
        trial = self._study.ask()
        setting = {name: trial.suggest_categorical(name, values) for name, values in self._knobs.items()}
        index = self._settings.index(setting)
        self._trials[index] = trial
        return index

    def tell(self, index: int, seconds: float | None) -> None:
        """Record one sample of setting ``index``: its step time in seconds, or None when it failed."""
        if self._final is not None:
            self._final.tell(index, seconds)
            return
        if not 0 <= index < len(self._settings):
            raise ValueError(f"tpe search: unknown setting {index!r}")
        if index not in self._trials:
            # A sample of a setting not asked for (the one the run started with): optuna records it as a trial.
            self._study.enqueue_trial(self._settings[index])
            self._suggest()
        trial = self._trials.pop(index)
        if seconds is None or not math.isfinite(seconds) or seconds < 0:
            self._failed.add(index)
            self._study.tell(trial, state=self._optuna.trial.TrialState.FAIL)
        else:
            self._samples.setdefault(index, []).append(float(seconds))
            self._study.tell(trial, float(seconds))
        self._told += 1
        if self._told >= self._budget or len(self._failed) == len(self._settings):
            self._start_final()

    def _start_final(self) -> None:
        medians = self.medians()
        finalists = sorted(medians, key=lambda i: medians[i])[:FINALISTS]
        if not finalists:
            raise RuntimeError(f"tpe search: every sampled setting failed: {sorted(self._failed)}")
        self._final = SuccessiveHalving(finalists, samples_per_round=self._samples_per_round, eta=self._eta)


def larger_grid_search(
    settings: Sequence[Mapping[str, Any]], *, samples_per_round: int, eta: int
) -> TpeThenHalving | None:
    """A :class:`TpeThenHalving` over ``settings`` when they are more than :data:`LARGER_GRID` and optuna is
    installed; None otherwise (successive halving over the whole grid is then the search)."""
    if len(settings) <= LARGER_GRID or importlib.util.find_spec("optuna") is None:
        return None
    return TpeThenHalving(settings, samples_per_round=samples_per_round, eta=eta)


def _distinct(values: Any) -> list[Any]:
    seen: list[Any] = []
    for value in values:
        if value not in seen:
            seen.append(value)
    return seen
