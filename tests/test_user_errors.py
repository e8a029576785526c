"""Every mistake a user can make on the command line ends in one or two lines on stderr
naming the key, file or path, exit status 2, no traceback, and nothing written.

Each case runs `t5x-like ...` in process (cli.main, as the console command does) from a
scratch current directory, with relative paths as a new user types them.
"""

import os
import subprocess
import sys

import pytest

from t5x_like import cli
from helpers import ROOT

BERT = os.path.join(ROOT, "configs", "bert_cpu.py")
T5 = os.path.join(ROOT, "configs", "t5_cpu.py")
GPT = os.path.join(ROOT, "configs", "gpt_cpu.py")
FINETUNE = os.path.join(ROOT, "configs", "finetune_books.py")


def _files(tmp):
  """Files the cases point at, made in the scratch directory (relative names)."""
  os.makedirs("empty_files")
  for name in ("a.txt", "b.txt"):
    open(os.path.join("empty_files", name), "w").write("  \n\n")
  os.makedirs("jsonl_no_field")
  with open(os.path.join("jsonl_no_field", "x.jsonl"), "w") as f:
    f.write('{"body": "Some text here."}\n{"body": "More text."}\n')
  os.makedirs("jsonl_few_rows")  # 6 of 289 rows carry the field: too little for a batch
  with open(os.path.join("jsonl_few_rows", "x.jsonl"), "w") as f:
    f.writelines('{"body": "A short row."}\n' if i % 48 == 0 else '{"title": "x"}\n'
                 for i in range(289))
  os.makedirs("plain_text")
  open(os.path.join("plain_text", "book.jsonl"), "w").write("Once upon a time.\nThe end.\n")
  os.makedirs("a_directory")
  open(os.path.join("a_directory", "doc.txt"), "w").write("Some text. More text.\n")
  open("not_a_dir", "w").write("a file where a workdir should be\n")
  open("syntax_error.py", "w").write("def get_config(:\n  pass\n")
  open("no_get_config.py", "w").write("X = 1\n")
  open("prompts.jsonl", "w").write('{"text": "hello"}\n')
  os.makedirs("ckpt_junk/checkpoints")
  open(os.path.join("ckpt_junk", "checkpoints", "35"), "w").write("junk")
  open("settings.json", "w").write('{"train": {"num_steps": 10}}\n')
  with open("variants.py", "w") as f:  # configs a user edits into a wrong value
    f.write(f"import sys\nsys.path.insert(0, {os.path.join(ROOT, 'configs')!r})\n"
            "import bert_cpu\n\n\ndef get_config(arg):\n"
            "  c = bert_cpu.get_config('smoke')\n"
            "  if arg == 'vocab':\n"
            "    c.model.overrides = dict(c.model.overrides, vocab_size=1000)\n"
            "  if arg == 'rule':\n"
            "    c.mesh.rules = (('batch', 'nosuchaxis'),)\n"
            "  if arg == 'phase':\n"
            "    c.train.phases = [dict(steps=5, length='long')]\n"
            "  if arg == 'option':\n"
            "    c.data.options = dict(max_predictions_per_seq='ten')\n"
            "  return c\n")
  os.makedirs("story")  # 40 sentences of one author
  with open(os.path.join("story", "smith_tale.txt"), "w") as f:
    f.writelines(f"The house of the doctor was quiet and the river ran {n} times.\n\n"
                 for n in range(40))
  os.makedirs("task")
  for split in ("train", "dev"):
    with open(os.path.join("task", f"{split}.csv"), "w") as f:
      f.write("text,label\nA passage of text.,austen\nAnother passage.,dickens\n")


def train(*flags, config=BERT, workdir="wd"):
  return ["train", f"--config={config}", f"--workdir={workdir}", *flags]


def smoke(*flags, config=BERT, workdir="wd"):
  return ["train", f"--config={config}:smoke", f"--workdir={workdir}", *flags]


def finetune(*flags):
  return ["finetune", f"--config={FINETUNE}:bert,smoke,dir=task", "--workdir=wd", *flags]


def infer(*flags, checkpoint="no_such_run", input_file="prompts.jsonl"):
  return ["infer", f"--config={GPT}:smoke", f"--checkpoint={checkpoint}",
          f"--input={input_file}", *flags]


