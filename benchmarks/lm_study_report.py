"""The LM study's figures from its ranks' raw results: time per step per link, bytes, time to DDP's loss, the bars;
its Markdown tables and its plots (``benchmarks/lm_study.py`` runs the jobs)."""

from __future__ import annotations

import dataclasses
import statistics
from pathlib import Path
from typing import Any

from harness import plots
from harness.results import header_lines, write_results

BASELINE = "torch/ddp"
REPORT_LINK = "100mbit"
PEERS = ("ddp", "ddp_fp16", "ddp_powersgd_rank4", "pmean")
NEAR = 1.01
"""The looser target: DDP's final held-out loss plus 1%. At the study's budget the loss is on a plateau where it
moves by about 1% between evaluations, so "reached DDP's loss exactly" is partly chance."""


def summarize(ranks: list[dict[str, Any]], job: dict[str, Any]) -> dict[str, Any]:
    """A variant's figures from every rank's result: rank 0's held-out curve, the bytes each rank sent per training
    step (mean over ranks), and per link the time per step (median over the repeats; see lm_study's docstring for
    DiLoCo's rounds)."""
    rank0 = next(r for r in ranks if r["rank"] == 0)
    steps, h_t = job["steps"], job["timing_sync_every"]
    phases: dict[str, list[list[float]]] = {}
    phase_bytes: dict[str, list[float]] = {}
    for i, first in enumerate(rank0["phases"]):
        per_step = [statistics.fmean(r["phases"][i]["step_s"][j] for r in ranks) for j in range(len(first["step_s"]))]
        phases.setdefault(first["link"], []).append(per_step)
        phase_bytes.setdefault(first["link"], []).append(
            statistics.fmean(r["phases"][i]["bytes"] for r in ranks) / len(per_step)
        )
    timing = {}
    for link, repeats in phases.items():
        round_ms = statistics.median(1e3 * statistics.fmean(times) for times in repeats)
        entry = {"phase_ms": [round(1e3 * statistics.fmean(t), 2) for t in repeats], "round_ms": round_ms}
        if h_t:
            local_ms = 1e3 * statistics.median(t for times in repeats for t in times)
            entry["local_ms"] = local_ms
            entry["ms_per_step"] = _at_trained_round(local_ms, round_ms, h_t, job)
            entry["phase_ms_per_step"] = [
                round(_at_trained_round(1e3 * statistics.median(t), 1e3 * statistics.fmean(t), h_t, job), 2)
                for t in repeats
            ]
        else:
            entry["ms_per_step"] = round_ms
        entry["timed_bytes_per_step"] = statistics.median(phase_bytes[link])
        timing[link] = entry
    return {
        "curve": rank0["curve"],
        "final_loss": rank0["curve"][-1][1],
        "bytes_per_step": statistics.fmean(r["train_bytes"] for r in ranks) / steps,
        "train_s": max(r["train_s"] for r in ranks),
        "ms_per_step": {link: round(entry["ms_per_step"], 2) for link, entry in timing.items()},
        "timing": timing,
    }


def _at_trained_round(local_ms: float, round_ms: float, h_t: int, job: dict[str, Any]) -> float:
    """DiLoCo's time per step at its trained round length from one timed with rounds of ``h_t`` steps."""
    return local_ms + (round_ms - local_ms) * h_t / job["options"]["sync_every"]


def repeat_ms(row: dict[str, Any], link: str) -> list[float]:
    """A variant's time per step at ``link`` in each timing phase (repeat), in the order they ran."""
    entry = row["timing"][link]
    return entry.get("phase_ms_per_step", entry["phase_ms"])


def step_time_ratios(jax_row: dict[str, Any], torch_row: dict[str, Any], link: str) -> tuple[float, float, float]:
    """JAX/torch time per step at ``link``: (median, min, max) over the repeats, each the ratio of the two phases
    that ran next to each other when the two were a pair (``--pairs``); else the ratio of the medians, thrice."""
    if jax_row.get("interleaved_with") != torch_row["name"]:
        ratio = jax_row["ms_per_step"][link] / torch_row["ms_per_step"][link]
        return ratio, ratio, ratio
    ratios = [j / t for j, t in zip(repeat_ms(jax_row, link), repeat_ms(torch_row, link))]
    return statistics.median(ratios), min(ratios), max(ratios)


