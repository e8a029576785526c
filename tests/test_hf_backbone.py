"""Hugging Face checkpoints as fine-tuning backbones (init.hf), in every form transformers
saves them: what loads, what is skipped and what starts at random, said in the log;
init.hf_random; init.model_overrides on the command line. The slow test fine-tunes a
BertModel-only checkpoint through `t5x-like finetune` and checks its first-step loss
against transformers' BertForSequenceClassification on the same weights and batch."""

import csv
import os

import jax
import numpy as np
import pytest
import torch
import transformers

import t5x_like.hf as hf
from t5x_like import cli
from t5x_like.finetune.backbone import BackboneError, load_backbone, resolve_init
from t5x_like.finetune.defaults import default_finetune_config

BERT = dict(vocab_size=40, hidden_size=16, num_hidden_layers=2, num_attention_heads=2,
            intermediate_size=24, max_position_embeddings=32)
GPT2 = dict(vocab_size=40, n_embd=16, n_layer=2, n_head=2, n_positions=32)
T5 = dict(vocab_size=40, d_model=16, d_kv=8, d_ff=24, num_layers=2, num_heads=2)


@pytest.fixture(autouse=True)
def _seed():
  torch.manual_seed(0)


def _save(model, path, vocab=None) -> str:
  model.save_pretrained(str(path))
  if vocab:
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n", encoding="utf-8")
  return str(path)


def _bert(tmp_path, cls, name=None, **config):
  """A `cls` (e.g. transformers.BertModel) of the tiny config, saved -> (model, dir)."""
  model = cls(transformers.BertConfig(**BERT, **config)).eval()
  vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"] + [f"w{i}" for i in range(35)]
  return model, _save(model, tmp_path / (name or cls.__name__), vocab)


def _config(hf_dir, **task):
  c = default_finetune_config()
  c.init.hf = hf_dir
  c.task.max_length = 16
  c.task.update(task)
  return c


def _state(model) -> dict:
  return {k: v.detach().numpy() for k, v in model.state_dict().items()}


# ------------------------------------------------------------------ BERT, every form
def test_a_bert_model_checkpoint_loads_its_encoder_and_pooler(tmp_path):
  """BertModel (no heads, no 'bert.' prefix): before, hf.load wanted cls.predictions.bias
  and the model_overrides workaround dropped the pooler."""
  model, path = _bert(tmp_path, transformers.BertModel)
  notes = resolve_init(_config(path)).notes
  assert notes[0].startswith(f"init.hf: {path} is a BertModel (2 layers, d_model 16, vocab"
                             " 40); loading its embeddings, encoder and pooler (")
  assert notes[1:] == ("init.hf: initialised at random: the classification head",)
  imported = hf.load_backbone(path)
  assert list(imported.loaded) == ["embeddings", "encoder", "pooler"]
  assert imported.skipped == () and imported.missing == ()
  assert not imported.config.mlm_head and not imported.config.nsp_head
  torch_weights = _state(model)
  np.testing.assert_array_equal(imported.params["pooler"]["kernel"],
                                torch_weights["pooler.dense.weight"].T)
  np.testing.assert_array_equal(imported.params["token_embed"]["embedding"],
                                torch_weights["embeddings.word_embeddings.weight"])
  # the run's backbone: the same params, the checkpoint's vocab.txt
  backbone = load_backbone(_config(path))
  assert backbone.source == f"Hugging Face checkpoint {path} (BertModel)"
  np.testing.assert_array_equal(backbone.params["pooler"]["bias"],
                                torch_weights["pooler.dense.bias"])
  assert backbone.tokenizer.encode("w3 w7")[:2] == [8, 12]
  # the whole-model API takes it too, without heads (its pooler has no place there)
  whole, params = hf.load(path)
  assert not whole.config.mlm_head and "pooler" not in params


