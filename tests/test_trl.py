"""TRL's SFTTrainer on ultrascale layouts (``UltraScaleSFTTrainer``, integrations/trl.py) against plain TRL in one
process (tests/trl_worker.py: one reference process per loss type, one 2-process launch for the layouts), and what
is refused at construction."""
from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("trl")

WORKER = Path(__file__).parent / "trl_worker.py"
# each layout and the plain TRL run it is compared with (the same SFTConfig and model)
LAYOUTS = {"zero3": "reference", "zero1": "reference", "zero2_eval": "reference_zero2_eval", "tp2_sp": "reference",
           "cp2_ring": "reference",
           "cp2_ulysses": "reference", "cp2_ring_packed": "reference_cp2_ring_packed",
           "ep2_moe": "reference_ep2_moe",
           "zero3_dft": "reference_zero3_dft", "zero3_lora": "reference_zero3_lora",
           "tp2_sp_lora": "reference_zero3_lora", "cp2_ring_assistant": "reference_cp2_ring_assistant",
           # pipelines: 1F1B and GPipe (DFT) on 2 layers, interleaved 1F1B and ZBV (with evaluation) on 4
           "pp2_1f1b": "reference", "pp2_gpipe_dft": "reference_zero3_dft",
           "pp2_interleaved": "reference_pp2_interleaved", "pp2_zbv_eval": "reference_pp2_zbv_eval",
           "pp2_zero_bubble": "reference_pp2_interleaved", "pp2_dualpipev": "reference_pp2_interleaved",
           "pp2_lora": "reference_zero3_lora", "zero3_ga2": "reference_zero3_ga2",
           # in this order: the second resumes from the first's checkpoint-2 (plain TRL: from its own)
           "zero3_save": "reference_zero3_save", "tp2_sp_resume": "reference_tp2_sp_resume"}
# DPOTrainer (trl_worker.DPO_CASES: where each takes its reference model from)
DPO_LAYOUTS = {"dpo_zero3": "reference_dpo", "dpo_ddp": "reference_dpo", "dpo_tp2_sp": "reference_dpo",
               "dpo_cp2_ulysses": "reference_dpo_cp2_ulysses", "dpo_cp2_ring_hinge": "reference_dpo_cp2_ring_hinge",
               "dpo_zero2_ipo_eval": "reference_dpo_zero2_ipo_eval", "dpo_ep2_moe": "reference_dpo_ep2_moe",
               "dpo_zero3_lora": "reference_dpo_zero3_lora", "dpo_tp2_sp_lora": "reference_dpo_zero3_lora",
               # pipelines: 1F1B with a reference model (a pipeline too), ZBV (4 layers) precomputed, evaluated
               "dpo_pp2_1f1b": "reference_dpo", "dpo_pp2_zbv_eval": "reference_dpo_pp2_zbv_eval",
               "dpo_tp2_sp_ga2": "reference_dpo_tp2_sp_ga2",
               # in this order: the second resumes from the first's checkpoint-2 (plain TRL: from its own)
               "dpo_zero3_save": "reference_dpo_zero3_save", "dpo_tp2_sp_resume": "reference_dpo_tp2_sp_resume",
               # a tokenizer's pad id outside the embedding, copied by TRL into model.config (issue 47)
               "dpo_zero3_pad_outside": "reference_dpo_zero3_pad_outside"}
CLIP = {"zero3_dft": 0.002, "pp2_gpipe_dft": 0.002, "zero3_lora": 0.1, "tp2_sp_lora": 0.1,
        "pp2_lora": 0.1}  # the cases' max_grad_norm (default: 1.0)
