"""model.remat_policy="auto" (plan/remat.py): the least-recompute policy whose compiled
train step fits the device, by compiling the candidates in order.

Default tier: the decision on fake compile results, validation, and a tiny scanned GPT
compiled on the 8 fake CPU devices ('none' fits the host; a budget between the 'none'
and 'dots' steps' compiled sizes, read from compile_train_step independently, takes
'dots'). Slow: every candidate compiled, a budget under them all. TPU tier: `plan
--compile=yes` of BERT base on a v3-8, where 'none' does not fit 16 GiB.
"""

import dataclasses
import json
import pathlib

import pytest

from t5x_like import cli
from t5x_like.command_flags import load_config_file
from t5x_like.experiment import build_mesh, build_model_from_config, config_vocab
from t5x_like.models import build_model
from t5x_like.plan import remat
from t5x_like.plan.compiled import compile_train_step
from t5x_like.plan.fit import OverMemory
from t5x_like.plan.shapes import batch_shapes_for
from t5x_like.train.config_check import validate
from t5x_like.train.optimizers import make_optimizer

CONFIGS = pathlib.Path(__file__).parents[1] / "configs"
GIB = 1 << 30


# ------------------------------------------------------------- the decision (fakes)
def _fake(results: dict):
  """total_of from {policy: bytes | 'over' | ('over', bytes the compiler says it needs)},
  recording the order it is asked in."""
  asked = []

  def total_of(policy):
    asked.append(policy)
    result = results[policy]
    if result == "over" or isinstance(result, tuple):
      needs = result[1] if isinstance(result, tuple) else None
      raise OverMemory("RESOURCE_EXHAUSTED: Used 20G of 16G hbm", needs, 16 * GIB)
    return result
  return total_of, asked


def test_roomy_device_takes_none_after_one_compile():
  total_of, asked = _fake({"none": 10 * GIB})
  choice = remat.choose_remat(total_of, 16 * GIB)
  assert (choice.policy, choice.fits, asked) == ("none", True, ["none"])
  assert choice.summary() == "remat auto: chose none (compiled 10.00 GiB of 16.00 GiB)"


def test_first_fitting_policy_in_recompute_order_with_reasons():
  # 'none' refused by the compiler, 'dots' over 90% of 16 GiB (14.4), 'dots_no_batch'
  # fits; 'full' would fit too but recomputes more and is never compiled.
  total_of, asked = _fake({"none": ("over", 20 * GIB), "dots": 15 * GIB,
                           "dots_no_batch": 12 * GIB, "full": 5 * GIB})
  choice = remat.choose_remat(total_of, 16 * GIB)
  assert asked == ["none", "dots", "dots_no_batch"]
  assert (choice.policy, choice.fits, choice.budget_bytes) == (
      "dots_no_batch", True, int(0.9 * 16 * GIB))
  assert [(c.policy, c.fits, c.refused) for c in choice.candidates] == [
      ("none", False, True), ("dots", False, False), ("dots_no_batch", True, False)]
  assert choice.summary() == ("remat auto: chose dots_no_batch (compiled 12.00 GiB of"
                              " 16.00 GiB; none needed 20.00 GiB)")
  reasons = choice.reasons()
  assert reasons[0] == "none: over (refused by the compiler, needs 20.000 GiB)"
  assert reasons[1] == "dots: 15.000 GiB > 14.400 GiB budget (over)"
  assert reasons[2] == "dots_no_batch: 12.000 GiB <= 14.400 GiB budget (fits)"


def test_nothing_fits_takes_full_and_says_so():
  total_of, asked = _fake({"none": 40 * GIB, "dots": 30 * GIB, "dots_no_batch": 20 * GIB,
                           "full": 15 * GIB})
  choice = remat.choose_remat(total_of, 16 * GIB)
  assert asked == list(remat.REMAT_ORDER) == ["none", "dots", "dots_no_batch", "full"]
  assert (choice.policy, choice.fits) == ("full", False)
  assert choice.summary().startswith("remat auto: chose full (compiled 15.00 GiB of 16.00 GiB")
  assert "nothing fits 90% of the device" in choice.summary()
  assert "none needed 40.00 GiB" in choice.summary()


def test_a_compile_error_that_is_not_memory_propagates():
  def total_of(policy):
    raise RuntimeError("INTERNAL: something else")
  with pytest.raises(RuntimeError, match="something else"):
    remat.choose_remat(total_of, 16 * GIB)


def test_unknown_memory_takes_none_without_compiling():
  choice = remat.choose_remat(lambda p: pytest.fail("compiled"), None)
  assert (choice.policy, choice.candidates) == ("none", ())


def test_headroom_is_a_fraction_of_the_device():
  total_of, _ = _fake({"none": 15 * GIB, "dots": 14 * GIB})
  assert remat.choose_remat(total_of, 16 * GIB).policy == "dots"  # 15 > 14.4
  total_of, _ = _fake({"none": 15 * GIB})
  assert remat.choose_remat(total_of, 16 * GIB, headroom=1.0).policy == "none"


