"""Fine-tuning: WordPiece == transformers' BertTokenizer, data errors with file:line,
encodings, heads (BertForSequenceClassification parity), training a tiny classifier
with the train step, and metrics against hand-computed values.
"""

import json
import string

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
import torch
import transformers

import t5x_like.hf as hf
from t5x_like import parallel
from t5x_like.data.vocab import default_vocab
from t5x_like.finetune import metrics
from t5x_like.finetune.data import DataError, read_examples
from t5x_like.finetune.encoding import (encode_decoder_pair, encode_examples,
                                        encode_text_to_text, label_targets, truncate_pair)
from t5x_like.finetune.model import FinetuneModel
from t5x_like.finetune.task import Example
from t5x_like.finetune.tasks import make_task
from t5x_like.finetune.tasks.span_extraction import encode_windows, span_text
from t5x_like.finetune.tasks.token_classification import encode_token_classification
from t5x_like.finetune.tokenizer import as_tokenizer
from t5x_like.finetune.wordpiece import WordPieceTokenizer
from t5x_like.models import bert, build_model, gpt2, t5
from t5x_like.train.state import create_train_state
from t5x_like.train.step import make_train_step

SPECIALS = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
WORDS = ["the", "quick", "brown", "fox", "jump", "##s", "##ed", "##ing", "over", "lazy", "dog",
         "un", "##aff", "##able", "hello", "world", "cafe", "café", "naive", "zur", "##ich",
         "new", "york", "Hello", "World", "The", "New", "York", "can", "do", "##n", "straße",
         "##er", "is", "in", "who", "lives", "paris", "city", "of", "light"]
CHARS = list("éüßçñ東京大学日本") + ["¿", "¡", "—", "“", "”"]


def _write_vocab(path, cased: bool) -> str:
  letters = string.ascii_letters if cased else string.ascii_lowercase
  tokens = (SPECIALS + WORDS + list(letters + string.digits + string.punctuation) + CHARS
            + ["##" + c for c in letters + string.digits])
  unique = list(dict.fromkeys(tokens))
  path.write_text("\n".join(unique) + "\n", encoding="utf-8")
  return str(path)


TEXTS = [
    "The quick brown fox jumped over the lazy dog!",
    "Hello, World... (unaffable) naïve café",
    "Zürich\tis   in\nSwitzerland; don't can't",
    "東京大学 は 日本 にある",  # CJK ideographs split, kana are not
    "ÀÉÎÕÜ straße STRASSE",
    "x" * 101 + " ok " + "y" * 100,  # over 100 characters -> [UNK]; exactly 100 -> pieces
    "weird\x00chars\ufffd here\x07 and \u200b zero width",  # dropped control characters
    "¿Qué tal? ¡Bien! — “quoted” $5.00 #tag @user",
    "unknownsymbol☃ snow ☃☃",
    "  leading and trailing   ",
    "",
    "\u00a0nbsp\u2028line sep\u3000ideographic space",
    "İstanbul ǅemal ﬁne ligature",
    "a^b`c~d|e 123,456.78 numbers9",
    "e\u0301 combining accent, ΑΣ final sigma ΟΔΟΣ",  # NFC composes é (cased)
]


@pytest.fixture(scope="module")
def vocab_files(tmp_path_factory):
  d = tmp_path_factory.mktemp("wordpiece")
  return {cased: _write_vocab(d / f"vocab_{cased}.txt", cased) for cased in (False, True)}


# ------------------------------------------------------------------ WordPiece
@pytest.mark.parametrize("cased", [False, True])
def test_wordpiece_ids_equal_transformers(vocab_files, cased):
  path = vocab_files[cased]
  ours = WordPieceTokenizer.from_file(path, lowercase=not cased)
  slow = transformers.BertTokenizerLegacy(path, do_lower_case=not cased)
  fast = transformers.BertTokenizer(path, do_lower_case=not cased)
  unk = 0
  for text in TEXTS:
    ids = ours.encode(text)
    assert ids == fast.encode(text, add_special_tokens=False), text
    # The legacy python tokenizer NFC-normalises (BERT's tokenization.py and the Rust
    # one do not): a decomposed accent differs only in a cased vocabulary.
    if not (cased and "\u0301" in text):
      assert ids == slow.encode(text, add_special_tokens=False), text
    with_offsets, _ = ours.encode_with_offsets(text)
    assert with_offsets == ids
    unk += ids.count(ours.unk_id)
  assert unk >= 4  # the texts really exercise [UNK]
  assert (ours.cls_id, ours.sep_id, ours.pad_id, ours.unk_id) == (2, 3, 0, 1)


