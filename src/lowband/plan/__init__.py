"""``lowband plan``: predicted iteration time of every strategy on a workload and links (pure maths on a
profile measured once on this machine; only :mod:`lowband.plan.measure` contacts other ranks, to measure
the links of a launched job). See docs/ARCHITECTURE.md."""

from lowband.plan.links import Links, links_from_layout
from lowband.plan.measure import links_from_fit, measure_links
from lowband.plan.planner import Acceptance, Entry, default_specs, make_plan, predict_spec, recommend
from lowband.plan.prediction import Prediction
from lowband.plan.profile import PlanProfile, measure_profile

__all__ = [
    "Acceptance", "Entry", "Links", "PlanProfile", "Prediction", "default_specs", "links_from_fit",
    "links_from_layout", "make_plan", "measure_links", "measure_profile", "predict_spec", "recommend",
]  # fmt: skip