DPO_CLIP = {"dpo_zero3_lora": 0.1, "dpo_tp2_sp_lora": 0.1}  # trl_worker's max_grad_norm for DPO (default: 0.5)
# The final weights. AdamW divides each element's update by its gradient's size, so an element whose gradient sits at
# rounding level moves by rounding noise times the learning rate, whatever the layout. In DPO the chosen and the
# rejected row of a pair share their prompt, and at the start (policy = reference) their gradients through the
# prompt's tokens nearly cancel: two plain TRL runs differing only in the attention kernel (eager, sdpa) differ by
# 1.9e-6 there. The layouts move one such element by up to 1.8e-5 (SFT, ring attention over packed rows) and 1.6e-4
# (DPO, a 4-layer model under ZBV: its weight gradients accumulated apart from its input gradients), measured on an
# AVX-512 machine (7.6e-5 and 2.3e-6 on another: the kernels' rounding differs), and the next element is under 1e-5.
# So the weights are compared by their relative distance (|W - W_ref| / |W_ref|, the L2 norm over every element)
# within 1e-5, with at most OUTLIERS elements beyond 1e-5 and none beyond 1e-3 (a wrong row or block moves far more
# elements than that); everything logged stays within 1e-5.
WEIGHTS_TOL = 1e-5
OUTLIERS = 2
TOL = 1e-5


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import subprocess

    from conftest import retry_native_crash, torchrun
    from tiny_tokenizer import make_tokenizer

    out = tmp_path_factory.mktemp("trl")
    make_tokenizer(out / "tok")
    references = dict.fromkeys([*LAYOUTS.values(), *DPO_LAYOUTS.values()])
    proc = subprocess.run([sys.executable, str(WORKER), str(out / "tok"), str(out), *references],
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    proc = retry_native_crash(lambda: torchrun(2, WORKER, str(out / "tok"), str(out), *LAYOUTS, *DPO_LAYOUTS),
                              "test_trl")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    # each run's layout said once by rank 0, with the chunked head the trainers turn on (chunked_loss=1024)
    said = [line for line in proc.stderr.splitlines() if line.startswith("ultrascale: 2 processes, layout ")]
    assert len(said) == len(LAYOUTS) + len(DPO_LAYOUTS) and all("chunked_loss=" in line for line in said), said
    return out


def _weights(directory: Path) -> dict:
    from safetensors.torch import load_file

    state = {}
    for f in sorted(directory.glob("*.safetensors")):
        state.update(load_file(f))
    return state


@pytest.mark.slow
@pytest.mark.parametrize("case", list(LAYOUTS))
def test_sft_matches_plain_trl(results, case):
    """The same model, rows and SFTConfig (its defaults but bf16) as plain TRL in one process: every step's loss,
    gradient norm (clipping active), logged entropy, mean token accuracy and token count, and the final weights,
    within 1e-5: ZeRO-3, ZeRO-1 (a class of the user's on UltraScaleTrainer and SFTTrainer), ZeRO-2 with evaluation
    every 2 steps (eval_loss and TRL's eval metrics), TP + SP, context parallel (ring and Ulysses; ring with TRL's padding-free
    packing), expert parallel on a Qwen3-MoE with TRL's router auxiliary loss (its logged aux_loss too; each rank's
    rows padded to their own length), TRL's DFT loss, LoRA (TRL's peft_config) under ZeRO-3 and TP + SP, and a run
    saved under ZeRO-3 and
    resumed from its step-2 checkpoint under TP + SP (against plain TRL resuming its own). TP + SP runs TRL's
    dynamically padded rows of odd lengths (the sequence padded to a multiple of tp for its shards). Pipelines
    (1F1B, GPipe with DFT, interleaved 1F1B, ZBV with evaluation): TRL's loss and metrics computed on the last stage,
    inside the schedule, each batch's own shapes (TRL pads each to its longest row)."""
    ref_run = json.loads((results / f"{LAYOUTS[case]}.json").read_text())
    got_run = json.loads((results / f"{case}.json").read_text())
    ref, got = ref_run["logs"], got_run["logs"]
    assert len(got_run["eval"]) == len(ref_run["eval"]) == (2 if case.endswith("eval") else 0)
    for a, b in zip(ref_run["eval"], got_run["eval"]):  # eval_loss, eval_entropy, ... as plain TRL logs them
        assert a.keys() == b.keys() and all(abs(a[k] - b[k]) <= TOL for k in a), (a, b)
    assert len(got) == len(ref) == (2 if case.endswith("resume") else 4)
    from trl import SFTConfig

    clip = CLIP.get(case, SFTConfig(output_dir="x", bf16=False).max_grad_norm)
    for step, (a, b) in enumerate(zip(ref, got)):
        assert a["grad_norm"] > clip, f"step {step}: clipping was not active ({a['grad_norm']} <= {clip})"
        assert abs(a["loss"] - b["loss"]) <= TOL, (step, a, b)
        assert abs(a["grad_norm"] - b["grad_norm"]) <= TOL * a["grad_norm"], (step, a, b)
        assert abs(a["entropy"] - b["entropy"]) <= TOL and abs(a["mean_token_accuracy"] - b["mean_token_accuracy"]) <= 1e-6
        assert a["num_tokens"] == b["num_tokens"], (step, a, b)
        assert ("aux_loss" in a) == ("aux_loss" in b) and abs(a.get("aux_loss", 0) - b.get("aux_loss", 0)) <= TOL
    # the saved model: the whole model, or a PEFT model's adapters in PEFT's files, as plain TRL saves them; and
    # what push_to_hub uploads (the Hub replaced by a recorder): the same files
    assert got_run["pushed"] == ref_run["pushed"] and "training_args.bin" in got_run["pushed"], got_run["pushed"]
    _weights_match(results / case, results / LAYOUTS[case])


def _weights_match(mine: Path, theirs: Path) -> None:
    """Final weights against plain TRL's (WEIGHTS_TOL: why a relative distance and a few outlying elements)."""
    import torch

    a, b = _weights(mine), _weights(theirs)
    assert a.keys() == b.keys() and b
    diff = torch.cat([(a[k].float() - b[k].float()).flatten() for k in b])
    ref = torch.cat([b[k].float().flatten() for k in b])
    assert float(diff.norm() / ref.norm()) <= WEIGHTS_TOL, float(diff.norm() / ref.norm())
    beyond = diff.abs() > TOL
    assert int(beyond.sum()) <= OUTLIERS, f"{int(beyond.sum())} elements beyond {TOL}: {diff.abs().topk(5).values}"
    assert float(diff.abs().max()) <= 1e-3, float(diff.abs().max())


def _reference_estimate_bytes(tokenizer_dir: Path, case: str) -> float:
    """check_dpo_layout's price of the reference model's weights per rank for ``case``'s model and layout (2 ranks)."""
    import torch
    from transformers import AutoTokenizer
    from trl_worker import CASES, model_for

    from ultrascale_plugins.planner.memory_check import check_memory
    from ultrascale_plugins.core.engine import validate
    from ultrascale_plugins.integrations.trl import reference_weights_gb
    from ultrascale_plugins.interface.config import ParallelConfig

    layout = {k: v for k, v in CASES[case].items() if not k.startswith("_")}
    with torch.device("meta"):
        model = model_for(AutoTokenizer.from_pretrained(str(tokenizer_dir)), CASES[case].get("_arch", "llama"),
                          CASES[case].get("_layers", 2))
    resolved = validate(ParallelConfig(**layout), model.config, 2, model=model)
    return reference_weights_gb(check_memory(resolved, model.config, model, 2, 64, 8, 1, 2, float("inf"))) * 1e9


def _close(a: float, b: float) -> bool:
    """Within 1e-5, relative for figures larger than 1 (a sequence's summed log-probabilities: ~40)."""
    return abs(a - b) <= TOL * max(1.0, abs(a))


@pytest.mark.slow
@pytest.mark.parametrize("case", list(DPO_LAYOUTS))
def test_dpo_matches_plain_trl(results, case):
    """DPOTrainer: the same model, preference rows and DPOConfig (its defaults but bf16, clipping at 0.5, LoRA's at
    0.1) as plain TRL in one process: every step's loss, gradient norm (clipping active), TRL's logged rewards (chosen, rejected,
    accuracies, margins), log-probabilities, mean logits, entropy, token accuracy and token count within 1e-5
    (relative for sums of log-probabilities), and the final weights. ZeRO-3 with the model given by name (TRL loads a
    second copy as the reference: the accelerator shards it, frozen), DDP and TP + SP with a reference model passed
    in, context parallel (Ulysses with precompute_ref_log_probs, no reference kept: the policy before training gives
    them, in the layout; ring with the hinge loss), ZeRO-2 with the IPO loss and evaluation every 2 steps,
    expert parallel on a Qwen3-MoE (the router auxiliary loss and its logged aux_loss), LoRA under ZeRO-3 and TP +
    SP (the reference is the policy with its adapters disabled: no second copy), pipelines (1F1B with a reference
    model, itself a pipeline; ZBV on 4 layers with precomputed log-probabilities and evaluation: each pipeline
    micro-batch holds whole pairs), and a run saved under ZeRO-3 and resumed from its step-2 checkpoint under TP +
    SP (against plain TRL resuming its own). The final weights within 1e-5 relative (WEIGHTS_TOL: why)."""
    ref_run = json.loads((results / f"{DPO_LAYOUTS[case]}.json").read_text())
    got_run = json.loads((results / f"{case}.json").read_text())
    ref, got = ref_run["logs"], got_run["logs"]
    steps = 2 if case.endswith("resume") else 4
    assert len(got) == len(ref) == steps and len(got_run["eval"]) == len(ref_run["eval"]) == (2 if "eval" in case else 0)
    for a, b in zip(ref_run["eval"], got_run["eval"]):
        assert a.keys() == b.keys() and all(_close(a[k], b[k]) for k in a), (a, b)
    for step, (a, b) in enumerate(zip(ref, got)):
        assert a.keys() == b.keys() and {"rewards/margins", "logps/chosen", "logits/rejected"} <= a.keys(), a
        assert a["grad_norm"] > DPO_CLIP.get(case, 0.5), f"step {step}: clipping was not active ({a['grad_norm']})"
        assert ("aux_loss" in a) == case.endswith("moe")
        for key in a:  # the gradient norm: relative
            close = abs(a[key] - b[key]) <= TOL * a[key] if key == "grad_norm" else _close(a[key], b[key])
            assert close, (step, key, a[key], b[key])
    assert got_run["pushed"] == ref_run["pushed"] and "README.md" in got_run["pushed"], got_run["pushed"]
    _weights_match(results / case, results / DPO_LAYOUTS[case])
    if case.endswith("pad_outside"):  # what the case stands for: the config's pad id one past the embedding
        saved = json.loads((results / case / "config.json").read_text())
        assert saved["pad_token_id"] == saved["vocab_size"], saved
    reference = got_run["reference"]
    if case.endswith("lora") or case in ("dpo_cp2_ulysses", "dpo_pp2_zbv_eval"):
        assert reference == {"class": None}  # no second model: adapters disabled, or log-probabilities precomputed
    else:  # a second model, in the layout: frozen, and sharded where the layout shards (ZeRO-3 by 2, TP by 2)
        assert reference["class"] == "ParallelCausalLM" and reference["trainable"] == 0, reference
        # what it holds is what check_dpo_layout prices it at (the policy's parameter bytes, most loaded rank)
        estimate = _reference_estimate_bytes(results / "tok", case)
        assert abs(reference["most_bytes"] - estimate) <= 1e-6 * estimate, (reference, estimate)
        if case in ("dpo_zero3", "dpo_tp2_sp", "dpo_tp2_sp_resume"):
            assert reference["held"] < 0.6 * reference["whole"], reference
        if case == "dpo_pp2_1f1b":  # this rank's stage of it: one of the two decoder layers, a part of the model
            assert reference["whole"] < 0.6 * 125248, reference


@pytest.fixture(scope="module")
def hsdp(results):
    """The 4-process cases (``FOUR``: HSDP and compositions), against the plain TRL runs of ``results``."""
    from conftest import retry_native_crash, torchrun

    proc = retry_native_crash(lambda: torchrun(4, WORKER, str(results / "tok"), str(results), *FOUR),
                              "test_trl hsdp")
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-6000:]
    return results


