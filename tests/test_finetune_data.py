"""Fine-tuning on a dataset (``data.dataset``): a tokenizer trained here, chat templates with and without
``{% generation %}``, packing, epochs, exact loss over valid tokens across ranks and micro-batches, resumption at
the data position, and bad data refused before any worker starts."""
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from tiny_tokenizer import CHATML_TAGGED, HEADERS, REASONING_LAST, chat_rows, make_pretrained, make_tokenizer, text_rows, write_jsonl
from ultrascale_plugins.interface.config import ConfigError
from ultrascale_plugins.distributed.loss import IGNORE_INDEX
from ultrascale_plugins.data.recipe import DataSpec

REPLY = "blue green red"


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory):
    return make_pretrained(tmp_path_factory.mktemp("pretrained") / "model")


def spec(tmp_path, dataset, **kw):
    kw.setdefault("cache_dir", str(tmp_path / "cache"))
    return DataSpec(dataset=str(dataset), **kw)


def batches(s, model_dir, global_batch=4, seed=0):
    from ultrascale_plugins.data.packed_rows import DatasetBatches
    from ultrascale_plugins.data.tokenized_cache import prepare

    return DatasetBatches(prepare(s, str(model_dir)), s, global_batch, seed)


# ---- chat: loss on the assistant's tokens only ----------------------------------------------------------------
@pytest.mark.parametrize("template", ["prefixes", "generation_tags", "reasoning_last", "headers"])
def test_chat_labels_are_the_assistant_tokens(pretrained, template):
    """ChatML found from prefixes, ChatML with {% generation %}, a template that renders the last reply unlike
    past ones (as Qwen3's does) and one with role headers and an injected system block (as Llama-3.1's)."""
    from ultrascale_plugins.data.chat_tokens import chat_sample
    from ultrascale_plugins.data.tokenized_cache import load_tokenizer

    tok = load_tokenizer(str(pretrained))
    tok.chat_template = {"generation_tags": CHATML_TAGGED, "reasoning_last": REASONING_LAST,
                         "headers": HEADERS}.get(template, tok.chat_template)
    messages = [{"role": "system", "content": "one two"}, {"role": "user", "content": "hello world"},
                {"role": "assistant", "content": "red five"}, {"role": "user", "content": "question"},
                {"role": "assistant", "content": REPLY}]
    ids, labels = chat_sample(tok, messages, "row 1")
    assert len(ids) == len(labels)
    kept = [t for t in labels if t != IGNORE_INDEX]
    text = tok.decode(kept)
    # both replies and their end-of-turn tokens (the last one's empty reasoning block too, as it is generated);
    # nothing of the system or user turns
    think = "<think></think>" if template == "reasoning_last" else ""
    assert text.replace("\n", "") == "red five<|im_end|>" + think + REPLY + "<|im_end|>", text
    assert "hello" not in text and "question" not in text and "user" not in text
    # the kept tokens are contiguous runs that end each assistant turn
    runs = np.flatnonzero(np.diff(np.r_[0, (np.array(labels) != IGNORE_INDEX).astype(int), 0]))
    assert len(runs) == 4


def test_chat_without_template_is_refused(tmp_path):
    from ultrascale_plugins.data.tokenized_cache import prepare

    model = tmp_path / "plain"
    make_tokenizer(model, template=None)
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    with pytest.raises(ConfigError, match="has no chat template"):
        prepare(spec(tmp_path, data, format="chat"), str(model))


