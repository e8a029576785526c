"""T5 v1.1 small / base / large: span corruption on C4 (Raffel et al. 2020; the T5 v1.1
release notes).

  t5x-like data prepare --config configs/t5_pretrain.py:base,raw --out gs://BUCKET/prepared/c4
  t5x-like train --config configs/t5_pretrain.py:base,corpus=gs://BUCKET/prepared/c4 \
      --workdir gs://BUCKET/t5-base
  t5x-like train --config configs/t5_pretrain.py:small,local --workdir /tmp/t5  (CPU)

Batch 256 x 512 inputs / 114 targets (noise density 0.15, mean span 3), 2^19 steps
(the T5 paper's pretraining length), Adafactor (decay rate 0.8, factored second
moments, no momentum) at 0.01 for 10k steps then 1/sqrt(step), z-loss 1e-4, no
dropout in pretraining (v1.1). Data: TFDS c4/en (3.1.0), prepared once into
`corpus` (the raw TFDS source with `raw`). Vocabulary: set data.vocab
to a T5 sentencepiece model with 100 sentinels (`t5x-like vocab train --family t5`);
the model keeps T5's 32,128 embedding rows.
Meshes: small and base are data parallel (v3-32: 3.4 and 9.1 GiB per device by
`t5x-like plan`); large shards params and optimizer state over 'fsdp' (8) as well (v4-64).
"""

from t5x_like.train.defaults import default_config, parse_arg, smoke_schedule

_SIZES = {"small": "t5-v1_1-small", "base": "t5-v1_1-base", "large": "t5-v1_1-large"}


def get_config(arg: str = "base"):
  a = parse_arg(arg, size="base", local=False, raw=False,
                corpus="gs://YOUR_BUCKET/prepared/c4-en-t5")
  if a.size not in _SIZES:
    raise ValueError(f"configs/t5_pretrain.py: size {a.size!r}; known: {sorted(_SIZES)}")
  c = default_config()
  c.model.preset = _SIZES[a.size]
  c.model.overrides = dict(vocab_size=32128, z_loss=1e-4)
  c.model.dtype = "bfloat16"
  c.model.scan_layers = True
  # small / base: save only matmul outputs ('dots'); measured with `t5x-like bench model`
  # (CPU, base, batch 4), 5% faster than no remat with 30% less memory. large: 'full'.
  c.model.remat_policy = "full" if a.size == "large" else "dots"

  # Training reads the corpus prepared once by `t5x-like data prepare`
  # (docs/prepared-corpora.md); `:SIZE,raw` names the raw source, which is what
  # `data prepare` reads.
  c.data.source = "tfds:c4/en:train#text" if a.raw else f"prepared:{a.corpus}"
  c.data.objective = "span_corruption"
  c.data.length = 512  # targets 114
  c.data.options = dict(noise_density=0.15, mean_noise_span_length=3.0)
  c.data.eval_fraction = 0.001

  c.train.batch_size = 256
  c.train.num_steps = 2**19
  c.train.log_every = 100
  c.train.eval_every = 10_000
  c.train.eval_batches = 20
  c.train.checkpoint_every = 5_000

  c.optimizer.name = "adafactor"
  c.optimizer.learning_rate = 0.01
  c.optimizer.schedule = "rsqrt"
  c.optimizer.warmup_steps = 10_000
  c.optimizer.weight_decay = 0.0
  c.optimizer.clip_norm = 0.0
  c.optimizer.adafactor_decay_rate = 0.8

  c.mesh.data = -1
  c.mesh.fsdp = 8 if a.size == "large" else 1
  if a.local:
    c.model.overrides = dict(d_model=64, d_ff=128, num_layers=1, num_decoder_layers=1,
                             num_heads=2, head_dim=32, z_loss=1e-4)
    c.model.dtype = "float32"
    c.model.remat_policy = "none"
    c.data.source = "embedded"
    c.data.eval_fraction = 0.02
    c.mesh.fsdp = 1
    smoke_schedule(c)
  return c
