"""`t5x-like plan`: what a config costs on a topology, without running the model.

Parameter counts and shardings, FLOPs per step, per-device memory, step time and
wall-clock at an assumed MFU, per training phase; XLA's analyses of the compiled step
beside the estimates where the devices exist, and then a roofline bound on the step
time from the compiled program (roofline.py).
"""

from t5x_like.plan.report import make_plan
from t5x_like.plan.text import format_plan
from t5x_like.plan.topology import Topology, parse_topology, planned_mesh, present_topology

__all__ = ["Topology", "format_plan", "make_plan", "parse_topology", "planned_mesh",
           "present_topology"]