# ------------------------------------------------------------ validation, plan text
def test_auto_is_valid_and_a_typo_exits_2_naming_the_key(capsys):
  config = load_config_file(str(CONFIGS / "gpt_cpu.py") + ":smoke")
  config.model.remat_policy = "auto"
  validate(config, 8)  # accepted
  rc = cli.main(["plan", "--config", str(CONFIGS / "gpt_cpu.py") + ":smoke",
                 "--config.model.remat_policy=atuo", "--topology", "v5e-4", "--compile=no"])
  err = capsys.readouterr().err
  assert rc == 2 and err.count("\n") == 1
  assert "model.remat_policy='atuo'" in err and "'auto'" in err


def test_the_trainer_takes_the_choice_from_its_caller(tmp_path):
  """train/ sits below plan/: the train command hands the trainer plan's chooser, and
  the trainer refuses "auto" without one rather than train an unresolved policy."""
  from t5x_like.train import loop
  config = load_config_file(f"{CONFIGS / 'gpt_cpu.py'}:smoke")
  config.model.remat_policy = "auto"
  with pytest.raises(ValueError, match="choose_remat"):
    loop.train(config, str(tmp_path / "w"))
  assert not (tmp_path / "w").exists()


def test_plan_text_says_what_auto_picked_and_why():
  total_of, _ = _fake({"none": "over", "dots": 15 * GIB, "dots_no_batch": 12 * GIB})
  lines = remat.choice_lines(remat.choose_remat(total_of, 16 * GIB).to_json())
  assert lines == [
      "remat auto: chose dots_no_batch by compiling each, least recomputation first,"
      " against 90% of 16.000 GiB = 14.400 GiB",
      "  none           over (refused by the compiler; needs ?)  over",
      "  dots                 15.000 GiB  over",
      "  dots_no_batch        12.000 GiB  fits"]
  assert remat.choice_lines(None) == []


@pytest.mark.slow
def test_plan_without_compile_picks_by_the_estimate(capsys):
  rc = cli.main(["plan", "--config", str(CONFIGS / "gpt_cpu.py") + ":smoke",
                 "--config.model.remat_policy=auto", "--topology", "v5e-4", "--compile=no"])
  out = capsys.readouterr().out
  assert rc == 0
  assert "remat auto: chose none by the estimate (no compile" in out  # 23 MiB of 16 GiB
  assert "compute float32, remat none," in out


# ----------------------------------------------------- compiled on the CPU devices
def _tiny(policy: str = "auto", scan_layers: bool = True):
  """A 2-layer GPT, scanned (scan keeps remat's recomputation apart on XLA:CPU), 8 rows
  of 32 tokens over the 8 fake devices, and its step's pieces."""
  c = load_config_file(str(CONFIGS / "gpt_cpu.py") + ":smoke")
  c.model.scan_layers = scan_layers
  c.model.remat_policy = policy
  c.model.overrides = dict(c.model.overrides, num_layers=2, d_model=32, d_ff=64,
                           max_position_embeddings=32)
  c.data.length, c.train.batch_size = 32, 8
  vocab = config_vocab(c)
  model = build_model_from_config(c, vocab.vocab_size)
  mesh, rules = build_mesh(c)
  optimizer, schedule = make_optimizer(c.optimizer, c.train.num_steps)
  return c, model, optimizer, schedule, mesh, rules, batch_shapes_for(c, vocab)


def _compiled_total(model, policy, optimizer, schedule, mesh, rules, shapes) -> int:
  """compile_train_step's total bytes per device of model with `policy` (not through
  plan/remat.py)."""
  m = build_model(dataclasses.replace(model.config, remat_policy=policy))
  return compile_train_step(m, optimizer, schedule, mesh, rules, shapes)["memory"]["total_bytes"]


def test_auto_on_the_cpu_host_takes_none():
  config, model, optimizer, schedule, mesh, rules, shapes = _tiny(scan_layers=False)
  assert model.config.remat_policy == "none"  # unresolved 'auto' builds as none
  resolved, choice = remat.resolve_config_remat(config, model, optimizer, schedule, mesh,
                                                rules, batch_shapes=shapes)
  assert choice.policy == resolved.config.remat_policy == "none"
  assert [c.policy for c in choice.candidates] == ["none"]
  assert choice.candidates[0].total_bytes < choice.budget_bytes < choice.memory_bytes


@pytest.mark.slow
def test_a_small_budget_takes_the_first_recomputing_policy_that_fits():
  _, model, optimizer, schedule, mesh, rules, shapes = _tiny()
  none, dots = (_compiled_total(model, p, optimizer, schedule, mesh, rules, shapes)
                for p in ("none", "dots"))
  assert dots < none  # scanned: dots keeps less than none
  budget = (none + dots) // 2
  resolved, choice = remat.resolve_remat(model, optimizer, schedule, mesh, rules, shapes,
                                         memory_bytes=budget, headroom=1.0)
  assert choice.policy == resolved.config.remat_policy == "dots"
  assert [(c.policy, c.total_bytes, c.fits) for c in choice.candidates] == [
      ("none", none, False), ("dots", dots, True)]


