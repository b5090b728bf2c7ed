"""DreamDDP: local SGD with partial synchronisation, scheduled to hide communication behind backward.

Pure maths (no communication): the cost model (``costmodel``: per-layer costs, the Eq. 7 event model,
the Eq. 8 objective), the schedule type (``schedule``), DreamDDP's Algorithm 2 with bubble filling
(``algorithm2``) and the other schedulers with their registry (``schedulers``).

Quick use::

    from lowband.localsgd import random_profile, make_schedule
    p = random_profile(30, seed=0, comm_ratio=2.0)
    s = make_schedule("dreamddp", p, 5)      # s.sets[h]: layers averaged in local iteration h
    s.layers_at(step)                        # layers to average at global step `step`
"""

from lowband.localsgd.algorithm2 import (
    count_dreamddp_solutions,
    dreamddp_sets,
    dreamddp_solutions,
    fill_bubbles,
    schedule_dreamddp,
)
from lowband.localsgd.costmodel import (
    CostProfile,
    LayerCost,
    comm_end,
    eq8_set_cost,
    exposed_comm_time,
    flsgd_period_time,
    iteration_time,
    iteration_times,
    objective_eq8,
    period_time,
)

# the profiler (measures), the runtime (averages layers in place) and the strategies built on them
from lowband.localsgd.divergence import model_divergence
from lowband.localsgd.interference import measure_interference
from lowband.localsgd.intervals import IntervalCosts
from lowband.localsgd.profiler import (
    fit_comm,
    load_profile,
    measure_comm,
    profile_model,
    refit_comm,
    save_profile,
    with_comm,
)
from lowband.localsgd.runtime import LayerAverager
from lowband.localsgd.schedule import Schedule, check_period
from lowband.localsgd.schedulers import (
    SCHEDULERS,
    make_schedule,
    schedule_bruteforce,
    schedule_enp,
    schedule_full,
    schedule_optimal,
    scheduler_names,
)
from lowband.localsgd.strategy import FLSGDOverlapStrategy, PartialSyncStrategy, PLSGDENPStrategy
from lowband.localsgd.synthetic import random_profile

__all__ = [
    "SCHEDULERS",
    "CostProfile",
    "FLSGDOverlapStrategy",
    "IntervalCosts",
    "LayerAverager",
    "LayerCost",
    "PLSGDENPStrategy",
    "PartialSyncStrategy",
    "Schedule",
    "check_period",
    "comm_end",
    "count_dreamddp_solutions",
    "dreamddp_sets",
    "dreamddp_solutions",
    "eq8_set_cost",
    "exposed_comm_time",
    "fill_bubbles",
    "fit_comm",
    "flsgd_period_time",
    "iteration_time",
    "iteration_times",
    "load_profile",
    "make_schedule",
    "measure_comm",
    "measure_interference",
    "model_divergence",
    "objective_eq8",
    "period_time",
    "profile_model",
    "random_profile",
    "refit_comm",
    "save_profile",
    "schedule_bruteforce",
    "schedule_dreamddp",
    "schedule_enp",
    "schedule_full",
    "schedule_optimal",
    "scheduler_names",
    "with_comm",
]