# ---- packing ---------------------------------------------------------------------------------------------------
def test_packing_covers_every_token_once_with_restarting_positions(tmp_path, pretrained):
    data = write_jsonl(tmp_path / "text.jsonl", text_rows(40))
    b = batches(spec(tmp_path, data, seq_len=24), pretrained)
    rows = b.train
    tok = rows.data
    epoch0 = [rows.row(r) for r in range(rows.rows_per_epoch)]
    stream = np.concatenate([tok.dataset[int(i)]["input_ids"] for i in rows._epoch(0)[0]])
    packed = torch.cat([r["input_ids"] for r in epoch0]).numpy()
    assert (packed == stream[:len(packed)]).all()  # every token once, in the epoch's order, none dropped early
    assert len(stream) - len(packed) < 24
    for r in epoch0:
        pos, labels = r["position_ids"], r["labels"]
        starts = torch.nonzero(pos == 0).flatten()
        assert starts[0] == 0 and (pos[1:] - pos[:-1] != 1).sum() == len(starts) - 1
        assert (labels[starts[1:]] == IGNORE_INDEX).all()  # no sample predicts its neighbour's first token
        assert (labels[labels != IGNORE_INDEX] == r["input_ids"][labels != IGNORE_INDEX]).all()
    # the next epoch is the same samples in another order, and the plan is the same every time it is built
    assert not (rows._epoch(1)[0] == rows._epoch(0)[0]).all()
    again = batches(spec(tmp_path, data, seq_len=24), pretrained)
    assert torch.equal(again.train.row(rows.rows_per_epoch + 3)["input_ids"],
                       rows.row(rows.rows_per_epoch + 3)["input_ids"])
    # each data-parallel rank reads its own slice of the global batch
    whole = b.global_batch_at(2)
    halves = [b.local_rows(2, r, 2) for r in range(2)]
    assert torch.equal(torch.cat([h["input_ids"] for h in halves]), whole["input_ids"])


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_packed_rows_attend_within_each_sample(tmp_path, pretrained, attn):
    """A packed row's token losses equal those of its samples run one by one: attention does not cross them."""
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.distributed.loss import shifted_targets, token_loss_sum

    data = write_jsonl(tmp_path / "text.jsonl", text_rows(30, seed=1))
    row = batches(spec(tmp_path, data, seq_len=48), pretrained).train.row(1)
    model = AutoModelForCausalLM.from_pretrained(str(pretrained), attn_implementation=attn).eval()
    batch = {k: v[None] for k, v in row.items()}
    with torch.no_grad():
        # use_cache=False, as the training step calls it: transformers reads packed samples from position_ids
        # only without a mask and without a cache
        packed = token_loss_sum(model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                                      use_cache=False).logits, shifted_targets(batch))
        starts = torch.nonzero(row["position_ids"] == 0).flatten().tolist() + [len(row["input_ids"])]
        assert len(starts) > 2  # the row holds several samples
        alone = sum(token_loss_sum(model(input_ids=batch["input_ids"][:, a:b]).logits,
                                   shifted_targets({"labels": batch["labels"][:, a:b]}))
                    for a, b in zip(starts[:-1], starts[1:]))
    assert torch.allclose(packed, alone, rtol=1e-5)


def test_rows_without_packing_are_padded_samples(tmp_path, pretrained):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(12))
    b = batches(spec(tmp_path, data, format="chat", seq_len=40, packing=False), pretrained)
    assert b.train.rows_per_epoch == 12
    row = b.train.row(0)
    n = int(b.train.data.lengths[b.train._epoch(0)[0][0]])
    assert (row["input_ids"][n:] == b.train.data.pad_id).all() and (row["labels"][n:] == IGNORE_INDEX).all()


# ---- bad data --------------------------------------------------------------------------------------------------
def test_bad_data_is_named(tmp_path, pretrained):
    from ultrascale_plugins.data.tokenized_cache import prepare

    with pytest.raises(ConfigError, match="no such file or directory"):
        prepare(spec(tmp_path, tmp_path / "missing.jsonl"), str(pretrained))
    text = write_jsonl(tmp_path / "text.jsonl", text_rows(5))
    with pytest.raises(ConfigError, match=r"data.text_field='body'.*text.jsonl has no such column.*columns: text"):
        prepare(spec(tmp_path, text, text_field="body"), str(pretrained))
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    with pytest.raises(ConfigError, match=r"empty.jsonl' is empty"):
        prepare(spec(tmp_path, empty), str(pretrained))
    holes = write_jsonl(tmp_path / "holes.jsonl", text_rows(3) + [{"text": None}])
    with pytest.raises(ConfigError, match=r"holes.jsonl, row 4 has no value"):
        prepare(spec(tmp_path, holes), str(pretrained))
    rows = chat_rows(6)
    rows[4]["messages"][1]["content"] = " ".join(["quick brown fox"] * 30)
    long = write_jsonl(tmp_path / "long.jsonl", rows)
    with pytest.raises(ConfigError, match=r"packing=false: .*long.jsonl, row 5 has \d+ tokens, more than "
                                          r"data.seq_len=32"):
        batches(spec(tmp_path, long, format="chat", seq_len=32, packing=False), pretrained)
    no_reply = write_jsonl(tmp_path / "noreply.jsonl", [{"messages": [{"role": "user", "content": "hi"}]}])
    with pytest.raises(ConfigError, match="noreply.jsonl, row 1: the conversation has no assistant message"):
        prepare(spec(tmp_path, no_reply, format="chat"), str(pretrained))


