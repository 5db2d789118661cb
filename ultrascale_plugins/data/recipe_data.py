"""The data of a recipe: its dataset tokenized and cut into rows (``data.dataset``), or the bundled byte-level
corpus (the embedded default). One place the command line, the workers and the Lightning / Accelerate builders
take it from."""
from __future__ import annotations

from ..interface.config import ConfigError


def default_tokenizer(recipe) -> str | None:
    """Where the tokenizer comes from when ``data.tokenizer`` is not set: the ``--init-from`` directory, else the
    checkpoint resumed from (every checkpoint of a run on a dataset holds its tokenizer)."""
    if recipe.init_from:
        return recipe.init_from
    if recipe.resume_from:
        from pathlib import Path

        saved = Path(recipe.resume_from) / "tokenizer"
        if saved.is_dir():
            return str(saved)
    return None


def open_dataset(recipe, *, in_worker: bool = False):
    """``DatasetBatches`` of the recipe's ``data.dataset`` (tokenized into the node's cache first if needed), with
    the tokenizer of ``data.tokenizer``, else of ``default_tokenizer``."""
    from .packed_rows import DatasetBatches
    from .tokenized_cache import prepare, prepare_on_node

    source = default_tokenizer(recipe)
    tokenized = prepare_on_node(recipe.data, source) if in_worker else prepare(recipe.data, source)
    return DatasetBatches(tokenized, recipe.data, recipe.train.global_batch, recipe.train.seed)


def check_vocabulary(tokenizer_size: int, model_config, where: str) -> None:
    vocab = getattr(model_config, "vocab_size", None)
    if vocab is not None and tokenizer_size > vocab:
        raise ConfigError(f"data.tokenizer at {where} has {tokenizer_size} tokens, more than the model's vocab_size="
                          f"{vocab}. Fix: use the model's own tokenizer (data.tokenizer, or the --init-from "
                          "directory's)")


def check_packing(spec, model_config) -> None:
    """Packed rows keep samples apart only through ``position_ids``; a model type not measured to honour them
    (``packing_support``, from benchmarks/packing_sweep.py) would train silently wrong: refused."""
    if not spec.dataset or not spec.packing:
        return
    import transformers

    from .packing_support import check_packing_model

    check_packing_model(model_config.model_type, transformers.__version__)


def prepare_before_launch(recipe, model_config, resume: str | None = None) -> str | None:
    """Tokenize the dataset into the cache (once, on this node, before any worker starts) and check it makes
    the recipe's batches and, with ``resume``, continues that checkpoint's data; the line to show the user, or
    None without a dataset."""
    extra = {}
    if resume:
        from ..checkpoints.sharded import read_meta

        extra = read_meta(resume).get("extra", {})
    if not recipe.data.dataset:
        if resume:
            check_resumable(extra, None, resume)
        return None
    from .tokenized_cache import load_tokenizer, tokenizer_dir

    check_packing(recipe.data, model_config)
    tok_path = tokenizer_dir(recipe.data, default_tokenizer(recipe))
    check_vocabulary(len(load_tokenizer(tok_path)), model_config, tok_path)  # before a long tokenization
    data = open_dataset(recipe)
    if resume:
        check_resumable(extra, data, resume)
    d, t = recipe.data, recipe.train
    steps = t.epochs * data.steps_per_epoch if t.epochs else t.steps
    tokens = int(data.train.data.lengths[data.train.indices].sum())
    held = f", {data.val.rows_per_epoch} held-out rows" if data.val is not None else ""
    return (f"ultrascale: data {d.dataset} ({d.format}): {len(data.train.indices)} samples, {tokens:,} tokens -> "
            f"{data.train.rows_per_epoch} rows of {d.seq_len}{' (packed)' if d.packing else ''} per epoch, "
            f"{data.steps_per_epoch} steps per epoch{held}; {steps} steps; tokenized once into {data.train.data.path}")


