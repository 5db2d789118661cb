"""Real ``Trainer.fit`` runs with the ultrascale strategies (see tests/test_lightning.py).

    python lightning_worker.py reference OUT.json             single device, strategy="auto": the references
    torchrun --nproc_per_node N lightning_worker.py runs OUT.json RUN [RUN ...]
                                                               each RUN (a name from RUNS) on N ranks, one fit each
    torchrun ... lightning_worker.py resume OUT.json DIR       fit 1 epoch with ModelCheckpoint, resume to 2 epochs
    python lightning_worker.py refuse MARKER in_init|in_configure_model
                                                               Lightning's own launcher, devices=2, ep=2 on a dense
                                                               model (held from __init__ or built in configure_model)

$HF_DIR names a save_pretrained directory of the same initial model, for the runs that load pretrained weights.

The LightningModule is what a user writes: an HF model in ``__init__`` (or built empty in ``configure_model``),
``training_step`` returning ``self.model(**batch).loss``, ``self.log(..., sync_dist=True)``.
"""
import json
import logging
import os
import sys
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_model, padded_batches  # noqa: E402

import lightning.pytorch as L  # noqa: E402

import ultrascale_plugins.integrations.lightning  # noqa: E402,F401  (registers the strategy names)

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)
ARCH, GLOBAL_BATCH, STEPS_PER_EPOCH = "llama8_tied", 8, 3


def as_rows(batches) -> list[dict]:
    return [{k: v[i] for k, v in b.items()} for b in batches for i in range(next(iter(b.values())).shape[0])]


TRAIN = as_rows(padded_batches(STEPS_PER_EPOCH, GLOBAL_BATCH))
VAL = as_rows(padded_batches(1, GLOBAL_BATCH, seed=9))

# name -> (strategy, Trainer keyword arguments); strategy names are the registered ones
RUNS = {
    "ultrascale": ("ultrascale", {}),
    "ultrascale_zero3": ("ultrascale_zero3", {}),
    "ultrascale_zero2": ("ultrascale_zero2", {}),
    "ultrascale_tp": ("ultrascale_tp", {}),
    "ultrascale_tp_sp": ("ultrascale_tp_sp", {}),
    "ultrascale_pp": ("ultrascale_pp", {}),
    "ultrascale_cp": ("ultrascale_cp", {}),  # context parallel (ring) over every device of the node
    "zero3_accumulate2": ("ultrascale_zero3", {"accumulate_grad_batches": 2}),
    "pp_accumulate2": ("ultrascale_pp", {"accumulate_grad_batches": 2}),
    "zero3_bf16_mixed": ("ultrascale_zero3", {"precision": "bf16-mixed"}),
    "tp_bf16_true": ("ultrascale_tp", {"precision": "bf16-true"}),
    "pretrained_meta_tp_sp": ("ultrascale_tp_sp", {"hf_dir": True}),  # built empty in configure_model
    "peft_zero3": ("ultrascale_zero3", {"peft": True}),  # a PEFT (LoRA) model made in configure_model
    "pretrained_init_from_zero3": ({"init_from": True}, {"seed": 5}),  # random init, replaced by the weights
    "zero1": ({"zero_stage": 1}, {}),  # the user's AdamW becomes a ZeroRedundancyOptimizer
    "pp2_tp2": ({"pp": 2, "tp": 2, "dp_shard": 1}, {}),
    # outside the Llama family: per-head norms replicated over TP under FSDP (compared with Qwen3 on one device)
    "qwen3_dp2_tp2": ({"dp_shard": 2, "tp": 2}, {"arch": "qwen3"}),
    "cp2_ulysses_dp2": ({"cp": 2, "cp_method": "ulysses", "dp_shard": 2}, {}),
    # torch's other AdamW implementations under TP without FSDP (foreach: the CUDA default), against one device
    # using the same implementation
    "tp_fused": ("ultrascale_tp", {"adamw": "fused"}),
    "tp_sp_foreach": ({"tp": 2, "sequence_parallel": True, "dp_shard": 1}, {"adamw": "foreach"}),
    # the chunked loss (no whole logits) under TP + SP with foreach AdamW
    "tp_sp_chunked": ({"tp": 2, "sequence_parallel": True, "dp_shard": 1, "chunked_loss": 16}, {"adamw": "foreach"}),
    "pp2_tp2_fused": ({"pp": 2, "tp": 2, "dp_shard": 1}, {"adamw": "fused"}),
    # offloaded ZeRO-3 stepping inside the backward: no clipping (it refuses it), Lightning's closure runs the backward
    "zero3_offload_step_in_backward": ({"dp_shard": 2, "cpu_offload": True, "optimizer_in_backward": True},
                                       {"adamw": "foreach", "gradient_clip_val": None}),
    # expert parallel on a mixture of experts (Qwen3-MoE, 8 experts, top-2; compared with it on one device): the
    # registered name (ep = devices per node, ZeRO-3 over every device) and an explicit layout under ZeRO-2
    "ultrascale_ep": ("ultrascale_ep", {"arch": "qwen3_moe"}),
    "ep2_zero2": ({"ep": 2, "zero_stage": 2}, {"arch": "qwen3_moe"}),
    # a field of the plugin outside the package (tests/outside_plugin; needs it on PYTHONPATH)
    "outside_acme_dp2_zero3_dp2": ({"acme_dp": 2, "dp_shard": 2}, {}),
}
# what each run is compared with: the single-device run with the same Trainer arguments
MODULE_ARGS = ("hf_dir", "seed")  # how the LightningModule builds its model, not Trainer arguments
ADAMW = {"for_loop": {"foreach": False}, "foreach": {"foreach": True}, "fused": {"fused": True}}


