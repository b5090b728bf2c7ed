"""Average consensus, written as BlueFog's examples/pytorch_average_consensus.py is: synchronous neighbor
averaging over a static or a one-peer dynamic topology, or asynchronous push-sum with window ops that
carry an associated p. Only the two import lines differ from a BlueFog program.

    torchrun --nproc-per-node 4 examples/bluefog/pytorch_average_consensus.py --asynchronous-mode
"""

import argparse

import torch

import lowband.compat.bluefog.torch as bf
from lowband.compat.bluefog.common import topology_util

parser = argparse.ArgumentParser(description="PyTorch Average Consensus Example")
parser.add_argument("--data-size", type=int, default=1000, help="the size of data.")
parser.add_argument("--max-iters", type=int, default=200, help="maximum iterations")
parser.add_argument("--virtual-topology", type=str, default="expo2", help="expo2, ring, mesh, star")
parser.add_argument("--asynchronous-mode", action="store_true", default=False, help="use window ops")
parser.add_argument("--enable-dynamic-topology", action="store_true", default=False, help="one peer per step")
parser.add_argument("--seed", type=int, default=2020, help="random seed")
args = parser.parse_args()

bf.init()
generator = torch.Generator().manual_seed(args.seed * (bf.rank() + 1))

if args.virtual_topology == "expo2":
    pass
elif args.virtual_topology == "ring":
    bf.set_topology(topology_util.RingGraph(bf.size(), connect_style=0))
elif args.virtual_topology == "mesh":
    bf.set_topology(topology_util.MeshGrid2DGraph(bf.size()), is_weighted=True)
elif args.virtual_topology == "star":
    bf.set_topology(topology_util.StarGraph(bf.size()))
else:
    raise NotImplementedError("Topology not supported: expo2, ring, mesh and star only")

x = torch.randn(args.data_size, dtype=torch.double, generator=generator)
x_bar = bf.allreduce(x, average=True)
mse = []

if not args.asynchronous_mode:
    if args.enable_dynamic_topology:
        dynamic_neighbors = topology_util.GetDynamicOnePeerSendRecvRanks(bf.load_topology(), bf.rank())
    for _ in range(args.max_iters):
        if args.enable_dynamic_topology:
            send_neighbors, recv_neighbors = next(dynamic_neighbors)
            neighbor_weights = {r: 1 / (len(recv_neighbors) + 1) for r in recv_neighbors}
            self_weight = 1 / (len(recv_neighbors) + 1)
            x = bf.neighbor_allreduce(
                x,
                name="x",
                self_weight=self_weight,
                src_weights=neighbor_weights,
                dst_weights=send_neighbors,
                enable_topo_check=False,
            )
        else:
            x = bf.neighbor_allreduce(x, name="x")
        mse.append(torch.norm(x - x_bar, p=2) / torch.norm(x_bar, p=2))
else:
    outdegree = len(bf.out_neighbor_ranks())
    bf.turn_on_win_ops_with_associated_p()
    bf.win_create(x, name="x", zero_init=True)
    for i in range(args.max_iters):
        if args.enable_dynamic_topology:
            sent_neighbor = bf.out_neighbor_ranks()[i % outdegree]
            dst_weights = {sent_neighbor: 0.5}
            self_weight = 0.5
        else:
            dst_weights = {rank: 1.0 / (outdegree + 1) for rank in bf.out_neighbor_ranks()}
            self_weight = 1 / (1 + outdegree)
        bf.win_accumulate(x, name="x", self_weight=self_weight, dst_weights=dst_weights, require_mutex=True)
        bf.win_update_then_collect(name="x")
        associated_p = bf.win_associated_p(name="x")
        mse.append(torch.norm(x / associated_p - x_bar, p=2) / torch.norm(x_bar, p=2))

    # Do not forget to sync at last!
    bf.barrier()
    bf.win_update_then_collect(name="x")
    associated_p = bf.win_associated_p(name="x")
    x = x / associated_p
    mse.append(torch.norm(x - x_bar, p=2) / torch.norm(x_bar, p=2))
    bf.barrier()
    bf.win_free(name="x")
    bf.turn_off_win_ops_with_associated_p()

print(f"Rank {bf.rank()}: MSE at last iteration: {float(mse[-1]):.3e}")
