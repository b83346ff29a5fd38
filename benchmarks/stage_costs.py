"""Per-block F, B, I and W(n) times of each pipeline stage, and the p2p latency between ranks.

The simulator and the performance model (docs/performance.md) need the per-micro-batch cost of every term
of a step: F (forward, 2BP off and on), B (full backward, 2BP off), I (backward-p1) and W(n)
(backward-p2 over n concatenated micro-batches, so W' = W(n)/n). They are measured the way
``bench pipeline`` ran the step: the same model, seed and stage cut (read from its JSON), two
gloo ranks with the same threads each, both timing their own stage at the same time so that
both see the load a step sees. Each block is timed on its own (the stage's forward and
backward run block by block with a detach in between), so that any other cut of the model,
into 4 or 8 stages, is a sum of blocks; the loss is one more block on the last stage.

The bytes that decide activation memory are recorded too: what autograd saves per
micro-batch (without parameters), and what the queue holds from backward-p1 to backward-p2.
Saved bytes are per stage (a storage two blocks save is held once), and per block as the
list of storages it saves (numbered within the measured stage), so that the bytes of any other
cut's stage are its blocks' storages counted once: what 4 stages on 2 ranks hold.

    python benchmarks/stage_costs.py --bench-json raw/bench.json --out raw/costs.json --micro-sizes 4 8
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from local_ranks import count, synchronized_clock  # beside this script
from torch import Tensor, nn

import twobp_autograd as twobp
from twobp_autograd.pipeline.launch import process_group, run_as_ranks
from twobp_autograd.pipeline.split import blocks_of, defer_norms, partition
from twobp_autograd.pipeline.zoo import build_model

__all__ = ["measure_stage", "micro_batch_sizes", "saved_bytes", "main"]

LOSS_BLOCK = "loss"


def micro_batch_sizes(batch_size: int, micro_batch_counts: Sequence[int]) -> list[int]:
    """The largest micro-batch of each split ``tensor_split`` makes (as the runtime does)."""
    return sorted({-(-batch_size // m) for m in micro_batch_counts}, reverse=True)


class saved_bytes(contextlib.AbstractContextManager):  # noqa: N801 (used like a function)
    """Counts the storage bytes autograd saves inside, each storage once, parameters excluded:
    the activation memory a micro-batch holds until its backward. Set ``block`` before each
    block runs: ``storages`` then lists, per block, the storages it saved (numbered in the
    order first seen) and their bytes."""

    def __init__(self, params: Sequence[Tensor]) -> None:
        self._excluded = {p.untyped_storage().data_ptr() for p in params}
        self._numbers: dict[int, int] = {}  # storage pointer -> its number
        self.bytes = 0
        self.block = 0
        self.storages: dict[int, dict[int, int]] = defaultdict(dict)  # block -> {number: bytes}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, tensor: Tensor) -> Tensor:
        storage = tensor.untyped_storage()
        pointer = storage.data_ptr()
        if pointer and pointer not in self._excluded:
            if pointer not in self._numbers:
                self._numbers[pointer] = len(self._numbers)
                self.bytes += storage.nbytes()
            self.storages[self.block][self._numbers[pointer]] = storage.nbytes()
        return tensor

    def block_storages(self, count: int) -> list[list[list[int]]]:
        """Per block ``0 .. count - 1``: its saved storages as [number, bytes] pairs."""
        return [[[n, size] for n, size in sorted(self.storages[b].items())] for b in range(count)]

    def __enter__(self) -> saved_bytes:
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._hooks.__exit__(*exc)


def _now(tensor: Tensor | None = None) -> float:
    return synchronized_clock(tensor.device if tensor is not None else None)


class _Stage:
    """One rank's blocks, run block by block so that each block's time can be read."""

    def __init__(self, blocks: Sequence[nn.Module], loss_fn: Callable[[Tensor, Tensor], Tensor] | None, first: bool):
        self.blocks = list(blocks)
        self.loss_fn = loss_fn
        self.first = first
        self.params = [p for block in self.blocks for p in block.parameters()]
        self.queues = [twobp.WeightGradQueue() for _ in self.blocks]

    @property
    def names(self) -> list[str]:
        return [type(b).__name__ for b in self.blocks] + ([LOSS_BLOCK] if self.loss_fn else [])

    def forward(
        self, x: Tensor, target: Tensor | None, twobp_on: bool, counter: saved_bytes | None = None
    ) -> tuple[list[tuple[Tensor, Tensor]], list[float]]:
        """Block by block (the loss last); ``counter`` is told which block runs."""
        pairs, times = [], []
        for index, block in enumerate(self.blocks):
            if counter is not None:
                counter.block = index
            # The runtime feeds the first rank's input as it is, and every other input as a leaf.
            needs_grad = x.is_floating_point() and not (self.first and index == 0)
            inp = x.detach().requires_grad_(needs_grad)
            queue = twobp.use_queue(self.queues[index]) if twobp_on else contextlib.nullcontext()
            with queue:
                start = _now(inp)
                out = block(inp)
                times.append(_now(out) - start)
            pairs.append((inp, out))
            x = out
        if self.loss_fn is not None:
            if counter is not None:
                counter.block = len(self.blocks)
            inp = x.detach().requires_grad_()
            start = _now(inp)
            loss = self.loss_fn(inp, target)
            times.append(_now(loss) - start)
            pairs.append((inp, loss))
        return pairs, times

    def backward(self, pairs: list[tuple[Tensor, Tensor]], grad: Tensor | None) -> list[float]:
        """Backward block by block from the last; ``grad`` is the output gradient (None when
        the stage ends with the loss)."""
        times = []
        for inp, out in reversed(pairs):
            start = _now(out)
            out.backward(grad)
            times.append(_now(inp) - start)
            grad = inp.grad
        return times[::-1]

    def flush(self) -> list[float]:
        times = []
        for queue in self.queues:
            start = _now()
            queue.flush()
            times.append(_now(self.params[0] if self.params else None) - start)
        return times + ([0.0] if self.loss_fn else [])

    def pending_bytes(self) -> list[int]:
        return [queue.pending().bytes for queue in self.queues] + ([0] if self.loss_fn else [])

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None

    def set_mode(self, twobp_on: bool) -> None:
        for block in self.blocks:
            (twobp.patch if twobp_on else twobp.unpatch)(block)


def measure_stage(
    blocks: Sequence[nn.Module],
    micro_inputs: Sequence[Tensor],
    micro_targets: Sequence[Tensor | None],
    *,
    loss_fn: Callable[[Tensor, Tensor], Tensor] | None,
    first: bool,
    counts: Sequence[int],
    repeats: int,
    warmup: int = 1,
    output_grad: Callable[[Tensor], Tensor] | None = None,
) -> list[dict[str, Any]]:
    """Per-block medians over ``repeats`` (after ``warmup``) of F off/on, B, I and W(n) for n
    in ``counts``, with the stage fed ``micro_inputs`` (at least ``max(counts)`` of them).
    A stage without ``loss_fn`` gets an output gradient from ``output_grad(output)``. The runs
    with 2BP off and on alternate within each repeat, so drift falls on both. Bytes are
    counted in the warm-up (at least one), whose times are not kept: the counting hooks cost
    time."""
    warmup = max(1, warmup)
    stage = _Stage(blocks, loss_fn, first)
    if len(micro_inputs) < max(counts):
        raise ValueError(f"need {max(counts)} micro-batches, got {len(micro_inputs)}")
    make_grad = output_grad or (lambda out: torch.randn_like(out))
    samples: dict[str, list[list[float]]] = defaultdict(list)  # quantity -> one list of per-block times per run
    memory: dict[str, list[Any]] = {}

    def output_gradient(pairs: list[tuple[Tensor, Tensor]]) -> Tensor | None:
        return None if loss_fn is not None else make_grad(pairs[-1][1])

    was_patched = False
    try:
        for repeat in range(warmup + repeats):
            keep = repeat >= warmup
            stage.set_mode(False)
            for k in range(len(counts)):  # as many F and B samples per repeat as W(n) ones
                with saved_bytes(stage.params) if not keep else contextlib.nullcontext() as saved_off:
                    pairs, forward = stage.forward(micro_inputs[k], micro_targets[k], False, saved_off)
                backward = stage.backward(pairs, output_gradient(pairs))
                stage.zero_grad()
                if keep:
                    samples["forward_off"].append(forward)
                    samples["backward"].append(backward)
                else:
                    memory.setdefault("output_bytes", [_bytes(out) for _, out in pairs])
                    memory.setdefault("saved_bytes_off", [saved_off.bytes])
                    memory.setdefault("saved_storages_off", saved_off.block_storages(len(stage.names)))

            stage.set_mode(True)
            was_patched = True
            for n in counts:
                for k in range(n):
                    with saved_bytes(stage.params) if not keep else contextlib.nullcontext() as saved_on:
                        pairs, forward = stage.forward(micro_inputs[k], micro_targets[k], True, saved_on)
                    input_grad = stage.backward(pairs, output_gradient(pairs))
                    if not keep and k == 0:
                        memory.setdefault("saved_bytes_on", [saved_on.bytes])
                        memory.setdefault("saved_storages_on", saved_on.block_storages(len(stage.names)))
                        memory.setdefault("pending_bytes", stage.pending_bytes())
                    if keep:
                        samples["forward_on"].append(forward)
                        samples["input_grad"].append(input_grad)
                if not any(stage.pending_bytes()):
                    raise RuntimeError("2BP on, yet nothing was queued: the stage is not deferring")
                flushed = stage.flush()
                stage.zero_grad()
                if keep:
                    samples[f"weight_grad_{n}"].append(flushed)
    finally:
        for queue in stage.queues:
            queue.clear()
        if was_patched:
            stage.set_mode(False)
        stage.zero_grad()

    names = stage.names
    result = []
    for index, name in enumerate(names):
        block: dict[str, Any] = {"name": name}
        for quantity in ("forward_off", "forward_on", "backward", "input_grad"):
            block[quantity] = statistics.median(run[index] for run in samples[quantity])
        block["weight_grad"] = {
            str(n): statistics.median(run[index] for run in samples[f"weight_grad_{n}"]) for n in counts
        }
        block["output_bytes"] = memory["output_bytes"][index]
        block["pending_bytes"] = memory["pending_bytes"][index]
        block["saved_storages_off"] = memory["saved_storages_off"][index]
        block["saved_storages_on"] = memory["saved_storages_on"][index]
        result.append(block)
    # Saved bytes are per stage (storages shared between blocks are counted once): on its first block.
    result[0]["stage_saved_bytes_off"] = memory["saved_bytes_off"][0]
    result[0]["stage_saved_bytes_on"] = memory["saved_bytes_on"][0]
    return result


def _bytes(tensor: Tensor) -> int:
    return tensor.numel() * tensor.element_size()


# -- two ranks -------------------------------------------------------------------------------


def _ping_pong(num_bytes: int, repeats: int) -> float:
    """One-way time of a message of ``num_bytes`` between ranks 0 and 1: median round trip / 2."""
    buffer = torch.zeros(max(1, num_bytes // 4), dtype=torch.float32)
    times = []
    for attempt in range(repeats + 5):
        dist.barrier()
        start = time.perf_counter()
        if dist.get_rank() == 0:
            dist.send(buffer, dst=1)
            dist.recv(buffer, src=1)
        else:
            dist.recv(buffer, src=0)
            dist.send(buffer, dst=0)
        if attempt >= 5:
            times.append((time.perf_counter() - start) / 2)
    return statistics.median(times)


def _rank_main(args: argparse.Namespace) -> None:
    with process_group(timeout=600.0, backend="gloo", threads=args.threads):
        _measure(dist.get_rank(), dist.get_world_size(), args)


def _measure_part(
    rank: int, world: int, bench: dict[str, Any], args: argparse.Namespace, device: torch.device
) -> dict[str, Any]:
    """Rank ``rank``'s blocks of the cut ``bench`` recorded, measured at every micro size."""
    options = argparse.Namespace(**bench["arguments"])
    model, make_batch, loss_fn = build_model(options.model, options, seed=options.seed)
    defer_norms(model)  # as bench pipeline does: the model's own norm classes defer too
    model.to(device)
    blocks = blocks_of(model)
    parts = partition(bench["block_costs"], world)
    mine = [blocks[i] for i in parts[rank]]
    before = [blocks[i] for i in range(parts[rank].start)]
    last = rank == world - 1

    per_size: dict[str, Any] = {}
    for size in args.micro_sizes:
        n = max(args.counts)
        inputs, targets = make_batch(n * size, torch.Generator().manual_seed(options.seed + 1))
        micro_inputs = [x.to(device) for x in inputs.tensor_split(n)]
        micro_targets = [t.to(device) for t in targets.tensor_split(n)] if last else [None] * n
        with torch.no_grad():  # this rank's inputs: what the stages before it send
            for block in before:
                micro_inputs = [block(x) for x in micro_inputs]
        per_size[str(size)] = measure_stage(
            mine,
            micro_inputs,
            micro_targets,
            loss_fn=loss_fn if last else None,
            first=rank == 0,
            counts=args.counts,
            repeats=args.repeats,
        )
    return {"rank": rank, "blocks": list(parts[rank]), "per_size": per_size}


