"""The LM study's figures from its jobs' raw results: the curves, the time per step per link, the time to each
target, the bars; its Markdown (``benchmarks/results/lm-study.md`` and the docs page) and its plots
(``benchmarks/lm_study.py`` runs the jobs; its docstring says what each figure means)."""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness import plots
from harness.links import parse_rate, rate_label
from harness.repeats import Spread, spread
from harness.results import ROOT, header_lines, load_lines, table, write_results

BASELINE = "torch/ddp"
REPORT_LINK = "100mbit"
FIXED_TARGET = 2.0
BASELINE_FRACTION = 0.8
"""Target (a): DDP fp32's held-out loss at this fraction of its budget."""
CHECK_TOLERANCE = 0.02
"""Largest gap (nats/byte) at any evaluation of the checked part for a JAX variant to use its torch twin's curve."""
PEERS = ("ddp", "ddp_fp16", "ddp_powersgd_rank4", "pmean")
DOCS_PAGE = ROOT / "docs" / "results" / "lm_study.md"


# --- the jobs' raw results -> rows --------------------------------------------------------------------------------


def summarize_training(ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """A trained variant's figures: rank 0's held-out curve, the bytes sent per rank (mean over the ranks) at each
    evaluation, and per step over the run."""
    rank0 = next(r for r in ranks if r["rank"] == 0)
    steps = [s for s, _ in ranks[0]["sent"]]
    sent = [[s, statistics.fmean(dict(r["sent"])[s] for r in ranks)] for s in steps]
    return {
        "curve": rank0["curve"],
        "final_loss": rank0["curve"][-1][1],
        "sent": sent,
        "bytes_per_step": sent[-1][1] / max(1, sent[-1][0]),
        "train_s": round(max(r["train_s"] for r in ranks), 1),
    }


def summarize_timing(ranks: list[dict[str, Any]], row: dict[str, Any]) -> dict[str, Any]:
    """A timed variant's figures per link: each phase (repeat) kept with its load; from the published ones the time
    per step (see lm_study's docstring for DiLoCo's rounds) and the bytes per step; for asynchronous averaging, each
    phase's training curve at the link."""
    rank0 = next(r for r in ranks if r["rank"] == 0)
    links: dict[str, dict[str, Any]] = {}
    for i, first in enumerate(rank0["phases"]):
        if first["load"] is None:
            continue  # the untimed phase
        entry = links.setdefault(first["link"], {"phases": []})
        phase = {"load": first["load"], "set_aside": first["set_aside"]}
        if "curve" in first:  # asynchronous averaging: a training run at the link
            phase.update(curve=first["curve"], wall_s=round(first["wall_s"], 2))
            phase["bytes_per_step"] = statistics.fmean(r["phases"][i]["bytes"] for r in ranks) / first["curve"][-1][0]
        else:
            count = len(first["step_s"])
            per_step = [statistics.fmean(r["phases"][i]["step_s"][j] for r in ranks) for j in range(count)]
            phase["ms_per_step"] = round(_per_step_ms(per_step, row), 3)
            phase["bytes_per_step"] = statistics.fmean(r["phases"][i]["bytes"] for r in ranks) / len(per_step)
        entry["phases"].append(phase)
    for entry in links.values():
        published = [p for p in entry["phases"] if p["load"]["published"]] or entry["phases"]
        entry["published"] = all(p["load"]["published"] for p in published)
        entry["bytes_per_step"] = statistics.median(p["bytes_per_step"] for p in published)
        if "ms_per_step" in published[0]:
            entry["ms_per_step"] = spread(p["ms_per_step"] for p in published).as_dict()
    return {"links": links}


def _per_step_ms(step_s: list[float], row: dict[str, Any]) -> float:
    """A phase's time per step: the mean step, or for DiLoCo timed with rounds of ``h_t`` steps the time per step
    at its trained H, ``local + (round - local) * h_t / H``."""
    mean = 1e3 * statistics.fmean(step_s)
    h_t = row["timing_round"]
    if not h_t:
        return mean
    local = 1e3 * statistics.median(step_s)
    return local + (mean - local) * h_t / sync_every(row)


def sync_every(row: dict[str, Any]) -> int:
    """DiLoCo's H: its option, else its configuration's default."""
    return int(row["options"].get("sync_every", _defaults(row["algorithm"]).get("sync_every", 1)))


def _defaults(algorithm: str) -> dict[str, Any]:
    from bagua_common.algorithms import configs  # noqa: F401 (importing it registers the configurations)
    from bagua_common.algorithms.registry import CONFIGS

    config = CONFIGS.get(algorithm)
    return {f.name: f.default for f in dataclasses.fields(config)} if config else {}


def uncompressed_steps(row: dict[str, Any]) -> int:
    """The steps an algorithm runs as a plain gradient allreduce before its own: QAdam's and 1-bit Adam's warm-up,
    PowerSGD's exact steps (ours and DDP's hook), asynchronous averaging's warm-up; 0 for the others."""
    if row["algorithm"] == "ddp_powersgd_rank4":
        return 10
    defaults = _defaults(row["algorithm"])
    key = next((k for k in ("warmup_steps", "start_iter") if k in defaults), None)
    return int(row["options"].get(key, defaults[key])) if key else 0


def uncompressed_twin(row: dict[str, Any]) -> str:
    """The variant whose time per step the uncompressed first steps take: the same front end's gradient allreduce
    (DDP for torch's PowerSGD hook)."""
    return BASELINE if row["algorithm"] == "ddp_powersgd_rank4" else f"{row['front_end']}/gradient_allreduce"


# --- curves and targets ----------------------------------------------------------------------------------------


def steps_to(curve: Sequence[Sequence[float]], target: float) -> float | None:
    """The first step at which the held-out ``curve`` ([step, loss, ...] points) reaches ``target`` (linear between
    evaluations), or None."""
    for i, (step, loss, *_) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return float(step)
            s0, l0 = curve[i - 1][0], curve[i - 1][1]
            return s0 + (l0 - target) / (l0 - loss) * (step - s0)
    return None


def loss_at(curve: Sequence[Sequence[float]], step: float) -> float:
    """The held-out loss at ``step`` (linear between evaluations)."""
    for (s0, l0, *_), (s1, l1, *_) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return l0 + (l1 - l0) * (step - s0) / (s1 - s0)
    raise ValueError(f"step {step} is outside the curve ({curve[0][0]}-{curve[-1][0]})")


def targets(data: dict[str, Any]) -> dict[str, float]:
    """The two targets (lm_study's docstring), by label; (a) only once DDP fp32 has trained."""
    out = {}
    base = data["train"].get(BASELINE)
    if base and base.get("status") == "ok":
        out[f"DDP's loss at {BASELINE_FRACTION:.0%} of its budget"] = loss_at(
            base["curve"], BASELINE_FRACTION * base["steps"]
        )
    out[f"fixed {FIXED_TARGET}"] = FIXED_TARGET
    return out


def curve_of(data: dict[str, Any], name: str) -> tuple[dict[str, Any] | None, str]:
    """(the training row whose curve stands for variant ``name``, how it was obtained): its own full run, or its
    torch twin's once the JAX run's checked part matched (see :data:`CHECK_TOLERANCE`); a JAX run over the whole
    budget is its own."""
    import lm_study

    row = data["train"].get(name)
    if row is None or row.get("status") != "ok":
        return None, "not trained"
    variant = next((v for v in lm_study.variants() if v["name"] == name), row)
    twin = lm_study.twin(variant)
    if twin is None or row["steps"] >= data["settings"]["steps"]:
        return row, "own run"
    source = data["train"].get(twin)
    if source is None or source.get("status") != "ok":
        return None, f"{twin} not trained"
    gap = check_gap(row["curve"], source["curve"])
    if gap > CHECK_TOLERANCE:
        return None, f"differs from {twin} by {gap:.3f} in its first {row['steps']} steps"
    return source, f"{twin}'s, checked on its first {row['steps']} steps (largest gap {gap:.3f})"


def check_gap(part: Sequence[Sequence[float]], full: Sequence[Sequence[float]]) -> float:
    """The largest |loss difference| between a checked part of a run and the full run it should follow, at the
    evaluations they share after the first."""
    theirs = {s: loss for s, loss, *_ in full}
    return max((abs(loss - theirs[s]) for s, loss, *_ in part[1:] if s in theirs), default=float("inf"))


@dataclasses.dataclass
class TimeToTarget:
    """A variant's time to a target at a link: ``seconds`` (median, min, max over the timed repeats), or why not
    (``missing``), with the ``final_loss`` when the target was never reached."""

    seconds: Spread | None = None
    steps: float | None = None
    missing: str = ""
    final_loss: float | None = None
    trained_steps: int | None = None
    """Set when the run trained only the first ``trained_steps`` of the schedule: not reached there."""

    def format(self) -> str:
        if self.seconds is not None:
            return self.seconds.format(".1f")
        if self.final_loss is not None and self.trained_steps is not None:
            return f"not reached in the {self.trained_steps} steps trained ({self.final_loss:.3f})"
        if self.final_loss is not None:
            return f"not reached (final {self.final_loss:.3f})"
        return self.missing or "-"


def time_to(data: dict[str, Any], name: str, link: str, target: float) -> TimeToTarget:
    """Variant ``name``'s time to ``target`` at ``link``: steps to target x time per step there (the uncompressed
    first steps at :func:`uncompressed_twin`'s), or for asynchronous averaging its own clock at the link."""
    timing = data["timing"].get(name, {})
    entry = timing.get("links", {}).get(link)
    if entry is None:
        return TimeToTarget(missing="not timed")
    if "ms_per_step" not in entry:  # trained at the link: each phase's own clock
        times, finals = [], []
        for phase in entry["phases"]:
            steps = steps_to(_loss_curve(phase["curve"]), target)
            finals.append(phase["curve"][-1][2])
            if steps is not None:
                times.append(_clock_at(phase["curve"], steps))
        if not times:
            return TimeToTarget(final_loss=statistics.median(finals))
        return TimeToTarget(spread(times))
    row, how = curve_of(data, name)
    if row is None:
        return TimeToTarget(missing=how)
    steps = steps_to(row["curve"], target)
    if steps is None:
        return TimeToTarget(final_loss=row["final_loss"], trained_steps=_partial(data, row))
    ms = entry["ms_per_step"]
    warm = min(steps, uncompressed_steps(timing))
    base = data["timing"].get(uncompressed_twin(timing), {}).get("links", {}).get(link, {}).get("ms_per_step")
    if warm and base is None:
        return TimeToTarget(missing=f"{uncompressed_twin(timing)} not timed")
    seconds = [(warm * (base[key] if warm else 0) + (steps - warm) * ms[key]) / 1e3 for key in ("median", "min", "max")]
    return TimeToTarget(Spread(tuple(seconds)), steps)


def _partial(data: dict[str, Any], row: dict[str, Any]) -> int | None:
    """The steps a run trained when it stopped before the end of the schedule (``train --steps``), else None."""
    trained = int(row["curve"][-1][0])
    return trained if trained < data["settings"]["steps"] else None


def _loss_curve(curve: Sequence[Sequence[float]]) -> list[list[float]]:
    """A run at the link's ``[step, seconds, loss]`` curve as the ``[step, loss]`` points :func:`steps_to` reads."""
    return [[step, loss] for step, _, loss in curve]


def _clock_at(curve: Sequence[Sequence[float]], step: float) -> float:
    for (s0, t0, _), (s1, t1, _) in zip(curve, curve[1:]):
        if s0 <= step <= s1:
            return t0 + (t1 - t0) * (step - s0) / (s1 - s0)
    return curve[-1][1]


# --- progress lines ---------------------------------------------------------------------------------------------


def train_line(row: dict[str, Any]) -> str:
    """A trained row as one progress line."""
    if row["status"] != "ok":
        return f"{row['name']}: {row['status']} ({row['wall_s']} s): " + " / ".join(row.get("log_tail", [])[-3:])
    return (
        f"{row['name']}: {row['steps']} steps, held-out loss {row['final_loss']:.4f}, "
        f"{row['bytes_per_step'] / 1e6:.3f} MB/step/rank ({row['wall_s']} s)"
    )


def timing_line(row: dict[str, Any]) -> str:
    """A timed row as one progress line."""
    if row["status"] != "ok":
        return f"{row['name']}: {row['status']} ({row['wall_s']} s): " + " / ".join(row.get("log_tail", [])[-3:])
    parts = []
    for link, entry in row["links"].items():
        if "ms_per_step" in entry:
            parts.append(f"{link} {Spread(tuple(entry['ms_per_step']['values'])).format('.0f')} ms")
        else:
            parts.append(f"{link} {statistics.median(p['wall_s'] for p in entry['phases']):.0f} s trained")
        if not entry["published"]:
            parts[-1] += " (load too high: not published)"
    return f"{row['name']}: " + ", ".join(parts)


# --- the report -------------------------------------------------------------------------------------------------


def _link_order(link: str) -> float:
    return -(parse_rate(link) or float("inf"))


def _links(data: dict[str, Any]) -> list[str]:
    return sorted({link for row in data["timing"].values() for link in row.get("links", {})}, key=_link_order)


def _names(data: dict[str, Any]) -> list[str]:
    import lm_study

    seen = set(data["train"]) | set(data["timing"])
    return [v["name"] for v in lm_study.variants() + lm_study.search_variants() if v["name"] in seen]


def settings_lines(data: dict[str, Any]) -> list[str]:
    """The settings every variant trained with, the corpus's entropies and the targets, in words."""
    from bagua_common.workload import gpt_config, load_corpus

    s = data["settings"]
    config = gpt_config(s["size"])
    tokens = s["ranks"] * s["windows"] * config.context
    entropies = load_corpus().heldout_entropies()

    def schedule(x: dict[str, Any]) -> str:
        shape = f"cosine to {x['final_ratio']:g}x" if x["kind"] == "cosine" else "constant"
        return f"peak lr {x['peak']:g}, {x['warmup']} warm-up steps, then {shape}"

    return [
        f"- model: GPT `{s['size']}` ({config.parameter_count:,} parameters: {config.layers} layers, width "
        f"{config.width}, {config.heads} heads, context {config.context}); {s['ranks']} ranks, {s['windows']} windows "
        f"of {config.context} predicted bytes per rank and step ({tokens} tokens per step), {s['steps']} steps "
        f"({s['steps'] * tokens:,} tokens); seed {s['seed']} (the initialization and the data's order)",
        f"- AdamW (betas {tuple(s['betas'])}, weight decay {s['weight_decay']}): {schedule(s['schedule'])}; QAdam and "
        f"1-bit Adam (their own Adam, betas {tuple(s['adam_betas'])}): {schedule(s['adam_schedule'])}",
        f"- held-out loss of rank 0's model on {s['heldout_windows']} windows every {s['eval_every']} steps; the "
        f"held-out text's unigram entropy {entropies.unigram:.3f} and bigram conditional entropy "
        f"{entropies.bigram:.3f} nats/byte (`Corpus.heldout_entropies()`)",
        "- targets: " + "; ".join(f"{label}: {value:.4f}" for label, value in targets(data).items()),
    ]


def training_lines(data: dict[str, Any]) -> list[str]:
    """Every variant's loss at equal tokens against gradient allreduce, its bytes and its steps to each target."""
    goals = targets(data)
    reference = data["train"].get("torch/gradient_allreduce")
    head = ["variant", "curve", "held-out loss", "vs gradient allreduce", "bytes/step/rank"]
    head += [f"steps to {label}" for label in goals]
    cells = []
    for name in _names(data):
        row, how = curve_of(data, name)
        if row is None:
            own = data["train"].get(name)
            if own is not None or name in data["timing"]:
                cells.append([name, how] + [""] * (len(head) - 2))
            continue
        # at equal tokens: gradient allreduce's loss at this run's last step (a run may stop early: --steps)
        last = row["curve"][-1][0]
        gap = f"{100 * (row['final_loss'] / loss_at(reference['curve'], last) - 1):+.1f}%" if reference else ""
        own = data["train"][name]
        partial = _partial(data, row)
        unreached = "not reached" if partial is None else f"not reached in {partial} steps"
        loss = f"{row['final_loss']:.4f}" + ("" if partial is None else f" (step {partial})")
        cells.append(
            [name, how, loss, gap, f"{own['bytes_per_step'] / 1e6:.3f} MB"]
            + [_fmt(steps_to(row["curve"], goal), ".0f", unreached) for goal in goals.values()]
        )
    async_rows = [(n, r) for n, r in data["timing"].items() if r.get("algorithm") in ("async",)]
    for name, row in async_rows:
        for link, entry in row.get("links", {}).items():
            final = statistics.median(p["curve"][-1][2] for p in entry["phases"])
            bytes_per_step = entry["bytes_per_step"]
            gap = f"{100 * (final / reference['final_loss'] - 1):+.1f}%" if reference else ""
            steps = [steps_to(_loss_curve(entry["phases"][0]["curve"]), goal) for goal in goals.values()]
            cells.append(
                [f"{name} @{link}", "own run at the link", f"{final:.4f}", gap, f"{bytes_per_step / 1e6:.3f} MB"]
                + [_fmt(s, ".0f", "not reached") for s in steps]
            )
    return table(head, cells)


def _fmt(value: float | None, spec: str, missing: str) -> str:
    return missing if value is None else format(value, spec)


def step_lines(data: dict[str, Any]) -> list[str]:
    """Time per step per link, median [min, max] over the published repeats, and bytes per step."""
    links = _links(data)
    head = ["variant", *(f"ms/step {rate_label(parse_rate(link))}" for link in links), "bytes/step/rank (timed)"]
    cells = []
    for name in _names(data):
        row = data["timing"].get(name)
        if row is None or row.get("status") != "ok":
            if row is not None:
                cells.append([name, row["status"]] + [""] * len(links))
            continue
        line = [name]
        for link in links:
            entry = row["links"].get(link)
            if entry is None or "ms_per_step" not in entry:
                line.append("trained at the link" if entry else "")
                continue
            text = Spread(tuple(entry["ms_per_step"]["values"])).format(".0f")
            line.append(text if entry["published"] else f"{text} (not published)")
        first = next(iter(row["links"].values()))
        line.append(f"{first['bytes_per_step'] / 1e6:.3f} MB")
        cells.append(line)
    return table(head, cells)


def target_lines(data: dict[str, Any]) -> list[str]:
    """Every variant's time to each target at each link, and at the report link as a fraction of DDP's."""
    links, goals, lines = _links(data), targets(data), []
    for label, goal in goals.items():
        head = ["variant", *(f"s @{rate_label(parse_rate(link))}" for link in links), f"vs DDP @{REPORT_LINK}"]
        ddp = time_to(data, BASELINE, REPORT_LINK, goal)
        cells = []
        for name in _names(data):
            got = {link: time_to(data, name, link, goal) for link in links}
            mine = got.get(REPORT_LINK)
            ratio = (
                f"{mine.seconds.median / ddp.seconds.median:.2f}"
                if mine is not None and mine.seconds and ddp.seconds
                else ""
            )
            cells.append([name, *(got[link].format() for link in links), ratio])
        lines += [f"### Time to {label} ({goal:.4f}), seconds: median [min, max] over the timed repeats", "",
                  *table(head, cells), ""]  # fmt: skip
    return lines


def bar_lines(data: dict[str, Any]) -> list[str]:
    """Issue 41's bars with their figures: DDP fp32's final loss; at the report link the best per-step algorithm of
    each front end within 1/3 of DDP's time to each target and DiLoCo within 1/5."""
    base = data["train"].get(BASELINE)
    if not base or base.get("status") != "ok":
        return ["(DDP fp32 has not trained: no bars)"]
    verdict = "met" if base["final_loss"] <= 1.9 else "missed"
    out = [f"- DDP fp32 reaches {base['final_loss']:.4f} (bar <= 1.9): {verdict}"]
    for label, goal in targets(data).items():
        ddp = time_to(data, BASELINE, REPORT_LINK, goal).seconds
        if ddp is None:
            out.append(f"- {label}: DDP fp32 not timed at {REPORT_LINK}")
            continue
        for front_end in ("torch", "jax"):
            for kind, bar in (("per-step", 1 / 3), ("diloco", 1 / 5)):
                best = []
                for name in _names(data):
                    row = data["timing"].get(name) or data["train"].get(name)
                    if row["front_end"] != front_end or row["algorithm"] in PEERS:
                        continue
                    if (row["algorithm"] == "diloco") != (kind == "diloco"):
                        continue
                    got = time_to(data, name, REPORT_LINK, goal).seconds
                    if got is not None:
                        best.append((got.median / ddp.median, name))
                if not best:
                    out.append(f"- {label}, {front_end} {kind}: none reached it: missed")
                    continue
                ratio, name = min(best)
                verdict = "met" if ratio <= bar else "missed"
                out.append(f"- {label}, {front_end} {kind}: {name} in {ratio:.2f}x DDP's time at {REPORT_LINK} "
                           f"(bar <= {bar:.2f}): {verdict}")  # fmt: skip
    return out


def plot(data: dict[str, Any], path: Path) -> Path | None:
    """Held-out loss against tokens, against wall-clock time at the report link, and against bytes sent per rank;
    the held-out text's unigram and bigram entropies as reference lines on each."""
    from bagua_common.workload import load_corpus

    drawn = plots.figure(1, 3, size=(6.5, 5.5))
    if drawn is None:
        return None
    fig, axes = drawn
    by_tokens, by_time, by_bytes = axes[0]
    tokens = data["settings"]["ranks"] * data["settings"]["windows"] * _context(data)
    goal = next(iter(targets(data).values()))
    for i, name in enumerate(_names(data)):
        row, _ = curve_of(data, name)
        if row is None:
            continue
        style = {"color": plots_color(i), "linestyle": "--" if name.startswith("jax/") else "-"}
        steps, losses = [p[0] for p in row["curve"]], [p[1] for p in row["curve"]]
        plots.curves(by_tokens, {name: ([s * tokens / 1e6 for s in steps], losses)}, {name: style})
        sent = dict((s, b) for s, b in data["train"][name]["sent"])
        mine = [(sent[s] / 1e6, loss) for s, loss in zip(steps, losses) if s in sent and sent[s] > 0]
        if mine and data["train"][name] is row:
            plots.curves(by_bytes, {name: ([b for b, _ in mine], [x for _, x in mine])}, {name: style})
        seconds = _seconds_at_link(data, name, steps)
        if seconds:
            plots.curves(by_time, {name: (seconds, losses)}, {name: style})
    trained_at_link = [  # asynchronous averaging: its own run at the link
        (name, row["links"][REPORT_LINK])
        for name, row in data["timing"].items()
        if "phases" in row.get("links", {}).get(REPORT_LINK, {}) and "ms_per_step" not in row["links"][REPORT_LINK]
    ]
    for i, (name, entry) in enumerate(trained_at_link, start=len(_names(data))):
        curve = entry["phases"][0]["curve"]
        label = f"{name} @{REPORT_LINK}"
        style = {"color": plots_color(i), "linestyle": "--" if name.startswith("jax/") else "-"}
        losses = [p[2] for p in curve]
        plots.curves(by_tokens, {label: ([p[0] * tokens / 1e6 for p in curve], losses)}, {label: style})
        plots.curves(by_time, {label: ([max(p[1], 1e-3) for p in curve], losses)}, {label: style})
    entropies = load_corpus().heldout_entropies()
    for ax in (by_tokens, by_time, by_bytes):
        plots.references(ax, {"unigram entropy": entropies.unigram, "bigram entropy": entropies.bigram,
                              f"target {goal:.3f}": goal})  # fmt: skip
        ax.set_ylabel("held-out loss (nats per byte)")
        ax.set_ylim(1.5, 4.0)
    by_tokens.set_xlabel("tokens (millions)")
    by_time.set_xlabel(f"wall-clock time at {rate_label(parse_rate(REPORT_LINK))} (s, log)")
    by_time.set_xscale("log")
    by_bytes.set_xlabel("bytes sent per rank (MB, log)")
    by_bytes.set_xscale("log")
    by_tokens.legend(fontsize=6, ncol=2)
    fig.suptitle(f"GPT {data['settings']['size']}, {data['settings']['ranks']} ranks: held-out loss "
                 "(torch solid, JAX dashed)")  # fmt: skip
    return plots.save(fig, path)


def plots_color(i: int) -> Any:
    import matplotlib

    return matplotlib.colormaps["tab20"](i % 20)


def _context(data: dict[str, Any]) -> int:
    from bagua_common.workload import gpt_config

    return gpt_config(data["settings"]["size"]).context


def _seconds_at_link(data: dict[str, Any], name: str, steps: list[float]) -> list[float] | None:
    entry = data["timing"].get(name, {}).get("links", {}).get(REPORT_LINK)
    if entry is None or "ms_per_step" not in entry:
        return None
    timing = data["timing"][name]
    warm = uncompressed_steps(timing)
    base = data["timing"].get(uncompressed_twin(timing), {}).get("links", {}).get(REPORT_LINK, {}).get("ms_per_step")
    ms = entry["ms_per_step"]["median"]
    if warm and base is None:
        return None
    return [max(1e-3, (min(s, warm) * (base["median"] if warm else 0) + max(0, s - warm) * ms) / 1e3) for s in steps]


def write(out: Path, name: str, data: dict[str, Any] | None) -> None:
    """Write ``<name>.md`` and ``<name>.png`` from the study's data, and, for the study itself (``lm-study`` in
    ``benchmarks/results``, not a run kept elsewhere), the docs page from the same lines."""
    if data is None:
        raise SystemExit(f"no {name}.json in {out}: run the study first")
    loads = [p["load"] for row in data["timing"].values() for e in row.get("links", {}).values() for p in e["phases"]]
    loads += [a for row in data["timing"].values() for e in row.get("links", {}).values() for p in e["phases"]
              for a in p["set_aside"]]  # fmt: skip
    body = [
        *settings_lines(data),
        *load_lines(loads),
        "- timed phases: the 1-minute load average before and after each, and the runnable threads of other "
        "processes sampled from /proc every 0.5 s during it (`harness.load`); a phase whose foreign load exceeded "
        "the limit before or during it was run again, and is kept only as 'set aside'",
        *(f"- `{c['command']}` ({c['date']})" for c in data.get("commands", [])),
        "",
        "## Held-out loss at equal tokens",
        "",
        *training_lines(data),
        "",
        "## Time per step",
        "",
        *step_lines(data),
        "",
        "## Time to a target",
        "",
        *target_lines(data),
        "## Bars",
        "",
        *bar_lines(data),
        "",
    ]
    title = "# LM study: every algorithm trained where learning happens, timed to a target loss"
    write_results(out, name, [title, "", *header_lines(data["meta"]), *body, f"![curves]({name}.png)"], data)
    chart = plot(data, out / f"{name}.png")
    if chart and name == "lm-study" and out.resolve() == (ROOT / "benchmarks" / "results").resolve():
        DOCS_PAGE.parent.mkdir(exist_ok=True)
        (DOCS_PAGE.parent / "lm_study.png").write_bytes(chart.read_bytes())
        generated = "<!-- generated by `python benchmarks/lm_study.py report`: edit lm_study_report.py instead -->"
        DOCS_PAGE.write_text("\n".join([generated, title, "", *header_lines(data["meta"]), *body,
                                        "![curves](lm_study.png)", ""]))  # fmt: skip
