"""In-band autotuning: the run tunes its own exact knobs between steps, with no server and no port.

Every rank calls :meth:`InBandTuner.step_finished` after each training step. After a warm-up,
steps are grouped into samples of ``steps_per_sample`` steps; at the end of each sample rank 0
feeds its time to the search (:class:`~bagua_common.tuning.successive_halving.SuccessiveHalving`, or for
a grid of more than a dozen settings :class:`~bagua_common.tuning.tpe_search.TpeThenHalving`) and
broadcasts the next setting's index over the run's own communicator. The sample boundaries are
step counts, never timings, so every rank reaches each broadcast at the same step, and every
rank applies rank 0's decision: per-rank timing noise cannot make ranks disagree. The front end
switches the setting before the next step, after its pending communication has finished (a
bucket resize racing with communication corrupted gradients in Horovod, #1282).

The knobs (:func:`tuning_knobs`): the bucket size; ``hierarchical`` or flat, when the job has two
levels (intra- and inter-node communicators, or a 2-D mesh) and the algorithm has the field; the
MPI engine's ring threshold, when the engine is MPI and its ranks span nodes. A knob without an
effect in the job is not searched. Only knobs that leave the numbers unchanged (up to the order
of a sum) are tuned by default: for compressed algorithms the quantization chunks follow bucket
boundaries, and their hierarchical form compresses other values, so those knobs are tuned only
when the user allows a change of numerics. The whole chosen setting is cached on disk, keyed by
model, world, engine and algorithm, so the next run starts tuned (``BAGUA_AUTOTUNE=cached``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import statistics
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from bagua_common.algorithms.registry import algorithm_facts
from bagua_common.tuning.successive_halving import SuccessiveHalving
from bagua_common.tuning.tpe_search import larger_grid_search

MODES = ("off", "once", "cached")

# Knobs whose every value gives the same numbers (up to the order of a sum) for any algorithm.
EXACT_KNOBS = frozenset({"mpi_ring_min_bytes"})
# The ring threshold's candidates besides the one in force: every allreduce between nodes takes the
# engine's ring, or none does (a threshold beyond any message; JSON keeps it exactly).
RING_ALWAYS = 0
RING_NEVER = 2**62

Broadcast = Callable[[np.ndarray], np.ndarray]  # int32 [k] from rank 0 -> the same on every rank


def autotune_mode(value: str | None = None) -> str:
    """The autotuning mode: ``value`` if given, else ``BAGUA_AUTOTUNE`` (default ``off``), validated.

    ``off`` never tunes; ``once`` tunes this run and stores the result; ``cached`` starts from the
    stored result when there is one for this model, world, engine and algorithm, and tunes (and
    stores) otherwise.
    """
    mode = os.environ.get("BAGUA_AUTOTUNE", "off") if value is None else value
    if mode not in MODES:
        raise ValueError(f"BAGUA_AUTOTUNE must be one of {', '.join(MODES)}, got {mode!r}")
    return mode


def check_knobs(algorithm: str, knobs: Mapping[str, Sequence[Any]], *, allow_numerics_change: bool = False) -> None:
    """Refuse to tune a knob that would change ``algorithm``'s numbers, unless the user allows it.

    ``knobs`` maps each knob's name to its candidate values. ``bucket_bytes`` (and torch's
    ``first_bucket_bytes``) are exact for the algorithms that declare themselves
    :attr:`~bagua_common.algorithms.registry.AlgorithmConfig.bucket_exact` (the full-precision ones),
    ``hierarchical`` for those declaring ``hierarchical_exact`` (gradient allreduce); unknown knobs are refused
    because nothing says they are exact.
    """
    for name, values in knobs.items():
        if len(values) == 0:
            raise ValueError(f"autotune: knob {name!r} has no candidate values")
        if name in EXACT_KNOBS or allow_numerics_change:
            continue
        if name == "hierarchical":
            if not algorithm_facts(algorithm).hierarchical_exact:
                raise ValueError(
                    f"autotune: {algorithm}'s hierarchical form computes other numbers than its flat one (it "
                    "compresses or averages at other places), so tune hierarchical only with "
                    "allow_numerics_change=True"
                )
            continue
        if name in ("bucket_bytes", "first_bucket_bytes"):
            if not algorithm_facts(algorithm).bucket_exact:
                raise ValueError(
                    f"autotune: {algorithm}'s numbers depend on its bucket layout (it quantizes per bucket, or is "
                    f"not known to be exact), so changing {name} changes them; tune it only with "
                    "allow_numerics_change=True"
                )
            continue
        raise ValueError(f"autotune: {name!r} is not a knob known to leave the numbers unchanged")


def bucket_candidates(total_bytes: int) -> list[int]:
    """Bucket sizes to try for a model of ``total_bytes``: from 1 MiB up by factors of 4, up to the first
    that holds the whole model (larger ones give the same buckets), at most 256 MiB."""
    sizes = [2**20]
    while sizes[-1] < total_bytes and sizes[-1] < 2**28:
        sizes.append(sizes[-1] * 4)
    return sizes


def grid(knobs: Mapping[str, Sequence[Any]]) -> list[dict[str, Any]]:
    """Every combination of the knobs' values, as settings (dicts), in a fixed order; the first takes
    every knob's first value."""
    settings: list[dict[str, Any]] = [{}]
    for name in sorted(knobs):
        settings = [{**s, name: v} for s in settings for v in knobs[name]]
    return settings


