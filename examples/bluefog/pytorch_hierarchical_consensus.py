"""Hierarchical neighbor averaging over machines, in BlueFog's style: every machine averages its ranks
and then mixes with the other machines. Run it as BlueFog's hierarchical tests are, with the machine
size given by ``BLUEFOG_NODES_PER_MACHINE``. Only the import line differs from a BlueFog program.

    BLUEFOG_NODES_PER_MACHINE=2 torchrun --nproc-per-node 4 examples/bluefog/pytorch_hierarchical_consensus.py
"""

import torch

import lowband.compat.bluefog.torch as bf

bf.init()
x = torch.full((4,), float(bf.rank()), dtype=torch.double)
others = [m for m in range(bf.machine_size()) if m != bf.machine_rank()]
if others:
    share = 0.25 / len(others)
    y = bf.hierarchical_neighbor_allreduce(
        x, self_weight=0.75, src_machine_weights={m: share for m in others}, dst_machine_weights=others
    )
else:
    y = bf.hierarchical_neighbor_allreduce(x)
bf.barrier()
print(
    f"rank={bf.rank()} local_rank={bf.local_rank()} local_size={bf.local_size()} "
    f"machine_rank={bf.machine_rank()} machine_size={bf.machine_size()} result={y[0].item():.6f}",
    flush=True,
)
bf.shutdown()