def test_other_sources_load(tmp_path, pretrained):
    """A directory of files, parquet, plain text (one sample per paragraph) and a save_to_disk directory."""
    import datasets

    rows = text_rows(10)
    folder = tmp_path / "shards"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", rows[:4])
    write_jsonl(folder / "b.jsonl", rows[4:])
    datasets.Dataset.from_list(rows).to_parquet(str(tmp_path / "t.parquet"))
    (tmp_path / "t.txt").write_text("\n\n".join(r["text"] for r in rows))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "saved"))
    from ultrascale_plugins.data.tokenized_cache import prepare

    counts = {name: len(prepare(spec(tmp_path, tmp_path / name), str(pretrained)).lengths)
              for name in ("shards", "t.parquet", "t.txt", "saved")}
    assert counts == {"shards": 10, "t.parquet": 10, "t.txt": 10, "saved": 10}
    assert prepare(spec(tmp_path, folder), str(pretrained)).where(6) == f"{folder / 'b.jsonl'}, row 3"


# ---- on real processes -----------------------------------------------------------------------------------------
def run_cli(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "train", *args], capture_output=True,
                          text=True, timeout=timeout, env=env)


def chat_recipe(tmp_path, data, nproc, **train):
    recipe = {"nproc": nproc,
              "data": {"dataset": str(data), "format": "chat", "seq_len": 48, "eval_fraction": 0.25,
                       "cache_dir": str(tmp_path / "cache")},
              "train": {"epochs": 10, "global_batch": 8, "grad_accum": 2, "lr": 0.01, "warmup_steps": 2,
                        "log_every": 5, "eval_batches": 1, **train},
              "parallel": {"dp_shard": nproc} if nproc > 1 else {}}
    path = tmp_path / f"chat{nproc}.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


def metrics(path):
    return json.loads(Path(path).read_text())