def test_the_old_workaround_keeps_the_pooler(tmp_path):
  """--config.init.model_overrides.{mlm_head,nsp_head}=false (the dotted form, parsed by
  the finetune command's flags) no longer drops the pretrained pooler."""
  from t5x_like.command_flags import parse_flags
  from t5x_like.commands import finetune
  _, path = _bert(tmp_path, transformers.BertModel)
  config_file = tmp_path / "ft.py"
  config_file.write_text("from t5x_like.finetune.defaults import default_finetune_config\n"
                         "def get_config():\n  return default_finetune_config()\n")
  fv = parse_flags("finetune", [f"--config={config_file}", f"--config.init.hf={path}",
                                "--config.init.model_overrides.mlm_head=false",
                                "--noconfig.init.model_overrides.nsp_head",
                                "--config.init.model_overrides.dropout_rate=0.0",
                                "--config.task.max_length=16"],
                   finetune._flags, required=())
  assert dict(fv.config.init.model_overrides) == dict(mlm_head=False, nsp_head=False,
                                                      dropout_rate=0.0)
  backbone = load_backbone(fv.config)
  assert "pooler" in backbone.params and backbone.model_config.dropout_rate == 0.0


def test_bert_for_pretraining_skips_its_heads_in_one_line(tmp_path):
  _, path = _bert(tmp_path, transformers.BertForPreTraining)
  notes = resolve_init(_config(path)).notes
  assert "loading its embeddings, encoder and pooler" in notes[0]
  skipped = [n for n in notes if "skipped" in n]
  assert len(skipped) == 1
  assert skipped[0].startswith("init.hf: skipped ")
  assert "cls.predictions.* (" in skipped[0] and "the MLM head)" in skipped[0]
  assert "cls.seq_relationship.* (2: the NSP head)" in skipped[0]


def test_bert_for_sequence_classification_skips_its_classifier(tmp_path):
  model, path = _bert(tmp_path, transformers.BertForSequenceClassification, num_labels=3)
  notes = resolve_init(_config(path)).notes
  assert notes[1:] == (
      "init.hf: skipped 2 tensor(s) fine-tuning does not use: classifier.* (2: the"
      " checkpoint's task head)",
      "init.hf: initialised at random: the classification head")
  imported = hf.load_backbone(path)
  assert imported.skipped == ("classifier.bias", "classifier.weight")
  np.testing.assert_array_equal(imported.params["pooler"]["kernel"],
                                _state(model)["bert.pooler.dense.weight"].T)


def test_a_checkpoint_without_a_pooler_starts_it_at_random_and_says_so(tmp_path):
  """BertForTokenClassification saves no pooler; a classification head reads one, a
  token-classification head does not (nothing to say then)."""
  _, path = _bert(tmp_path, transformers.BertForTokenClassification)
  notes = resolve_init(_config(path)).notes
  assert "loading its embeddings and encoder (" in notes[0]
  assert notes[-1] == ("init.hf: initialised at random: the pooler (not in the checkpoint),"
                       " the classification head")
  backbone = load_backbone(_config(path))
  assert "pooler" not in backbone.params
  tagging = resolve_init(_config(path, name="token_classification")).notes
  assert tagging[-1] == "init.hf: initialised at random: the token_classification head"
  # a benchmark's task type is its registry's (above finetune/): said as such
  benchmark = _config(path)
  benchmark.benchmark.name = "squad/v1.1"
  assert resolve_init(benchmark).notes[-1] == (
      "init.hf: initialised at random: the pooler (not in the checkpoint, where the task's"
      " head reads one), the task's head")


def test_a_pooler_the_task_does_not_read_is_skipped(tmp_path):
  _, path = _bert(tmp_path, transformers.BertModel)
  notes = resolve_init(_config(path, pooler=False)).notes
  assert "init.hf: skipped 2 tensor(s) fine-tuning does not use: pooler.* (2: the" \
         " pooler)" in notes
  assert "pooler" not in load_backbone(_config(path, pooler=False)).params


