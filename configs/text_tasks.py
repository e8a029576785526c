"""Fine-tuning on a task of `t5x-like task authorship|acceptability|coherence`.

  t5x-like task acceptability --source 'text:my_books/*.txt' --out workdir/acceptability
  t5x-like finetune --config configs/text_tasks.py:acceptability --workdir workdir/ft_acc \\
      --config.init.checkpoint=workdir/bert_mini          # pretrained; without: random
Arguments: the task kind (authorship, acceptability, coherence); family=bert|t5; dir=PATH
(where `t5x-like task` wrote: default workdir/<kind>); `smoke` (the :smoke pretraining
configs, 10 steps; tests). The backbone is configs/bert_cpu.py:mini or t5_cpu.py:mini,
the one-hour pretraining of docs/text-tasks.md; train/dev/test.csv are read, and
final_metrics.json has the dev and test accuracy.
BERT: coherence (a sentence pair) through [CLS] and the pretrained pooler, as BERT
classifies pairs; authorship and acceptability mean-pooled without the pooler
(docs/book-task.md: the best head there for both arms); T5: the label generated as
text and ranked, or with --config.task.text_to_text=false the encoder alone under a
mean-pooled head (EncT5).
AdamW at 1e-3 (each arm's pick from 1e-4 / 3e-4 / 1e-3 on acceptability and coherence,
docs/text-tasks.md), 30 warmup steps then linear decay, 300 steps of 32 (the experiment
driver sets 20 epochs, within 100-300 steps).
"""

import os

from t5x_like.finetune.defaults import cpu_recipe_config
from t5x_like.train.defaults import parse_arg

KINDS = ("authorship", "acceptability", "coherence")


def get_config(arg: str = "acceptability"):
  args = parse_arg(arg, task="acceptability", family="bert", dir="", smoke=False)
  if args.task not in KINDS:
    raise ValueError(f"configs/text_tasks.py: task={args.task!r}: expected one of {KINDS}")
  if args.family not in ("bert", "t5"):
    raise ValueError(f"configs/text_tasks.py: family={args.family!r}: expected bert or t5")
  folder = args.dir or f"workdir/{args.task}"
  pretrain = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          {"bert": "bert_cpu.py", "t5": "t5_cpu.py"}[args.family])
  c = cpu_recipe_config(pretrain + (":smoke" if args.smoke else ":mini"), args.smoke)
  c.task.train_file = f"{folder}/train.csv"
  c.task.dev_file = f"{folder}/dev.csv"
  c.task.test_file = f"{folder}/test.csv"
  c.task.text_pair_column = "text_pair" if args.task == "coherence" else ""
  # Pieces: sentences of at most 40 words (and 32-word passages) fit in 64; a
  # coherence pair in 128 (the pretraining length); the smoke backbones have 64.
  c.task.max_length = 128 if args.task == "coherence" and not args.smoke else 64
  c.task.target_length = 8  # a label + eos
  c.task.task_prefix = args.task
  # BERT: a pair through [CLS] and the NSP-trained pooler (BERT's own pair head), a
  # single text mean-pooled without it (docs/text-tasks.md: the heads measured)
  if args.task == "coherence" and args.family == "bert":
    c.task.pooling, c.task.pooler = "cls", True
  c.train.log_every = 5 if args.smoke else 50
  c.train.eval_every = 0  # dev and test at the end
  return c