@pytest.mark.slow
def test_chat_finetune_learns_the_reply_exactly_resumes_and_exports(tmp_path, pretrained):
    """The assistant's reply is fixed, the user's text random: the loss falls near zero only if user tokens do
    not count. Two processes (ZeRO-3, 2 micro-batches with uneven token counts) equal one; a run resumed from
    its mid-epoch checkpoint continues with the same samples (bit for bit); the export carries the tokenizer
    and its chat template."""
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(96, reply=REPLY))
    two = run_cli(str(chat_recipe(tmp_path, data, 2, save_dir=str(tmp_path / "ck"), save_every=4)),
                  "--init-from", str(pretrained), "--metrics", str(tmp_path / "two.json"))
    assert two.returncode == 0, two.stdout[-3000:] + two.stderr[-3000:]
    assert "(chat): 72 samples" in two.stdout and "steps per epoch" in two.stdout, two.stdout
    one = run_cli(str(chat_recipe(tmp_path, data, 1)), "--init-from", str(pretrained),
                  "--metrics", str(tmp_path / "one.json"))
    assert one.returncode == 0, one.stderr[-3000:]
    m2, m1 = metrics(tmp_path / "two.json"), metrics(tmp_path / "one.json")
    steps = len(m2["losses"])
    assert steps % 10 == 0 and steps >= 20  # epochs x steps per epoch
    np.testing.assert_allclose(m2["losses"], m1["losses"], rtol=2e-5, atol=2e-6)
    assert m2["losses"][0] > 3 and m2["losses"][-1] < 0.1, m2["losses"]
    assert m2["val_loss"] < 0.1
    # resume from step 4 (mid-epoch: an epoch has 3 steps) from the checkpoint alone (its model, tokenizer and data
    # position; no --init-from): the same losses, bit for bit
    ckpt = tmp_path / "ck" / "step-00000004"
    resumed = run_cli(str(chat_recipe(tmp_path, data, 2, save_dir=str(tmp_path / "ck2"))), "--resume", str(ckpt),
                      "--metrics", str(tmp_path / "resumed.json"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert metrics(tmp_path / "resumed.json")["losses"] == m2["losses"][4:]
    # the checkpoint's copy of the tokenizer (saved again by transformers, other bytes) is the same tokenizer ...
    from ultrascale_plugins.data.tokenized_cache import cache_key, load_tokenizer

    s = spec(tmp_path, data, format="chat")
    assert cache_key(s, load_tokenizer(str(ckpt / "tokenizer"))) == cache_key(s, load_tokenizer(str(pretrained)))
    # ... and another tokenizer is refused before any worker starts, in one line
    other = tmp_path / "other-tokenizer"
    make_tokenizer(other, vocab_size=300)
    refused = run_cli(str(chat_recipe(tmp_path, data, 2)), "--resume", str(ckpt), "--set",
                      f"data.tokenizer={other}")
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1 and "tokenizer" in lines[0] and "Fix:" in lines[0], \
        refused.stderr[-3000:]
    assert "ultrascale: 2 processes" not in refused.stdout  # no worker started
    # the export is a model and a tokenizer with its chat template
    from ultrascale_plugins.checkpoints.export import export_hf
    from transformers import AutoTokenizer

    out = export_hf(tmp_path / "ck" / f"step-{steps:08d}", tmp_path / "export")
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.chat_template and "im_start" in tok.chat_template


@pytest.mark.slow
def test_text_packing_across_ranks_equals_one_process(tmp_path, pretrained):
    """Packed text rows (no attention mask, position_ids restarting) on 4 processes — two data-parallel ranks
    reading their own rows x two pipeline stages, whose micro-batches hold different numbers of valid tokens —
    and the same recipe on one process: equal losses."""
    data = write_jsonl(tmp_path / "text.jsonl", text_rows(80, seed=3))
    out = {}
    for nproc, layout in ((4, {"pp": 2, "dp_shard": 2}), (1, {})):
        recipe = {"nproc": nproc, "data": {"dataset": str(data), "seq_len": 32, "cache_dir": str(tmp_path / "c")},
                  "train": {"steps": 6, "global_batch": 4, "lr": 0.01, "log_every": 3, "eval_batches": 0},
                  "parallel": layout}
        path = tmp_path / f"text{nproc}.yaml"
        path.write_text(yaml.safe_dump(recipe))
        proc = run_cli(str(path), "--init-from", str(pretrained), "--metrics", str(tmp_path / f"t{nproc}.json"))
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[nproc] = metrics(tmp_path / f"t{nproc}.json")["losses"]
    np.testing.assert_allclose(out[4], out[1], rtol=2e-5, atol=2e-6)


def test_bad_data_refused_before_launch(tmp_path, pretrained):
    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(8))
    path = chat_recipe(tmp_path, data, 2)
    proc = run_cli(str(path), "--init-from", str(pretrained), "--set", "data.messages_field=conversation")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert "data.messages_field='conversation'" in proc.stderr and "chat.jsonl" in proc.stderr
    assert "processes, layout" not in proc.stdout  # no worker started


# ---- the same data path in Lightning and Accelerate -------------------------------------------------------------
def test_dataloaders_read_the_command_lines_rows(tmp_path, pretrained):
    """The DataLoader builder (Lightning DataModule, Accelerate loop) uses the command line's cache entry and
    rows: same tokens, same labels, same positions."""
    from ultrascale_plugins.data.data_loaders import build_dataloaders
    from ultrascale_plugins.data.packed_rows import Rows, split_indices
    from ultrascale_plugins.data.tokenized_cache import prepare

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(40))
    s = spec(tmp_path, data, format="chat", seq_len=40, eval_fraction=0.2)
    cli_side = prepare(s, str(pretrained))
    section = {"dataset": str(data), "format": "chat", "seq_len": 40, "eval_fraction": 0.2,
               "cache_dir": str(tmp_path / "cache")}
    train, val = build_dataloaders(section, str(pretrained), batch_size=2)
    assert train.dataset.rows.data.path == cli_side.path  # tokenized once, shared
    rows = Rows(cli_side, split_indices(40, 0.2, 0)[0], 40, True, 0, shuffle=False)
    for r in (0, 3, len(train.dataset) - 1):
        for key, value in rows.row(r).items():
            assert torch.equal(train.dataset[r][key], value)
    batch = next(iter(train))
    assert set(batch) == {"input_ids", "labels", "position_ids"} and batch["input_ids"].shape == (2, 40)
    assert val is not None and len(val.dataset) >= 2


