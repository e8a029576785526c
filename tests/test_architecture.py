"""The package's shape, read from its source: the import graph (every import, deferred
ones inside functions included) has no cycle, only the train command imports the
trainer, the lower layers (models/, data/, parallel/, checkpoint/, experiment,
command_flags, fs, errors) import nothing above them, fine-tuning and the benchmarks never
import the studies, and no module grows past ~400 lines."""

import ast
import os

import pytest
from helpers import ROOT

PACKAGE = os.path.join(ROOT, "t5x_like")
MAX_LINES = 420


def _module_name(path: str) -> str:
  name = os.path.relpath(path, ROOT)[:-len(".py")].replace(os.sep, ".")
  return name[:-len(".__init__")] if name.endswith(".__init__") else name


def _modules() -> dict[str, str]:
  return {_module_name(os.path.join(d, f)): os.path.join(d, f)
          for d, _, files in os.walk(PACKAGE) for f in files if f.endswith(".py")}


MODULES = _modules()


def _imports(name: str, path: str) -> set[str]:
  """The t5x_like modules `name` imports anywhere in its file (a package's __init__
  when a name is imported from the package)."""
  package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
  found = set()
  for node in ast.walk(ast.parse(open(path, encoding="utf-8").read())):
    if isinstance(node, ast.Import):
      found.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom):
      base = node.module or ""
      if node.level:
        parts = package.split(".")[:len(package.split(".")) - node.level + 1]
        base = ".".join(parts + [base] if base else parts)
      for alias in node.names:
        full = f"{base}.{alias.name}"
        found.add(full if full in MODULES else base)
  return {m for m in found if m in MODULES and m != name}


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
  """Strongly connected components of more than one module (Tarjan)."""
  index, low, stack, on_stack, out = {}, {}, [], set(), []

  def visit(v):
    index[v] = low[v] = len(index)
    stack.append(v)
    on_stack.add(v)
    for w in sorted(graph[v]):
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


def test_the_cycle_finder_finds_a_planted_cycle():
  graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
  assert _cycles(graph) == [["a", "b", "c"]]
  assert _cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_deferred_and_relative_imports():
  assert "t5x_like.infer" in GRAPH["t5x_like.finetune.evaluate"]
  assert "t5x_like.train.loop" in GRAPH["t5x_like.commands.train"]  # inside main()
  assert "t5x_like.experiment" in GRAPH["t5x_like.finetune.backbone"]  # inside a function


def test_no_import_cycle():
  assert _cycles(GRAPH) == []


def test_only_the_train_command_imports_the_trainer():
  importers = sorted(m for m, imports in GRAPH.items() if "t5x_like.train.loop" in imports)
  assert importers == ["t5x_like.commands.train"]


@pytest.mark.parametrize("layer, allowed", [
    ("t5x_like.models", ("t5x_like.models", "t5x_like.parallel.rules", "t5x_like.errors")),
    ("t5x_like.data", ("t5x_like.data", "t5x_like.corpus", "t5x_like.errors",
                       "t5x_like.fs")),
    ("t5x_like.experiment", ("t5x_like.data", "t5x_like.models", "t5x_like.parallel",
                             "t5x_like.errors")),
    ("t5x_like.parallel", ("t5x_like.parallel", "t5x_like.errors")),
    ("t5x_like.checkpoint", ("t5x_like.checkpoint", "t5x_like.errors", "t5x_like.fs",
                             "t5x_like.failpoints")),
    ("t5x_like.command_flags", ("t5x_like.errors",)),
    ("t5x_like.fs", ("t5x_like.errors",)),
    ("t5x_like.errors", ()),
])
def test_lower_layers_import_nothing_above_them(layer, allowed):
  above = sorted({(m, i) for m, imports in GRAPH.items()
                  if m == layer or m.startswith(layer + ".") for i in imports
                  if not any(i == a or i.startswith(a + ".") for a in allowed)})
  assert above == []


@pytest.mark.parametrize("room", ["t5x_like.finetune", "t5x_like.benchmarks"])
def test_fine_tuning_and_benchmarks_never_import_the_studies(room):
  """Three rooms: studies may import fine-tuning and benchmarks, never the reverse."""
  wrong = sorted((m, i) for m, imports in GRAPH.items()
                 if m == room or m.startswith(room + ".") for i in imports
                 if i == "t5x_like.studies" or i.startswith("t5x_like.studies."))
  assert wrong == []


def test_the_rooms_check_sees_a_study_import():
  """The check above is not vacuous: a study imports both rooms."""
  study = GRAPH["t5x_like.studies.text_task_experiment"]
  assert any(i.startswith("t5x_like.finetune.") for i in study)


def test_no_module_over_the_size_limit():
  sizes = {m: sum(1 for _ in open(p, encoding="utf-8")) for m, p in MODULES.items()}
  assert {m: n for m, n in sizes.items() if n > MAX_LINES} == {}
