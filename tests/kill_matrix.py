"""The kill matrix (issue 44): SIGKILL a random process of a supervised multi-process run
at random points, and check that the run finishes by itself as an uninterrupted one.

  .venv/bin/python tests/kill_matrix.py --processes 2,4 --kills 20 --seed 0

From the seed it picks, for each kill, a (config, process count) among the smoke configs
(bert_cpu, t5_cpu, gpt_cpu) and --processes, a victim process, and a point:

  in_step        step S's train step dispatched, still running       (S in 1..12)
  during_save    step S's asynchronous checkpoint being written       (S in 4, 8, 12)
  during_eval    between the eval batches of step S                   (S in 6, 12)
  first_compile  0.5 s into the first train step's compile (step 1)

The kills of one (config, process count) form one supervised run (`t5x-like supervise
--num_processes=N -- train ...`): each fires once, in the process it names, at the
first time that process reaches its point, whichever restart that is. The kill is a
SIGKILL the process sends itself at a named point (T5X_LIKE_FAILPOINT, items
POINT@STEP:PROCESS, with T5X_LIKE_FAILPOINT_ONCE; t5x_like/failpoints.py) rather than
one from outside on a timer: on a loaded 2-core machine a timer lands anywhere, while a
failpoint hits the window it names on every run, and the table says which one it hit.

Each (config, N) also runs once uninterrupted under the same supervisor. A run passes
when it exits 0 within its bound, every kill fired, and its train losses, its eval
rows (metrics.jsonl) and every array of its final checkpoint equal the uninterrupted
run's bit for bit. One row per kill, then a summary; the exit status is 1 on any
failure. tests/test_kill_matrix.py runs a short version (slow tier).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import random
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from typing import Optional

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
os.environ.setdefault("JAX_PLATFORMS", "cpu")  # the comparison reads checkpoints on CPU
from helpers import CONFIGS, ROOT, child_env, cli_command, eval_rows, losses  # noqa: E402

CONFIG_NAMES = {"bert": "bert_cpu.py:smoke", "t5": "t5_cpu.py:smoke", "gpt": "gpt_cpu.py:smoke"}
NUM_STEPS, CHECKPOINT_EVERY, EVAL_EVERY = 12, 4, 6
TRAIN_FLAGS = (f"--config.train.num_steps={NUM_STEPS}", "--config.train.log_every=1",
               f"--config.train.checkpoint_every={CHECKPOINT_EVERY}",
               f"--config.train.eval_every={EVAL_EVERY}",
               "--config.train.async_checkpoints=True")
# point shown -> (failpoint name, the steps it may fire at)
POINTS = {
    "in_step": ("in_step", list(range(1, NUM_STEPS + 1))),
    "during_save": ("after_save", list(range(CHECKPOINT_EVERY, NUM_STEPS + 1,
                                             CHECKPOINT_EVERY))),
    "during_eval": ("during_eval", list(range(EVAL_EVERY, NUM_STEPS + 1, EVAL_EVERY))),
    "first_compile": ("first_compile", [1]),
}
DEVICES = 8  # fake CPU devices in all: 8 // N per process


@dataclasses.dataclass
class Kill:
  victim: int
  point: str  # a key of POINTS
  step: int

  @property
  def item(self) -> str:
    """Its T5X_LIKE_FAILPOINT item."""
    return f"{POINTS[self.point][0]}@{self.step}:{self.victim}"


@dataclasses.dataclass
class Outcome:
  """What one supervised run did."""
  returncode: Optional[int]  # None: past its bound
  seconds: float
  restarts: int
  resumed: list  # the step each restart resumed from, in order
  fired: list  # the items that fired, in the order they fired
  log: str


# ------------------------------------------------------------------------- plan
def plan(seed: int, kills: int, configs: list[str], processes: list[int]
         ) -> dict[tuple[str, int], list[Kill]]:
  """{(config, N): its kills}: `kills` kills over every (config, N) in turn, the points
  in turn, victims and steps at random; no (point, step) twice in one run, at most one
  first_compile (only the first start begins at step 0 for sure)."""
  rng = random.Random(seed)
  cells = [(c, n) for c in configs for n in processes]
  rng.shuffle(cells)
  points = list(POINTS)
  rng.shuffle(points)
  runs: dict[tuple[str, int], list[Kill]] = {cell: [] for cell in cells}
  for k in range(kills):
    cell = cells[k % len(cells)]
    taken = {(x.point, x.step) for x in runs[cell]}
    for offset in range(len(points)):  # the next point in turn that still has a step free
      point = points[(k + offset) % len(points)]
      free = [s for s in POINTS[point][1] if (point, s) not in taken]
      if free:
        break
    runs[cell].append(Kill(rng.randrange(cell[1]), point, rng.choice(free)))
  return {cell: ks for cell, ks in runs.items() if ks}


# ---------------------------------------------------------------------- running
def supervised_run(config: str, n: int, workdir: str, kills: list[Kill], bound_s: float,
                   stop_grace_s: float = 5.0) -> Outcome:
  """`t5x-like supervise --num_processes=n -- train` of `config` in workdir, with the
  kills armed; stopped (SIGTERM, then SIGKILL) past bound_s."""
  once = os.path.join(workdir + ".fired")
  os.makedirs(once, exist_ok=True)
  env = child_env(DEVICES)
  env.pop("T5X_LIKE_FAILPOINT", None)
  if kills:
    env.update(T5X_LIKE_FAILPOINT=",".join(k.item for k in kills),
               T5X_LIKE_FAILPOINT_ONCE=once)
  cmd = cli_command("supervise", f"--num_processes={n}",
                    f"--cpu_devices_per_process={DEVICES // n}",
                    f"--max_restarts={len(kills) + 2}", f"--stop_grace_seconds={stop_grace_s}",
                    "--", "train", f"--config={CONFIGS}/{config}", f"--workdir={workdir}",
                    *TRAIN_FLAGS)
  log_path = workdir + ".log"
  start = time.monotonic()
  with open(log_path, "w") as log:
    proc = subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
      returncode = proc.wait(timeout=bound_s)
    except subprocess.TimeoutExpired:
      returncode = None
      proc.send_signal(signal.SIGTERM)  # the supervisor stops its workers
      try:
        proc.wait(timeout=60)
      except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
  seconds = time.monotonic() - start
  text = open(log_path).read()
  resumed = [int(m.group(1)) if m.group(1) else 0 for m in re.finditer(
      r"supervisor: restart \d+/\d+: .*?(?:resuming from step (\d+)|starting from step 0)",
      text)]
  fired = sorted(os.listdir(once), key=lambda item: _fired_at(os.path.join(once, item)))
  return Outcome(returncode, seconds, len(resumed), resumed, fired, text)


def _fired_at(path: str) -> float:
  match = re.search(r"at ([\d.]+)", open(path).read())
  return float(match.group(1)) if match else 0.0


# -------------------------------------------------------------------- comparing
def final_checkpoint_arrays(workdir: str) -> tuple[int, dict]:
  """(step, {path: numpy array}) of the train state of workdir's newest committed
  checkpoint, read back with orbax as numpy (no mesh, any process count)."""
  import jax
  import numpy as np
  import orbax.checkpoint as ocp
  from etils import epath
  from t5x_like.train.pretrained import find_checkpoint
  step_dir = find_checkpoint(epath.Path(workdir))
  handler = ocp.PyTreeCheckpointHandler()
  try:
    tree = handler.metadata(step_dir / "state")
    tree = getattr(tree, "tree", tree)
    args = jax.tree.map(lambda _: ocp.RestoreArgs(restore_type=np.ndarray), tree)
    state = handler.restore(step_dir / "state", args=ocp.args.PyTreeRestore(restore_args=args))
  finally:
    handler.close()
  return int(step_dir.name), {jax.tree_util.keystr(path): np.asarray(leaf)
                              for path, leaf in jax.tree_util.tree_leaves_with_path(state)}


def differences(reference: str, workdir: str) -> list[str]:
  """How workdir's run differs from the reference run's: [] when the losses, the eval
  rows and the final checkpoint's arrays are the same bit for bit."""
  import numpy as np
  out = []
  try:
    ref_losses, got_losses = losses(reference), losses(workdir)
    if got_losses != ref_losses:
      steps = sorted(s for s in ref_losses.keys() | got_losses.keys()
                     if ref_losses.get(s) != got_losses.get(s))
      out.append(f"losses differ at steps {steps[:6]}")
    if eval_rows(workdir) != eval_rows(reference):
      out.append(f"eval rows differ: {sorted(eval_rows(workdir))} vs"
                 f" {sorted(eval_rows(reference))} (steps)")
    (ref_step, ref), (step, got) = final_checkpoint_arrays(reference), final_checkpoint_arrays(workdir)
    if step != ref_step:
      out.append(f"final checkpoint step {step} != {ref_step}")
    elif got.keys() != ref.keys():
      out.append(f"final checkpoint names differ: {sorted(got.keys() ^ ref.keys())[:3]}")
    else:
      unequal = [k for k in ref if ref[k].dtype != got[k].dtype or not np.array_equal(
          ref[k], got[k])]
      if unequal:
        out.append(f"{len(unequal)} of {len(ref)} final arrays differ: {unequal[:3]}")
  except Exception as e:  # noqa: BLE001  (a missing file is a failed run, reported so)
    out.append(f"could not compare: {type(e).__name__}: {e}")
  return out


