"""A study as a declaration: its variants, how one is measured once, and what its report adds.

:class:`Study` names the results' stem, the title, the variants and a ``measure`` function that times one variant
once (a :class:`Trial`: at one link, on a network of some ranks, in one repeat) and returns its figures;
:func:`main` does the rest, the same way for every study:

* options: ``--repeats``, ``--ranks``, ``--links`` (per-rank link rates; ``none`` is the bare veth), ``--only``,
  ``--max-load``, ``--attempts``, ``--out``, ``--name``, ``--report`` (only rewrite the report from the JSON), and
  the study's own (``add_options``);
* the loop: every repeat runs, for each rank count and each link, every variant once, in an order rotated from
  repeat to repeat (:func:`~harness.repeats.rotated`); each trial behind the load gate
  (:meth:`~harness.load.LoadGate.measure`: run on a quiet machine, run again when its load keeps it from being
  published), its row (the variant's fields, the trial's, the figures, the load) added to the JSON at once, so an
  interrupted study keeps what it measured;
* the report: the results' header (:func:`~harness.results.header_lines`), the loads the trials met, then a table
  per rank count of ``metric`` (the median over the published repeats with [min, max]) by variant and link
  (:func:`table_lines`), or the study's own lines instead (``report``, which may include that table); the JSON
  beside it; a chart of the same figures unless ``plot`` is False.

A study that needs root (the emulated network) says ``network=True``; its trials then get a
:class:`~harness.links.Network` of their rank count shaped to their link.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import json
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

from . import plots, results
from .links import Network, link_name, parse_rate, probe, rate_label, require_root
from .load import LoadGate
from .repeats import Spread, rotated, spread


@dataclasses.dataclass(frozen=True)
class Variant:
    """One thing a study measures: its ``name`` (unique in the study) and the ``fields`` its measure reads, which
    its rows keep too."""

    name: str
    fields: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        return self.fields[key]

    def matches(self, selector: str) -> bool:
        """Whether ``selector`` (from ``--only``) names this variant: its name, or one of its fields' values (an
        algorithm, a front end)."""
        return selector == self.name or any(selector == str(v) for v in self.fields.values())


@dataclasses.dataclass
class Trial:
    """One measurement: ``variant`` at ``link`` on ``ranks`` ranks in repeat ``repeat``; ``net`` the emulated
    network (None for a study without one), ``tmp`` a scratch folder, ``args`` the parsed options."""

    variant: Variant
    link: str
    ranks: int
    repeat: int
    net: Network | None
    tmp: Path
    args: argparse.Namespace

    def scratch(self, suffix: str = "") -> Path:
        """A fresh path in the scratch folder for this trial's files (a job's results, its log)."""
        name = f"{self.variant.name}-{self.ranks}-{self.link}-{self.repeat}-{time.monotonic_ns()}{suffix}"
        return self.tmp / name.replace("/", "_").replace(" ", "_")


@dataclasses.dataclass
class Study:
    """A study's declaration (see the module docstring). ``metric`` names the figure of a row that the table and
    chart give (seconds; shown as ``unit`` after multiplying by ``scale``); ``variants`` is a list, or a function
    of the options that makes one; ``links`` and ``ranks`` are the defaults of ``--links`` and ``--ranks``;
    ``packages`` the versions recorded; ``prepare`` adds to the data (its ``meta``: notes, settings in words)
    before the run and before a ``--report``, ``finish`` after the run (a follow-up measurement); ``report``
    gives the Markdown after the header (default :func:`table_lines`); ``plot`` draws the study's own chart
    (``plot(data, path)``), or the default one (True), or none; ``worker`` is what the study's own processes run
    (``python <study>.py --worker ARGS...``: :func:`main` hands it ``ARGS``)."""

    name: str
    title: str
    variants: Sequence[Variant] | Callable[[argparse.Namespace], Sequence[Variant]]
    measure: Callable[[Trial], dict[str, Any]]
    description: str = ""
    metric: str = "step_s"
    metric_label: str = "time per step"
    scale: float = 1e3
    unit: str = "ms"
    links: Sequence[str] = ("none",)
    ranks: Sequence[int] = (2,)
    repeats: int = 3
    network: bool = True
    packages: Sequence[str] = ("torch", "jax", "numpy")
    add_options: Callable[[argparse.ArgumentParser], None] | None = None
    report: Callable[[dict[str, Any]], list[str]] | None = None
    prepare: Callable[[argparse.Namespace, dict[str, Any]], None] | None = None
    finish: Callable[[argparse.Namespace, dict[str, Any]], None] | None = None
    worker: Callable[[list[str]], None] | None = None
    plot: bool | Callable[[dict[str, Any], Path], Path | None] = True

    def variant_list(self, args: argparse.Namespace) -> list[Variant]:
        """The variants of this run: all, or those ``--only`` names, in declaration order."""
        every = list(self.variants(args) if callable(self.variants) else self.variants)
        for selectors in (args.only, args.repeat_only):
            unknown = [s for s in selectors or () if not any(v.matches(s) for v in every)]
            if unknown:
                raise SystemExit(f"{self.name}: no variant matches {unknown}; the variants: {[v.name for v in every]}")
        return [v for v in every if not args.only or any(v.matches(s) for s in args.only)]


def parser(study: Study) -> argparse.ArgumentParser:
    """The options every study has, then the study's own."""
    p = argparse.ArgumentParser(
        description=study.title, epilog=study.description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--repeats", type=int, default=study.repeats, help="rounds of every variant, interleaved")
    p.add_argument("--ranks", type=int, nargs="+", default=list(study.ranks), help="rank counts")
    if study.network:
        p.add_argument(
            "--links",
            "--rates",
            nargs="+",
            default=list(study.links),
            type=link_name,
            help="per-rank link rates (e.g. 100mbit, 1gbit); 'none': unshaped",
        )
        p.add_argument("--delay-ms", type=float, default=0.0, help="one-way latency per link (needs netem)")
    p.add_argument(
        "--only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="run only the variants these name (a name or a field's value, e.g. an algorithm)",
    )
    p.add_argument(
        "--repeat-only",
        nargs="+",
        default=None,
        metavar="NAME",
        help="in the repeats after the first, run only the variants these name",
    )
    p.add_argument("--max-load", type=float, default=None, help="the load gate's limit (default 0.75 per core)")
    p.add_argument("--attempts", type=int, default=3, help="runs of a trial whose load keeps it from being published")
    p.add_argument("--out", type=Path, default=results.RESULTS, help="results directory (default benchmarks/results)")
    p.add_argument("--name", default=study.name, help="the results files' stem")
    p.add_argument("--report", action="store_true", help="only rewrite the report from the JSON")
    if study.add_options:
        study.add_options(p)
    return p


def summary(rows: Sequence[dict[str, Any]], metric: str) -> dict[tuple[str, int, str], Spread]:
    """The spread of ``metric`` over the published rows of each (variant, ranks, link)."""
    values: dict[tuple[str, int, str], list[float]] = {}
    for row in rows:
        if row.get("status", "ok") == "ok" and row.get("load", {}).get("published", True) and metric in row:
            values.setdefault((row["variant"], row["ranks"], row["link"]), []).append(row[metric])
    return {key: spread(v) for key, v in values.items()}


def link_order(link: str) -> float:
    """A sort key for links: slowest first, unshaped last."""
    return parse_rate(link) or float("inf")


def table_lines(study: Study, data: dict[str, Any]) -> list[str]:
    """Per rank count, the table of the metric by variant (rows, in the order they ran first) and link."""
    rows, spreads = data["rows"], summary(data["rows"], study.metric)
    lines = []
    for ranks in sorted({r["ranks"] for r in rows}):
        links = sorted({r["link"] for r in rows if r["ranks"] == ranks}, key=link_order)
        names = list(dict.fromkeys(r["variant"] for r in rows if r["ranks"] == ranks))
        cells = []
        for name in names:
            row = [name]
            for link in links:
                got = spreads.get((name, ranks, link))
                mine = [r for r in rows if (r["variant"], r["ranks"], r["link"]) == (name, ranks, link)]
                failed = [r.get("status", "") for r in mine]
                row.append(got.scaled(study.scale).format(".4g") if got else (failed[-1] if failed else ""))
            cells.append(row)
        head = ["variant", *(rate_label(parse_rate(link)) if study.network else study.metric_label for link in links)]
        where = f"{ranks} ranks: " if study.network else ""
        lines += [
            f"### {where}{study.metric_label} ({study.unit}), median [min, max] over the published repeats",
            "",
            *results.table(head, cells),
            "",
        ]
    return lines


def write_report(study: Study, data: dict[str, Any], out: Path, stem: str) -> list[Path]:
    """The Markdown and the JSON of ``data`` (and the chart), as the module docstring lists them."""
    loads = [r["load"] for r in data["rows"] if r.get("load")]
    loads += [aside for r in data["rows"] for aside in r.get("set_aside", [])]
    lines = [f"# {study.title}", "", *results.header_lines(data["meta"]), *results.load_lines(loads), ""]
    lines += study.report(data) if study.report else table_lines(study, data)
    paths = list(results.write_results(out, stem, lines, data))
    if study.plot and data["rows"]:
        draw = study.plot if callable(study.plot) else functools.partial(_plot, study=study)
        chart = draw(data, out / f"{stem}.png")
        if chart:
            paths.append(chart)
    return paths


def _plot(data: dict[str, Any], path: Path, study: Study) -> Path | None:
    spreads = summary(data["rows"], study.metric)
    counts = sorted({ranks for _, ranks, _ in spreads})
    drawn = plots.figure(1, len(counts)) if counts else None
    if drawn is None:
        return None
    fig, axes = drawn
    for ax, ranks in zip(axes[0], counts):
        links = sorted({link for _, n, link in spreads if n == ranks}, key=link_order)
        series: dict[str, dict[str, Spread]] = {}
        for (name, n, link), value in spreads.items():
            if n == ranks:
                series.setdefault(name, {})[rate_label(parse_rate(link))] = value.scaled(study.scale)
        plots.spreads(ax, [rate_label(parse_rate(link)) for link in links], series)
        ax.set_title(f"{ranks} ranks")
        ax.set_xlabel("per-rank link")
        ax.set_ylabel(f"{study.metric_label} ({study.unit}, log)")
        ax.legend(fontsize=7)
    fig.suptitle(study.title)
    return plots.save(fig, path)


@contextlib.contextmanager
def _network(study: Study, ranks: int, args: argparse.Namespace) -> Iterator[Network | None]:
    if not study.network:
        yield None
        return
    with Network(ranks, None, delay_ms=args.delay_ms, verbose=False) as net:
        yield net


def run(study: Study, args: argparse.Namespace, data: dict[str, Any], json_path: Path) -> None:
    """Measure every trial of ``args`` behind the load gate, adding each row to ``data`` and writing it out."""
    variants, links = study.variant_list(args), getattr(args, "links", ["none"])
    later = [v for v in variants if not args.repeat_only or any(map(v.matches, args.repeat_only))]
    total, done = (len(variants) + (args.repeats - 1) * len(later)) * len(args.ranks) * len(links), 0
    gate = LoadGate(args.max_load, attempts=args.attempts)
    try:
        with tempfile.TemporaryDirectory(prefix=f"{study.name}-") as tmp:
            for repeat in range(args.repeats):
                for ranks in args.ranks:
                    with _network(study, ranks, args) as net:
                        for link in links:
                            if net is not None and parse_rate(link) != net.rate:
                                net.reshape(link)
                            for variant in rotated(variants, repeat):
                                if repeat and args.repeat_only and not any(map(variant.matches, args.repeat_only)):
                                    continue
                                trial = Trial(variant, link, ranks, repeat, net, Path(tmp), args)
                                row = _measure(study, gate, trial)
                                data["rows"].append(row)
                                done += 1
                                print(f"[{done}/{total}] {_describe(study, row)}", flush=True)
                                json_path.parent.mkdir(parents=True, exist_ok=True)
                                json_path.write_text(json.dumps(data, indent=1) + "\n")
    except KeyboardInterrupt:
        print("interrupted; writing what was measured", file=sys.stderr)
    finally:
        gate.close()


def _measure(study: Study, gate: LoadGate, trial: Trial) -> dict[str, Any]:
    """One trial behind the gate: its row."""
    label = f"{trial.variant.name} at {trial.link}"
    measured, load, aside = gate.measure(lambda: study.measure(trial), label)
    return {
        "variant": trial.variant.name,
        **trial.variant.fields,
        "ranks": trial.ranks,
        "link": trial.link,
        "repeat": trial.repeat,
        **measured,
        "load": load.as_dict(),
        "set_aside": [x.as_dict() for x in aside],
    }


def _describe(study: Study, row: dict[str, Any]) -> str:
    figure = row.get(study.metric)
    shown = f"{figure * study.scale:.4g} {study.unit}" if figure is not None else "-"
    load = row["load"]
    return (
        f"{row['variant']}, {row['ranks']} ranks, {row['link']}, repeat {row['repeat']}: {row.get('status', 'ok')} "
        f"{shown}; load {load['load_before']} -> {load['load_after']}, foreign {load['foreign_mean']}"
        + ("" if load["published"] else " (not published)")
    )


def main(study: Study, argv: Sequence[str] | None = None) -> int:
    """Run ``study`` from the command line ``argv`` (default ``sys.argv[1:]``) and write its results."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--worker"] and study.worker:
        study.worker(argv[1:])
        return 0
    args = parser(study).parse_args(argv)
    study.variant_list(args)  # unknown names fail before anything runs
    json_path = args.out / f"{args.name}.json"
    if args.report:
        data = json.loads(json_path.read_text())
        if study.prepare:
            study.prepare(args, data)
    else:
        if study.network:
            require_root()
        settings = {k: v for k, v in vars(args).items() if k not in ("out", "name", "report")}
        meta = results.run_meta(study.packages, argv=argv)
        if study.network:
            meta["netem"] = bool(probe().get("netem"))
        data = {"meta": meta, "settings": settings, "rows": []}
        if study.prepare:
            study.prepare(args, data)
        run(study, args, data, json_path)
        results.finish_meta(data["meta"])
        if study.finish:
            study.finish(args, data)
    for path in write_report(study, data, args.out, args.name):
        print(f"wrote {path}")
    return 0
