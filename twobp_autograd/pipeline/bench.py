"""``bench pipeline``: throughput, bubble and memory of each schedule with 2BP on and off.

    torchrun --nproc-per-node 2 -m twobp_autograd bench pipeline --model mlp --schedule all
    python -m twobp_autograd bench pipeline --nproc 2 ...     # spawns the ranks itself

Every rank builds the same model from one seed and keeps its own stage (balanced by measured
block time, averaged over ranks so that all cut alike). The runs of one schedule alternate
2BP off and on step by step (A B A B), so that drift of a shared, noisy machine falls on both
sides of each ratio. Rank 0 prints a table, and on request writes the JSON of every step and,
for the last step of each run, a Chrome trace and a PNG timeline.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import Tensor, nn

from ..queue import WeightGradQueue
from .launch import run_as_ranks, threads_per_rank
from .runtime import PipelineRuntime, StepReport, init_distributed
from .schedules import SCHEDULES, default_num_micro_batches, schedule
from .models import TiedGradients, blocks_of, loss_fn_of, split_model
from .stages import measure_block_costs, parameter_costs
from .trace import plot_timeline, write_chrome_trace

__all__ = ["main", "build_model", "LlamaLikeBlock"]

MODELS = ("resnet152", "transformer", "mlp", "llama", "bert", "mamba")


# -- models ----------------------------------------------------------------------------------


class Attention(nn.Module):
    """Causal multi-head self-attention with rotary position embeddings and Linear projections."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x: Tensor) -> Tensor:
        b, t, d = x.shape
        q, k, v = (proj(x).view(b, t, self.heads, d // self.heads).transpose(1, 2) for proj in (self.q, self.k, self.v))
        q, k = _rotate(q), _rotate(k)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(out.transpose(1, 2).reshape(b, t, d))


def _rotate(x: Tensor) -> Tensor:
    """Rotary position embedding on the last dimension (pairs of halves)."""
    t, half = x.shape[-2], x.shape[-1] // 2
    frequencies = 10000.0 ** (-torch.arange(half, device=x.device, dtype=torch.float32) / half)
    angles = torch.arange(t, device=x.device, dtype=torch.float32)[:, None] * frequencies
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    first, second = x[..., :half], x[..., half:]
    return torch.cat((first * cos - second * sin, first * sin + second * cos), dim=-1)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.gate, self.up = nn.Linear(dim, hidden, bias=False), nn.Linear(dim, hidden, bias=False)
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.down(F.silu(self.gate(x)) * self.up(x))


class LlamaLikeBlock(nn.Module):
    """Pre-norm residual block: RMSNorm, attention, RMSNorm, SwiGLU MLP."""

    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(dim), Attention(dim, heads)
        self.mlp_norm, self.mlp = nn.RMSNorm(dim), SwiGLU(dim, 8 * dim // 3)

    def forward(self, x: Tensor) -> Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class _FlattenTokens(nn.Module):
    """Logits (batch, time, vocab) as rows, so that cross-entropy takes them as they are."""

    def forward(self, x: Tensor) -> Tensor:
        return x.flatten(0, 1)


ModelSpec = tuple[nn.Module, Callable[[int, torch.Generator], tuple[Tensor, Tensor]], Callable[[Tensor, Tensor], Tensor]]


def build_model(name: str, args: argparse.Namespace) -> ModelSpec:
    """The model, ``make_batch(batch_size, generator) -> (inputs, targets)``, and the loss."""
    if name == "mlp":  # by default 8 blocks of Linear 512->2048, GELU, Linear 2048->512, LayerNorm
        width, seq = args.width or 512, args.seq_len or 64
        model = nn.Sequential(
            *(
                nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width), nn.LayerNorm(width))
                for _ in range(args.depth or 8)
            )
        )

        def make_batch(b: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
            return torch.randn(b, seq, width, generator=g), torch.randn(b, seq, width, generator=g)

        return model, make_batch, F.mse_loss
    if name == "transformer":
        width, seq, vocab = args.width or 256, args.seq_len or 64, 1000
        model = nn.Sequential(
            nn.Embedding(vocab, width),
            *(LlamaLikeBlock(width, heads=max(1, width // 64)) for _ in range(args.depth or 8)),
            nn.Sequential(nn.RMSNorm(width), nn.Linear(width, vocab, bias=False), _FlattenTokens()),
        )

        def make_batch(b: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
            tokens = torch.randint(0, vocab, (b, seq + 1), generator=g)
            return tokens[:, :-1].contiguous(), tokens[:, 1:].reshape(-1)

        return model, make_batch, F.cross_entropy
    if name == "resnet152":
        import torchvision

        size, classes = args.image_size, 100
        model = torchvision.models.resnet152(num_classes=classes)

        def make_batch(b: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
            return torch.randn(b, 3, size, size, generator=g), torch.randint(0, classes, (b,), generator=g)

        return model, make_batch, F.cross_entropy
    if name in ("llama", "bert", "mamba"):
        return _hugging_face_model(name, args)
    raise ValueError(f"unknown model {name!r}; choose one of {', '.join(MODELS)}")


def _hugging_face_model(name: str, args: argparse.Namespace) -> ModelSpec:
    """A Hugging Face model built from a config (nothing downloaded), tied embeddings, sized
    by --width/--depth/--seq-len like the transformer; BERT with 15% of positions labelled."""
    import transformers

    width, depth, seq, vocab = args.width or 256, args.depth or 8, args.seq_len or 64, 1000
    heads = max(1, width // 64)
    if name == "llama":
        model: nn.Module = transformers.LlamaForCausalLM(
            transformers.LlamaConfig(
                vocab_size=vocab, hidden_size=width, intermediate_size=8 * width // 3, num_hidden_layers=depth,
                num_attention_heads=heads, num_key_value_heads=heads, max_position_embeddings=seq,
                tie_word_embeddings=True, attn_implementation="sdpa",
            )
        )  # fmt: skip
    elif name == "bert":
        model = transformers.BertForMaskedLM(
            transformers.BertConfig(
                vocab_size=vocab, hidden_size=width, intermediate_size=4 * width, num_hidden_layers=depth,
                num_attention_heads=heads, max_position_embeddings=seq, attn_implementation="sdpa",
            )
        )  # fmt: skip
    else:
        model = transformers.MambaForCausalLM(
            transformers.MambaConfig(vocab_size=vocab, hidden_size=width, num_hidden_layers=depth, state_size=16, expand=2)
        )

    def make_batch(b: int, g: torch.Generator) -> tuple[Tensor, Tensor]:
        ids = torch.randint(0, vocab, (b, seq), generator=g)
        if name != "bert":
            return ids, ids.clone()  # causal models shift their labels themselves
        return ids, ids.masked_fill(torch.rand(ids.shape, generator=g) >= 0.15, -100)

    return model, make_batch, loss_fn_of(model)


DEFAULT_BATCH = {"mlp": 32, "transformer": 16, "resnet152": 16, "llama": 16, "bert": 16, "mamba": 16}


# -- command line ----------------------------------------------------------------------------


def parse_args(argv: "Sequence[str] | None") -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="twobp_autograd bench pipeline", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", choices=MODELS, default="mlp")
    parser.add_argument("--schedule", choices=(*SCHEDULES, "all"), default="all")
    parser.add_argument("--twobp", choices=("on", "off", "both"), default="both")
    parser.add_argument("--steps", type=int, default=5, help="measured steps per run (after --warmup)")
    parser.add_argument("--warmup", type=int, default=1, help="unmeasured steps per run first")
    parser.add_argument("--micro-batches", type=int, default=None, help="default: the schedule's (p, or 2p for 1f1b-2 and zb)")
    parser.add_argument("--batch-size", type=int, default=None, help="samples per step (default per model)")
    parser.add_argument("--width", type=int, default=None, help="hidden size (all but resnet152)")
    parser.add_argument("--depth", type=int, default=None, help="number of blocks / layers (all but resnet152)")
    parser.add_argument("--seq-len", type=int, default=None, help="tokens per sample (all but resnet152)")
    parser.add_argument("--image-size", type=int, default=64, help="resnet152 input resolution")
    parser.add_argument("--balance", choices=("time", "params"), default="time", help="what stages are balanced by")
    parser.add_argument("--json", default=None, help="write every step's metrics here (rank 0)")
    parser.add_argument("--trace", default=None, help="directory for Chrome traces and PNG timelines")
    parser.add_argument("--nproc", type=int, default=2, help="ranks to spawn when not launched by torchrun")
    parser.add_argument("--threads", type=int, default=None, help="CPU threads per rank (default: cores / ranks)")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds any rank waits for a peer")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--offload", action="store_true", help="2BP: park pending W in pinned host memory (CUDA)")
    parser.add_argument("--weight-grad-streams", type=int, default=1, help="2BP: CUDA streams a flush spreads W over")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    args = parser.parse_args(list(argv) if argv is not None else None)
    if args.steps < 1 or args.warmup < 0:
        parser.error("--steps must be at least 1 and --warmup at least 0")
    return args


def main(argv: "Sequence[str] | None" = None) -> int:
    argv = list(argv) if argv is not None else None
    if argv and argv[0] == "pipeline":  # tolerate the sub-command name being passed along
        argv = argv[1:]
    args = parse_args(argv)
    run_as_ranks(_rank_main, args, args.nproc)
    return 0


# -- one rank --------------------------------------------------------------------------------


def _rank_main(args: argparse.Namespace) -> None:
    world = int(os.environ["WORLD_SIZE"])
    threads = threads_per_rank(world, args.threads)
    torch.set_num_threads(threads)
    device = init_distributed(timeout=args.timeout)
    try:
        _benchmark(args, device, threads)
    finally:
        dist.destroy_process_group()


def _benchmark(args: argparse.Namespace, device: torch.device, threads: int) -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(args.seed)
    model, make_batch, loss_fn = build_model(args.model, args)
    model.to(device).train()
    batch_size = args.batch_size or DEFAULT_BATCH[args.model]
    inputs, targets = make_batch(batch_size, torch.Generator().manual_seed(args.seed + 1))
    inputs, targets = inputs.to(device), targets.to(device)

    schedules = list(SCHEDULES) if args.schedule == "all" else [args.schedule]
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.twobp]
    runs = [(name, twobp) for name in schedules for twobp in modes]
    num_micro = {name: args.micro_batches or default_num_micro_batches(name, world) for name in schedules}

    costs = _agreed_costs(model, inputs[: math.ceil(batch_size / max(num_micro.values()))], args.balance, device)
    pipeline = split_model(model, world, costs=costs)
    stage = pipeline.stages[rank]
    tied = TiedGradients(pipeline)  # embeddings shared by the first and last rank
    del model, pipeline  # the other ranks' blocks
    runtimes = {
        (name, twobp): PipelineRuntime(
            stage,
            schedule(name, world, num_micro[name], twobp)[rank],
            num_micro_batches=num_micro[name],
            loss_fn=loss_fn,
            twobp=twobp,
            device=device,
            timeout=args.timeout,
            queue=WeightGradQueue(offload_to_host=args.offload, weight_grad_streams=args.weight_grad_streams) if twobp else None,
        )
        for name, twobp in runs
    }

    progress = None
    if rank == 0 and not args.no_progress:
        from tqdm import tqdm

        progress = tqdm(total=(args.warmup + args.steps) * len(runs), desc=f"{args.model} x{world}", unit="step")
    reports: dict[tuple[str, bool], list[StepReport]] = {run: [] for run in runs}
    for step in range(args.warmup + args.steps):
        for run in runs:  # A B A B: each schedule's off and on runs take turns step by step
            report = runtimes[run].step(inputs if rank == 0 else None, targets if rank == world - 1 else None)
            tied.all_reduce()
            for p in stage.parameters():
                p.grad = None
            if progress is not None:
                progress.update()
            if rank == 0 and step >= args.warmup:
                assert isinstance(report, StepReport)
                reports[run].append(report)
    if progress is not None:
        progress.close()
    if rank == 0:
        summary = _summarise(reports, num_micro, batch_size)
        print(_table(summary, args, world, device, threads))
        if args.json:
            _write_json(args.json, args, world, device, threads, costs, summary, reports)
        if args.trace:
            _write_traces(args.trace, args.model, reports)


def _agreed_costs(model: nn.Module, sample: Tensor, balance: str, device: torch.device) -> list[float]:
    """Per-block cost every rank agrees on: measured times averaged over ranks, or parameter
    counts (identical everywhere)."""
    blocks = blocks_of(model)
    if balance == "params":
        return parameter_costs(blocks)
    measured = torch.tensor(measure_block_costs(blocks, sample), dtype=torch.float64, device=device)
    dist.all_reduce(measured)
    return (measured / dist.get_world_size()).tolist()


# -- results ---------------------------------------------------------------------------------


def _summarise(reports: dict[tuple[str, bool], list[StepReport]], num_micro: dict[str, int], batch_size: int) -> list[dict[str, Any]]:
    rows = []
    for (name, twobp), steps in reports.items():
        step_times = [r.step_time for r in steps]
        rows.append(
            {
                "schedule": name,
                "twobp": twobp,
                "micro_batches": num_micro[name],
                "step_time_median": statistics.median(step_times),
                "samples_per_s": batch_size / statistics.median(step_times),
                "bubble_ratio": statistics.median(r.bubble_ratio for r in steps),
                "peak_bytes": max(m.peak_bytes for r in steps for m in r.ranks),
                "peak_rss": max(m.peak_rss for r in steps for m in r.ranks),
                "loss": steps[-1].loss,
            }
        )
    off = {row["schedule"]: row["samples_per_s"] for row in rows if not row["twobp"]}
    for row in rows:
        row["ratio_to_off"] = row["samples_per_s"] / off[row["schedule"]] if row["schedule"] in off else None
    return rows


def _table(rows: list[dict[str, Any]], args: argparse.Namespace, world: int, device: torch.device, threads: int) -> str:
    memory = "peak alloc MiB" if device.type == "cuda" else "peak heap MiB"
    header = ["schedule", "2BP", "m", "samples/s", "vs 2BP off", "bubble", memory, "peak RSS MiB"]
    lines = [
        f"{args.model}: {world} ranks on {device.type}, {threads} thread(s) each, "
        f"median of {args.steps} step(s) after {args.warmup} warm-up, off/on alternating",
        "",
    ]
    table = [header] + [
        [
            row["schedule"],
            "on" if row["twobp"] else "off",
            str(row["micro_batches"]),
            f"{row['samples_per_s']:.2f}",
            "-" if row["ratio_to_off"] is None else f"{row['ratio_to_off']:.3f}",
            f"{row['bubble_ratio']:.3f}",
            f"{row['peak_bytes'] / 2**20:.1f}",
            f"{row['peak_rss'] / 2**20:.0f}",
        ]
        for row in rows
    ]
    widths = [max(len(r[i]) for r in table) for i in range(len(header))]
    lines += ["  ".join(cell.rjust(w) for cell, w in zip(r, widths)) for r in table]
    return "\n".join(lines)


def _run_name(model: str, name: str, twobp: bool) -> str:
    return f"{model}-{name}-2bp-{'on' if twobp else 'off'}"


def _write_json(
    path: str,
    args: argparse.Namespace,
    world: int,
    device: torch.device,
    threads: int,
    costs: list[float],
    rows: list[dict[str, Any]],
    reports: dict[tuple[str, bool], list[StepReport]],
) -> None:
    document = {
        "arguments": vars(args),
        "world_size": world,
        "device": str(device),
        "threads_per_rank": threads,
        "torch": torch.__version__,
        "block_costs": costs,
        "summary": rows,
        "steps": {
            _run_name(args.model, name, twobp): [
                {
                    "step_time": r.step_time,
                    "bubble_ratio": r.bubble_ratio,
                    "throughput": r.throughput,
                    "idle": r.idle,
                    "loss": r.loss,
                    "peak_bytes": [m.peak_bytes for m in r.ranks],
                    "deferred_jobs": [m.deferred_jobs for m in r.ranks],
                }
                for r in steps
            ]
            for (name, twobp), steps in reports.items()
        },
    }
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w", encoding="utf-8") as file:
        json.dump(document, file, indent=2)


def _write_traces(directory: str, model: str, reports: dict[tuple[str, bool], list[StepReport]]) -> None:
    os.makedirs(directory, exist_ok=True)
    for (name, twobp), steps in reports.items():
        timelines = [m.events for m in steps[-1].ranks]
        base = os.path.join(directory, _run_name(model, name, twobp))
        write_chrome_trace(base + ".json", timelines)
        plot_timeline(timelines, base + ".png", title=f"{model}, {name}, 2BP {'on' if twobp else 'off'} (last measured step)")


if __name__ == "__main__":
    raise SystemExit(main())