# ------------------------------------------------------------------------- main
def run_matrix(runs: dict[tuple[str, int], list[Kill]], root: str, start_bound_s: float,
               echo=print) -> list[dict]:
  """Runs each (config, N) uninterrupted once and with its kills; one dict per kill."""
  rows = []
  echo(f"{'config':6} {'N':>2} {'victim':>6} {'point':<17} {'fired':>5} {'resumed':>7}"
       f" {'restarts':>8} {'seconds':>7} {'ref s':>6}  equal")
  for (name, n), kills in runs.items():
    config = CONFIG_NAMES[name]
    reference = os.path.join(root, f"{name}_{n}_reference")
    ref = supervised_run(config, n, reference, [], start_bound_s)
    workdir = os.path.join(root, f"{name}_{n}_killed")
    got = supervised_run(config, n, workdir, kills, start_bound_s * (len(kills) + 1))
    problems = []
    if ref.returncode != 0:
      problems.append(f"the uninterrupted run exited {ref.returncode}: {ref.log[-800:]}")
    if got.returncode != 0:
      problems.append(f"the killed run {'ran past its bound' if got.returncode is None else f'exited {got.returncode}'}"
                      f": {got.log[-1500:]}")
    unfired = [k.item for k in kills if k.item not in got.fired]
    if unfired:
      problems.append(f"never fired: {unfired}")
    if not problems:
      problems = differences(reference, workdir)
    for kill in kills:
      order = got.fired.index(kill.item) if kill.item in got.fired else None
      resumed = (got.resumed[order] if order is not None and order < len(got.resumed)
                 else None)
      row = dict(config=name, processes=n, victim=kill.victim, point=kill.point,
                 step=kill.step, fired=order is not None, resumed=resumed,
                 restarts=got.restarts, seconds=round(got.seconds, 1),
                 reference_seconds=round(ref.seconds, 1), equal=not problems)
      rows.append(row)
      echo(f"{name:6} {n:>2} {kill.victim:>6} {kill.point + '@' + str(kill.step):<17}"
           f" {'yes' if row['fired'] else 'no':>5} {'-' if resumed is None else resumed:>7}"
           f" {got.restarts:>8} {got.seconds:>7.0f} {ref.seconds:>6.0f}  "
           f"{'yes' if row['equal'] else 'NO'}")
    for problem in problems:
      echo(f"  {name} N={n}: {problem}")
  return rows