# (id, argv, words the message must contain)
CASES = [
    # ------------------------------------------------------------ flags and config files
    ("key typo", train("--config.train.num_step=100"), ["train.num_step", "train.num_steps"]),
    ("key that is not there", train("--config.train.steps=1000"), ["train.steps",
                                                                   "train.num_steps"]),
    ("section typo", train("--config.optimiser.learning_rate=1"), ["optimiser", "optimizer"]),
    ("key typo, nested", train("--config.model.dtipe=bfloat16"), ["model.dtipe",
                                                                  "model.dtype"]),
    ("missing config file", ["train", "--config=configs/nope.py", "--workdir=wd"],
     ["configs/nope.py"]),
    ("config is a directory", ["train", "--config=a_directory", "--workdir=wd"],
     ["a_directory"]),
    ("config is not python", ["train", "--config=prompts.jsonl", "--workdir=wd"],
     ["prompts.jsonl"]),
    ("config syntax error", ["train", "--config=syntax_error.py", "--workdir=wd"],
     ["syntax_error.py"]),
    ("config without get_config", ["train", "--config=no_get_config.py", "--workdir=wd"],
     ["no_get_config.py", "get_config"]),
    ("config argument refused", ["train", f"--config={BERT}:bogus", "--workdir=wd"],
     ["bogus"]),
    ("value of the wrong type", train("--config.train.num_steps=abc"), ["train.num_steps"]),
    ("a JSON file as the config", ["train", "--config=settings.json", "--workdir=wd"],
     ["settings.json", ".py"]),
    ("vocab_size under the vocabulary's", train(config="variants.py:vocab"),
     ["model.overrides.vocab_size=1000", "8192"]),
    ("mesh rule naming no mesh axis", train(config="variants.py:rule"),
     ["mesh.rules[0]", "nosuchaxis"]),
    ("phase length not a number", train(config="variants.py:phase"),
     ["train.phases[0].length", "long"]),
    ("objective option of the wrong type", train(config="variants.py:option"),
     ["data.options.max_predictions_per_seq", "ten", "int"]),
    ("model override that is no ModelConfig field",
     train("--config.model.overrides.loss_chunk_row=0"),
     ["model.overrides.loss_chunk_row", "ModelConfig", "'model.overrides.loss_chunk_rows'"]),
    ("model override of the wrong type", train("--config.model.overrides.num_layers=two"),
     ["model.overrides.num_layers=two", "int"]),
    ("missing --workdir", ["train", f"--config={BERT}"], ["--workdir"]),
    ("missing --config", ["train", "--workdir=wd"], ["--config"]),
    ("unknown flag", train("--bogus=1"), ["bogus"]),
    ("multi-host without coordinator", train("--num_processes=2"), ["--coordinator_address"]),
    # ------------------------------------------------------ text-task builders (task)
    ("task source: empty glob", ["task", "acceptability", "--source=text:nothing/*.txt",
                                 "--out=out"], ["nothing/*.txt"]),
    ("task source: too few sentences", ["task", "coherence", "--source=text:a_directory/*.txt",
                                        "--out=out"], ["a_directory", "too small"]),
    ("task: more labels per class than the data", [
        "task", "acceptability", "--source=text:story/*.txt", "--out=out",
        "--per_class=500"], ["--per_class 500", "story", "acceptable"]),
    ("task: one author only", ["task", "authorship", "--source=text:story/*.txt",
                               "--out=out"], ["two authors", "smith"]),
    # ------------------------------------------------------------------- config values
    ("learning rate nan", train("--config.optimizer.learning_rate=nan"),
     ["optimizer.learning_rate"]),
    ("learning rate inf", train("--config.optimizer.learning_rate=inf"),
     ["optimizer.learning_rate"]),
    ("weight decay nan", train("--config.optimizer.weight_decay=nan"),
     ["optimizer.weight_decay"]),
    ("negative seed", train("--config.seed=-1"), ["seed"]),
    ("cudnn attention on a CPU", train("--config.model.attention_impl=cudnn"),
     ["model.attention_impl='cudnn'", "needs a GPU"]),
    ("unknown attention kernel", train("--config.model.attention_impl=flash"),
     ["model.attention_impl", "'cudnn'"]),
    ("T5 length of 10^7", train("--config.data.length=10000000", config=T5),
     ["data.length=10000000", "GiB"]),
    ("zero batch", train("--config.train.batch_size=0"), ["train.batch_size"]),
    ("batch over 8 devices", train("--config.train.batch_size=7"), ["train.batch_size"]),
    ("negative eval_every", train("--config.train.eval_every=-1"), ["train.eval_every"]),
    ("unknown preset", train("--config.model.preset=bert-huge"), ["model.preset"]),
    ("unknown objective", train("--config.data.objective=mlm"), ["data.objective"]),
    ("objective of another family", train("--config.data.objective=causal_lm"),
     ["data.objective", "causal_lm"]),
    ("unknown optimizer", train("--config.optimizer.name=sgd"), ["optimizer.name"]),
    ("warmup past the end", train("--config.optimizer.warmup_steps=100000"),
     ["optimizer.warmup_steps"]),
    ("heads over the mesh", train("--config.mesh.tensor=3"), ["mesh"]),
    ("length past positions", train("--config.data.length=4096"), ["data.length"]),
    ("b1 out of range", train("--config.optimizer.b1=1.5"), ["optimizer.b1"]),
    # ------------------------------------------------------------------- paths, sources
    ("glob matching nothing", train("--config.data.source=text:nothing/*.txt"),
     ["nothing/*.txt"]),
    ("directory instead of a glob", train("--config.data.source=text:a_directory"),
     ["a_directory"]),
    ("only empty files", train("--config.data.source=text:empty_files/*.txt"),
     ["empty_files"]),
    ("jsonl rows without the field", train("--config.data.source=jsonl:jsonl_no_field/*"),
     ["jsonl_no_field", "text"]),
    ("jsonl source too small for one example",
     train("--config.data.source=jsonl:jsonl_few_rows/*:body"),
     ["jsonl_few_rows", "data.length=", "too little text"]),
    ("jsonl glob over text files", train("--config.data.source=jsonl:plain_text/*.jsonl"),
     ["plain_text"]),
    ("unknown source scheme", train("--config.data.source=csv:x.csv"), ["data.source"]),
    ("missing vocabulary", train("--config.data.vocab=no_such_vocab.model"),
     ["no_such_vocab.model"]),
    ("workdir is a file", train(workdir="not_a_dir"), ["not_a_dir"]),
    ("unsupported URL scheme", train(workdir="ftp://host/run"), ["ftp"]),
    ("file named like a step in checkpoints/", smoke(workdir="ckpt_junk"),
     ["checkpoints/35"]),
    # ------------------------------------------------------------------- other commands
    ("infer: no checkpoint", infer(), ["no_such_run"]),
    ("infer: missing input", infer(input_file="nope.jsonl", checkpoint="a_directory"),
     ["nope.jsonl"]),
    ("infer: checkpoints/ without a finished step", infer(checkpoint="ckpt_junk"),
     ["ckpt_junk"]),
    ("infer: key typo", infer("--config.data.lenght=3"), ["data.lenght", "data.length"]),
    ("finetune: key typo", finetune("--config.train.num_step=3"), ["train.num_step"]),
    ("finetune: missing task file", finetune("--config.task.train_file=task/nope.csv"),
     ["task/nope.csv"]),
    ("finetune: missing pretrained checkpoint",
     finetune("--config.init.checkpoint=no_such_run"), ["no_such_run"]),
    ("finetune: missing pretraining config", finetune("--config.init.config=nope.py"),
     ["init.config", "nope.py"]),
    ("finetune: unknown task", finetune("--config.task.name=summarize"),
     ["task.name", "summarize", "regression"]),
    ("finetune: a task option it refuses", finetune("--config.task.pooling=max"),
     ["config.task", "pooling='max'"]),
    ("finetune: span extraction without a context column",
     finetune("--config.task.name=span_extraction"), ["span_extraction", "text_pair_column"]),
    ("plan: unknown topology", ["plan", f"--config={BERT}", "--topology=v9-7"], ["v9-7"]),
    ("plan: key typo", ["plan", f"--config={BERT}", "--config.mesh.tensr=2"],
     ["mesh.tensr", "mesh.tensor"]),
    ("bench model: key typo", ["bench", "model", f"--config={BERT}:smoke",
                               "--config.train.batchsize=2"], ["train.batchsize"]),
    ("vocab train: glob matching nothing", ["vocab", "train", "--source", "text:none/*.txt",
                                            "--vocab-size", "700", "--family", "bert",
                                            "--out", "v"], ["none/*.txt"]),
    ("unknown command", ["pretrain"], ["pretrain"]),
]


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
  path = tmp_path_factory.mktemp("user_errors")
  cwd = os.getcwd()
  os.chdir(path)
  try:
    _files(path)
  finally:
    os.chdir(cwd)
  return path