def test_wordpiece_offsets_point_at_the_pieces(vocab_files):
  tok = WordPieceTokenizer.from_file(vocab_files[False])
  text = "Zürich is   unaffable, naïve\x00ly!"
  ids, offsets = tok.encode_with_offsets(text)
  spans = [text[a:b] for a, b in offsets]
  assert tok.pieces(ids) == ["zur", "##ich", "is", "un", "##aff", "##able", ",", "naive",
                             "##l", "##y", "!"]
  # Accents stripped and a dropped NUL in the middle of a word: spans still exact.
  assert spans == ["Zür", "ich", "is", "un", "aff", "able", ",", "naïve", "l", "y", "!"]
  assert offsets[7] == (23, 28) and offsets[8] == (29, 30)


# ------------------------------------------------------------------ data files
CSV_HEADER = "text,label\n"
CSV_GOOD = 'great movie,pos\n"a\nmultiline, quoted review",neg\n'  # lines 2 and 3-4


@pytest.mark.parametrize("bad_row,fragment", [
    ("only one field\n", "column 'label' is missing"),
    ('"",pos\n', "column 'text' is empty"),
    ("fine text,maybe\n", "label 'maybe' is not in the label list"),
])
def test_csv_bad_row_names_file_and_line(tmp_path, bad_row, fragment):
  path = tmp_path / "train.csv"
  path.write_text(CSV_HEADER + CSV_GOOD + bad_row + "ok,pos\n", encoding="utf-8")
  cfg = make_task("classification", labels=("neg", "pos"))
  with pytest.raises(DataError, match=fragment) as info:
    read_examples(path, cfg)
  assert info.value.line == 5 and info.value.path == str(path)
  assert str(info.value).startswith(f"{path}:5: ")

  kept = read_examples(path, make_task("classification", labels=("neg", "pos"),
                                       skip_bad_rows=True))
  assert [e.line for e in kept.examples] == [2, 3, 6]
  assert kept.stats["bad_rows"] == 1 and kept.stats["examples"] == 3
  assert kept.stats["bad_row_messages"][0].startswith(f"{path}:5: ")


def test_csv_labels_collected_sorted_and_pairs(tmp_path):
  path = tmp_path / "pairs.csv"
  path.write_text("premise,hypothesis,gold\nA cat.,An animal.,yes\nA cat.,A dog.,no\n"
                  "x,y,maybe\n", encoding="utf-8")
  data = read_examples(path, make_task("classification", text_column="premise",
                                       text_pair_column="hypothesis",
                                        label_column="gold"))
  assert data.labels == ("maybe", "no", "yes")
  assert [(e.text_pair, e.label) for e in data.examples] == [("An animal.", 2), ("A dog.", 1),
                                                             ("y", 0)]
  with pytest.raises(DataError, match="header has no column 'sentence'") as info:
    read_examples(path, make_task("classification", text_column="sentence"))
  assert info.value.line == 1


JSONL_LINES = [
    json.dumps({"text": "good", "label": "pos"}),
    "",  # blank lines are counted, not errors
    json.dumps({"text": "bad", "label": "neg"}),
]


@pytest.mark.parametrize("bad_line,fragment", [
    ('{"text": "broken", "label": ', "malformed JSON"),
    (json.dumps({"text": "no label"}), "column 'label' is missing"),
    (json.dumps({"text": "odd", "label": "neutral"}), "label 'neutral' is not in the label list"),
    (json.dumps(["not", "an", "object"]), "expected a JSON object"),
])
def test_jsonl_bad_line_names_file_and_line(tmp_path, bad_line, fragment):
  path = tmp_path / "dev.jsonl"
  path.write_text("\n".join(JSONL_LINES + [bad_line, JSONL_LINES[0]]) + "\n", encoding="utf-8")
  with pytest.raises(DataError, match=fragment) as info:
    read_examples(path, make_task("classification"), labels=("neg", "pos"))
  assert info.value.line == 4 and str(info.value).startswith(f"{path}:4: ")
  kept = read_examples(path, make_task("classification", skip_bad_rows=True),
                       labels=("neg", "pos"))
  assert [e.line for e in kept.examples] == [1, 3, 5]
  assert kept.stats["bad_rows"] == 1 and kept.stats["blank_lines"] == 1


def test_skip_bad_rows_counts_every_reason(tmp_path):
  path = tmp_path / "mixed.jsonl"
  rows = ['{"text": "a", "label": "pos"}', "{oops", '{"label": "pos"}',
          '{"text": "  ", "label": "neg"}', '{"text": "b", "label": "other"}',
          '{"text": "c", "label": "neg"}']
  path.write_text("\n".join(rows) + "\n", encoding="utf-8")
  data = read_examples(path, make_task("classification", labels=("neg", "pos"),
                                       skip_bad_rows=True))
  assert [e.line for e in data.examples] == [1, 6]
  assert data.stats["rows"] == 6 and data.stats["bad_rows"] == 4
  assert data.stats["bad_row_reasons"] == {"malformed_json": 1, "missing_column": 1,
                                           "empty_text": 1, "unknown_label": 1}