def check_resumable(extra: dict, data, where: str) -> None:
    """A checkpoint (its ``extra``) continues with this recipe's data (``DatasetBatches``, or None for the byte
    corpus): the same dataset, tokenizer and format (the cache key), and epochs of the same rows. Checked before
    launch by the command line and again in the workers."""
    saved = extra.get("data")
    if data is None:
        if saved:
            raise ConfigError(f"--resume {where}: the checkpoint was trained on a dataset, this recipe reads the "
                              "byte-level corpus. Fix: resume with the recipe's data.dataset")
        return
    if saved is None:
        raise ConfigError(f"--resume {where}: the checkpoint has no dataset position (it was trained on the "
                          "byte-level corpus). Fix: start from its export with --init-from instead")
    if saved["dataset_key"] != data.key:
        raise ConfigError(f"--resume {where}: the dataset, tokenizer or data format differ from the ones the "
                          "checkpoint was trained on, so 'the next samples' is not defined. Fix: resume with the "
                          "same data.dataset and tokenizer (leave data.tokenizer out: the checkpoint's own is used), "
                          "or start a new run from its export (--init-from)")
    now = data.train.rows_per_epoch
    if saved.get("rows_per_epoch") != now:
        raise ConfigError(f"--resume {where}: the checkpoint's epochs had {saved.get('rows_per_epoch')} rows, this "
                          f"recipe's have {now} (data.seq_len, packing or eval_fraction changed). Fix: resume with "
                          "the data settings it was trained with")


class TrainingData:
    """What the training loop reads: this rank's rows of step ``s`` and of validation batch ``i``, the steps an
    epoch has, and the data position a checkpoint keeps (the global row the next step starts at)."""

    def __init__(self, recipe):
        self.recipe = recipe
        self.tokenizer = None
        self.row_base = 0  # rows of step s: row_base + s x global_batch (moved by a resume)
        if recipe.data.dataset:
            check_packing(recipe.data, recipe.model_config())  # also when started without the command line
            self.source = open_dataset(recipe, in_worker=True)
            self.tokenizer = self.source.train.data.tokenizer
            self.eval_batches = min(recipe.train.eval_batches, self.source.eval_batches)
            self.steps_per_epoch = self.source.steps_per_epoch
        else:
            from .corpus import ByteBatches, load_tokens

            self.source = ByteBatches(load_tokens(recipe.data.corpus), recipe.data.seq_len,
                                      recipe.train.global_batch, recipe.train.seed, corpus=recipe.data.corpus)
            self.eval_batches = recipe.train.eval_batches
            self.steps_per_epoch = None

    @property
    def steps(self) -> int:
        t = self.recipe.train
        return t.epochs * self.steps_per_epoch if t.epochs else t.steps

    def train_rows(self, step: int, dp_rank: int, dp_size: int) -> dict:
        if self.tokenizer is None:
            return self.source.local(self.source.global_batch_at(step), dp_rank, dp_size)
        return self.source.local_rows(step, dp_rank, dp_size, first_row=self.row_base)

    def val_rows(self, index: int, dp_rank: int, dp_size: int) -> dict:
        if self.tokenizer is None:
            return self.source.local(self.source.global_batch_at(index, "val"), dp_rank, dp_size)
        return self.source.local_rows(index, dp_rank, dp_size, split="val")

    def position(self, next_step: int) -> dict:
        """The checkpoint's data position after ``next_step`` steps."""
        out = {"data_position": next_step}
        if self.tokenizer is not None:
            out["data"] = {"next_row": self.row_base + next_step * self.recipe.train.global_batch,
                           "dataset_key": self.source.key, "rows_per_epoch": self.source.train.rows_per_epoch}
        return out

    def resume(self, extra: dict, step: int, where: str) -> None:
        """Continue at the checkpoint's data position: step ``step`` reads the row after the last one read."""
        data = self.source if self.tokenizer is not None else None
        check_resumable(extra, data, where)
        if data is not None:
            self.row_base = int(extra["data"]["next_row"]) - step * self.recipe.train.global_batch