# the 4-process cases (trl_worker.CASES) and the plain TRL runs they match
FOUR = {"hsdp": "reference", "dpo_hsdp": "reference_dpo", "dp2_tp2_sp": "reference", "pp2_tp2": "reference",
        "pp2_dp2": "reference", "dpo_pp2_dp2": "reference_dpo"}


@pytest.mark.sweep  # benchmarks/sweep_tests.py: 4 processes; every 2-process layout in CI
@pytest.mark.parametrize("case", list(FOUR))
def test_four_process_layouts_match_plain_trl(hsdp, case):
    """On 4 processes: HSDP (dp_replicate=2 x dp_shard=2) for SFTTrainer and DPOTrainer (the reference loaded by
    TRL from the model's name, sharded the same way), SFT under ZeRO-3 x TP 2 + SP, a pipeline x TP 2 and a
    pipeline x ZeRO-3 for both trainers (DPO's data-parallel replicas hold rows of other lengths: they rebuild
    their schedules together):
    every logged figure within 1e-5 of plain TRL's, and the final weights."""
    reference = FOUR[case]
    ref, got = (json.loads((hsdp / f"{name}.json").read_text())["logs"] for name in (reference, case))
    assert len(ref) == len(got) == 4
    for step, (a, b) in enumerate(zip(ref, got)):
        assert a.keys() == b.keys()
        for key in a:
            close = abs(a[key] - b[key]) <= TOL * a[key] if key == "grad_norm" else _close(a[key], b[key])
            assert close, (step, key, a[key], b[key])
    if case.startswith("dpo"):
        return _weights_match(hsdp / case, hsdp / reference)
    mine, theirs = _weights(hsdp / case), _weights(hsdp / reference)
    worst = max(float((mine[k].float() - theirs[k].float()).abs().max()) for k in theirs)
    assert mine.keys() == theirs.keys() and worst <= TOL, worst


