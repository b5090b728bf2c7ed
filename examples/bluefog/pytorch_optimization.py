"""Decentralized least squares, written as BlueFog's examples/pytorch_optimization.py is: the optimum by
distributed gradient descent with allreduce, then exact diffusion, gradient tracking (neighbor_allreduce)
or push-DIGing (window ops). Only the two import lines differ from a BlueFog program.

    torchrun --nproc-per-node 4 examples/bluefog/pytorch_optimization.py --method push_diging
"""

import argparse

import torch

import lowband.compat.bluefog.torch as bf
from lowband.compat.bluefog.common import topology_util

parser = argparse.ArgumentParser(description="PyTorch decentralized optimization example")
parser.add_argument("--method", type=str, default="exact_diffusion",
                    help="exact_diffusion, gradient_tracking or push_diging")  # fmt: skip
parser.add_argument("--max-iter", type=int, default=300, help="maximum iterations")
parser.add_argument("--lr", type=float, default=0.1, help="step size")
parser.add_argument("--seed", type=int, default=123, help="random seed")
args = parser.parse_args()

bf.init()


def loss_step(X, y, w):
    """Local least-squares loss (mean over this rank's rows) and its gradient in w.grad."""
    loss = torch.mean((X.mm(w) - y) ** 2)
    loss.backward()
    return loss


def distributed_grad_descent(X, y, maxite=2000, alpha=0.1):
    """The global optimum: gradient descent on the average of the ranks' losses (allreduce)."""
    w_opt = torch.zeros(n, 1, dtype=torch.double, requires_grad=True)
    for _ in range(maxite):
        loss_step(X, y, w_opt)
        grad = bf.allreduce(w_opt.grad.data, name="gradient")
        w_opt.data = w_opt.data - alpha * grad
        w_opt.grad.data.zero_()
    return w_opt


def exact_diffusion(X, y, w_opt, maxite=300, alpha=0.1, use_Abar=True):
    topology = bf.load_topology()
    self_weight, neighbor_weights = topology_util.GetRecvWeights(topology, bf.rank())
    if use_Abar:
        self_weight = (self_weight + 1) / 2
        for k, v in neighbor_weights.items():
            neighbor_weights[k] = v / 2
    w = torch.zeros(n, 1, dtype=torch.double, requires_grad=True)
    phi, psi, psi_prev = w.clone(), w.clone(), w.clone()
    mse = []
    for _ in range(maxite):
        loss_step(X, y, w)
        with torch.no_grad():
            psi = w - alpha * w.grad.data
            phi = psi + w.data - psi_prev
            w.data = bf.neighbor_allreduce(phi, self_weight=self_weight, src_weights=neighbor_weights)
            psi_prev = psi
            w.grad.data.zero_()
        mse.append(torch.norm(w.data - w_opt.data, p=2))
    return w, mse


def gradient_tracking(X, y, w_opt, maxite=300, alpha=0.1):
    w = torch.zeros(n, 1, dtype=torch.double, requires_grad=True)
    loss_step(X, y, w)
    q = w.grad.data.clone()  # q^0 = grad(w^0)
    w.grad.data.zero_()
    grad_prev = q.clone()
    mse = []
    for _ in range(maxite):
        with torch.no_grad():
            w.data = bf.neighbor_allreduce(w.data, name="local variable w") - alpha * q
        loss_step(X, y, w)
        grad = w.grad.data.clone()
        q = bf.neighbor_allreduce(q, name="local variable q") + grad - grad_prev
        grad_prev = grad
        w.grad.data.zero_()
        mse.append(torch.norm(w.data - w_opt.data, p=2))
    return w, mse


def push_diging(X, y, w_opt, maxite=300, alpha=0.1):
    bf.set_topology(topology_util.ExponentialTwoGraph(bf.size()))
    outdegree = len(bf.out_neighbor_ranks())
    # the window holds [u, v, p]: the iterate, the gradient tracker and the push-sum weight
    w = torch.zeros(2 * n + 1, 1).to(torch.double)
    x = torch.zeros(n, 1, dtype=torch.double, requires_grad=True)
    loss_step(X, y, x)
    grad = x.grad.data.clone()
    w[n : 2 * n] = grad
    x.grad.data.zero_()
    w[-1] = 1.0
    grad_prev = w[n : 2 * n].clone()
    bf.win_create(w, name="w_buff", zero_init=True)
    mse = []
    for _ in range(maxite):
        bf.barrier()
        w[:n] = w[:n] - alpha * w[n : 2 * n]
        bf.win_accumulate(
            w, name="w_buff", dst_weights={rank: 1.0 / (outdegree + 1) for rank in bf.out_neighbor_ranks()},
            require_mutex=True,
        )  # fmt: skip
        w.div_(1 + outdegree)
        bf.barrier()
        w = bf.win_update_then_collect(name="w_buff")
        x.data = w[:n] / w[-1]
        loss_step(X, y, x)
        grad = x.grad.data.clone()
        x.grad.data.zero_()
        w[n : 2 * n] += grad - grad_prev
        grad_prev = grad
        mse.append(torch.norm(x.data - w_opt.data, p=2))
    bf.barrier()
    w = bf.win_update_then_collect(name="w_buff")
    x.data = w[:n] / w[-1]
    bf.barrier()
    bf.win_free()
    return x, mse


# Generate this rank's data: m rows of a linear model with noise.
m, n = 20, 5
generator = torch.Generator().manual_seed(args.seed + bf.rank())
X = torch.randn(m, n, dtype=torch.double, generator=generator)
x_o = torch.arange(1, n + 1, dtype=torch.double).reshape(n, 1)
y = X.mm(x_o) + 0.1 * torch.randn(m, 1, dtype=torch.double, generator=generator)

w_opt = distributed_grad_descent(X, y, maxite=400, alpha=args.lr)

if args.method == "exact_diffusion":
    w, mse = exact_diffusion(X, y, w_opt, maxite=args.max_iter, alpha=args.lr)
elif args.method == "gradient_tracking":
    w, mse = gradient_tracking(X, y, w_opt, maxite=args.max_iter, alpha=args.lr)
elif args.method == "push_diging":
    w, mse = push_diging(X, y, w_opt, maxite=args.max_iter, alpha=args.lr)
else:
    raise NotImplementedError("Algorithm not supported: exact_diffusion, gradient_tracking, push_diging")

relative_error = float(torch.norm(w.data - w_opt.data) / torch.norm(w_opt.data))
print(f"[{args.method}] Rank {bf.rank()}: relative error to the optimum {relative_error:.3e}")