@pytest.mark.slow
@pytest.mark.sweep  # benchmarks/sweep_tests.py; the chat data path through the command line in CI
def test_lightning_and_accelerate_recipes_fine_tune_on_chat_data(tmp_path, pretrained):
    import csv

    data = write_jsonl(tmp_path / "chat.jsonl", chat_rows(96))
    recipes = Path(__file__).parent.parent / "recipes"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ULTRASCALE_CACHE": str(tmp_path / "cache")}
    common = ["--model", str(pretrained), "--dataset", str(data), "--format", "chat", "--seq-len", "48",
              "--batch-size", "2", "--lr", "0.01"]
    lit = subprocess.run([sys.executable, str(recipes / "lightning" / "finetune.py"), *common, "--devices", "2",
                          "--strategy", "ultrascale_zero3", "--max-steps", "12", "--val-check-interval", "6",
                          "--out", str(tmp_path / "pl")], capture_output=True, text=True, timeout=600, env=env)
    assert lit.returncode == 0, lit.stderr[-4000:]
    logged = [float(r["train_loss"]) for f in tmp_path.glob("pl/logs/version_*/metrics.csv")
              for r in csv.DictReader(f.open()) if r.get("train_loss")]
    assert len(logged) == 12 and np.mean(logged[-3:]) < np.mean(logged[:3]) - 1, logged
    acc = subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "accelerate-launch",
                          str(recipes / "accelerate" / "zero3.yaml"), str(recipes / "accelerate" / "finetune.py"),
                          *common, "--steps", "12"], capture_output=True, text=True, timeout=600, env=env)
    assert acc.returncode == 0, acc.stderr[-4000:]
    printed = [float(line.split("loss")[1]) for line in acc.stdout.splitlines() if line.startswith("step ")]
    assert len(printed) == 12 and np.mean(printed[-3:]) < np.mean(printed[:3]) - 1, printed


@pytest.mark.slow
def test_workers_under_torchrun_tokenize_once_per_node(tmp_path, pretrained):
    """Started by torchrun (not ``ultrascale train``), the workers find no cache entry: local rank 0 writes it
    once while the other rank waits, then both train on it."""
    from conftest import torchrun

    data = write_jsonl(tmp_path / "text.jsonl", text_rows(40, seed=5))
    recipe = {"nproc": 2, "data": {"dataset": str(data), "seq_len": 32, "cache_dir": str(tmp_path / "cache")},
              "train": {"steps": 2, "global_batch": 4, "log_every": 1, "eval_batches": 0},
              "parallel": {"dp_shard": 2}}
    path = tmp_path / "r.yaml"
    path.write_text(yaml.safe_dump(recipe))
    proc = torchrun(2, "-m", "ultrascale_plugins.cli.train", str(path), "--init-from", str(pretrained),
                    "--metrics", str(tmp_path / "m.json"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("ultrascale: tokenizing") == 1, proc.stdout
    assert len(list((tmp_path / "cache" / "tokenized").iterdir())) == 1
    assert len(metrics(tmp_path / "m.json")["losses"]) == 2


def test_packing_refused_for_a_model_type_that_lets_samples_meet(tmp_path):
    """OPT builds its masks without position_ids (measured by benchmarks/packing_sweep.py): packed rows would
    attend to each other, so packing is refused before launch; packing: false is the fix and passes."""
    from transformers import OPTConfig

    from ultrascale_plugins.data.recipe_data import check_packing

    data = write_jsonl(tmp_path / "text.jsonl", text_rows(4))
    with pytest.raises(ConfigError, match=r"data.packing=true: model type 'opt' lets packed samples attend.*"
                                          r"packing: false"):
        check_packing(spec(tmp_path, data), OPTConfig())
    check_packing(spec(tmp_path, data, packing=False), OPTConfig())