def tuning_knobs(
    algorithm: str,
    *,
    bucket_bytes: int,
    total_bytes: int,
    hierarchical: bool | None = None,
    two_levels: bool = False,
    mpi_ring_min_bytes: int | None = None,
    allow_numerics_change: bool = False,
) -> dict[str, list[Any]]:
    """The knobs worth tuning in this job, each with its candidates, the value in force first.

    The bucket size (``bucket_bytes`` now, then :func:`bucket_candidates` of the model's
    ``total_bytes``, less those that, like the current one, hold the whole model: they give the
    same buckets) is always searched. ``hierarchical`` is the algorithm's current value (None
    when it has no such field); it is searched only when the job has two levels (``two_levels``)
    and the flag is exact for ``algorithm``, since on one level both values run the same flat
    allreduce. ``mpi_ring_min_bytes`` is the world communicator's threshold when its engine is
    MPI and its ranks span nodes (None otherwise: the threshold then has no effect); it is tried
    against every allreduce taking the ring and none doing so. The result passes
    :func:`check_knobs` (which raises for knobs that change ``algorithm``'s numbers).
    """
    one_bucket = bucket_bytes >= total_bytes
    others = (b for b in bucket_candidates(total_bytes) if b != bucket_bytes and not (one_bucket and b >= total_bytes))
    knobs: dict[str, list[Any]] = {"bucket_bytes": [bucket_bytes, *others]}
    if (
        hierarchical is not None
        and two_levels
        and (allow_numerics_change or algorithm_facts(algorithm).hierarchical_exact)
    ):
        knobs["hierarchical"] = [hierarchical, not hierarchical]
    if mpi_ring_min_bytes is not None:
        others = (b for b in (RING_ALWAYS, RING_NEVER) if b != mpi_ring_min_bytes)
        knobs["mpi_ring_min_bytes"] = [mpi_ring_min_bytes, *others]
    check_knobs(algorithm, knobs, allow_numerics_change=allow_numerics_change)
    return knobs


def setting_label(setting: Mapping[str, Any]) -> str:
    """A setting as text, ``"bucket_bytes=1048576 hierarchical=True"``: the key of its median in reports."""
    return " ".join(f"{name}={setting[name]}" for name in sorted(setting))


class InBandTuner:
    """Tunes between steps: every rank calls :meth:`step_finished` after each step with its step time.

    ``settings`` are the candidates (the first is the one the run starts with); ``broadcast`` sends
    an int32 vector from rank 0 to every rank over the run's communicator (called collectively, at
    the same steps on every rank). A sample whose time exceeds ``timeout_factor`` times the fastest
    median seen so far counts as failed (timed out), as does a sample reported as None.
    """

    def __init__(
        self,
        settings: Sequence[Mapping[str, Any]],
        *,
        rank: int,
        broadcast: Broadcast,
        warmup_steps: int = 5,
        steps_per_sample: int = 10,
        samples_per_round: int = 3,
        eta: int = 2,
        timeout_factor: float = 4.0,
    ) -> None:
        if warmup_steps < 0 or steps_per_sample < 1:
            raise ValueError(
                f"autotune: warmup_steps must be >= 0 and steps_per_sample >= 1, "
                f"got {warmup_steps!r} and {steps_per_sample!r}"
            )
        self._settings = [dict(s) for s in settings]
        self._rank = rank
        self._broadcast = broadcast
        self._warmup = warmup_steps
        self._per_sample = steps_per_sample
        self._timeout_factor = timeout_factor
        self._search = larger_grid_search(
            self._settings, samples_per_round=samples_per_round, eta=eta
        ) or SuccessiveHalving(list(range(len(self._settings))), samples_per_round=samples_per_round, eta=eta)
        self._current = 0
        self._steps = 0
        self._sample: list[float] = []
        self._sample_failed = False
        self._finished = False

    @property
    def finished(self) -> bool:
        """True once the search has decided; the run keeps :attr:`current` from then on."""
        return self._finished

    @property
    def current(self) -> dict[str, Any]:
        """The setting in force (the decided one once :attr:`finished`)."""
        return dict(self._settings[self._current])

    def medians(self) -> dict[int, float]:
        """Rank 0's median sample time per setting index (empty on other ranks)."""
        return self._search.medians() if self._rank == 0 else {}

    def step_finished(self, seconds: float | None) -> dict[str, Any] | None:
        """Record one step's wall time (None: the step failed); returns a setting to switch to, else None.

        The returned setting must be applied before the next step, after pending communication has
        finished. Every rank returns the same thing at the same step.
        """
        if self._finished:
            return None
        self._steps += 1
        if self._steps <= self._warmup:
            return None
        if seconds is None or not math.isfinite(seconds):
            self._sample_failed = True
        else:
            self._sample.append(seconds)
        if (self._steps - self._warmup) % self._per_sample:
            return None
        decision = self._broadcast(self._decide() if self._rank == 0 else np.zeros(2, np.int32))
        self._sample, self._sample_failed = [], False
        chosen, finished = int(decision[0]), bool(decision[1])
        self._finished = finished
        if chosen == self._current:
            return None
        self._current = chosen
        return self.current

    def _decide(self) -> np.ndarray:
        sample = None if self._sample_failed else statistics.median(self._sample)
        fastest = min(self._search.medians().values(), default=math.inf)
        if sample is not None and sample > self._timeout_factor * fastest:
            sample = None
        self._search.tell(self._current, sample)
        if self._search.done:
            return np.array([self._search.best, 1], np.int32)
        return np.array([self._search.ask(), 0], np.int32)


