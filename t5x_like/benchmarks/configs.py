"""Fine-tuning configs of the benchmarks (configs/glue.py, superglue.py, squad.py).

  get_config("cola")               BERT-base (configs/bert_pretrain.py) on glue/cola
  get_config("mnli,family=t5")     T5 v1.1 base (configs/t5_pretrain.py), text to text
  get_config("rte,smoke")          the small CPU models (bert_cpu / t5_cpu :smoke), 4 steps
                                   on 64 training examples: tests and the tour
  get_config("stsb,cpu")           the CPU study's backbones (bert_cpu / t5_cpu :glue) with
                                   the recipe of Turc et al. 2019 (docs/glue.md)

Arguments (big_vision style, t5x_like.train.defaults.parse_arg): the task (a TFDS config
of the suite: cola, ..., boolq, ..., v1.1 or v2.0, SQuAD's also as v1 / v2), family=bert|t5,
smoke, cpu, epochs, data_dir (a TFDS data dir, or the benchmark's own files: GLUE's
CoLA/train.tsv ...), max_steps (cpu: a cap on the steps of the epochs). The epochs are
passes over the train split the run reads (train.epochs, train.num_steps = 0: the steps
are counted at run time and logged), so epochs=3 is three epochs of your own file too;
--config.train.num_steps=N sets the steps instead. Point init.checkpoint at a
pretraining run (`--init` of finetune-suite): its workdir's config.py names the
backbone; without init.checkpoint, or for a run that saved none, the backbone is
init.default_config (BERT-base / T5 base; the CPU models with smoke).

The recipes: BERT's (Devlin et al. 2019, section 4): batch 32, 3 epochs, AdamW with a
learning rate of 2e-5 (3e-5 for SQuAD), 10% linear warmup, sequences of 128 tokens (384
for SQuAD, question cut to 64); T5's fine-tuning (Raffel et al. 2020) uses a constant
1e-3 with Adafactor at batch 128: here AdamW 1e-4 at batch 32, linear decay. `cpu`:
the small BERTs of Turc et al. 2019 ("Well-Read Students Learn Better"): 4 epochs
(capped at max_steps=1500 on 2 cores: SST-2's 67k examples get 0.7 of an epoch),
batch 32, AdamW 1e-4 (the middle of their grid 3e-4 ... 3e-5: finetune-suite --lr_grid
picks one per task on a split of train), 10% warmup; T5 text to text alike at 1e-3.
"""

from __future__ import annotations

import os

import ml_collections

from t5x_like.benchmarks.registry import SUITES, benchmark
from t5x_like.finetune.defaults import default_finetune_config
from t5x_like.train.defaults import parse_arg

_BACKBONES = {"bert": ("bert_pretrain.py:base", "bert_cpu.py:smoke"),
              "t5": ("t5_pretrain.py:base", "t5_cpu.py:smoke")}
_CPU_BACKBONES = {"bert": "bert_cpu.py:glue", "t5": "t5_cpu.py:glue"}
# The arguments after the task, with their defaults (docs/benchmark-tasks.md lists each).
ARGUMENTS = dict(family="bert", smoke=False, cpu=False, epochs=0.0, data_dir="",
                 max_steps=1500)


def benchmark_config(suite: str, arg: str, configs_dir: str) -> ml_collections.ConfigDict:
  """The config of one task of `suite` (see the module docstring); configs_dir: where the
  pretraining configs are (the calling config file's directory)."""
  where = f"configs/{ {'super_glue': 'superglue'}.get(suite, suite)}.py"
  a = parse_arg(arg, task=SUITES[suite][0], **ARGUMENTS)
  a.task = {"v1": "v1.1", "v2": "v2.0"}.get(a.task, a.task) if suite == "squad" else a.task
  if a.task not in SUITES[suite]:
    raise ValueError(f"{where}: unknown task {a.task!r}; known: {', '.join(SUITES[suite])}")
  if a.family not in _BACKBONES:
    raise ValueError(f"{where}: family={a.family!r}: expected bert or t5")
  bench = benchmark(f"{suite}/{a.task}")
  span = bench.kind == "span"
  c = default_finetune_config()
  c.benchmark.name = bench.tfds_name
  c.benchmark.data_dir = a.data_dir
  # init.config stays "": a pretraining workdir in init.checkpoint names its own config
  # (its config.py); without one, the default backbone (finetune/backbone.py).
  c.init.default_config = os.path.join(configs_dir, _BACKBONES[a.family][a.smoke])
  c.task.max_length = 384 if span else 128
  c.task.max_question_length = 64
  c.task.target_length = 32 if span else 16  # T5: answers / label strings + eos
  c.train.batch_size = 32
  # The steps of the epochs over the train split the run reads, known at run time
  # (finetune/steps.py): the user's own file counts, not the split's published size.
  c.train.num_steps = 0
  c.train.epochs = a.epochs or (4.0 if a.cpu else 3.0)
  c.train.log_every = 50
  c.train.eval_every = 0  # dev metrics at the end
  c.train.checkpoint_every = 1000
  c.optimizer.name = "adamw"
  c.optimizer.schedule = "linear"
  c.optimizer.learning_rate = 1e-4 if a.family == "t5" else (3e-5 if span else 2e-5)
  c.optimizer.warmup_steps = 0
  c.optimizer.warmup_fraction = 0.1
  c.optimizer.weight_decay = 0.01
  if a.cpu and not a.smoke:  # the CPU study (docs/glue.md): Turc et al.'s recipe
    c.init.default_config = os.path.join(configs_dir, _CPU_BACKBONES[a.family])
    c.train.max_steps = a.max_steps
    c.train.checkpoint_every = 0
    c.optimizer.learning_rate = 1e-3 if a.family == "t5" else 1e-4
  if a.smoke:  # the CPU models: 64 positions; a handful of steps on a few examples
    c.task.max_length = 64
    c.task.max_question_length = 16
    c.task.target_length = 16  # the smoke vocabulary cuts "not_equivalent" into 8 pieces
    c.benchmark.max_train_examples = 64
    c.benchmark.max_eval_examples = 16
    c.train.batch_size = 8
    c.train.num_steps = 4
    c.train.log_every = 2
    c.train.checkpoint_every = 0
    c.optimizer.warmup_steps = 1
    c.optimizer.warmup_fraction = 0.0
    c.optimizer.learning_rate = 1e-3
  return c