def _snapshot(path):
  return sorted((os.path.relpath(os.path.join(d, f), path), os.path.getsize(os.path.join(d, f)))
                for d, _, files in os.walk(path) for f in files) + sorted(
      os.path.relpath(d, path) for d, _, _ in os.walk(path))


def test_at_least_forty_cases():
  assert len(CASES) >= 40 and len({c[0] for c in CASES}) == len(CASES)


@pytest.mark.parametrize("name, argv, words", CASES, ids=[c[0] for c in CASES])
def test_user_error(name, argv, words, scratch, monkeypatch, capfd):
  monkeypatch.chdir(scratch)
  before = _snapshot(scratch)
  code = cli.main(list(argv))
  out, err = capfd.readouterr()
  lines = [line for line in err.splitlines() if line.strip()]
  assert code == 2, (name, code, err[-3000:])
  assert "Traceback" not in err + out, err
  assert 1 <= len(lines) <= 2, err
  for word in words:
    assert word in err, (word, err)
  assert _snapshot(scratch) == before, "something was written"


def test_debug_shows_the_traceback(scratch, monkeypatch, capfd):
  monkeypatch.chdir(scratch)
  assert cli.main(["--debug", *train("--config.optimizer.learning_rate=nan")]) == 2
  err = capfd.readouterr().err
  assert "Traceback" in err and "optimizer.learning_rate" in err.splitlines()[-1]