def main(argv=None) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
  parser.add_argument("--processes", default="2,4", help="process counts, e.g. 2,4")
  parser.add_argument("--kills", type=int, default=20, help="kills in all")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--configs", default="bert,t5,gpt", help="of " + ",".join(CONFIG_NAMES))
  parser.add_argument("--start_seconds", type=float, default=300.0,
                      help="bound of one start: a run with K kills must finish within"
                           " (K + 1) times this")
  parser.add_argument("--workdir", default=None, help="where the runs go (default: a"
                      " temporary directory, deleted after a run that passes)")
  args = parser.parse_args(argv)
  configs = args.configs.split(",")
  processes = [int(n) for n in args.processes.split(",")]
  bad = [c for c in configs if c not in CONFIG_NAMES] + [n for n in processes
                                                         if n < 2 or DEVICES % n]
  if bad:
    parser.error(f"unknown config or process count {bad}: configs of"
                 f" {sorted(CONFIG_NAMES)}, process counts 2, 4 or 8")
  root = args.workdir or tempfile.mkdtemp(prefix="kill_matrix_")
  os.makedirs(root, exist_ok=True)
  runs = plan(args.seed, args.kills, configs, processes)
  print(f"kill matrix: {args.kills} kills, seed {args.seed}, {len(runs)} supervised runs"
        f" (+ {len(runs)} uninterrupted) in {root}; load average"
        f" {' '.join(f'{x:.1f}' for x in os.getloadavg())} on {os.cpu_count()} cores",
        flush=True)
  started = time.monotonic()
  rows = run_matrix(runs, root, args.start_seconds,
                    echo=lambda line: print(line, flush=True))
  failed = [r for r in rows if not r["equal"]]
  runs_failed = {(r["config"], r["processes"]) for r in failed}
  print(f"summary: {len(rows) - len(failed)}/{len(rows)} kills recovered to the"
        f" uninterrupted run bit for bit; {sum(r['fired'] for r in rows)} fired;"
        f" {len(runs) - len(runs_failed)}/{len(runs)} runs passed in"
        f" {time.monotonic() - started:.0f} s; load average now"
        f" {' '.join(f'{x:.1f}' for x in os.getloadavg())}")
  if not failed and not args.workdir:
    shutil.rmtree(root, ignore_errors=True)
  return 1 if failed else 0


if __name__ == "__main__":
  sys.exit(main())