def test_token_and_span_rows(tmp_path):
  tags = tmp_path / "ner.jsonl"
  tags.write_text(json.dumps({"text": "John lives here", "label": ["B-PER", "O", "O"]}) + "\n"
                  + json.dumps({"text": "Two words", "label": "O"}) + "\n", encoding="utf-8")
  with pytest.raises(DataError, match="1 tags for 2 words") as info:
    read_examples(tags, make_task("token_classification"))
  assert info.value.line == 2
  data = read_examples(tags, make_task("token_classification", skip_bad_rows=True))
  assert data.labels == ("B-PER", "O") and data.examples[0].tags == (0, 1, 1)

  spans = tmp_path / "squad.csv"
  spans.write_text("question,context,answer_text,answer_start\n"
                   "Where?,He lives in Paris.,Paris,12\nWhere?,He lives in Paris.,Paris,3\n",
                   encoding="utf-8")
  cfg = make_task("span_extraction", text_column="question", text_pair_column="context")
  with pytest.raises(DataError, match="not at character 3") as info:
    read_examples(spans, cfg)
  assert info.value.line == 3


# ------------------------------------------------------------------ encodings
def test_bert_pair_layout_and_truncation_equal_transformers(vocab_files):
  tok = WordPieceTokenizer.from_file(vocab_files[False])
  hf_tok = transformers.BertTokenizerLegacy(vocab_files[False])
  a, b = "the quick brown fox jumped over the lazy dog", "hello world"
  data = [Example(a, b, label=1), Example("hello", None, label=0)]
  for max_length in (32, 12, 9):
    batch, stats = encode_examples(data, tok, make_task("classification", max_length=max_length))
    for row, ex in enumerate(data):
      ref = hf_tok(ex.text, ex.text_pair, max_length=max_length, truncation="longest_first",
                   padding="max_length", return_token_type_ids=True)
      assert batch["encoder_input_tokens"][row].tolist() == ref["input_ids"]
      assert batch["encoder_type_ids"][row].tolist() == ref["token_type_ids"]
    assert stats["truncated"] == (max_length < 16)
  # [CLS] a [SEP] b [SEP]: the longer side loses tokens first, b on a tie.
  assert truncate_pair([1] * 5, [2] * 3, 6) == ([1] * 3, [2] * 3)
  assert truncate_pair([1] * 3, [2] * 3, 5) == ([1] * 3, [2] * 2)
  batch, _ = encode_examples(data, tok, make_task("classification", max_length=9))
  assert tok.pieces(batch["encoder_input_tokens"][0]) == [
      "[CLS]", "the", "quick", "brown", "fox", "[SEP]", "hello", "world", "[SEP]"]
  assert batch["encoder_type_ids"][0].tolist() == [0] * 6 + [1] * 3
  assert tok.pieces(batch["encoder_input_tokens"][1]) == ["[CLS]", "hello", "[SEP]"] + [
      "[PAD]"] * 6
  assert batch["labels"].tolist() == [1, 0]


def test_token_classification_labels_on_first_subtoken(vocab_files):
  tok = WordPieceTokenizer.from_file(vocab_files[False])
  example = Example("Zürich is unaffable", tags=(2, 0, 1))
  features, truncated = encode_token_classification(tok, example, max_length=10)
  assert tok.pieces(features["encoder_input_tokens"][:8]) == [
      "[CLS]", "zur", "##ich", "is", "un", "##aff", "##able", "[SEP]"]
  assert features["labels"].tolist() == [-1, 2, -1, 0, 1, -1, -1, -1, -1, -1]
  assert not truncated
  features, truncated = encode_token_classification(tok, example, max_length=5)
  assert features["labels"].tolist() == [-1, 2, -1, 0, -1] and truncated


