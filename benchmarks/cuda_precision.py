"""Each side's gradient error against fp64 on a GPU, per parameter: torchvision's ResNet-50 over
three micro-batches, plain autograd and 2BP (one flush), both against the same model run in
fp64, with cuDNN's TF32 off. Prints the parameters where either side is furthest from fp64, so
that a gap between the two shows which side it is (tests/test_cuda_models.py asserts the bound;
this says the figures).

    python benchmarks/cuda_precision.py [--memory-format channels_last]
"""

from __future__ import annotations

import argparse
import copy
from collections.abc import Sequence

import torch
import torch.nn.functional as F
import torchvision
from local_ranks import count  # beside this script

import twobp_autograd as twobp

__all__ = ["main"]


def _error(grad: torch.Tensor, exact: torch.Tensor) -> float:
    return ((grad.double() - exact).norm() / exact.norm().clamp_min(1e-300)).item()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--memory-format", choices=["contiguous", "channels_last"], default="contiguous")
    parser.add_argument("--rows", type=count(), default=8, help="parameters to print")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("error: cuda_precision.py needs a CUDA GPU, and CUDA is not available")
    torch.backends.cudnn.allow_tf32 = False
    torch.set_float32_matmul_precision("highest")
    memory_format = torch.channels_last if args.memory_format == "channels_last" else torch.contiguous_format
    torch.manual_seed(0)
    model = torchvision.models.resnet50(num_classes=10, zero_init_residual=True).cuda().to(memory_format=memory_format)
    plain, exact = copy.deepcopy(model), copy.deepcopy(model).double()
    twobp.patch(model)
    for _ in range(3):
        x = torch.randn(4, 3, 64, 64, device="cuda").to(memory_format=memory_format)
        y = torch.randint(0, 10, (4,), device="cuda")
        for net, inputs in ((model, x), (plain, x), (exact, x.double())):
            (F.cross_entropy(net(inputs), y) / 3).backward()
    twobp.flush_weight_grads()
    rows = []
    for (name, p), q, e in zip(model.named_parameters(), plain.parameters(), exact.parameters(), strict=True):
        rows.append((name, _error(p.grad, e.grad), _error(q.grad, e.grad)))
    rows.sort(key=lambda row: -max(row[1], row[2]))
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, {args.memory_format}: error against fp64")
    print(f"{'parameter':<36}{'2BP':>10}{'plain':>10}")
    for name, ours, theirs in rows[: args.rows]:
        print(f"{name:<36}{ours:>10.1e}{theirs:>10.1e}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
