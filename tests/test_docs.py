"""The manual points at what exists: every repository path a page names (README.md,
configs/README.md, launch/README.md, docs/*.md) is there, every config in configs/ is
listed in configs/README.md, and the README's package map names every command, every
folder and every top-level module of the package. Reads text only: no jax, well under a
second."""

import ast
import glob
import os
import re

import pytest

from helpers import ROOT

PAGES = ["README.md", "configs/README.md", "launch/README.md",
         *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "*.md")))]

# A repository path: one of the tracked top-level folders, then path characters; not
# the tail of a longer path (workdir/configs/..., gs://bucket/tests/...).
_PATH = re.compile(r"(?<![\w./:~$-])((?:t5x_like|configs|docs|launch|tests|\.ci)/[\w./*-]*)")
# A relative Markdown link: [text](target), target neither a URL nor an anchor.
_LINK = re.compile(r"\]\((?!https?:|mailto:|#)([^)\s#]+)(?:#[^)]*)?\)")
# A dotted module of the package (`python -m t5x_like.studies.glue_experiment`).
_MODULE = re.compile(r"(?<![\w.~/:])(t5x_like(?:\.\w+)+)(?![\w.-])")


def _exists(path: str) -> bool:
  """A file or folder of the repository; a glob (tests/test_bench*.py) that matches one."""
  path = path.rstrip(".").rstrip(",")
  full = os.path.join(ROOT, path)
  return bool(glob.glob(full)) if "*" in path else os.path.exists(full)


def _module_exists(dotted: str) -> bool:
  """t5x_like.a.b names a module or package, a name inside a module (t5x_like.cli.main),
  or a function a package defines or imports in its __init__ (t5x_like.hf.load); not
  t5x_like.studies.books, a module that is not there."""
  parts = dotted.split(".")
  base = os.path.join(ROOT, *parts)
  if os.path.isfile(base + ".py") or os.path.isdir(base):
    return True
  module = os.path.dirname(base)
  init = os.path.join(module, "__init__.py")
  if os.path.isfile(module + ".py"):
    return True
  if not os.path.isfile(init):
    return False
  name = parts[-1]
  defines = re.compile(rf"^def {name}\b|^from .* import .*\b{name}\b|^{name} = ", re.M)
  return defines.search(open(init, encoding="utf-8").read()) is not None


def missing_paths(text: str, page: str = "README.md") -> list[str]:
  """The repository paths, relative links and package modules that `text` (the page at
  `page`, for its relative links) names and that do not exist."""
  out = [p for p in _PATH.findall(text) if not _exists(p)]
  folder = os.path.dirname(page)
  out += [t for t in _LINK.findall(text) if not _exists(os.path.normpath(os.path.join(folder, t)))]
  out += [m for m in _MODULE.findall(text) if not _module_exists(m)]
  return sorted(set(out))


@pytest.mark.parametrize("page", PAGES)
def test_every_path_a_page_names_exists(page):
  with open(os.path.join(ROOT, page), encoding="utf-8") as f:
    assert missing_paths(f.read(), page) == []


def test_the_path_check_finds_a_planted_bad_path():
  assert missing_paths("see `t5x_like/bench/model.py` and docs/benchmarks.md") == [
      "docs/benchmarks.md", "t5x_like/bench/model.py"]
  assert missing_paths("[speed](docs/nowhere.md#top), `python -m t5x_like.studies.books`") == [
      "docs/nowhere.md", "t5x_like.studies.books"]
  assert missing_paths("`configs/bert_cpu.py:smoke`, t5x_like/speed/, tests/test_bench*.py,"
                       " workdir/configs/x.py, [x](speed.md#a)", "docs/x.md") == []


def _configs_listed(readme: str) -> list[str]:
  """The .py files of configs/ that configs/README.md does not name (as `file.py`)."""
  files = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "configs", "*.py")))
  return [f for f in files if f"`{f}`" not in readme]


def test_every_config_is_listed_in_configs_readme():
  with open(os.path.join(ROOT, "configs", "README.md"), encoding="utf-8") as f:
    assert _configs_listed(f.read()) == []
  assert _configs_listed("| `bert_cpu.py` |") != []  # a README without the others fails


def _package_map(readme: str) -> str:
  """The README's "Package map" section."""
  return readme.split("## Package map", 1)[1].split("\n## ", 1)[0]


def map_leaves_out(package_map: str) -> list[str]:
  """The commands of `t5x-like` (cli.COMMANDS, as `name`), the package's folders (as
  `t5x_like/name/`) and top-level modules (as `name.py`) the package map does not name."""
  tree = ast.parse(open(os.path.join(ROOT, "t5x_like", "cli.py"), encoding="utf-8").read())
  commands = next(ast.literal_eval(n.value).keys() for n in tree.body
                  if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "COMMANDS"
                  and isinstance(n.value, ast.Dict))
  modules = sorted(os.path.basename(p) for p in glob.glob(os.path.join(ROOT, "t5x_like", "*.py"))
                   if not p.endswith("__init__.py"))
  folders = sorted(f"t5x_like/{d}/" for d in os.listdir(os.path.join(ROOT, "t5x_like"))
                   if os.path.isfile(os.path.join(ROOT, "t5x_like", d, "__init__.py")))
  return ([c for c in commands if f"`{c}`" not in package_map]
          + [f for f in folders if f"`{f}`" not in package_map]
          + [m for m in modules if f"`{m}`" not in package_map])


def test_the_package_map_names_every_command_and_top_level_module():
  with open(os.path.join(ROOT, "README.md"), encoding="utf-8") as f:
    assert map_leaves_out(_package_map(f.read())) == []
  planted = map_leaves_out("| `t5x_like/commands/` | `train`, `cli.py` |")
  assert "supervise" in planted and "t5x_like/speed/" in planted and "fs.py" in planted
  assert "train" not in planted and "t5x_like/commands/" not in planted
