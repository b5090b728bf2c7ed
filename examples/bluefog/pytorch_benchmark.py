"""The synthetic benchmark loop, written as BlueFog's examples/pytorch_benchmark.py is (a small CNN on
random 32x32 images instead of a torchvision model): broadcast the parameters, wrap the optimizer, time
batches. Only the import line differs from a BlueFog program.

    torchrun --nproc-per-node 4 examples/bluefog/pytorch_benchmark.py --dist-optimizer win_put
"""

import argparse
import timeit

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

import lowband.compat.bluefog.torch as bf

parser = argparse.ArgumentParser(description="PyTorch Synthetic Benchmark",
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)  # fmt: skip
parser.add_argument("--batch-size", type=int, default=32, help="input batch size")
parser.add_argument("--num-warmup-batches", type=int, default=2, help="number of warm-up batches")
parser.add_argument("--num-batches-per-iter", type=int, default=3, help="number of batches per iteration")
parser.add_argument("--num-iters", type=int, default=3, help="number of benchmark iterations")
parser.add_argument("--dist-optimizer", type=str, default="neighbor_allreduce",
                    help="neighbor_allreduce, allreduce, gradient_allreduce, win_put, "
                         "hierarchical_neighbor_allreduce, adapt_then_combine")  # fmt: skip
parser.add_argument(
    "--num-steps-per-communication", type=int, default=1, help="local steps per communication"
)
args = parser.parse_args()

bf.init()


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.fc = nn.Linear(8 * 16 * 16, 10)

    def forward(self, x):
        x = F.max_pool2d(F.relu(self.conv(x)), 2)
        return self.fc(x.flatten(1))


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=0.01 * bf.size())

# Bluefog: broadcast parameters & optimizer state.
bf.broadcast_parameters(model.state_dict(), root_rank=0)
bf.broadcast_optimizer_state(optimizer, root_rank=0)

# Bluefog: wrap optimizer with DistributedOptimizer.
J = args.num_steps_per_communication
if args.dist_optimizer == "win_put":
    optimizer = bf.DistributedWinPutOptimizer(optimizer, model=model, num_steps_per_communication=J)
elif args.dist_optimizer == "gradient_allreduce":
    optimizer = bf.DistributedGradientAllreduceOptimizer(
        optimizer, model=model, num_steps_per_communication=J
    )
elif args.dist_optimizer == "allreduce":
    optimizer = bf.DistributedAdaptWithCombineOptimizer(
        optimizer,
        model=model,
        communication_type=bf.CommunicationType.allreduce,
        num_steps_per_communication=J,
    )
elif args.dist_optimizer == "neighbor_allreduce":
    optimizer = bf.DistributedAdaptWithCombineOptimizer(
        optimizer, model=model, communication_type=bf.CommunicationType.neighbor_allreduce,
        num_steps_per_communication=J,
    )  # fmt: skip
elif args.dist_optimizer == "hierarchical_neighbor_allreduce":
    optimizer = bf.DistributedAdaptWithCombineOptimizer(
        optimizer, model=model, communication_type=bf.CommunicationType.hierarchical_neighbor_allreduce,
        num_steps_per_communication=J,
    )  # fmt: skip
elif args.dist_optimizer == "adapt_then_combine":
    optimizer = bf.DistributedAdaptThenCombineOptimizer(optimizer, model=model, num_steps_per_communication=J)
else:
    raise ValueError("Unknown args.dist-optimizer type -- " + args.dist_optimizer)

# Set up fake data
generator = torch.Generator().manual_seed(bf.rank())
data = torch.randn(args.batch_size, 3, 32, 32, generator=generator)
target = torch.randint(0, 10, (args.batch_size,), generator=generator)


def benchmark_step():
    optimizer.zero_grad()
    output = model(data)
    loss = F.cross_entropy(output, target)
    loss.backward()
    optimizer.step()


def log(s, nl=True):
    if bf.rank() != 0:
        return
    print(s, end="\n" if nl else "")


log(f"Model: small CNN, batch size: {args.batch_size}, number of ranks: {bf.size()}")
timeit.timeit(benchmark_step, number=args.num_warmup_batches)

img_secs = []
for x in range(args.num_iters):
    time = timeit.timeit(benchmark_step, number=args.num_batches_per_iter)
    img_sec = args.batch_size * args.num_batches_per_iter / time
    log(f"Iter #{x}: {img_sec:.1f} img/sec per rank")
    img_secs.append(img_sec)

img_sec_mean = np.mean(img_secs)
img_sec_conf = 1.96 * np.std(img_secs)
total = bf.allreduce(torch.tensor(img_sec_mean), average=False, name="img_sec")
log(
    f"Img/sec per rank: {img_sec_mean:.1f} +-{img_sec_conf:.1f}; total on {bf.size()} ranks: {float(total):.1f}"
)

if args.dist_optimizer == "win_put":
    bf.barrier()
    optimizer.unregister_window()