def test_hf_random_is_the_architecture_at_random(tmp_path, capsys):
  model, path = _bert(tmp_path, transformers.BertModel)
  config = _config(path)
  config.init.hf_random = True
  notes = resolve_init(config).notes
  assert notes == (f"init.hf_random: random initialisation of the architecture of {path},"
                   " a BertModel (2 layers, d_model 16, vocab 40), tokenized as it is; no"
                   " weights read",)
  backbone = load_backbone(config)
  assert backbone.source.startswith("random initialisation (init.hf_random)")
  assert backbone.tokenizer.encode("w3")[0] == 8  # the checkpoint's vocab.txt
  loaded = load_backbone(_config(path)).params
  shapes = jax.tree.map(np.shape, backbone.params)
  assert shapes == jax.tree.map(np.shape, {k: v for k, v in loaded.items() if k != "pooler"})
  assert not np.allclose(backbone.params["token_embed"]["embedding"],
                         loaded["token_embed"]["embedding"])
  # without init.hf: one line naming the key, before anything is read
  config.init.hf = ""
  with pytest.raises(BackboneError, match="init.hf_random=true needs config.init.hf"):
    resolve_init(config)


def test_max_length_beyond_the_checkpoints_positions_is_refused(tmp_path):
  _, path = _bert(tmp_path, transformers.BertModel)
  with pytest.raises(BackboneError, match=r"task.max_length=64 exceeds the 32 learned"):
    resolve_init(_config(path, max_length=64))


# ------------------------------------------------------------------ GPT-2 and T5
@pytest.mark.parametrize("cls", ["GPT2Model", "GPT2LMHeadModel",
                                 "GPT2ForSequenceClassification"])
def test_gpt2_with_or_without_heads(tmp_path, cls):
  model = getattr(transformers, cls)(transformers.GPT2Config(**GPT2, pad_token_id=0)).eval()
  path = _save(model, tmp_path / cls)
  imported = hf.load_backbone(path)
  assert list(imported.loaded) == ["embeddings", "decoder"] and imported.missing == ()
  prefix = "" if cls == "GPT2Model" else "transformer."
  np.testing.assert_array_equal(imported.params["token_embed"]["embedding"],
                                _state(model)[f"{prefix}wte.weight"])
  groups = hf.skipped_groups(imported)
  if cls == "GPT2ForSequenceClassification":
    assert groups == [("score.weight", 1, "the checkpoint's classification head")]
  else:  # a tied lm_head is not saved, or skipped as the LM head
    assert groups in ([], [("lm_head.weight", 1, "the LM head (tied to the embeddings)")])
  config = _config(path)
  config.tokenizer.vocab = "unused.txt"  # GPT-2's BPE is not read here
  notes = resolve_init(config).notes
  assert "loading its embeddings and decoder" in notes[0]
  assert notes[-1] == "init.hf: initialised at random: the classification head"


def test_t5_encoder_only_needs_a_head(tmp_path):
  encoder = transformers.T5EncoderModel(transformers.T5Config(**T5)).eval()
  path = _save(encoder, tmp_path / "t5enc")
  with pytest.raises(BackboneError, match="T5EncoderModel has no decoder.*"
                                          "task.text_to_text=false"):
    resolve_init(_config(path))
  notes = resolve_init(_config(path, text_to_text=False)).notes
  assert "loading its embeddings and encoder" in notes[0]
  imported = hf.load_backbone(path, decoder=False)
  np.testing.assert_array_equal(imported.params["token_embed"]["embedding"],
                                _state(encoder)["shared.weight"])
  assert imported.skipped == ()


def test_t5_with_a_head_skips_the_unused_decoder(tmp_path):
  model = transformers.T5ForConditionalGeneration(transformers.T5Config(**T5)).eval()
  path = _save(model, tmp_path / "t5")
  notes = resolve_init(_config(path, text_to_text=False)).notes
  assert any(n.startswith("init.hf: skipped") and "decoder.* (" in n and "the decoder)" in n
             for n in notes), notes
  assert "loading its embeddings, encoder and decoder" in resolve_init(_config(path)).notes[0]
  # T5ForSequenceClassification keeps the model under 'transformer.'
  classifier = transformers.T5ForSequenceClassification(transformers.T5Config(**T5)).eval()
  imported = hf.load_backbone(_save(classifier, tmp_path / "t5cls"))
  assert list(imported.loaded) == ["embeddings", "encoder", "decoder"]
  assert [g[0] for g in hf.skipped_groups(imported)] == ["classification_head.*"]