@pytest.mark.parametrize("which", ["wordpiece", "sentencepiece"])
def test_span_positions_round_trip_to_the_answer(vocab_files, which):
  tok = (WordPieceTokenizer.from_file(vocab_files[False]) if which == "wordpiece"
         else as_tokenizer(default_vocab("bert")))
  context = "The city of light is Paris, where he lives; nothing else."
  examples = [Example("Who lives in the city of light?", context, answer_text=answer,
                      answer_start=context.index(answer))
              for answer in ("Paris", "the city of light"[4:], "he lives")]
  examples.append(Example("Who?", context, answer_text="", answer_start=-1))
  task = make_task("span_extraction", text_pair_column="context", max_length=48,
                   allow_no_answer=True)
  batch, stats = encode_examples(examples, tok, task)
  assert stats["answers_lost"] == 0 and stats["rows"] == len(examples)  # one window each
  for row, ex in enumerate(examples):
    start, end = batch["start_positions"][row], batch["end_positions"][row]
    assert batch["example_index"][row] == row
    if ex.answer_text:
      assert 0 < start <= end
      assert span_text(context, batch["context_offsets"][row], start, end) == ex.answer_text
    else:
      assert start == end == 0
  # A window too short for the whole context: the answer is in a later window, never
  # lost; the windows without it point at [CLS].
  late = Example("Who?", context, answer_text="nothing", answer_start=context.index("nothing"))
  rows, lost = encode_windows(tok, late, max_length=12, doc_stride=2)
  assert not lost and len(rows) > 1
  holding = [r for r in rows if r["start_positions"] > 0]
  assert holding and all(r["start_positions"] == r["end_positions"] == 0
                         for r in rows if r["start_positions"] == 0)
  assert span_text(context, holding[0]["context_offsets"], holding[0]["start_positions"],
                   holding[0]["end_positions"]) == "nothing"


def test_decoder_and_text_to_text_encodings():
  gpt = as_tokenizer(default_vocab("gpt"))
  features, _ = encode_decoder_pair(gpt, Example("a good film", "yes", label=1), 16)
  ids = gpt.encode("a good film") + [gpt.eos_id] + gpt.encode("yes") + [gpt.eos_id]
  assert features["decoder_input_tokens"][:len(ids)].tolist() == ids
  assert features["decoder_segment_ids"].tolist() == [1] * len(ids) + [0] * (16 - len(ids))

  t5_tok = as_tokenizer(default_vocab("t5"))
  names = ("negative", "positive")
  features, _ = encode_text_to_text(t5_tok, Example("a good film", label=1), names, 16, 6,
                                    "sst2")
  target = t5_tok.encode("positive") + [1]
  assert features["decoder_target_tokens"][:len(target)].tolist() == target
  assert features["decoder_input_tokens"].tolist()[:len(target)] == [0] + target[:-1]
  assert features["decoder_loss_weights"].sum() == len(target)
  enc = t5_tok.encode("sst2: a good film") + [1]
  assert features["encoder_input_tokens"][:len(enc)].tolist() == enc
  assert label_targets(t5_tok, names, 6).shape == (2, 6)
  # T5's encoder under a head (text_to_text=False): the same inputs, no decoder features
  head_task = make_task("classification", text_to_text=False, task_prefix="sst2",
                        max_length=16)
  features, cut = head_task.encode(Example("a good film", label=1), t5_tok, "encoder_decoder",
                                   names)
  assert sorted(features) == ["encoder_input_tokens", "labels"] and not cut
  assert features["encoder_input_tokens"].tolist() == enc + [0] * (16 - len(enc))
  assert features["labels"] == 1


# ------------------------------------------------------------------ heads
def _init(model, seed=0):
  return jax.jit(model.init)(jax.random.key(seed))


def _with_reference_weights(tmp_path, task, num_labels, **config_kw):
  """(transformers' BertForSequenceClassification, our FinetuneModel for `task`, its params
  with the reference's weights: backbone and pooler through a saved checkpoint and
  hf.load, the classifier copied)."""
  config = transformers.BertConfig(vocab_size=99, hidden_size=24, num_hidden_layers=2,
                                   num_attention_heads=3, intermediate_size=37,
                                   num_labels=num_labels, **config_kw)
  reference = transformers.BertForSequenceClassification(config).eval()
  pretraining = transformers.BertForPreTraining(config)
  pretraining.bert.load_state_dict(reference.bert.state_dict())
  pretraining.save_pretrained(str(tmp_path / "bert"))
  backbone, pretrained = hf.load(str(tmp_path / "bert"))
  model = FinetuneModel(backbone.config, task,
                        **({"num_labels": num_labels} if task == "classification" else {}))
  # load_backbone fills every backbone param and the pooler; only shapes are needed here.
  params = model.load_backbone(jax.eval_shape(model.init, jax.random.key(0)), pretrained)
  params["head"]["classifier"] = {
      "kernel": reference.classifier.weight.detach().numpy().T,
      "bias": reference.classifier.bias.detach().numpy()}
  return reference, model, params


