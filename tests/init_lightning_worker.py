"""Lightning's ``configure_model`` under ``trainer.init_module(empty_init=True)`` with a config that names no weights:
the ultrascale strategy initializes the meta-device model shard by shard (see tests/test_init.py).

    torchrun --nproc_per_node 2 init_lightning_worker.py OUT.pt SEED ARCH

Rank 0 saves ``{"state": full weights right after setup, "losses": [...]}`` with ``torch.save``.
"""
import logging
import os
import sys
import warnings

import torch
from torch.utils.data import DataLoader, Dataset

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from models import make_config, padded_batches  # noqa: E402

import lightning.pytorch as L  # noqa: E402

import ultrascale_plugins.integrations.lightning  # noqa: E402,F401  (registers the strategy names)

warnings.filterwarnings("ignore")
logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
logging.getLogger("lightning.fabric").setLevel(logging.ERROR)


class Rows(Dataset):
    def __init__(self, batches):
        self.rows = [{k: v[i] for k, v in b.items()} for b in batches for i in range(len(b["input_ids"]))]

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


class CausalLM(L.LightningModule):
    def __init__(self, arch: str):
        super().__init__()
        self.arch = arch
        self.losses: list[float] = []
        self.initial: dict | None = None

    def configure_model(self):
        from transformers import AutoModelForCausalLM

        with self.trainer.init_module(empty_init=True):  # meta device: no rank holds the whole model
            self.model = AutoModelForCausalLM.from_config(make_config(self.arch), attn_implementation="sdpa")

    def on_fit_start(self):  # after the strategy has parallelized and initialized the model
        self.initial = self.trainer.strategy.pmodel.full_state_dict()

    def training_step(self, batch, batch_idx):
        loss = self.model(**batch).loss
        self.losses.append(loss.item())
        return loss

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def train_dataloader(self):
        replicas = self.trainer.strategy.distributed_sampler_kwargs["num_replicas"]
        return DataLoader(Rows(padded_batches(2)), batch_size=8 // replicas)


def main():
    out, seed, arch = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    L.seed_everything(seed, verbose=False)
    module = CausalLM(arch)
    trainer = L.Trainer(accelerator="cpu", devices=int(os.environ["LOCAL_WORLD_SIZE"]), strategy="ultrascale_zero3",
                        max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                        enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(module)
    if int(os.environ.get("RANK", "0")) == 0:
        torch.save({"state": module.initial, "losses": module.losses}, out)


if __name__ == "__main__":
    main()