def steps_to(curve: list[list[float]], target: float) -> float | None:
    """The first step at which the held-out ``curve`` reaches ``target`` (linear between evaluations), or None."""
    for i, (step, loss) in enumerate(curve):
        if loss <= target:
            if i == 0:
                return float(step)
            s0, l0 = curve[i - 1]
            return s0 + (l0 - target) / (l0 - loss) * (step - s0)
    return None


def one_line(row: dict[str, Any]) -> str:
    """A row as one progress line."""
    if row["status"] != "ok":
        return f"{row['name']}: {row['status']} ({row['wall_s']} s): " + " / ".join(row.get("log_tail", [])[-3:])
    ms = ", ".join(f"{k} {v:.0f} ms" for k, v in row["ms_per_step"].items())
    return (
        f"{row['name']}: loss {row['final_loss']:.4f}, {row['bytes_per_step'] / 1e6:.3f} MB/step, {ms} "
        f"({row['wall_s']} s, load {row['load_before']} -> {row['load_after']})"
    )


def full_precision_steps(row: dict[str, Any]) -> int:
    """The steps an algorithm runs uncompressed before its own steps: QAdam's and 1-bit Adam's warm-up, PowerSGD's
    exact steps, asynchronous averaging's allreduce warm-up (its options, else its configuration's default); 0 for
    the others."""
    from bagua_common.algorithms import configs  # noqa: F401 (importing it registers the configurations)
    from bagua_common.algorithms.registry import CONFIGS

    config = CONFIGS.get(row["algorithm"])
    defaults = {field.name: field.default for field in dataclasses.fields(config)} if config else {}
    key = next((k for k in ("warmup_steps", "start_iter") if k in defaults), None)
    return int(row["options"].get(key, defaults[key])) if key else 0


def _time_to(row: dict[str, Any], link: str, target: float, base: dict[str, Any]) -> float | None:
    """Seconds to reach ``target`` at ``link`` (:func:`elapsed` of the steps needed); asynchronous averaging only at
    the link it trained at."""
    steps = steps_to(row["curve"], target)
    if steps is None or link not in row["ms_per_step"]:
        return None
    if row["algorithm"] == "async" and link != row["train_link"]:
        return None
    return elapsed(row, steps, link, base)


def elapsed(row: dict[str, Any], steps: float, link: str, base: dict[str, Any]) -> float:
    """Seconds a variant's first ``steps`` steps take at ``link``: its time per step there, the uncompressed first
    steps (:func:`full_precision_steps`) at DDP fp32's (``base``)."""
    uncompressed = min(steps, full_precision_steps(row))
    return (uncompressed * base["ms_per_step"][link] + (steps - uncompressed) * row["ms_per_step"][link]) / 1e3


def _run_time(row: dict[str, Any], link: str) -> float:
    """Seconds of a variant's whole training run at ``link``."""
    return row["curve"][-1][0] * row["ms_per_step"][link] / 1e3


def _fmt(value: float | None, spec: str = ".1f", missing: str = "not reached") -> str:
    return missing if value is None else format(value, spec)