@pytest.mark.long
def test_every_candidate_compiled_in_order_when_none_fits():
  _, model, optimizer, schedule, mesh, rules, shapes = _tiny()
  totals = {p: _compiled_total(model, p, optimizer, schedule, mesh, rules, shapes)
            for p in remat.REMAT_ORDER}
  assert totals["full"] <= totals["dots_no_batch"] <= totals["dots"] < totals["none"]
  budget = (totals["dots_no_batch"] + totals["dots"]) // 2
  _, choice = remat.resolve_remat(model, optimizer, schedule, mesh, rules, shapes,
                                  memory_bytes=budget, headroom=1.0)
  assert choice.policy == "dots_no_batch"
  assert [c.total_bytes for c in choice.candidates] == [
      totals["none"], totals["dots"], totals["dots_no_batch"]]
  _, choice = remat.resolve_remat(model, optimizer, schedule, mesh, rules, shapes,
                                  memory_bytes=min(totals.values()) - 1, headroom=1.0)
  assert (choice.policy, choice.fits) == ("full", False)
  assert {c.policy: c.total_bytes for c in choice.candidates} == totals


@pytest.mark.long
def test_train_and_finetune_log_the_choice(tmp_path, capsys):
  """`train` with auto, then `finetune` from a pretraining config that says auto."""
  bert = CONFIGS / "bert_cpu.py"
  assert cli.main(["train", f"--config={bert}:smoke", f"--workdir={tmp_path / 'pre'}",
                   "--config.model.remat_policy=auto", "--config.train.num_steps=2",
                   "--config.optimizer.warmup_steps=1", "--config.train.eval_every=0"]) == 0
  out = capsys.readouterr().out
  assert "remat auto: chose none (compiled " in out and " MiB of " in out
  pretrain = tmp_path / "bert_auto.py"
  pretrain.write_text("from t5x_like.command_flags import load_config_file\n\n\n"
                      "def get_config():\n"
                      f"  c = load_config_file({str(bert) + ':smoke'!r})\n"
                      "  c.model.remat_policy = 'auto'\n  return c\n")
  task = tmp_path / "books"
  assert cli.main(["task", "books", "--out", str(task), "--num_blocks", "4",
                   "--block_words", "100", "--passage_words", "16"]) == 0
  capsys.readouterr()
  assert cli.main(["finetune", f"--config={CONFIGS / 'finetune_books.py'}:bert,smoke,"
                   f"dir={task}", f"--workdir={tmp_path / 'ft'}",
                   f"--config.init.config={pretrain}", "--config.train.num_steps=2"]) == 0
  assert "remat auto: chose none (compiled " in capsys.readouterr().out


# ------------------------------------------------------------------ TPU (deviceless)
@pytest.mark.tpu
@pytest.mark.long  # the TPU tier's longest by far: .ci/long, not .ci/run
def test_plan_on_a_v5e_slice_compiles_and_picks_a_recomputing_policy(capsys):
  """bert_cpu.py:mini scanned, 1056 rows of 128 per chip on a v5e-4: 'none' does not fit
  90% of the chip's 16 GiB (at 512 rows it compiles to 7.2 GiB, 'dots' to 5.9), a
  recomputing policy does. About 19 minutes on 2 busy cores: a program over HBM is slow
  for libtpu to refuse."""
  pytest.importorskip("libtpu")
  assert cli.main(["plan", "--config", str(CONFIGS / "bert_cpu.py") + ":mini",
                   "--topology", "v5e-4", "--compile=yes", "--json",
                   "--config.model.remat_policy=auto", "--config.model.scan_layers=True",
                   "--config.train.batch_size=4224"]) == 0
  plan = json.loads(capsys.readouterr().out)
  choice = plan["remat_auto"]
  assert choice["by"] == "compiled" and choice["fits"]
  assert choice["budget_bytes"] == int(0.9 * 16 * GIB)
  none, *_, chosen = choice["candidates"]
  assert none["policy"] == "none" and not none["fits"]
  assert none["refused"] or none["total_bytes"] > choice["budget_bytes"]
  assert chosen["policy"] == choice["policy"] in ("dots", "dots_no_batch", "full")
  assert plan["model"]["remat_policy"] == choice["policy"]
  # the plan's own compile of the chosen step (not the choice's) fits the budget
  phase, = plan["phases"]
  assert phase["xla"]["memory"]["total_bytes"] <= choice["budget_bytes"]
  text = remat.choice_lines(choice)  # what `plan` prints
  assert text[0].startswith(f"remat auto: chose {choice['policy']} by compiling each")
  assert text[1].split()[:1] == ["none"] and text[1].endswith("over")