def test_bert_classifier_equals_bert_for_sequence_classification(tmp_path):
  torch.manual_seed(0)
  reference, model, params = _with_reference_weights(tmp_path, "classification", num_labels=3)
  rng = np.random.default_rng(0)
  tokens = rng.integers(5, 99, (3, 10))
  tokens[:, 0] = 2
  tokens[1, 6:] = 0
  types = np.zeros_like(tokens)
  types[:, 4:] = 1
  types[tokens == 0] = 0
  with torch.no_grad():
    ref = reference(input_ids=torch.tensor(tokens), token_type_ids=torch.tensor(types),
                    attention_mask=torch.tensor(tokens != 0)).logits.numpy()
  ours = jax.jit(model.logits)(params, {"encoder_input_tokens": jnp.asarray(tokens),
                                        "encoder_type_ids": jnp.asarray(types)})
  assert ours.shape == (3, 3)
  np.testing.assert_allclose(np.asarray(ours), ref, atol=1e-5)

  # pooling="mean": the pooler and classifier read the mean of the real tokens' states.
  mean_model = FinetuneModel(model.config, "classification", num_labels=3, pooling="mean")
  with torch.no_grad():
    mask = torch.tensor(tokens != 0, dtype=torch.float32)
    hidden = reference.bert(input_ids=torch.tensor(tokens), token_type_ids=torch.tensor(types),
                            attention_mask=mask).last_hidden_state
    mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
    ref_mean = reference.classifier(torch.tanh(reference.bert.pooler.dense(mean))).numpy()
  ours_mean = jax.jit(mean_model.logits)(params, {"encoder_input_tokens": jnp.asarray(tokens),
                                                  "encoder_type_ids": jnp.asarray(types)})
  np.testing.assert_allclose(np.asarray(ours_mean), ref_mean, atol=1e-5)
  assert np.abs(ref_mean - ref).max() > 1e-3  # it is not the [CLS] reading


def test_regression_equals_bert_for_sequence_classification_with_one_label(tmp_path):
  torch.manual_seed(1)
  reference, model, params = _with_reference_weights(tmp_path, "regression", num_labels=1,
                                                     problem_type="regression")
  rng = np.random.default_rng(1)
  tokens = rng.integers(5, 99, (4, 9))
  tokens[:, 0] = 2
  tokens[2, 5:] = 0
  scores = np.array([0.5, 4.0, -1.25, 2.0], np.float32)
  with torch.no_grad():
    ref = reference(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(tokens != 0),
                    labels=torch.tensor(scores))
  batch = {"encoder_input_tokens": jnp.asarray(tokens),
           "encoder_type_ids": jnp.zeros_like(jnp.asarray(tokens)), "labels": scores}
  np.testing.assert_allclose(np.asarray(jax.jit(model.predict)(params, batch)),
                             ref.logits.numpy()[:, 0], atol=1e-5)
  loss, metrics = model.loss_fn(params, batch, None)  # no dropout rng: deterministic
  np.testing.assert_allclose(float(loss), float(ref.loss), rtol=1e-5)


def test_regression_rows_and_metrics(tmp_path):
  import scipy.stats
  path = tmp_path / "sts.csv"
  path.write_text("a,b,score\nA cat.,An animal.,3.5\nA cat.,A dog.,x\nA cat.,A cat.,5\n",
                  encoding="utf-8")
  task = make_task("regression", text_column="a", text_pair_column="b", label_column="score",
                   skip_bad_rows=True)
  data = read_examples(path, task)
  assert [e.label for e in data.examples] == [3.5, 5.0] and data.labels == ()
  assert data.stats["bad_row_messages"] == [f"{path}:3: column 'score' is not a number: 'x'"]
  predicted = np.array([0.1, 2.0, 2.0, 3.5, 0.7, 5.0])
  gold = np.array([0.0, 1.0, 3.0, 3.0, 2.0, 4.5], np.float32)  # ties on both sides
  scores = task.metrics(predicted, {"labels": gold}, None)
  # correlations in percent (as GLUE reports them); the MSE in the score's own unit
  assert scores["pearson"] == pytest.approx(100 * scipy.stats.pearsonr(predicted, gold)[0])
  assert scores["spearman"] == pytest.approx(100 * scipy.stats.spearmanr(predicted, gold)[0])
  assert scores["mse"] == pytest.approx(np.mean((predicted - gold) ** 2))


def test_gpt_head_reads_the_last_real_token():
  model = FinetuneModel(gpt2(1, 32, vocab_size=50, num_heads=2, d_ff=64,
                             max_position_embeddings=16), "classification", num_labels=2)
  params = _init(model)
  assert "logits_dense" not in params["backbone"] and set(params["head"]) == {"classifier"}
  tokens = jnp.array([[4, 5, 6, 0, 0], [4, 5, 6, 7, 8]])
  segments = jnp.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
  logits = jax.jit(model.logits)
  padded = logits(params, {"decoder_input_tokens": tokens, "decoder_segment_ids": segments})
  short = logits(params, {"decoder_input_tokens": tokens[:, :3],
                          "decoder_segment_ids": segments[:, :3]})
  np.testing.assert_allclose(padded[0], short[0], atol=1e-6)  # padding changes nothing
  assert np.max(np.abs(padded[1] - short[1])) > 1e-4  # row 1 reads token 8, not token 6