def test_console_command_one_line_and_exit_2(scratch):
  """The installed console command (a fresh process): exit 2, one line, no traceback."""
  console = os.path.join(os.path.dirname(sys.executable), "t5x-like")
  proc = subprocess.run([console, *train(
      "--config.train.num_step=100")], cwd=scratch, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 2, proc.stderr
  assert proc.stderr.strip().count("\n") == 0 and "train.num_steps" in proc.stderr


# ------------------------------------------------------------------------- --help
HELP = [(["train"], "--workdir"), (["plan"], "--topology"), (["infer"], "--checkpoint"),
        (["finetune"], "--workdir"), (["models"], "names"), (["vocab"], "train"),
        (["vocab", "train"], "--source"), (["vocab", "encode"], "--vocab"),
        (["vocab", "decode"], "ids"), (["task"], "books"), (["task", "books"], "--out"),
        (["task", "books-unseen"], "--num_regions"), (["task", "acceptability"], "--per_class"),
        (["task", "coherence"], "--min_distance"), (["task", "authorship"], "--source"), (["bench"], "bert-vs-torch"),
        (["bench", "data"], "--objective"), (["bench", "attention"], "--interpret_pallas"),
        (["bench", "model"], "--steps"), (["bench", "compile"], "--layers"),
        (["bench", "bert-vs-torch"], "--config"), (["data"], "prepare"),
        (["data", "prepare"], "--out")]


@pytest.mark.parametrize("command, flag", HELP, ids=[" ".join(c) for c, _ in HELP])
def test_every_command_answers_help(command, flag, capsys):
  for option in ("--help", "-h", "--helpshort", "--helpfull"):  # absl flags, every command
    assert cli.main([*command, option]) == 0, option
    out, err = capsys.readouterr()
    assert "usage" in out.lower() and flag in out, (option, out, err)
    assert "Unknown command line flag" not in err


def test_top_level_help_lists_every_command(capsys):
  assert cli.main(["--help"]) == 0
  out = capsys.readouterr().out
  for command in ("train", "plan", "infer", "finetune", "models", "vocab", "task", "bench"):
    assert f"    {command}" in out, command