def _trainer_classes():
    from trl import GRPOTrainer, SFTTrainer

    from ultrascale_plugins.integrations.trainer import UltraScaleTrainer
    from ultrascale_plugins.integrations.trl import UltraScaleSFTTrainer

    return UltraScaleTrainer, UltraScaleSFTTrainer, SFTTrainer, GRPOTrainer


@pytest.mark.slow
def test_the_checkpoint_a_layout_saved_is_the_packages_sharded_one(results):
    """Each trainer's ZeRO-3 run's checkpoint-2 holds the package's sharded checkpoint (model and optimizer shards),
    which the TP + SP run resumed from (test_sft_matches_plain_trl[tp2_sp_resume],
    test_dpo_matches_plain_trl[dpo_tp2_sp_resume]), and TRL's model card is written beside it."""
    for saved in ("zero3_save", "dpo_zero3_save"):
        checkpoint = results / f"run-{saved}" / "checkpoint-2"
        assert (checkpoint / "ultrascale.json").is_file() and (checkpoint / "trainer_state.json").is_file()
        # TRL's model card beside the checkpoints, as plain TRL writes it at each save
        for run in (f"run-{saved}", f"run-reference_{saved}"):
            assert (results / run / "README.md").is_file(), run


def test_what_is_refused_at_construction(monkeypatch):
    """Before any model or process group: an untested TRL version (naming it), GRPO (trainers that generate: out of
    scope). SFTTrainer or DPOTrainer combined with UltraScaleTrainer by hand is UltraScaleSFTTrainer /
    UltraScaleDPOTrainer."""
    import trl
    from trl import DPOTrainer

    from ultrascale_plugins.integrations.trl import UltraScaleDPOTrainer
    from ultrascale_plugins.integrations.trl_contract import trl_kind
    from ultrascale_plugins.interface.config import ConfigError

    base, sft, plain_sft, grpo = _trainer_classes()
    assert trl_kind(sft) == "sft" and trl_kind(UltraScaleDPOTrainer) == "dpo" and trl_kind(base) is None

    class Mine(base, plain_sft):
        pass

    class Dpo(base, DPOTrainer):
        pass

    class Grpo(base, grpo):
        pass

    assert trl_kind(Mine) == "sft" and trl_kind(Dpo) == "dpo"  # built by hand on both: the same as the package's
    with pytest.raises(ConfigError, match="GRPOTrainer: out of scope: trainers that generate"):
        trl_kind(Grpo)
    with pytest.raises(ConfigError, match="trainers that generate"):
        Grpo(model=None)
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    for cls in (sft, UltraScaleDPOTrainer):
        with pytest.raises(ConfigError, match=r"trl 1\.17\.0: .*tested: 1\.16\.x"):
            trl_kind(cls)


