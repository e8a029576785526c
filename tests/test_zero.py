"""ZeRO layouts (config.mesh.zero_stage; Rajbhandari et al., SC 2020): the optimizer state
(stage 1) and the gradients (stage 2) split over the data-parallel devices.

The shards are worked out by hand from the shapes and the mesh; the losses, params and
moments of each layout are compared with the replicated layout's over 20 steps on 8 CPU
devices (floating-point reassociation only: the same function, summed in another order).
The slow tier kills a stage-2 run with SIGKILL and resumes it: the losses equal the
uninterrupted run's, bit for bit.
"""

import jax
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from t5x_like import cli, parallel
from t5x_like.models import bert, build_model
from t5x_like.parallel.shardings import zero_spec
from t5x_like.train.defaults import default_config
from t5x_like.train.optimizers import make_optimizer
from t5x_like.train.state import create_train_state
from t5x_like.train.step import make_train_step
from helpers import ROOT, killed_and_resumed, losses, run_child, train_command

RULES = parallel.DEFAULT_RULES
VOCAB, B, L, P_MLM = 64, 32, 16, 4
STEPS = 20
SIZES = {"data": 4, "fsdp": 2, "tensor": 1}


def test_zero_spec_takes_the_largest_free_dim_the_batch_axes_divide():
  free = ("data", "fsdp")
  # A replicated [24, 1024, 4096] stack over data 4 x fsdp 2: 4096 is the largest dim.
  assert zero_spec((24, 1024, 4096), P(), SIZES, free) == P(None, None, ("data", "fsdp"))
  # embed already over fsdp: only data is free, on the largest replicated dim (vocab 64).
  assert zero_spec((64, 32), P(None, "fsdp"), SIZES, free) == P("data", "fsdp")
  # A 1-D [32] over fsdp: no replicated dim, so data joins fsdp on it (32 % 8 == 0).
  assert zero_spec((32,), P("fsdp"), SIZES, free) == P(("fsdp", "data"))
  # Nothing divisible by 8 (or by 4 on top of fsdp): left as the param is.
  assert zero_spec((2, 3), P(), SIZES, free) == P()
  assert zero_spec((6,), P("fsdp"), SIZES, free) == P("fsdp")
  # A size-1 axis splits nothing: its dim counts as unsplit.
  assert zero_spec((64,), P(), {"data": 1, "fsdp": 1}, free) == P()
  assert zero_spec((8, 64), P("fsdp", "tensor"), SIZES, free) == P("fsdp", ("tensor", "data"))


def test_a_zero_stage_outside_0_to_2_names_the_key_and_exits_2(capsys, tmp_path):
  code = cli.main(["train", f"--config={ROOT}/configs/bert_cpu.py:smoke",
                   f"--workdir={tmp_path / 'run'}", "--config.mesh.zero_stage=3"])
  err = capsys.readouterr().err
  assert code == 2 and "mesh.zero_stage=3" in err and "mesh.fsdp" in err, err
  assert not (tmp_path / "run").exists()


