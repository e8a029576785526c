"""T5 v1.1 span corruption on the embedded corpus, small enough for a laptop CPU.

  t5x-like train --config configs/t5_cpu.py --workdir /tmp/t5
  t5x-like train --config configs/t5_cpu.py:smoke --workdir /tmp/t5s   (tests)
  t5x-like train --config configs/t5_cpu.py:mini --workdir /tmp/t5m    (~60 min, 2 cores)

`mini`: 4 + 4 layers of 256 (4 heads of 64, gated FFN 512), 10,000 steps of 32: the
one-hour pretraining of the text-task experiments (docs/text-tasks.md).
`glue`: the default model (2 + 2 layers of 128) for 12,000 steps: the pretraining of the
GLUE study (docs/glue.md; t5x_like.studies.glue_experiment sets data.mixture).
"""

from t5x_like.train.defaults import default_config, smoke_schedule


def get_config(arg: str = ""):
  c = default_config()
  c.model.preset = "t5-v1_1-small"
  c.model.overrides = dict(d_model=128, d_ff=256, num_layers=2, num_decoder_layers=2,
                           num_heads=2, head_dim=64)
  c.model.dtype = "bfloat16"  # bf16 matmuls with float32 accumulation; params float32
  c.data.objective = "span_corruption"
  c.data.length = 128  # inputs; targets 29 (T5's random_spans_helper)
  c.train.batch_size = 32
  c.train.num_steps = 2000
  c.train.log_every = 50
  c.train.eval_every = 500
  c.train.checkpoint_every = 500
  c.optimizer.name = "adafactor"
  c.optimizer.learning_rate = 0.01
  c.optimizer.schedule = "rsqrt"  # constant 0.01 for warmup_steps, then 1/sqrt (T5)
  c.optimizer.warmup_steps = 200
  c.optimizer.weight_decay = 0.0
  if arg == "smoke":
    c.model.overrides = dict(d_model=64, d_ff=128, num_layers=1, num_decoder_layers=1,
                             num_heads=2, head_dim=32)
    c.model.dtype = "float32"  # bit-exact resume tests run in float32
    smoke_schedule(c)
  elif arg == "mini":
    c.model.overrides = dict(d_model=256, d_ff=512, num_layers=4, num_decoder_layers=4,
                             num_heads=4, head_dim=64)
    c.train.num_steps = 10_000
    c.train.eval_every = 2000
    c.train.checkpoint_every = 1000
  elif arg == "glue":
    c.train.num_steps = 12_000
    c.train.eval_every = 3000
    c.train.checkpoint_every = 1000
  elif arg:
    raise ValueError(f"configs/t5_cpu.py: unknown variant {arg!r} (expected '', 'smoke',"
                     " 'mini' or 'glue')")
  return c
