"""The package's shape, read from its source (the AST of every module, deferred imports
inside functions included): the rooms of t5x_like (each top-level folder or module)
stand in an ordered list of layers and every import points down it, the product never
imports the studies, no module reaches outside the package for the repository's
configs/, no file import cycle, only the train command imports the trainer, and files
grown long are named for a look.

`python3 tests/test_architecture.py` prints the room graph: each room's layer and the
rooms it imports."""

import ast
import os
import re
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from helpers import ROOT  # noqa: E402  (run as a script too)

PACKAGE = os.path.join(ROOT, "t5x_like")

# The rooms from the bottom up. A room imports only rooms of lower layers, never one of
# its own layer or above; a new room takes its place here.
LAYERS = [
    ("errors",),  # the exit statuses and UserError: below everything
    ("fs", "command_flags", "failpoints", "gpu_flags", "corpus", "parallel", "models"),
    ("data", "checkpoint", "infer", "hf"),
    ("experiment", "task_builders", "host_loss"),  # config -> objects; surviving a lost host
    ("train",),
    ("plan",),  # compiles train steps; chooses remat for the train command
    ("finetune",),
    ("benchmarks", "speed"),  # task benchmarks (GLUE, ...); speed benchmarks
    ("studies",),  # the research drivers: the lab, imported by nothing in the product
    ("commands",),
    ("cli",),
]
LAYER_OF = {room: i for i, rooms in enumerate(LAYERS) for room in rooms}

# Files over LOOK_AT_LINES are named here, each once looked at: a new long file fails
# until someone reads it and either splits it by job or adds it with why it is one job.
# Past HARD_LIMIT_LINES a file fails whatever the list says. A flag for a look, not a
# cap that shapes files: a file trimmed to fit a cap keeps its two jobs.
LOOK_AT_LINES = 400
HARD_LIMIT_LINES = 600
LONG_FILES = {
    "t5x_like/plan/hlo.py": "one job: reading a compiled step's HLO",
    "t5x_like/models/model.py": "one job: the three families' model contract",
    "t5x_like/checkpoint/checkpointer.py": "one job: saving and restoring train state",
    "t5x_like/train/config_check.py": "one job: validating a config before a run",
    "t5x_like/command_flags.py": "one job: a command's command line (absl flags, --config"
                                 " overrides and their open sections, usage, errors)",
}


# ============================================================================ the graph
def _module_name(path: str) -> str:
  name = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
  return name[:-len(".__init__")] if name.endswith(".__init__") else name


def _modules() -> dict[str, str]:
  return {_module_name(os.path.join(d, f)): os.path.join(d, f)
          for d, _, files in os.walk(PACKAGE) for f in files if f.endswith(".py")}


MODULES = _modules()
SOURCES = {name: open(path, encoding="utf-8").read() for name, path in MODULES.items()}
TREES = {name: ast.parse(source) for name, source in SOURCES.items()}


def _imports(name: str, tree: ast.AST, modules) -> set[str]:
  """The t5x_like modules `name` imports anywhere in its file (a package's __init__
  when a name is imported from the package)."""
  is_package = modules.get(name, "").endswith("__init__.py")
  package = name if is_package else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(tree):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + [base] if base else parts)
      for alias in node.names:
        full = f"{base}.{alias.name}"
        found.add(full if full in modules else base)
  return {m for m in found if m in modules and m != name}


GRAPH = {name: _imports(name, tree, MODULES) for name, tree in TREES.items()}


def room(module: str) -> str:
  """t5x_like.train.loop -> train; t5x_like.errors -> errors; t5x_like -> ''."""
  return module.split(".")[1] if "." in module else ""


def climbs(graph: dict[str, set[str]], layer_of: dict[str, int]) -> list[tuple[str, str]]:
  """(importer, imported) pairs where a room imports one of its own layer or above;
  a room missing from layer_of climbs everywhere (it must be given its place)."""
  out = []
  for m, imports in graph.items():
    for i in imports:
      a, b = room(m), room(i)
      if a and b and a != b and layer_of.get(a, -1) <= layer_of.get(b, len(layer_of) + 99):
        out.append((m, i))
  return sorted(out)


def study_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
  """(product module, study module) pairs: the product never imports the lab."""
  return sorted((m, i) for m, imports in graph.items() for i in imports
                if room(i) == "studies" and room(m) != "studies")


_CONFIGS_SEGMENT = re.compile(r"(^|[/\\])configs([/\\]|$)")


def reaches_outside(tree: ast.AST) -> bool:
  """A module that builds a path from its own file (`__file__`) and names a `configs`
  folder: the repository's configs/ is not shipped with the package."""
  names_file = any(isinstance(n, ast.Name) and n.id == "__file__" for n in ast.walk(tree))
  docstrings = {id(n.value) for n in ast.walk(tree) if isinstance(n, ast.Expr)}
  return names_file and any(
      isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docstrings
      and _CONFIGS_SEGMENT.search(n.value) for n in ast.walk(tree))


def room_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
  """room -> the other rooms it imports."""
  out: dict[str, set[str]] = {}
  for m, imports in graph.items():
    if room(m):
      out.setdefault(room(m), set()).update(room(i) for i in imports
                                             if room(i) and room(i) != room(m))
  return out


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph.get(v, ())):
      if w not in index:
        visit(w)
        low[v] = min(low[v], low[w])
      elif w in on_stack:
        low[v] = min(low[v], index[w])
    if low[v] == index[v]:
      component = []
      while True:
        w = stack.pop()
        on_stack.discard(w)
        component.append(w)
        if w == v:
          break
      if len(component) > 1:
        out.append(sorted(component))

  for v in sorted(graph):
    if v not in index:
      visit(v)
  return out