def test_t5_rank_classification_scores_each_label_string():
  cfg = t5("1.1", 32, 64, 1, 2, vocab_size=60)
  targets = np.array([[5, 6, 1, 0], [7, 1, 0, 0], [8, 9, 10, 1]])
  model = FinetuneModel(cfg, "classification", label_targets=targets)
  params = _init(model)
  enc = jnp.array([[3, 4, 5, 1, 0], [6, 7, 1, 0, 0]])
  scores = jax.jit(model.logits)(params, {"encoder_input_tokens": enc})
  full = build_model(cfg)  # teacher-forced likelihood of each label, one label at a time
  full_logits = jax.jit(full.logits)
  for c in range(3):
    tgt = jnp.asarray(np.tile(targets[c], (2, 1)))
    dec = jnp.concatenate([jnp.zeros((2, 1), jnp.int32), tgt[:, :-1]], 1)
    logp = jax.nn.log_softmax(full_logits(params["backbone"], {"encoder_input_tokens": enc,
                                                               "decoder_input_tokens": dec}))
    want = jnp.sum(jnp.take_along_axis(logp, tgt[..., None], -1)[..., 0] * (tgt > 0), -1)
    np.testing.assert_allclose(scores[:, c], want, rtol=1e-5)
    if c == 2:  # training is the EncoderDecoder loss: mean token NLL of the label targets
      batch = {"encoder_input_tokens": enc, "decoder_input_tokens": dec,
               "decoder_target_tokens": tgt, "decoder_loss_weights": (tgt > 0).astype(jnp.int32),
               "labels": jnp.array([2, 2])}
      loss, loss_metrics = jax.jit(model.loss_fn)(params, batch, None)
      np.testing.assert_allclose(loss, -jnp.sum(want) / 8, rtol=1e-5)
      assert loss_metrics["token_tokens"] == 8


def test_t5_encoder_head_equals_t5_encoder_model_mean_pooled(tmp_path):
  """text_to_text=False: transformers' T5EncoderModel's last hidden state, mean-pooled
  over the real tokens, through the classifier; the decoder is not part of the model."""
  torch.manual_seed(0)
  config = transformers.T5Config(vocab_size=99, d_model=32, d_kv=8, d_ff=64, num_layers=2,
                                 num_decoder_layers=1, num_heads=4, dropout_rate=0.0,
                                 feed_forward_proj="gated-gelu", tie_word_embeddings=False)
  transformers.T5ForConditionalGeneration(config).save_pretrained(str(tmp_path / "t5"))
  reference = transformers.T5EncoderModel.from_pretrained(str(tmp_path / "t5")).eval()
  backbone, pretrained = hf.load(str(tmp_path / "t5"))
  model = FinetuneModel(backbone.config, "classification", num_labels=3, pooling="mean",
                        text_to_text=False)
  assert not model.text_to_text
  params = model.load_backbone(jax.eval_shape(model.init, jax.random.key(0)), pretrained)
  assert "decoder" not in params["backbone"] and "logits_dense" not in params["backbone"]
  rng = np.random.default_rng(0)
  kernel, bias = rng.normal(0, 0.5, (32, 3)).astype(np.float32), rng.normal(0, 0.5, 3)
  params["head"] = {"classifier": {"kernel": kernel, "bias": bias.astype(np.float32)}}
  tokens = rng.integers(2, 99, (3, 9))
  tokens[1, 5:] = 0
  tokens[2, 2:] = 0
  with torch.no_grad():
    mask = torch.tensor(tokens != 0)
    hidden = reference(input_ids=torch.tensor(tokens), attention_mask=mask).last_hidden_state
    mean = (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)
  want = mean.numpy() @ kernel + bias
  ours = jax.jit(model.logits)(params, {"encoder_input_tokens": jnp.asarray(tokens)})
  np.testing.assert_allclose(np.asarray(ours), want, atol=1e-5)
  batch = {"encoder_input_tokens": jnp.asarray(tokens), "labels": jnp.array([0, 2, 1])}
  loss, _ = model.loss_fn(params, batch, None)
  np.testing.assert_allclose(float(loss), -np.mean(_log_softmax(want)[[0, 1, 2], [0, 2, 1]]),
                             rtol=1e-5)