@pytest.mark.parametrize("field,value,dp,words", [
    ("use_weighting", True, 1, "WPO's weights need each token's log"),
    ("sync_ref_model", True, 1, "TR-DPO"),
    ("loss_type", ["aot"], 2, "2 data-parallel replicas: AOT sorts the pairs"),
    ("loss_type", ["sigmoid", "sft"], 2, "mean over the micro-batch's chosen tokens"),
    ("activation_offloading", True, 1, "activation_offload"),
])
def test_dpo_arguments_the_layout_cannot_honour_are_refused(field, value, dp, words, tmp_path):
    """Before any model or process group, naming the field, the value and the fix; the loss types that need the
    whole micro-batch's pairs only where data-parallel replicas split them."""
    from trl import DPOConfig

    from ultrascale_plugins.integrations.accelerate import UltraScalePlugin
    from ultrascale_plugins.integrations.trl import UltraScaleDPOTrainer
    from ultrascale_plugins.interface.config import ConfigError

    args = DPOConfig(output_dir=str(tmp_path), bf16=False)
    setattr(args, field, value)
    with pytest.raises(ConfigError, match=f"DPOConfig\\({field}=.*{words}"):
        UltraScaleDPOTrainer(model=None, args=args, ultrascale_plugin=UltraScalePlugin(dp_shard=dp))
    if field == "loss_type":  # one replica holds the whole micro-batch: TRL's own loss is the one-process one
        from ultrascale_plugins.integrations.trl_contract import refuse_dpo_arguments

        refuse_dpo_arguments(args, 1)