# ------------------------------------------------------------------ the command line
def test_unknown_finetune_keys_name_the_finetune_defaults(tmp_path, capsys):
  config_file = tmp_path / "ft.py"
  config_file.write_text("from t5x_like.finetune.defaults import default_finetune_config\n"
                         "def get_config():\n  return default_finetune_config()\n")
  assert cli.main(["finetune", f"--config={config_file}", f"--workdir={tmp_path / 'w'}",
                   "--config.init.zzz=1"]) == 2
  err = capsys.readouterr().err
  assert "did you mean 'init.hf'? (t5x_like/finetune/defaults.py lists every key)" in err
  assert err.count("\n") == 1
  assert cli.main(["finetune", f"--config={config_file}", f"--workdir={tmp_path / 'w'}",
                   "--config.qxqxq=1"]) == 2
  assert ("the config has no key 'qxqxq' (t5x_like/finetune/defaults.py lists every key)"
          in capsys.readouterr().err)
  assert cli.main(["finetune", f"--config={config_file}", f"--workdir={tmp_path / 'w'}",
                   "--config.init.model_overrides.mlm_heads=false"]) == 2
  assert "'init.model_overrides.mlm_head'" in capsys.readouterr().err  # the closest field
  assert not os.path.exists(tmp_path / "w")
  # train's keys are train's
  assert cli.main(["train", "--config=configs/bert_cpu.py:smoke", f"--workdir={tmp_path}/t",
                   "--config.zzz.yyy=1"]) == 2
  assert "t5x_like/train/defaults.py lists every key" in capsys.readouterr().err


def test_model_overrides_as_a_dict(tmp_path):
  from t5x_like.command_flags import parse_flags
  from t5x_like.commands import finetune
  config_file = tmp_path / "ft.py"
  config_file.write_text("from t5x_like.finetune.defaults import default_finetune_config\n"
                         "def get_config():\n  return default_finetune_config()\n")
  fv = parse_flags("finetune", [f"--config={config_file}", "--config.init.model_overrides="
                                "{'dropout_rate': 0.0, 'attention_dropout_rate': 0.05}"],
                   finetune._flags, required=())
  assert dict(fv.config.init.model_overrides) == dict(dropout_rate=0.0,
                                                      attention_dropout_rate=0.05)


# ------------------------------------------------------------------ must-show 4 (slow)
def _write_csv(path, rows):
  with open(path, "w", encoding="utf-8", newline="") as f:
    writer = csv.DictWriter(f, fieldnames=["text", "label"])
    writer.writeheader()
    writer.writerows(rows)


def _saved_params(workdir, step) -> dict:
  """{dotted name: array} of the params of a run's checkpoint `step`, read with orbax."""
  import orbax.checkpoint as ocp
  from flax.traverse_util import flatten_dict
  from t5x_like.train.pretrained import find_checkpoint
  handler = ocp.PyTreeCheckpointHandler()
  tree = handler.restore(find_checkpoint(str(workdir), step=step) / "state")
  handler.close()
  return {"/".join(k): np.asarray(v) for k, v in flatten_dict(tree["params"]).items()}


FINETUNE_CONFIG = """
from t5x_like.finetune.defaults import default_finetune_config

def get_config():
  c = default_finetune_config()
  c.init.hf = {hf!r}
  c.task.train_file = {dir!r} + "/train.csv"
  c.task.dev_file = {dir!r} + "/dev.csv"
  c.task.max_length = 16
  c.train.batch_size = 8  # = the train file: the first batch is all of it
  c.train.num_steps = 2
  c.train.log_every = 1
  c.train.eval_every = 0
  c.train.checkpoint_every = 1
  c.optimizer.name = "adamw"
  c.optimizer.schedule = "linear"
  c.optimizer.learning_rate = 1e-2
  c.optimizer.warmup_steps = 1  # the first update's rate is 0
  c.optimizer.weight_decay = 0.01
  return c
"""


