"""QAdam and 1-bit Adam on transformers: how far their parameters grow against AdamW's, with Bagua's formula and
with the per-coordinate step bound (``step_bound``, :mod:`bagua_common.algorithms.frozen_variance`).

Models: the workload's ``small`` GPT in both front ends (bagua_jax on a 2-device mesh, bagua_torch on 2 gloo
ranks), and Hugging Face ``transformers`` BERT (masked LM, 15% of the tokens masked) and GPT-2 (causal LM)
built from a configuration (nothing is downloaded; ``--hf-shape mini`` is 2 layers of width 64 with 2 heads and
an MLP of 256, windows of 64 tokens, ``base`` the published bert-base / GPT-2 small shapes; both
with a vocabulary of the corpus's 256 bytes, BERT's plus a [MASK] token; dropout off, so that
the optimizers alone differ). Every model trains on the corpus of :mod:`bagua_common.workload.corpus`
(byte tokens, each rank's from ``(seed, step, rank)``), 2 ranks, the same tokens for every optimizer.

Settings: ``short`` (lr 1e-3, a 10-step warm-up, the issue's case) and ``defaults`` (lr 1e-3, the default
100-step warm-up); each runs ``--after-warmup`` steps after its warm-up. Optimizers: AdamW (torch's and optax's
defaults but lr: the reference), and QAdam and 1-bit Adam with ``step_bound=None`` (Bagua's formula) and with
the default bound. Per run: the largest ratio over parameter tensors of the tensor's largest magnitude to
AdamW's (the issue's bar: at most 3), the tensor it is reached on, the largest magnitude overall and the last
training loss.

    python benchmarks/adam_growth.py                    # writes benchmarks/results/adam-growth.{md,json}
    python benchmarks/adam_growth.py --settings short --after-warmup 2 --out /tmp/quick   # a quick check
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from harness.options import add_out_option, add_subset_option
from harness.results import finish_meta, header_lines, run_meta, write_results

from bagua_common.job.local_launch import free_port

MODELS = ("gpt-small", "bert", "gpt2")
SETTINGS = {"short": 10, "defaults": 100}
"""Setting -> warm-up steps (lr 1e-3 in both)."""
OPTIMIZERS = ("adamw", "qadam/bagua", "qadam/bounded", "onebit_adam/bagua", "onebit_adam/bounded")
LR, BATCH, SEED, NRANKS = 1e-3, 4, 0, 2
MASK = 256
HF_LENGTH = {"mini": 64, "base": 128}
"""Tokens per window of the Hugging Face models, by shape."""
"""BERT's [MASK] token: one past the corpus's bytes."""


def _hf_model(model: str, shape: str):
    """A Hugging Face model from a configuration, and its loss on int64 tokens ``(batch, length)`` of one rank."""
    import torch
    import transformers

    if model == "bert":
        mini = {"num_hidden_layers": 2, "hidden_size": 64, "num_attention_heads": 2, "intermediate_size": 256}
        config = transformers.BertConfig(
            **(mini if shape == "mini" else {}),
            vocab_size=MASK + 1,
            pad_token_id=0,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
        net = transformers.BertForMaskedLM(config)

        def loss(module, tokens, generator):
            masked = torch.rand(tokens.shape, generator=generator) < 0.15
            labels = torch.where(masked, tokens, torch.full_like(tokens, -100))
            inputs = torch.where(masked, torch.full_like(tokens, MASK), tokens)
            return module(input_ids=inputs, labels=labels).loss

        return net, loss, HF_LENGTH[shape]
    mini = {"n_layer": 2, "n_embd": 64, "n_head": 2, "n_inner": 256}
    config = transformers.GPT2Config(
        **(mini if shape == "mini" else {}),
        vocab_size=256,
        bos_token_id=None,
        eos_token_id=None,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
    )
    return (
        transformers.GPT2LMHeadModel(config),
        lambda module, tokens, _: module(tokens, labels=tokens).loss,
        HF_LENGTH[shape],
    )


def _summary(params: dict, reference: dict | None) -> dict:
    import numpy as np

    largest = {k: float(np.abs(v).max()) for k, v in params.items()}
    out = {"max_abs": largest, "largest": max(largest.values())}
    if reference is not None:
        ratios = {k: v / reference[k] for k, v in largest.items() if reference[k] > 0}
        worst = max(ratios, key=ratios.get)
        out.update(ratio=ratios[worst], tensor=worst)
    return out


def worker_torch(args: argparse.Namespace) -> None:
    """One torch rank: every optimizer of every setting on ``args.model``; rank 0 writes the results. The warm-up
    (plain Adam on averaged gradients, the same in both algorithms with either formula) runs once; every variant
    goes on from its end state (model, optimizer and the BERT mask generator), as a resume from a checkpoint would."""
    import torch

    import bagua_torch
    from bagua_common.workload import init_gpt_params, load_corpus
    from bagua_torch.algorithms import QAdamAlgorithm, QAdamOptimizer, algorithm_class, get_algorithm
    from bagua_torch.models.gpt import GPT, next_token_loss

    torch.set_num_threads(1)
    group = bagua_torch.init_process_group(timeout=300)
    corpus, results = load_corpus(), {}

    def model():
        torch.manual_seed(SEED)
        if args.model == "gpt-small":
            net = GPT("small", init_gpt_params("small", SEED))
            return (
                net,
                lambda module, tokens, _: next_token_loss(module(tokens[:, :-1]), tokens),
                net.config.context + 1,
            )
        return _hf_model(args.model, args.hf_shape)

    def train(net, optimizer, algorithm, loss_fn, length, steps, generator) -> float:
        wrapped = bagua_torch.with_bagua(net, [optimizer], algorithm)
        for step in steps:
            tokens = torch.from_numpy(corpus.batch(SEED, step, group.rank, BATCH, length)).long()
            optimizer.zero_grad()
            loss = loss_fn(wrapped, tokens, generator)
            loss.backward()
            optimizer.step()
        wrapped.close()
        return loss.item()

    def record(key, net, loss, reference):
        params = {k: v.detach().numpy() for k, v in net.named_parameters()}
        results[key] = {**_summary(params, reference), "loss": loss}
        if group.rank == 0:
            print(f"{args.model} {key}: {results[key].get('ratio')}", file=sys.stderr, flush=True)

    for setting in args.settings:
        warmup = SETTINGS[setting]
        total = warmup + args.after_warmup
        net, loss_fn, length = model()
        optimizer = torch.optim.AdamW(net.parameters(), lr=LR)
        generator = torch.Generator().manual_seed(SEED * 1000 + group.rank)
        loss = train(net, optimizer, "gradient_allreduce", loss_fn, length, range(total), generator)
        record(f"{setting}/adamw", net, loss, None)
        reference = results[f"{setting}/adamw"]["max_abs"]
        # The warm-up is the same plain Adam on averaged gradients in both algorithms and with either formula.
        net, loss_fn, length = model()
        optimizer = QAdamOptimizer(net.parameters(), lr=LR, warmup_steps=warmup)
        generator = torch.Generator().manual_seed(SEED * 1000 + group.rank)
        train(net, optimizer, QAdamAlgorithm(optimizer), loss_fn, length, range(warmup), generator)
        warm = copy.deepcopy((net.state_dict(), optimizer.state_dict(), generator.get_state()))
        for name in OPTIMIZERS[1:]:
            algorithm, _, formula = name.partition("/")
            optimizer_class = algorithm_class(algorithm).optimizer_class
            net, loss_fn, length = model()
            net.load_state_dict(warm[0])
            bound = {} if formula == "bounded" else {"step_bound": None}
            optimizer = optimizer_class(net.parameters(), lr=LR, warmup_steps=warmup, **bound)
            optimizer.load_state_dict(warm[1])
            generator.set_state(warm[2])
            chosen = get_algorithm(algorithm, optimizer=optimizer)
            loss = train(net, optimizer, chosen, loss_fn, length, range(warmup, total), generator)
            record(f"{setting}/{name}", net, loss, reference)
    if group.rank == 0:
        Path(args.result).write_text(json.dumps(results))


def worker_jax(args: argparse.Namespace) -> None:
    """The ``small`` GPT in bagua_jax on a 2-device mesh: every optimizer of every setting; writes the results."""
    import jax
    import numpy as np
    import optax
    from jax.sharding import Mesh

    from bagua_common.workload import init_gpt_params, load_corpus
    from bagua_jax.algorithms import make_algorithm
    from bagua_jax.models.gpt import gpt_loss_fn
    from bagua_jax.trainer import DataParallel

    mesh = Mesh(np.array(jax.devices()[:NRANKS]), ("ranks",))
    corpus, loss_fn, results = load_corpus(), gpt_loss_fn("small"), {}
    for setting in args.settings:
        warmup, reference = SETTINGS[setting], None
        for name in OPTIMIZERS:
            algorithm, _, formula = name.partition("/")
            if algorithm == "adamw":
                trainer = DataParallel(loss_fn, optax.adamw(LR), make_algorithm("gradient_allreduce"), mesh=mesh)
            else:
                bound = {} if formula == "bounded" else {"step_bound": None}
                chosen = make_algorithm(algorithm, learning_rate=LR, warmup_steps=warmup, **bound)
                trainer = DataParallel(loss_fn, None, chosen, mesh=mesh)
            state = trainer.init(init_gpt_params("small", SEED))
            for step in range(warmup + args.after_warmup):
                tokens = np.concatenate([corpus.batch(SEED, step, r, BATCH, 129) for r in range(NRANKS)])
                state, loss = trainer.step(state, {"tokens": tokens})
            params = {k: np.asarray(v) for k, v in state.params.items()}
            results[f"{setting}/{name}"] = {**_summary(params, reference), "loss": float(loss)}
            if name == "adamw":
                reference = results[f"{setting}/{name}"]["max_abs"]
    Path(args.result).write_text(json.dumps(results))


def _run(front_end: str, model: str, args: argparse.Namespace, result: Path) -> dict:
    command = [sys.executable, __file__, f"--worker-{front_end}", "--model", model, "--result", str(result)]
    command += ["--after-warmup", str(args.after_warmup), "--hf-shape", args.hf_shape, "--settings", *args.settings]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[1]), *sys.path])}
    if front_end == "jax":
        env["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={NRANKS}"
        subprocess.run(command, env=env, check=True, timeout=args.timeout)
    else:
        env.update(WORLD_SIZE=str(NRANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
        procs = [
            subprocess.Popen(command, env={**env, "RANK": str(r), "LOCAL_RANK": str(r), "LOCAL_WORLD_SIZE": "2"})
            for r in range(NRANKS)
        ]
        try:
            codes = [p.wait(timeout=args.timeout) for p in procs]
        finally:
            for p in procs:
                p.kill()
        if any(codes):
            raise RuntimeError(f"{front_end} {model}: ranks exited with {codes}")
    return json.loads(result.read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_subset_option(parser, "--models", MODELS, "models to train (default: all)")
    add_subset_option(parser, "--settings", list(SETTINGS), "warm-up settings (default: all)")
    parser.add_argument("--after-warmup", type=int, default=30, help="steps after each warm-up (default 30)")
    parser.add_argument("--hf-shape", choices=("mini", "base"), default="mini", help="Hugging Face model shapes")
    parser.add_argument("--timeout", type=float, default=3600, help="seconds per job")
    parser.add_argument("--name", default="adam-growth", help="stem of the result files")
    add_out_option(parser)
    parser.add_argument("--model", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    parser.add_argument("--worker-torch", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--worker-jax", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_torch:
        return worker_torch(args)
    if args.worker_jax:
        return worker_jax(args)
    meta = run_meta(["torch", "jax", "flax", "transformers"], argv=sys.argv[1:])
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for model in args.models:
            for front_end in ("jax", "torch") if model == "gpt-small" else ("torch",):
                runs[f"{front_end} {model}"] = _run(front_end, model, args, Path(tmp) / f"{front_end}-{model}.json")
                print(f"{front_end} {model} done", flush=True)
    finish_meta(meta)
    lines = [f"# {args.name}", "", *header_lines(meta), ""]
    lines += ["Largest ratio over parameter tensors of max |w| to AdamW's (tensor), and the last training loss.", ""]
    lines += ["| run | setting | " + " | ".join(OPTIMIZERS[1:]) + " | AdamW max abs, loss |"]
    lines += ["|---|---|" + "---:|" * len(OPTIMIZERS)]
    for run, results in runs.items():
        for setting in args.settings:
            cells = [
                f"{results[f'{setting}/{o}']['ratio']:.2f} ({results[f'{setting}/{o}']['tensor']}), "
                f"{results[f'{setting}/{o}']['loss']:.3f}"
                for o in OPTIMIZERS[1:]
            ]
            adamw = results[f"{setting}/adamw"]
            lines.append(
                f"| {run} | {setting} | " + " | ".join(cells) + f" | {adamw['largest']:.3f}, {adamw['loss']:.3f} |"
            )
    md, _ = write_results(args.out, args.name, lines, {"meta": meta, "runs": runs})
    print("\n".join(lines))
    print(f"wrote {md}")


if __name__ == "__main__":
    main()