# ============================================================================ the checks
def test_every_room_has_its_place_in_the_layers():
  assert sorted(set(room_graph(GRAPH)) - set(LAYER_OF)) == []


def test_every_import_points_down_the_layers():
  assert climbs(GRAPH, LAYER_OF) == []


def test_the_product_never_imports_the_studies():
  assert study_imports(GRAPH) == []


def test_no_module_reaches_outside_the_package_for_configs():
  assert sorted(m for m, tree in TREES.items()
                if "__file__" in SOURCES[m] and reaches_outside(tree)) == []


def test_no_import_cycle():
  assert _cycles(GRAPH) == []


def test_only_the_train_command_imports_the_trainer():
  importers = sorted(m for m, imports in GRAPH.items() if "t5x_like.train.loop" in imports)
  assert importers == ["t5x_like.commands.train"]


def test_long_files_are_named_for_a_look():
  sizes = {os.path.relpath(p, ROOT): sum(1 for _ in open(p, encoding="utf-8"))
           for p in MODULES.values()}
  assert {f: n for f, n in sizes.items() if n > HARD_LIMIT_LINES} == {}
  assert sorted(f for f, n in sizes.items() if n > LOOK_AT_LINES and f not in LONG_FILES) == []


# ================================================== each check can fail (planted cases)
def test_the_cycle_finder_finds_a_planted_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _cycles(graph) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_layer_check_finds_a_planted_climb():
  graph = {"t5x_like.train.loop": {"t5x_like.plan.remat", "t5x_like.data.loader"},
           "t5x_like.plan.remat": {"t5x_like.train.state"},
           "t5x_like.data.loader": {"t5x_like.errors"},
           "t5x_like.errors": set(), "t5x_like.train.state": set()}
  assert climbs(graph, LAYER_OF) == [("t5x_like.train.loop", "t5x_like.plan.remat")]
  same_layer = {"t5x_like.models.x": {"t5x_like.parallel.y"}, "t5x_like.parallel.y": set()}
  assert climbs(same_layer, LAYER_OF) == [("t5x_like.models.x", "t5x_like.parallel.y")]
  unplaced = {"t5x_like.newroom.a": {"t5x_like.errors"}, "t5x_like.errors": set()}
  assert climbs(unplaced, LAYER_OF) == [("t5x_like.newroom.a", "t5x_like.errors")]
  graph["t5x_like.commands.train"] = {"t5x_like.cli"}  # commands included
  assert ("t5x_like.commands.train", "t5x_like.cli") in climbs(graph, LAYER_OF)


def test_the_study_check_finds_a_planted_study_import():
  graph = {"t5x_like.commands.task": {"t5x_like.studies.text_tasks"},
           "t5x_like.studies.glue_experiment": {"t5x_like.studies.text_tasks",
                                                "t5x_like.finetune.loop"}}
  assert study_imports(graph) == [("t5x_like.commands.task", "t5x_like.studies.text_tasks")]


@pytest.mark.parametrize("source, reaches", [
    ('import os\nCONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname('
     'os.path.abspath(__file__)))), "configs")\n', True),
    ('import os\nC = os.path.join(os.path.dirname(__file__), "..", "..", "configs")\n', True),
    ('import pathlib\nC = pathlib.Path(__file__).parents[2] / "configs/bert_cpu.py"\n', True),
    ('"""Run with --config configs/bert_cpu.py."""\nimport os\nHERE = os.path.dirname(__file__)\n',
     False),
    ('def f(workdir):\n  return workdir + "/configs"\n', False),
])
def test_the_reach_check_finds_a_planted_configs_path(source, reaches):
  assert reaches_outside(ast.parse(source)) == reaches


def test_the_graph_sees_deferred_and_relative_imports():
  assert "t5x_like.infer" in GRAPH["t5x_like.finetune.evaluate"]
  assert "t5x_like.train.loop" in GRAPH["t5x_like.commands.train"]  # inside main()
  assert "t5x_like.experiment" in GRAPH["t5x_like.finetune.backbone"]  # inside a function


# ========================================================================== the drawing
def draw(graph: dict[str, set[str]] = GRAPH) -> str:
  """One line per room from the bottom: its layer, its name, the rooms it imports (each
  with its layer), then the counts of climbs and cycles."""
  rooms = room_graph(graph)
  lines = []
  for i, layer in enumerate(LAYERS):
    for r in layer:
      imported = ", ".join(f"{d}({LAYER_OF.get(d, '?')})"
                           for d in sorted(rooms.get(r, ()), key=lambda d: (LAYER_OF.get(d, 99), d)))
      lines.append(f"{i:2d} {r:14s} -> {imported or '-'}")
  lines.append(f"climbs: {len(climbs(graph, LAYER_OF))}; study imports: {len(study_imports(graph))};"
               f" file cycles: {len(_cycles(graph))}; room cycles: {len(_cycles(rooms))}")
  return "\n".join(lines)


if __name__ == "__main__":
  print(draw())


def test_fine_tuning_imports_neither_the_benchmarks_nor_plan():
  """finetune/ takes its data source (benchmarks/task_data.py for a benchmark) and its
  remat chooser (plan/remat.py) from the caller: it imports neither room (issue 56 item 1)."""
  wrong = sorted((m, i) for m, imports in GRAPH.items() if m.startswith("t5x_like.finetune")
                 for i in imports if i.startswith(("t5x_like.benchmarks", "t5x_like.plan")))
  assert wrong == []
  assert "t5x_like.finetune.splits" in GRAPH["t5x_like.benchmarks.task_data"]  # the seam