def test_what_is_refused_at_construction_is_one_line_from_rank_0_in_launched_workers(monkeypatch, capsys, tmp_path):
    """A TRL argument the layout owns, in a torchrun worker: one line from rank 0 naming the field and the fix, exit
    status 2 on every rank, no traceback (the refusals above, as a launched job sees them)."""
    from trl import SFTConfig

    from test_trainer import as_launched_rank
    from ultrascale_plugins.integrations.trl import UltraScaleSFTTrainer

    args = SFTConfig(output_dir=str(tmp_path), bf16=False, label_smoothing_factor=0.1)
    for rank in (0, 1):
        as_launched_rank(monkeypatch, rank)
        with pytest.raises(SystemExit) as exc:
            UltraScaleSFTTrainer(model=None, args=args)
        lines = capsys.readouterr().err.splitlines()
        assert exc.value.code == 2
        assert len(lines) == (rank == 0) and all(line.startswith("ultrascale: error: SFTConfig(label_smoothing_"
                                                                  "factor=0.1) with ultrascale: label smoothing")
                                                 for line in lines), lines


@pytest.mark.parametrize("field,value,words", [
    ("label_smoothing_factor", 0.1, "needs the whole logits"),
    ("activation_offloading", True, "activation_offload"),
    ("use_liger_kernel", True, "Liger"),
])
def test_sft_arguments_the_layout_owns_are_refused(field, value, words, tmp_path):
    from trl import SFTConfig

    from ultrascale_plugins.integrations.trl_contract import refuse_sft_arguments
    from ultrascale_plugins.interface.config import ConfigError

    args = SFTConfig(output_dir=str(tmp_path), bf16=False)
    setattr(args, field, value)
    with pytest.raises(ConfigError, match=f"SFTConfig\\({field}=.*{words}"):
        refuse_sft_arguments(args)


def test_dpo_with_lora_in_a_pipeline_is_refused_at_construction(tmp_path):
    """DPO's reference of a PEFT model is the model with its adapters disabled, which TRL's switch cannot reach in
    a pipeline's stages: refused before the model or any process group is touched (a reference model, or
    precomputed log-probabilities, run there)."""
    from peft import LoraConfig
    from trl import DPOConfig

    from ultrascale_plugins.integrations.accelerate import UltraScalePlugin
    from ultrascale_plugins.integrations.trl import UltraScaleDPOTrainer
    from ultrascale_plugins.interface.config import ConfigError

    with pytest.raises(ConfigError, match="UltraScaleDPOTrainer with pp=2 and a PEFT model"):
        UltraScaleDPOTrainer(model=None, args=DPOConfig(output_dir=str(tmp_path), bf16=False),
                             peft_config=LoraConfig(r=4), ultrascale_plugin=UltraScalePlugin(pp=2))