def _bert_batch(seed=0):
  r = np.random.RandomState(seed)
  tokens = r.randint(1, VOCAB, (B, L)).astype(np.int32)
  tokens[::3, 12:] = 0
  return {"encoder_input_tokens": tokens,
          "encoder_type_ids": (np.arange(L)[None] >= L // 2).astype(np.int32).repeat(B, 0),
          "mlm_positions": r.randint(0, 12, (B, P_MLM)).astype(np.int32),
          "mlm_targets": r.randint(1, VOCAB, (B, P_MLM)).astype(np.int32),
          "mlm_weights": (r.rand(B, P_MLM) > 0.3).astype(np.int32),
          "nsp_labels": r.randint(0, 2, (B,)).astype(np.int32)}


@pytest.fixture(scope="module")
def runs():
  """{(zero_stage, microbatches): (losses per step, final state, state shardings)}."""
  model = build_model(bert(2, 32, vocab_size=VOCAB, num_heads=2, d_ff=64,
                           max_position_embeddings=L, dropout_rate=0.0,
                           attention_dropout_rate=0.0))
  cfg = default_config().optimizer
  cfg.name, cfg.schedule, cfg.learning_rate = "adamw", "linear", 3e-3
  cfg.warmup_steps, cfg.decay_steps = 0, 100
  tx, sched = make_optimizer(cfg, 100)
  batch = _bert_batch()
  shapes = {k: v.shape for k, v in batch.items()}
  mesh = parallel.make_mesh(SIZES)
  sharded = parallel.shard_batch(batch, mesh, RULES)
  out = {}
  for stage, micro in ((0, 1), (1, 1), (2, 1), (0, 2), (2, 2)):
    state, shardings = create_train_state(model, tx, mesh, RULES, shapes, jax.random.key(0),
                                          stage)
    step = make_train_step(model, tx, sched, microbatches=micro, mesh=mesh, rules=RULES,
                           state_shardings=shardings, batch_shapes=shapes, zero_stage=stage)
    history = []
    for _ in range(STEPS):
      state, metrics = step(state, sharded, jax.random.key(1))
      history.append(float(metrics["loss"]))
    out[stage, micro] = (np.array(history), jax.device_get(state), shardings)
  return out


def _spec(shardings, *path):
  node = shardings.opt_state
  return [s.spec for p, s in jax.tree_util.tree_leaves_with_path(node)
          if jax.tree_util.keystr(p).endswith("".join(f"['{k}']" for k in path))]


def test_the_moments_are_split_over_the_data_devices_from_stage_1(runs):
  kernel = ("encoder", "layers_0", "mlp", "wi", "kernel")  # [embed 32, mlp 64]
  replicated = _spec(runs[0, 1][2], *kernel)
  zero = _spec(runs[1, 1][2], *kernel)
  assert len(replicated) == 2 and all(s == P("fsdp", "tensor") for s in replicated)
  # mu and nu: embed keeps fsdp, data joins the size-1 tensor axis on the mlp dim.
  assert len(zero) == 2 and all(s == P("fsdp", ("tensor", "data")) for s in zero), zero
  assert runs[1, 1][2].params == runs[0, 1][2].params  # the params keep their layout


@pytest.mark.parametrize("stage, micro", [(1, 1), (2, 1), (2, 2)])
def test_each_layout_trains_as_the_replicated_one(runs, stage, micro):
  ref_losses, ref_state, _ = runs[0, micro]
  got_losses, got_state, _ = runs[stage, micro]
  # Reassociation only: the 20 losses within 1e-5 of the replicated layout's (they fall
  # by ~1.0 over the run), every param and moment within 2e-5.
  assert ref_losses[0] - ref_losses[-1] > 0.5
  np.testing.assert_allclose(got_losses, ref_losses, rtol=0, atol=1e-5)
  for (path, x), y in zip(jax.tree_util.tree_leaves_with_path(got_state),
                          jax.tree.leaves(ref_state)):
    np.testing.assert_allclose(x, y, rtol=1e-5, atol=2e-5, err_msg=jax.tree_util.keystr(path))


@pytest.mark.slow
def test_a_zero_2_run_killed_and_resumed_gives_the_uninterrupted_losses(tmp_path):
  flags = ("--config.mesh.zero_stage=2", "--config.mesh.fsdp=2")
  full = str(tmp_path / "full")
  done = run_child(train_command("bert_cpu.py:smoke", full, *flags))
  assert done.returncode == 0, done.stderr[-3000:]
  expected = losses(full)
  assert sorted(expected) == list(range(1, 21))
  killed = str(tmp_path / "killed")
  resumed = killed_and_resumed("bert_cpu.py:smoke", killed, *flags)
  assert resumed.returncode == 0, resumed.stderr[-3000:]
  assert "resumed from step" in resumed.stdout + resumed.stderr
  assert losses(killed) == expected  # float32 on CPU: identical
