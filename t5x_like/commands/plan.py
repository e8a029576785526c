"""`t5x-like plan --config FILE[:ARG] [--config.KEY=VALUE ...] [--topology NAME ...]
[--compile=yes [--fit_batch] [--search_layouts]]`.

Prints the plan of a config on each topology (default: the devices present) as text,
or with --json one JSON object per line. absl / ml-collections flags, as `train`.
"""

from __future__ import annotations

import json
import sys

from absl import flags
from ml_collections import config_flags

from t5x_like.command_flags import parse_flags
from t5x_like.plan.report import COMPILE_CHOICES


def _flags(argv: list[str]) -> flags.FlagValues:
  """The flags; `argv` is where --config.KEY=VALUE overrides are read from (ml-collections
  reads sys.argv otherwise, which an in-process call does not set)."""
  fv = flags.FlagValues()
  config_flags.DEFINE_config_file("config", None, "experiment config file[:arg]",
                                  flag_values=fv, lock_config=True, sys_argv=argv)
  flags.DEFINE_multi_string("topology", [], "v3-32, v3-128, v4-64, v5p-128, cpu-8, ...;"
                            " repeatable; default: the devices present", flag_values=fv)
  flags.DEFINE_float("mfu", 0.4, "assumed model FLOPs utilisation for the step time",
                     flag_values=fv)
  flags.DEFINE_bool("json", False, "one JSON object per topology instead of text",
                    flag_values=fv)
  flags.DEFINE_enum("compile", "auto", list(COMPILE_CHOICES),
                    "compile the real train step for XLA's analyses: auto = when the"
                    " topology's devices are all present", flag_values=fv)
  flags.DEFINE_bool("fit_batch", False, "with the compile: search, by compiling the train"
                    " step again (2-4 times per phase), for the largest per-device batch"
                    " that fits the device's memory", flag_values=fv)
  flags.DEFINE_bool("search_layouts", False, "with the compile: compile the train step of"
                    " every layout (data x fsdp x tensor, mesh.zero_stage) and print the"
                    " fastest that fits as --config. flags (plan/layouts.py)", flag_values=fv)
  return fv


def _config_source(argv: list[str]) -> str:
  for i, arg in enumerate(argv):
    if arg.startswith("--config="):
      return arg.split("=", 1)[1]
    if arg == "--config" and i + 1 < len(argv):
      return argv[i + 1]
  return "config"


def _search(config, topology, compile_step: str) -> dict:
  """plan/layouts.py's search on the topology's devices (present, or libtpu's)."""
  import jax
  from t5x_like.plan import tpu as tpu_lib
  from t5x_like.plan.layouts import search_layouts
  from t5x_like.plan.roofline import chip_for
  if compile_step == "no":
    raise ValueError("--search_layouts compiles every candidate: drop --compile=no")
  if topology.devices_present():
    devices = jax.devices(topology.platform)
  elif topology.platform == "tpu":
    devices = tpu_lib.slice_devices(topology)
  else:
    raise ValueError(f"--search_layouts: the {topology.num_devices} {topology.device_kind}"
                     f" devices of {topology.name} are not all present here")
  result = search_layouts(config, devices, chip_for(topology), topology.memory_bytes)
  chosen = result["chosen"]
  result["chosen_layout"] = None if chosen is None else chosen["layout"]
  result["mfu_ceiling"] = None if chosen is None else chosen.get("mfu_ceiling")
  return result


def main(argv: list[str]) -> int:
  fv = parse_flags("plan", argv, _flags, doc=__doc__)
  from t5x_like.plan.report import make_plan
  from t5x_like.plan.text import format_plan
  from t5x_like.plan.topology import parse_topology, present_topology
  from t5x_like.plan.tpu import quiet_backend_init
  quiet_backend_init()
  dtype = fv.config.model.dtype
  try:
    topologies = ([parse_topology(name, dtype) for name in fv.topology] if fv.topology
                  else [present_topology(dtype)])
    for topology in topologies:
      plan = make_plan(fv.config, topology, mfu=fv.mfu, compile_step=fv.compile,
                       fit_batch=fv.fit_batch)
      if fv.search_layouts:
        plan["layout_search"] = _search(fv.config, topology, fv.compile)
      if fv.json:
        print(json.dumps(plan), flush=True)
      else:
        print(format_plan(plan, _config_source(argv[1:])) + "\n", flush=True)
        if fv.search_layouts:
          from t5x_like.plan.layouts import search_lines
          print("\n".join(search_lines(plan["layout_search"])) + "\n", flush=True)
  except ValueError as e:
    print(f"t5x-like plan: {e}", file=sys.stderr)
    return 2
  return 0
