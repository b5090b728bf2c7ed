"""An MNIST-style training loop, written as BlueFog's examples/pytorch_mnist.py is, on scikit-learn's
offline 8x8 digits: broadcast the parameters, wrap the optimizer (adapt-with-combine, adapt-then-combine,
gradient allreduce or win-put; optionally a one-peer dynamic topology), train, and average the test
metrics with allreduce. Only the two import lines differ from a BlueFog program.

    torchrun --nproc-per-node 4 examples/bluefog/pytorch_mnist.py --dist-optimizer win_put
"""

import argparse

import torch
import torch.nn.functional as F
from sklearn.datasets import load_digits
from torch import nn

import lowband.compat.bluefog.torch as bf
from lowband.compat.bluefog.common import topology_util

parser = argparse.ArgumentParser(description="PyTorch digits example")
parser.add_argument("--batch-size", type=int, default=16, help="input batch size for training")
parser.add_argument("--epochs", type=int, default=4, help="number of epochs to train")
parser.add_argument("--lr", type=float, default=0.1, help="learning rate")
parser.add_argument("--dist-optimizer", type=str, default="neighbor_allreduce",
                    help="neighbor_allreduce, adapt_then_combine, gradient_allreduce, win_put")  # fmt: skip
parser.add_argument("--enable-dynamic-topology", action="store_true", default=False)
parser.add_argument("--seed", type=int, default=42, help="random seed")
args = parser.parse_args()

bf.init()
bf.set_topology(topology_util.ExponentialGraph(bf.size()))

# Partition the data set among the ranks (BlueFog uses DistributedSampler(num_replicas=bf.size(),
# rank=bf.rank())); hold out every fifth sample for the test.
digits = load_digits()
images = torch.tensor(digits.data, dtype=torch.float32) / 16.0
labels = torch.tensor(digits.target, dtype=torch.long)
is_test = torch.arange(len(labels)) % 5 == 0
train_x, train_y = images[~is_test][bf.rank() :: bf.size()], labels[~is_test][bf.rank() :: bf.size()]
test_x, test_y = images[is_test][bf.rank() :: bf.size()], labels[is_test][bf.rank() :: bf.size()]


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(64, 64)
        self.fc2 = nn.Linear(64, 10)

    def forward(self, x):
        return F.log_softmax(self.fc2(F.relu(self.fc1(x))), dim=1)


model = Net()
optimizer = torch.optim.SGD(model.parameters(), lr=args.lr * bf.size(), momentum=0.5)

# Bluefog: broadcast parameters & optimizer state.
bf.broadcast_parameters(model.state_dict(), root_rank=0)
bf.broadcast_optimizer_state(optimizer, root_rank=0)

if args.dist_optimizer == "win_put":
    optimizer = bf.DistributedWinPutOptimizer(optimizer, model=model)
elif args.dist_optimizer == "gradient_allreduce":
    optimizer = bf.DistributedGradientAllreduceOptimizer(optimizer, model=model)
elif args.dist_optimizer == "adapt_then_combine":
    optimizer = bf.DistributedAdaptThenCombineOptimizer(optimizer, model=model)
elif args.dist_optimizer == "neighbor_allreduce":
    optimizer = bf.DistributedAdaptWithCombineOptimizer(optimizer, model=model)
else:
    raise ValueError("Unknown args.dist-optimizer type -- " + args.dist_optimizer)

if args.enable_dynamic_topology:
    dynamic_neighbor_allreduce_gen = topology_util.GetDynamicOnePeerSendRecvRanks(
        bf.load_topology(), bf.rank()
    )


def dynamic_topology_update(batch_idx):
    if args.dist_optimizer == "win_put":
        num_out_neighbors = len(bf.out_neighbor_ranks())
        sent_neighbor = bf.out_neighbor_ranks()[batch_idx % num_out_neighbors]
        optimizer.dst_weights = {sent_neighbor: 1.0}
    elif args.dist_optimizer in ("neighbor_allreduce", "adapt_then_combine"):
        send_neighbors, recv_neighbors = next(dynamic_neighbor_allreduce_gen)
        optimizer.dst_weights = send_neighbors
        optimizer.src_weights = {r: 1 / (len(recv_neighbors) + 1) for r in recv_neighbors}
        optimizer.self_weight = 1 / (len(recv_neighbors) + 1)
        optimizer.enable_topo_check = False


def train(epoch):
    model.train()
    generator = torch.Generator().manual_seed(args.seed + 1000 * epoch + bf.rank())
    order = torch.randperm(len(train_y), generator=generator)
    steps = len(order) // args.batch_size
    for batch_idx in range(steps):
        idx = order[batch_idx * args.batch_size : (batch_idx + 1) * args.batch_size]
        if args.enable_dynamic_topology:
            dynamic_topology_update(batch_idx)
        optimizer.zero_grad()
        output = model(train_x[idx])
        loss = F.nll_loss(output, train_y[idx])
        loss.backward()
        optimizer.step()


def metric_average(val, name):
    tensor = torch.tensor(val)  # pylint: disable=not-callable
    avg_tensor = bf.allreduce(tensor, name=name)
    return avg_tensor.item()


def test():
    model.eval()
    with torch.no_grad():
        output = model(test_x)
        test_loss = F.nll_loss(output, test_y, reduction="sum").item() / len(test_y)
        test_accuracy = output.argmax(dim=1).eq(test_y).float().mean().item()
    test_loss = metric_average(test_loss, "avg_loss")
    test_accuracy = metric_average(test_accuracy, "avg_accuracy")
    if bf.rank() == 0:
        print(f"Test set: Average loss: {test_loss:.4f}, Accuracy: {100.0 * test_accuracy:.2f}%")
    return test_accuracy


for epoch in range(1, args.epochs + 1):
    train(epoch)
    accuracy = test()

if args.dist_optimizer == "win_put":
    bf.barrier()
    optimizer.unregister_window()