def cache_key(model_digest: str, world: Sequence[int], engine: str, algorithm: str) -> str:
    """The key of a tuning result: the model's signature digest, the world layout, engine and algorithm."""
    text = json.dumps([model_digest, list(world), engine, algorithm])
    return hashlib.sha256(text.encode()).hexdigest()


def default_cache_path() -> Path:
    """``BAGUA_AUTOTUNE_CACHE`` if set, else ``$XDG_CACHE_HOME/bagua/autotune.json`` (``~/.cache`` by default)."""
    explicit = os.environ.get("BAGUA_AUTOTUNE_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "bagua" / "autotune.json"


class TuningCache:
    """Tuning results on disk, one JSON file of ``{key: setting}``, replaced atomically on every write."""

    def __init__(self, path: str | os.PathLike[str] | None = None) -> None:
        self.path = Path(path) if path is not None else default_cache_path()

    def _load(self) -> dict[str, Any]:
        try:
            data = json.loads(self.path.read_text())
        except FileNotFoundError:
            return {}
        except (OSError, ValueError) as error:
            raise ValueError(f"autotune cache {self.path} is unreadable ({error}); delete it to start over") from None
        if not isinstance(data, dict):
            raise ValueError(f"autotune cache {self.path} does not hold a JSON object; delete it to start over")
        return data

    def get(self, key: str) -> dict[str, Any] | None:
        """The stored setting for ``key``, or None."""
        entry = self._load().get(key)
        return dict(entry["setting"]) if entry else None

    def put(self, key: str, setting: Mapping[str, Any], medians: Mapping[str, float] | None = None) -> None:
        """Store ``setting`` (and the medians that chose it) under ``key``; other keys are kept."""
        data = self._load()
        data[key] = {"setting": dict(setting), "medians": dict(medians or {})}
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile("w", dir=self.path.parent, delete=False, suffix=".tmp") as out:
            json.dump(data, out, indent=1, sort_keys=True)
        os.replace(out.name, self.path)


class TuningSession:
    """One job's tuning of ``knobs`` (see :func:`tuning_knobs`), cache included.

    With ``mode`` ``cached`` and a setting of the grid stored under ``key`` in rank 0's ``cache``
    (default: :class:`TuningCache` at its default path), rank 0 broadcasts it, it is
    :attr:`current` on every rank and nothing is searched: ranks on other nodes, whose caches may
    differ, follow rank 0's. Otherwise an :class:`InBandTuner` (given ``tuner_options``) searches
    :func:`grid` of the knobs, and once it has decided, rank 0 stores the whole setting with every
    candidate's median. Every rank calls :meth:`step_finished` at the same steps.
    """

    def __init__(
        self,
        knobs: Mapping[str, Sequence[Any]],
        *,
        key: str,
        mode: str,
        rank: int,
        broadcast: Broadcast,
        cache: TuningCache | None = None,
        **tuner_options: Any,
    ) -> None:
        self._cache = cache if cache is not None else TuningCache()
        self._key = key
        self._rank = rank
        self._settings = grid(knobs)
        self.cached: dict[str, Any] | None = None
        if mode == "cached":
            stored = self._cache.get(key) if rank == 0 else None
            index = self._settings.index(stored) if stored in self._settings else -1
            index = int(broadcast(np.array([index, 0], np.int32))[0])
            self.cached = self._settings[index] if index >= 0 else None
        self._tuner = InBandTuner(self._settings, rank=rank, broadcast=broadcast, **tuner_options)

    @property
    def finished(self) -> bool:
        """True once the setting is decided (or came from the cache)."""
        return self.cached is not None or self._tuner.finished

    @property
    def current(self) -> dict[str, Any]:
        """The setting in force: the cached one, else the tuner's."""
        return dict(self.cached) if self.cached is not None else self._tuner.current

    def medians(self) -> dict[str, float]:
        """Rank 0's median sample time per searched setting, by :func:`setting_label` (empty elsewhere)."""
        return {setting_label(self._settings[i]): s for i, s in self._tuner.medians().items()}

    def step_finished(self, seconds: float | None) -> dict[str, Any] | None:
        """:meth:`InBandTuner.step_finished`, storing the decision when it is made; None once finished."""
        if self.finished:
            return None
        change = self._tuner.step_finished(seconds)
        if self._tuner.finished and self._rank == 0:
            self._cache.put(self._key, self._tuner.current, self.medians())
        return change