def _random_params(model, seed=0):
  """Params of the model's shapes without compiling its init (normal(0, 0.2))."""
  rng = np.random.default_rng(seed)
  shapes = jax.eval_shape(model.init, jax.random.key(0))
  return jax.tree.map(lambda s: rng.normal(0, 0.2, s.shape).astype(np.float32), shapes)


def _log_softmax(x):
  x = np.asarray(x, np.float64)
  x = x - x.max(-1, keepdims=True)
  return x - np.log(np.exp(x).sum(-1, keepdims=True))


def _loss_and_logits(model, params, batch):
  return jax.jit(lambda p, b: (model.loss_fn(p, b, None), model.logits(p, b)))(params, batch)


def test_tagging_and_span_losses_follow_their_logits():
  cfg = bert(1, 32, vocab_size=64, num_heads=2, d_ff=64, max_position_embeddings=16)
  tokens = np.array([[2, 9, 10, 11, 3, 12, 13, 3, 0, 0]] * 2, np.int32)
  tokens[1, 5:] = [14, 3, 0, 0, 0]
  batch = {"encoder_input_tokens": tokens, "encoder_type_ids": np.zeros_like(tokens)}

  tagger = FinetuneModel(cfg, "token_classification", num_labels=3)
  params = _random_params(tagger)
  labels = np.full(tokens.shape, -1, np.int32)
  labels[0, [1, 3]] = [2, 0]
  labels[1, 2] = 1
  (loss, m), logits = _loss_and_logits(tagger, params, {**batch, "labels": labels})
  logp = _log_softmax(logits)
  given = labels >= 0
  want = -np.take_along_axis(logp, np.maximum(labels, 0)[..., None], -1)[..., 0][given].mean()
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  assert m["tagging_tokens"] == 3

  reader = FinetuneModel(cfg, "span_extraction")
  params = _random_params(reader, seed=1)
  start, end = np.array([5, 0]), np.array([6, 0])
  (loss, _), out = _loss_and_logits(reader, params, {**batch, "start_positions": start,
                                                     "end_positions": end})
  assert np.all(np.asarray(out["start_logits"])[tokens == 0] <= -1e8)  # padding masked
  rows = np.arange(2)
  want = -0.5 * (_log_softmax(out["start_logits"])[rows, start].mean()
                 + _log_softmax(out["end_logits"])[rows, end].mean())
  np.testing.assert_allclose(loss, want, rtol=1e-5)
  offsets = np.full(tokens.shape + (2,), -1, np.int32)
  offsets[:, 5:7] = [[0, 3], [4, 6]]  # only tokens 5 and 6 are context
  max_context = np.zeros(tokens.shape, np.int32)
  max_context[:, 5] = 1  # token 6 may end an answer but not start one
  best = jax.jit(reader.predict)(params, {**batch, "context_offsets": offsets,
                                          "max_context": max_context})
  start_logits, end_logits = np.asarray(out["start_logits"]), np.asarray(out["end_logits"])
  np.testing.assert_array_equal(np.asarray(best["start_index"])[:, 0], 5)
  np.testing.assert_allclose(np.asarray(best["start_logit"])[:, 0], start_logits[:, 5],
                             rtol=1e-6)
  assert np.all(np.asarray(best["start_logit"])[:, 1:] <= -1e8)  # the rest masked
  ends = np.asarray(best["end_index"])[:, :2]
  want = np.where(end_logits[:, 5:6] >= end_logits[:, 6:7], [[5, 6]], [[6, 5]])
  np.testing.assert_array_equal(ends, want)
  np.testing.assert_allclose(best["null_score"], start_logits[:, 0] + end_logits[:, 0],
                             rtol=1e-6)


# ------------------------------------------------------------------ training
POSITIVE, NEGATIVE = ["good", "great", "fine", "nice"], ["bad", "awful", "poor", "sad"]
FILLER = ["the", "movie", "was", "plot", "acting", "a", "and", "very", "film", "story"]


def _toy_rows(rng, n):
  rows = []
  for _ in range(n):
    label = rng.integers(2)
    words = list(rng.choice(FILLER, rng.integers(3, 7)))
    words.insert(rng.integers(len(words) + 1), rng.choice(POSITIVE if label else NEGATIVE))
    rows.append({"sentence": " ".join(words), "sentiment": ["neg", "pos"][label]})
  return rows


