"""Pretrained weights of a TP-packed parameter (GPT-2's fused ``c_attn``: each TP rank holds its slice of q, of k
and of v) load exactly under tp=2: the rank's pieces are read where they are in the file, not as one block.
(Before the fix, every rank's ``c_attn`` was read from the wrong rows: silently wrong weights.)"""
import sys

import pytest


def worker(path: str) -> None:
    import torch
    import torch.distributed as dist
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.checkpoints import load

    pmodel = load.from_pretrained(path, {"tp": 2, "dp_shard": 1})
    packed = dict(pmodel.module.named_parameters())["transformer.h.0.attn.c_attn.weight"]
    assert "StridedShard" in str(packed.placements), packed.placements  # really held as packed pieces
    full = pmodel.full_state_dict()
    reference = AutoModelForCausalLM.from_pretrained(path).state_dict()
    wrong = [k for k in reference if not torch.equal(full[k], reference[k])]
    assert not wrong, wrong
    if dist.get_rank() == 0:
        print("weights equal", len(reference))


@pytest.mark.slow
def test_gpt2_fused_qkv_loads_exactly_under_tp(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, GPT2Config

    from conftest import torchrun

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(GPT2Config(vocab_size=256, n_embd=64, n_layer=2, n_head=4,
                                                        n_positions=64, bos_token_id=0, eos_token_id=0))
    model.save_pretrained(str(tmp_path))
    proc = torchrun(2, __file__, str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "weights equal" in proc.stdout


if __name__ == "__main__":
    worker(sys.argv[1])
