"""launch/gpu_bench.sh: the commands a GPU session runs (DRY_RUN=1; nothing runs)."""

import os
import subprocess

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(REPO, "launch", "gpu_bench.sh")


def _run(env_extra, *args):
  env = dict(os.environ, DRY_RUN="1", T5X="t5x-like", **env_extra)
  return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, env=env,
                        timeout=60)


def test_dry_run_prints_each_step_with_its_profile_and_environment(tmp_path):
  out = str(tmp_path / "o")
  run = _run({"OUT": out, "STEPS": "bert_auto gpt2_flags_none gpt2_full_logits"})
  assert run.returncode == 0, run.stderr
  lines = [l for l in run.stdout.splitlines() if l.startswith("+ ")]
  assert len(lines) == 3
  assert f"--profile {out}/bert_auto.prof > {out}/bert_auto.json 2> {out}/bert_auto.log" in lines[0]
  assert "configs/bert_pretrain.py:large" in lines[0]
  assert lines[1].startswith("+ env T5X_LIKE_GPU_XLA_FLAGS=none timeout 540 t5x-like bench model")
  assert "--config.model.overrides.loss_chunk_rows=0" in lines[2]
  assert not os.path.exists(out)  # a dry run writes nothing


def test_every_listed_step_is_a_known_command():
  listed = _run({}, "list")
  assert listed.returncode == 0
  names = [l.split("|")[0] for l in listed.stdout.splitlines()]
  assert {"bert_auto", "bert_explicit", "gpt2", "t5", "peer_gpt2", "peer_bert"} <= set(names)
  for line in listed.stdout.splitlines():
    name, _, command = line.split("|")
    if name in ("resume_pallas_gpu", "compare"):  # functions of the script
      continue
    assert command.split()[0] == "bench" and command.split()[1] in {"model", "peer", "attention"}


def test_the_resume_check_kills_at_a_save_and_compares_the_losses():
  text = open(SCRIPT).read()
  assert "T5X_LIKE_FAILPOINT=after_save@8" in text and "--config.model.attention_impl=pallas_gpu" in text


@pytest.mark.parametrize("args,env", [((), {"STEPS": "bert_auto nope"}), (("fly",), {})])
def test_unknown_step_or_subcommand_exits_2_before_running_anything(args, env, tmp_path):
  run = _run({"OUT": str(tmp_path / "o"), **env}, *args)
  assert run.returncode == 2
  assert "unknown" in run.stderr.splitlines()[0]
  assert run.stdout == ""