def test_sft_in_a_pipeline_refuses_a_router_auxiliary_loss(tmp_path):
    """A pipeline computes the router loss per pipeline micro-batch, TRL over its batch: refused before anything
    runs, naming the fix (the coefficient at 0, or no pipeline)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3MoeConfig
    from trl import SFTConfig

    from ultrascale_plugins.integrations.accelerate import UltraScalePlugin
    from ultrascale_plugins.integrations.trl import UltraScaleSFTTrainer
    from ultrascale_plugins.interface.config import ConfigError

    with torch.device("meta"):
        moe = AutoModelForCausalLM.from_config(Qwen3MoeConfig(
            vocab_size=64, hidden_size=32, intermediate_size=64, moe_intermediate_size=16, num_hidden_layers=2,
            num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_experts=4, num_experts_per_tok=2))
    args = SFTConfig(output_dir=str(tmp_path), bf16=False)
    with pytest.raises(ConfigError, match="pp=2 and a router auxiliary loss.*router_aux_loss_coef=0"):
        UltraScaleSFTTrainer(model=moe, args=args, ultrascale_plugin=UltraScalePlugin(pp=2))


RECIPE = Path(__file__).parent.parent / "recipes" / "trl"


def test_the_sft_recipe_checks_llama_8b_on_8_gpus_at_full_size(capsys):
    """recipes/trl/sft.py --check with the recipe's layout file: the layout against 8 processes and Llama-3.1-8B's
    config on the meta device, and the memory estimate against an H100 80 GB (with TRL's chunked head)."""
    line, predicted = _check("sft", "llama-3.1-8b", "llama-3.1-8b-8gpu.yaml", capsys)
    assert line.startswith("ok: llama (8.03B) on 8 x h100-sxm-80gb") and "'chunked_loss': 1024" in line, line
    assert 10 < predicted < 80, line


def _check(recipe: str, model: str, layout: str, capsys, *extra) -> tuple[str, float]:
    """recipes/trl/RECIPE.py --check on recipes/sft/configs/MODEL.json with a layout file of recipes/trl, on 8 x
    H100 80 GB: its line, and the GB per GPU it predicts."""
    import importlib

    sys.path.insert(0, str(RECIPE))
    try:
        module = importlib.import_module(recipe)
    finally:
        sys.path.remove(str(RECIPE))
    module.main(["--check", "--model", str(RECIPE.parent / "sft" / "configs" / f"{model}.json"), "--layout",
                 str(RECIPE / layout), "--nproc", "8", "--gpu", "h100-sxm-80gb", *extra])
    line = capsys.readouterr().out.strip().splitlines()[-1]
    return line, float(line.split("predicted ")[1].split(" GB")[0])


def test_the_sft_recipe_checks_qwen3_30b_a3b_with_expert_parallel_on_8_gpus(capsys):
    """recipes/trl/sft.py --check with the expert-parallel layout file: Qwen3-30B-A3B's config on the meta device,
    its 128 experts split over ep=8 under ZeRO-3, bf16 states, against 8 x H100 80 GB."""
    line, predicted = _check("sft", "qwen3-30b-a3b", "qwen3-30b-a3b-ep-8gpu.yaml", capsys)
    assert line.startswith("ok: qwen3_moe (30.53B) on 8 x h100-sxm-80gb") and "'ep': 8" in line, line
    assert 20 < predicted < 70, line


def test_the_dpo_recipe_checks_llama_8b_on_8_gpus_at_full_size(capsys):
    """recipes/trl/dpo.py --check with its layout file: Llama-3.1-8B on 8 x H100 80 GB, the policy's chosen and
    rejected rows and the reference model's weights (sharded as the policy's) in the estimate; without a reference
    (LoRA or precomputed log-probabilities) less."""
    line, with_reference = _check("dpo", "llama-3.1-8b", "llama-3.1-8b-dpo-8gpu.yaml", capsys)
    assert line.startswith("ok: llama (8.03B) on 8 x h100-sxm-80gb") and "a reference model's weights" in line, line
    line, alone = _check("dpo", "llama-3.1-8b", "llama-3.1-8b-dpo-8gpu.yaml", capsys, "--precompute")
    assert 10 < alone < with_reference < 80 and "reference" not in line, line


@pytest.mark.slow
def test_the_dpo_recipe_trains_a_shrunk_model(tmp_path):
    """recipes/trl/dpo.py under torchrun on 2 processes, its layout file with dp_shard=2 (fp32 on a CPU), a tiny
    pretrained Llama as the policy and as the reference (both built on the meta device, each rank reading its
    shards) and preference pairs: it trains from the pretrained weights and writes a Hugging Face directory."""
    import random

    import torch
    from safetensors.torch import load_file

    from conftest import torchrun
    from tiny_tokenizer import WORDS, make_pretrained

    make_pretrained(tmp_path / "tiny")
    r = random.Random(0)
    words = lambda n: " ".join(r.choice(WORDS) for _ in range(n))  # noqa: E731
    with open(tmp_path / "prefs.jsonl", "w") as f:
        for _ in range(12):
            f.write(json.dumps({"prompt": words(5), "chosen": " " + words(6), "rejected": " " + words(4)}) + "\n")
    proc = torchrun(2, RECIPE / "dpo.py", "--model", str(tmp_path / "tiny"), "--layout",
                    str(RECIPE / "llama-3.1-8b-dpo-8gpu.yaml"), "--set", "dp_shard=2", "--set", "mixed_precision=no",
                    "--data", str(tmp_path / "prefs.jsonl"), "--max-steps", "3", "--max-length", "64",
                    "--batch-size", "2", "--accumulate", "1", "--lr", "1e-3", "--logging-steps", "1",
                    "--output-dir", str(tmp_path / "out"), timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    output = proc.stdout + proc.stderr
    assert output.count("train_runtime") == 1
    # the first step: the reference read the same weights as the policy (log-ratios 0: the loss is ln 2)
    assert "'loss': '0.6931'" in output and "'rewards/margins': '0'" in output, output[-3000:]
    start, end = load_file(tmp_path / "tiny" / "model.safetensors"), load_file(tmp_path / "out" / "final" / "model.safetensors")
    moved = max(float((end[k] - start[k]).abs().max()) for k in start)
    assert 0 < moved < 0.05, moved  # trained a few steps from the pretrained weights (not from a fresh draw)
    assert all(torch.isfinite(v).all() for v in end.values())


@pytest.mark.slow
def test_the_sft_recipe_trains_a_shrunk_model(tmp_path):
    """recipes/trl/sft.py under torchrun on 2 processes, the recipe's layout file with dp_shard=2 (fp32 on a CPU), a
    tiny pretrained Llama (read shard by shard) and prompt-completion rows: it trains from the pretrained weights
    and writes a Hugging Face directory."""
    import random

    import torch
    from safetensors.torch import load_file

    from conftest import torchrun
    from tiny_tokenizer import WORDS, make_pretrained

    make_pretrained(tmp_path / "tiny")
    r = random.Random(0)
    with open(tmp_path / "data.jsonl", "w") as f:
        for _ in range(16):
            f.write(json.dumps({"prompt": " ".join(r.choice(WORDS) for _ in range(5)),
                                "completion": " " + " ".join(r.choice(WORDS) for _ in range(7))}) + "\n")
    proc = torchrun(2, RECIPE / "sft.py", "--model", str(tmp_path / "tiny"), "--layout",
                    str(RECIPE / "llama-3.1-8b-8gpu.yaml"), "--set", "dp_shard=2", "--set", "mixed_precision=no",
                    "--data", str(tmp_path / "data.jsonl"), "--max-steps", "3", "--max-length", "64",
                    "--batch-size", "2", "--accumulate", "1", "--lr", "1e-3", "--output-dir", str(tmp_path / "out"),
                    timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert (proc.stdout + proc.stderr).count("train_runtime") == 1
    start, end = load_file(tmp_path / "tiny" / "model.safetensors"), load_file(tmp_path / "out" / "final" / "model.safetensors")
    moved = max(float((end[k] - start[k]).abs().max()) for k in start)
    assert 0 < moved < 0.05, moved  # trained a few steps from the pretrained weights (not from a fresh draw)
    assert all(torch.isfinite(v).all() for v in end.values())