def table_lines(rows: dict[str, dict[str, Any]], links: list[str]) -> list[str]:
    """The main table: every variant that finished, against DDP fp32."""
    base = rows.get(BASELINE)
    target = base["final_loss"] if base else None
    head = ["variant", "held-out loss", "vs DDP", "bytes/step/rank", "DDP/bytes"]
    head += [f"ms/step {link}" for link in links] + ["steps to DDP loss", "steps to DDP loss +1%"]
    head += [f"s to DDP loss @{link}" for link in links]
    head += [f"vs DDP's run @{REPORT_LINK}", "same, to DDP loss +1%"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    ddp_time = _run_time(base, REPORT_LINK) if base else None
    for row in rows.values():
        if row["status"] != "ok":
            lines.append(f"| {row['name']} | {row['status']} |" + " |" * (len(head) - 2))
            continue
        cells = [row["name"], f"{row['final_loss']:.4f}"]
        cells.append(f"{100 * (row['final_loss'] / target - 1):+.1f}%" if target else "")
        cells.append(f"{row['bytes_per_step'] / 1e6:.4f} MB")
        cells.append(f"{base['bytes_per_step'] / row['bytes_per_step']:.0f}x" if base and row["bytes_per_step"] else "")
        cells += [_fmt(row["ms_per_step"].get(link), ".0f", "") for link in links]
        cells += [_fmt(steps_to(row["curve"], goal) if target else None, ".0f") for goal in (target, NEAR * target)]
        times = {link: _time_to(row, link, target, base) if target else None for link in links}
        cells += [_fmt(times[link], ".1f", "-") for link in links]
        for goal in (target, NEAR * target):
            mine = _time_to(row, REPORT_LINK, goal, base) if target else None
            cells.append(f"{mine / ddp_time:.2f}" if mine is not None and ddp_time else "not reached")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def bar_lines(rows: dict[str, dict[str, Any]], links: list[str], steps: int) -> list[str]:
    """The issues' bars, each with its figures and whether it is met."""
    ok = {k: r for k, r in rows.items() if r["status"] == "ok"}
    base = ok.get(BASELINE)
    if base is None or REPORT_LINK not in base["ms_per_step"]:
        return ["(no DDP fp32 result at 100 Mbit/s: no bars)"]
    target, ddp_time = base["final_loss"], _run_time(base, REPORT_LINK)
    out = [f"DDP fp32: final held-out loss {target:.4f} after {steps} steps, {ddp_time:.1f} s at 100 Mbit/s.", ""]
    for fe in ("torch", "jax"):
        for goal, what in ((target, "DDP's loss"), (NEAR * target, "DDP's loss +1%")):
            mine = [
                (t / ddp_time, r["name"])
                for r in ok.values()
                if r["front_end"] == fe and r["algorithm"] not in PEERS
                for t in [_time_to(r, REPORT_LINK, goal, base)]
                if t is not None
            ]
            if mine:
                ratio, name = min(mine)
                verdict = "met" if ratio <= 1 / 3 else "missed"
                out.append(
                    f"- {fe}: fastest to {what} at 100 Mbit/s: {name}, {ratio:.2f}x DDP's run (bar <= 0.33): {verdict}"
                )
            else:
                out.append(f"- {fe}: no algorithm reached {what} within {steps} steps: missed")
    pairs = sorted({r["name"].split("/", 1)[1] for r in ok.values() if r["front_end"] == "jax"})
    for label in pairs:
        torch_row, jax_row = ok.get(f"torch/{label}"), ok.get(f"jax/{label}")
        if torch_row and jax_row:
            ratios = {link: step_time_ratios(jax_row, torch_row, link) for link in links}
            worst = max(max(r, 1 / r) for r, _, _ in ratios.values())
            if jax_row.get("interleaved_with") == torch_row["name"]:
                how = f"side by side, median [range] of {len(repeat_ms(jax_row, links[0]))} interleaved repeats"
                text = ", ".join(f"{link} {r:.2f} [{lo:.2f}-{hi:.2f}]" for link, (r, lo, hi) in ratios.items())
            else:
                how = "separate jobs"
                text = ", ".join(f"{link} {r:.2f}" for link, (r, _, _) in ratios.items())
            out.append(
                f"- {label}: JAX/torch step time {text} ({how}; bar within 1.3x): {'met' if worst <= 1.3 else 'missed'}"
            )
    for row in ok.values():
        if row["algorithm"] != "diloco":
            continue
        gap = row["final_loss"] / target - 1
        fewer = base["bytes_per_step"] / row["bytes_per_step"] if row["bytes_per_step"] else float("inf")
        time_ratio = row["ms_per_step"][REPORT_LINK] / base["ms_per_step"][REPORT_LINK]
        if row["options"].get("fragments", 1) > 1:
            met = gap <= 0.03 and fewer >= 400
            bar = "loss within 3%, >= 400x fewer bytes"
        else:
            met = gap <= 0.02 and fewer >= 100 and time_ratio <= 0.2
            bar = "loss within 2%, >= 100x fewer bytes, <= 1/5 of DDP's time for the same tokens"
        out.append(
            f"- {row['name']}: loss {100 * gap:+.1f}% vs DDP at equal tokens, {fewer:.0f}x fewer bytes, "
            f"{time_ratio:.2f}x DDP's time per step at 100 Mbit/s (bar: {bar}): {'met' if met else 'missed'}"
        )
    return out


def plot(rows: dict[str, dict[str, Any]], path: Path) -> Path | None:
    """Held-out loss against wall-clock time at 100 Mbit/s (warm-ups at DDP's time per step) and against bytes sent
    per rank."""
    drawn = plots.figure(1, 2, size=(7.5, 6.5))
    if drawn is None:
        return None
    fig, ((by_time, by_bytes),) = drawn
    from matplotlib import colormaps

    colors = colormaps["tab20"]
    base = rows.get(BASELINE)
    for i, row in enumerate(r for r in rows.values() if r["status"] == "ok"):
        steps = [s for s, _ in row["curve"]]
        losses = [loss for _, loss in row["curve"]]
        style = dict(color=colors(i % 20), linestyle="--" if row["front_end"] == "jax" else "-", label=row["name"])
        if base and REPORT_LINK in row["ms_per_step"]:
            by_time.plot([elapsed(row, s, REPORT_LINK, base) for s in steps], losses, **style)
        by_bytes.plot([s * row["bytes_per_step"] / 1e6 for s in steps[1:]], losses[1:], **style)
    by_time.set_xlabel("wall-clock time at 100 Mbit/s (s)")
    by_bytes.set_xlabel("bytes sent per rank (MB, log)")
    by_bytes.set_xscale("log")
    for ax in (by_time, by_bytes):
        ax.set_ylabel("held-out loss (nats per byte)")
        ax.grid(alpha=0.3)
    by_bytes.legend(fontsize=6, ncol=2)
    fig.suptitle("small GPT (3.26M), 4 ranks, CPU: held-out loss (torch solid, JAX dashed)")
    return plots.save(fig, path, dpi=100)


def write(out: Path, name: str, data: dict[str, Any] | None) -> None:
    """Write ``<name>.md`` and ``<name>.png`` from the study's data (the JSON it keeps)."""
    if data is None:
        raise SystemExit(f"no {name}.json in {out}: run the study first")
    meta, cfg, rows = data["meta"], data["settings"], data["rows"]
    links = sorted({link for r in rows.values() for link in r.get("ms_per_step", {})}, key=_link_order)
    tokens = cfg["ranks"] * cfg["batch"] * 128
    loads = [sample[1][0] for sample in data["load_samples"]]
    lines = [
        "# LM study: every algorithm on the small GPT over shaped links",
        "",
        *header_lines(meta),
        *(f"- pairs rerun side by side: `{run['command']}` ({run['date']} UTC)" for run in meta.get("pair_runs", [])),
        f"- 1-minute load average before each variant: min {min(loads, default=0)}, "
        f"median {round(statistics.median(loads), 2) if loads else 0}, max {max(loads, default=0)} "
        "(samples in the JSON)",
        f"- {cfg['ranks']} ranks, GPT {cfg['size']}, {cfg['batch']} windows of 128 predicted bytes per rank and step "
        f"({tokens} tokens per step), {cfg['steps']} steps ({cfg['steps'] * tokens} tokens) per variant; AdamW lr "
        f"{cfg['lr']} (QAdam / 1-bit Adam: their own Adam, same lr, default warm-up); held-out loss of rank 0's model "
        f"on {cfg['heldout_windows']} windows every {cfg['eval_every']} steps",
        "- links: per-rank bandwidth shaped by the kernel's tbf on both ends of each veth pair "
        + ("(netem available, not used)" if meta.get("netem") else "(the kernel has no sch_netem: no latency added)")
        + "; torch and plain JAX over gloo, bagua_jax over the native MPI engine",
        "",
        *table_lines(rows, links),
        "",
        "## Bars",
        "",
        *bar_lines(rows, links, cfg["steps"]),
        "",
    ]
    write_results(out, name, lines, data)
    plot(rows, out / f"{name}.png")


def _link_order(link: str) -> float:
    from harness.links import parse_rate

    rate = parse_rate(link)
    return -(rate or float("inf"))