def _document(bench: dict[str, Any], args: argparse.Namespace, latency: list[list[float]], ranks: list[Any]) -> None:
    document = {
        "bench_arguments": bench["arguments"],
        "block_costs": bench["block_costs"],
        "threads_per_rank": args.threads,
        "counts": list(args.counts),
        "repeats": args.repeats,
        "micro_sizes": list(args.micro_sizes),
        "latency_points": latency,
        "ranks": ranks,
        "device": args.device_name,
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    temporary = out.with_suffix(".partial")
    temporary.write_text(json.dumps(document, indent=1))
    os.replace(temporary, out)


def _measure(rank: int, world: int, args: argparse.Namespace) -> None:
    bench = json.loads(Path(args.bench_json).read_text())
    part = _measure_part(rank, world, bench, args, torch.device("cpu"))
    per_size = part["per_size"]
    boundary_bytes = {size: blocks[-1]["output_bytes"] for size, blocks in per_size.items()} if rank == 0 else {}
    shared = [boundary_bytes]  # the message sizes of the cut, known to rank 0
    dist.broadcast_object_list(shared, src=0)
    boundary_bytes = shared[0]
    latency = [[1, _ping_pong(1, args.latency_repeats)]]
    latency += [[b, _ping_pong(b, args.latency_repeats)] for b in sorted(set(boundary_bytes.values()))]

    gathered: list[Any] | None = [None] * world if rank == 0 else None
    dist.gather_object(part, gathered, dst=0)
    if rank == 0:
        assert gathered is not None
        _document(bench, args, latency, gathered)


def _measure_on_one_gpu(args: argparse.Namespace) -> None:
    """Both ranks' blocks measured in turn on the one GPU: the blocks' own terms, as a GPU
    runs them, for the simulator to replay. One GPU has no link between ranks to time, so
    the latency recorded is zero: replays assume a free hand-over."""
    bench = json.loads(Path(args.bench_json).read_text())
    ranks = [_measure_part(rank, 2, bench, args, torch.device("cuda")) for rank in range(2)]
    _document(bench, args, [[1, 0.0]], ranks)


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--bench-json", required=True, help="the JSON `bench pipeline --json` wrote (2 ranks)")
    parser.add_argument("--out", required=True)
    parser.add_argument("--micro-sizes", type=count(), nargs="+", required=True, help="micro-batch sizes to measure")
    parser.add_argument("--counts", type=count(), nargs="+", default=[1, 2, 4, 8], help="n of the W(n) measured")
    parser.add_argument("--repeats", type=count(), default=3)
    parser.add_argument("--latency-repeats", type=count(), default=20)
    parser.add_argument("--threads", type=count(), default=1, help="intra-op threads per rank")
    parser.add_argument(
        "--device", choices=["cpu", "cuda"], default="cpu", help="cuda: both ranks' blocks in turn on one GPU"
    )
    args = parser.parse_args(argv)
    if 1 not in args.counts:
        parser.error("--counts must include 1 (W of one micro-batch)")
    args.counts = sorted(set(args.counts))
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cuda":
        if not torch.cuda.is_available():
            raise SystemExit("error: --device cuda, but CUDA is not available")
        args.device_name = torch.cuda.get_device_name()
        _measure_on_one_gpu(args)
    else:
        args.device_name = "cpu"
        run_as_ranks(_rank_main, args, 2)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