def reference_key(kwargs: dict) -> str:
    return json.dumps({k: v for k, v in kwargs.items() if k not in MODULE_ARGS}, sort_keys=True)


class Rows(Dataset):
    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class CausalLM(L.LightningModule):
    def __init__(self, hf_dir: str | None = None, seed: int = 0, arch: str = ARCH, adamw: str = "for_loop",
                 peft: bool = False):
        super().__init__()
        self.hf_dir, self.adamw, self.peft = hf_dir, adamw, peft
        self.losses: list[float] = []
        if hf_dir is None:
            self.model = make_model(arch, seed=seed)

    def configure_model(self):
        if self.hf_dir is not None and not hasattr(self, "model"):
            from transformers import AutoConfig, AutoModelForCausalLM

            with self.trainer.init_module(empty_init=True):  # meta device: each rank loads its shards
                self.model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(self.hf_dir))
        if self.peft and not hasattr(self.model, "peft_config"):
            from peft import LoraConfig, get_peft_model

            torch.manual_seed(1)
            self.model = get_peft_model(self.model, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0,
                                                               target_modules="all-linear"))

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        self.log("train_loss", loss, sync_dist=True)
        return loss

    def validation_step(self, batch, batch_idx):
        self.log("val_loss", self.model(**batch).loss, sync_dist=True)

    def configure_optimizers(self):
        return torch.optim.AdamW(self.parameters(), lr=1e-3, weight_decay=0.01, **ADAMW[self.adamw])

    def _loader(self, rows, shuffle: bool):
        kwargs = getattr(self.trainer.strategy, "distributed_sampler_kwargs", None) or {}
        replicas = kwargs.get("num_replicas", 1)
        sampler = None
        if not getattr(self.trainer.strategy, "is_distributed", False):
            # one device: the order Lightning's own DistributedSampler gives the union of the ranks' batches
            # (shuffled for training, seed 0, reshuffled per epoch through set_epoch)
            from torch.utils.data import DistributedSampler

            sampler = DistributedSampler(Rows(rows), num_replicas=1, rank=0, shuffle=shuffle, seed=0)
        return DataLoader(Rows(rows), batch_size=GLOBAL_BATCH // replicas, sampler=sampler)

    def train_dataloader(self):
        return self._loader(TRAIN, shuffle=True)

    def val_dataloader(self):
        return self._loader(VAL, shuffle=False)


class LateRankZero(CausalLM):
    """Rank 0 builds its model later than the others (as a loaded machine may): the other ranks refuse a layout
    first, and for longer than Lightning's process observer takes to notice a rank that ended (5 s)."""

    def configure_model(self):
        super().configure_model()
        if self.trainer.global_rank == 0:
            import time

            time.sleep(6)


def trainer(strategy, devices: int, **kwargs) -> L.Trainer:
    if isinstance(strategy, dict):
        from ultrascale_plugins.integrations.lightning import UltraScaleStrategy

        if strategy.get("init_from") is True:
            strategy = {**strategy, "init_from": os.environ["HF_DIR"]}
        strategy = UltraScaleStrategy(**strategy)
    args = dict(accelerator="cpu", devices=devices, strategy=strategy, max_epochs=2, logger=False,
                enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                gradient_clip_val=0.5, num_sanity_val_steps=0, deterministic=False)
    args.update(kwargs)
    return L.Trainer(**args)


def fit(strategy, devices, ckpt_path=None, **kwargs) -> dict:
    hf_dir = os.environ["HF_DIR"] if kwargs.pop("hf_dir", None) else None
    module = CausalLM(hf_dir, seed=kwargs.pop("seed", 0), arch=kwargs.pop("arch", ARCH),
                      adamw=kwargs.pop("adamw", "for_loop"), peft=kwargs.pop("peft", False))
    t = trainer(strategy, devices, **kwargs)
    t.fit(module, ckpt_path=ckpt_path)
    pmodel = getattr(t.strategy, "pmodel", None)  # the layout that ran (a registered name picks it in setup)
    return {"losses": module.losses, "val_loss": float(t.callback_metrics.get("val_loss", "nan")),
            "layout": pmodel.config.to_dict() if pmodel is not None else None}


def resume(directory: str, devices: int) -> dict:
    """Save at the end of epoch 1 (ModelCheckpoint, ZeRO-3), resume for epoch 2 in the same layout and in TP."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    first = fit("ultrascale_zero3", devices, max_epochs=1, enable_checkpointing=True,
                callbacks=[ModelCheckpoint(dirpath=directory, save_top_k=-1)])
    saved = sorted(os.listdir(directory))
    ckpt = os.path.join(directory, saved[-1])
    return {"first": first, "saved": saved,
            "same_layout": fit("ultrascale_zero3", devices, ckpt_path=ckpt),
            "tp": fit("ultrascale_tp", devices, ckpt_path=ckpt)}


def main():
    mode, out = sys.argv[1], sys.argv[2]
    result = {}
    if mode == "reference":
        for kwargs in {reference_key(k): k for _, k in RUNS.values()}.values():
            result[reference_key(kwargs)] = fit("auto", 1, **kwargs)
    elif mode == "resume":
        result = resume(sys.argv[3], int(os.environ["WORLD_SIZE"]))
    elif mode == "refuse":  # refused: nothing is written
        module = CausalLM() if sys.argv[3] == "in_init" else LateRankZero(os.environ["HF_DIR"])
        trainer({"ep": 2}, 2, max_steps=1).fit(module)
    elif mode == "runs":
        devices = int(os.environ["LOCAL_WORLD_SIZE"])
        nodes = int(os.environ["WORLD_SIZE"]) // devices
        for name in sys.argv[3:]:
            strategy, kwargs = RUNS[name]
            result[name] = fit(strategy, devices, num_nodes=nodes, **kwargs)
    if int(os.environ.get("RANK", "0")) == 0:
        with open(out, "w") as f:
            json.dump(result, f)


if __name__ == "__main__":
    main()
