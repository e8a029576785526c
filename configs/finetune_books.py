"""Fine-tuning on the book task (t5x_like/task_builders/books.py): which book a passage is from.

  t5x-like task books --out workdir/books
  t5x-like train --config configs/bert_cpu.py --workdir workdir/bert_books \\
      --config.data.source='text:workdir/books/pretrain/*.txt' --config.train.num_steps=6000
  t5x-like finetune --config configs/finetune_books.py:bert --workdir workdir/ft_bert \\
      --config.init.checkpoint=workdir/bert_books        # pretrained
  t5x-like finetune --config configs/finetune_books.py:bert --workdir workdir/ft_bert_random
                                                         # the same, random initialisation
Variants: bert (configs/bert_cpu.py, mean-pooled classifier), t5 (configs/t5_cpu.py, the
author's name as text to text, evaluated by generating it); `,smoke` for tests (the
:smoke pretraining configs, 10 steps); `task=books` (the default, in-domain),
`task=unseen` (`t5x-like task books-unseen`: 3 books not pretrained on) or
`task=within` (`t5x-like task books-within`: Frankenstein's narrators), pretraining on
the task's own pretrain/ (t5x_like/task_builders/books_ood.py); `dir=PATH`: where the
`t5x-like task` command wrote (default workdir/books, workdir/books_unseen,
workdir/books_within).
The recipe (BERT) is the one the experiments of docs/book-task.md chose: mean pooling
without the pooler (a [CLS] that starts at random learns slowly and flatters pretraining; mean
pooling is as good for the pretrained model and far better from random
initialisation), AdamW at 1e-3 (best or level with the best of 3e-3 / 1e-3 / 3e-4, both
inits, in and out of domain), 30 warmup steps, 300 steps of 32 (900 gain nothing).
Measured (docs/book-task.md, mean of 3 seeds): pretrained 6,000 steps, then 0.674 dev
accuracy against 0.617 from random initialisation (each at its best learning rate: 0.675 / 0.624).
"""

import os

from t5x_like.finetune.defaults import cpu_recipe_config
from t5x_like.train.defaults import parse_arg


# task= -> where `t5x-like task ...` writes it by default (dir= overrides).
TASK_DIRS = {"books": "workdir/books", "unseen": "workdir/books_unseen",
             "within": "workdir/books_within"}


def get_config(arg: str = "bert"):
  args = parse_arg(arg, family="bert", smoke=False, task="books", dir="")
  if args.family not in ("bert", "t5"):
    raise ValueError(f"configs/finetune_books.py: family={args.family!r}: expected bert or t5")
  if args.task not in TASK_DIRS:
    raise ValueError(f"configs/finetune_books.py: task={args.task!r}: expected one of"
                     f" {sorted(TASK_DIRS)}")
  args.dir = args.dir or TASK_DIRS[args.task]
  # The pretraining config beside this file, wherever the command runs from.
  pretrain = os.path.join(os.path.dirname(os.path.abspath(__file__)),
                          {"bert": "bert_cpu.py", "t5": "t5_cpu.py"}[args.family])
  c = cpu_recipe_config(pretrain + (":smoke" if args.smoke else ""), args.smoke)
  c.task.train_file = f"{args.dir}/train.csv"
  c.task.dev_file = f"{args.dir}/dev.csv"
  c.task.max_length = 64  # 32-word passages; bert_cpu has 64 positions
  c.task.target_length = 8  # a label (surname, narrator) + eos (up to 5 pieces in the t5 vocab)
  c.task.task_prefix = "book"
  # 300 steps: ~13 epochs of the 720 training passages
  c.train.log_every = 5 if args.smoke else 25
  c.train.eval_every = 0 if args.smoke else 100
  return c