@pytest.mark.slow
def test_a_bert_model_checkpoint_fine_tunes_equal_to_transformers_first_step(tmp_path,
                                                                             capsys):
  """Must-show 4. A BertModel-only checkpoint (no heads: the form sentence encoders are
  shared in) fine-tunes through `t5x-like finetune` with init.hf, its pooler loaded.
  Its first-step loss equals transformers' BertForSequenceClassification's on the same
  weights and the same batch: the encoder and pooler from the same file, the classifier
  the one our run drew (copied into torch), dropout off on both sides (our
  init.model_overrides, torch's eval mode), the batch tokenized by transformers'
  BertTokenizer from the same vocab.txt. The first update's learning rate is 0 (linear
  warmup), so the step-1 checkpoint holds the weights the first loss was computed on,
  and the second update trains."""
  from t5x_like.train.metrics import read_jsonl
  # Weights drawn wide (the head too: init_std is the checkpoint's initializer_range),
  # so that the loss is far from log 2, where any near-zero logits would agree.
  model, path = _bert(tmp_path, transformers.BertModel, initializer_range=0.5)
  words = [f"w{i}" for i in range(35)]
  rng = np.random.default_rng(0)
  rows = [{"text": " ".join(rng.choice(words, int(rng.integers(3, 13)))),
           "label": ["neg", "pos"][int(rng.integers(2))]} for _ in range(8)]
  _write_csv(tmp_path / "train.csv", rows)
  _write_csv(tmp_path / "dev.csv", rows[:4])
  (tmp_path / "ft.py").write_text(FINETUNE_CONFIG.format(hf=path, dir=str(tmp_path)))
  workdir = tmp_path / "ft"
  assert cli.main(["finetune", f"--config={tmp_path / 'ft.py'}", f"--workdir={workdir}",
                   "--config.init.model_overrides.dropout_rate=0.0",
                   "--config.init.model_overrides.attention_dropout_rate=0.0"]) == 0
  out = capsys.readouterr().out
  assert "loading its embeddings, encoder and pooler" in out
  assert "initialised at random: the classification head" in out
  start, tuned = _saved_params(workdir, 1), _saved_params(workdir, 2)
  torch_weights = _state(model)
  np.testing.assert_array_equal(start["backbone/token_embed/embedding"],
                                torch_weights["embeddings.word_embeddings.weight"])
  np.testing.assert_array_equal(start["head/pooler/kernel"],
                                torch_weights["pooler.dense.weight"].T)
  assert not np.array_equal(tuned["head/pooler/kernel"], start["head/pooler/kernel"])

  reference = transformers.BertForSequenceClassification.from_pretrained(
      path, num_labels=2).eval()
  with torch.no_grad():
    reference.classifier.weight.copy_(torch.tensor(start["head/classifier/kernel"].T))
    reference.classifier.bias.copy_(torch.tensor(start["head/classifier/bias"]))
  np.testing.assert_array_equal(reference.bert.pooler.dense.weight.detach().numpy(),
                                torch_weights["pooler.dense.weight"])
  tokenizer = transformers.BertTokenizer(os.path.join(path, "vocab.txt"))
  batch = tokenizer([r["text"] for r in rows], padding="max_length", max_length=16,
                    truncation=True, return_tensors="pt")
  labels = torch.tensor([["neg", "pos"].index(r["label"]) for r in rows])
  with torch.no_grad():
    torch_loss = float(reference(**batch, labels=labels).loss)
  rows_logged = {r["step"]: r for r in read_jsonl(str(workdir / "metrics.jsonl"))
                 if "loss" in r}
  our_loss = rows_logged[1]["loss"]
  print(f"first-step loss: ours {our_loss:.6f}, transformers {torch_loss:.6f}")
  assert abs(torch_loss - np.log(2)) > 0.2
  assert our_loss == pytest.approx(torch_loss, abs=1e-4)
  assert rows_logged[2]["loss"] == pytest.approx(our_loss, abs=1e-6)  # lr 0: same weights