@pytest.mark.long
def test_tiny_bert_finetunes_to_high_accuracy_with_the_train_step(tmp_path):
  vocab = tmp_path / "vocab.txt"
  vocab.write_text("\n".join(SPECIALS + POSITIVE + NEGATIVE + FILLER) + "\n")
  tok = WordPieceTokenizer.from_file(str(vocab))
  rng = np.random.default_rng(0)
  files = {}
  for split, n in (("train", 320), ("dev", 128)):
    files[split] = tmp_path / f"{split}.jsonl"
    files[split].write_text("\n".join(json.dumps(r) for r in _toy_rows(rng, n)) + "\n")
  cfg = make_task("classification", text_column="sentence", label_column="sentiment")
  train = read_examples(files["train"], cfg)
  dev = read_examples(files["dev"], cfg, labels=train.labels)
  assert train.labels == ("neg", "pos")
  train_batch, _ = encode_examples(train.examples, tok, make_task("classification", max_length=12))
  dev_batch, _ = encode_examples(dev.examples, tok, make_task("classification", max_length=12))

  config = bert(2, 32, vocab_size=32, num_heads=2, d_ff=64,  # 23 ids, padded to shard
                max_position_embeddings=16, dropout_rate=0.0, attention_dropout_rate=0.0)
  model = FinetuneModel(config, "classification", num_labels=2)
  mesh = parallel.make_mesh({"data": 2, "fsdp": 2, "tensor": 2})
  tx = optax.adamw(3e-3, weight_decay=0.01)
  batch_size = 32
  shapes = {k: (batch_size,) + v.shape[1:] for k, v in train_batch.items()}
  state, shardings = create_train_state(model, tx, mesh, parallel.DEFAULT_RULES, shapes,
                                        jax.random.key(0))
  # Start from "pretrained" weights: a BERT with MLM / NSP heads, loaded into the backbone.
  pretrained = _init(build_model(config), seed=1)
  params = model.load_backbone(jax.device_get(state.params), pretrained)
  np.testing.assert_array_equal(params["head"]["pooler"]["kernel"],
                                pretrained["pooler"]["kernel"])
  state = state.replace(params=jax.device_put(params, shardings.params))
  step = make_train_step(model, tx, lambda s: 3e-3, mesh=mesh, state_shardings=shardings,
                         batch_shapes=shapes)
  losses = []
  for i in range(100):
    rows = np.arange(i * batch_size, (i + 1) * batch_size) % len(train.examples)
    batch = parallel.shard_batch({k: v[rows] for k, v in train_batch.items()}, mesh)
    state, m = step(state, batch, jax.random.key(2))
    losses.append(float(m["loss"]))
  assert m["classification_tokens"] == batch_size
  assert np.mean(losses[-10:]) < 0.5 * np.mean(losses[:10]), losses[::10]
  predictions = jax.jit(model.predict)(jax.device_get(state.params), dev_batch)
  assert metrics.accuracy(predictions, dev_batch["labels"]) > 0.9

  other = jax.eval_shape(build_model(config.replace(d_ff=48)).init, jax.random.key(1))
  with pytest.raises(ValueError, match=r"pretrained param encoder/layers_0/mlp/wi/bias has"
                     r" shape \(48,\) but the fine-tuning model's backbone expects \(64,\)"):
    model.load_backbone(params, other)


# ------------------------------------------------------------------ metrics
def test_classification_metrics_by_hand():
  labels = np.array([0, 0, 1, 1, 2, 2, -1])
  predictions = np.array([0, 1, 1, 1, 1, 0, 2])  # class 2 is never predicted
  assert metrics.accuracy(predictions, labels) == pytest.approx(3 / 6)
  # class 0: tp 1 fp 1 fn 1 -> 1/2; class 1: tp 2 fp 2 fn 0 -> 4/6; class 2: tp 0 -> 0
  assert metrics.macro_f1(predictions, labels) == pytest.approx((1 / 2 + 2 / 3 + 0) / 3)
  # A class only predicted (3) joins the average with F1 0.
  assert metrics.macro_f1([3, 0], [0, 0]) == pytest.approx((2 / 3 + 0) / 2)
  assert metrics.macro_f1([1, 1], [1, 1]) == 1.0


def test_span_metrics_by_hand():
  assert metrics.normalize_answer("  The  Eiffel-Tower, a landmark! ") == "eiffeltower landmark"
  assert metrics.exact_match("the Eiffel Tower.", ["Eiffel tower", "Paris"]) == 1.0
  assert metrics.exact_match("Tower", "Eiffel Tower") == 0.0
  # pred {eiffel, tower, paris} vs gold {eiffel, tower}: p 2/3, r 1 -> 0.8
  assert metrics.token_f1("Eiffel Tower, Paris", "the Eiffel Tower") == pytest.approx(0.8)
  assert metrics.token_f1("London", ["Paris", "in London"]) == pytest.approx(2 / 3)
  scores = metrics.squad_scores(["Paris", "a dog"], [["paris"], ["the cat"]])
  assert scores == {"exact_match": 50.0, "f1": 50.0}
