"""The real-size fine-tuning recipes in ``recipes/sft/``: each one's full layout checked statically against its real
model config and world size (the command line's own pre-launch checks, on the meta device) and costed by the
planner within 80 GB per GPU; then a fully shrunk model of the same type (every size field small, vocabulary
included) trains a few steps through ``ultrascale train --init-from`` with the recipe's layout scaled down to a
few CPU processes. A recipe that no longer parses, validates or fits fails here.

A LoRA recipe (a ``peft:`` section; ``<model>-lora.yaml`` shares ``configs/<model>.json``) is costed by the
estimate ``ultrascale train`` itself checks before launch, made on the PEFT model on the meta device (the planner
does not price adapters yet), and its shrunk run (a PEFT model built on the meta device, its base read from the
pretrained directory) checks that the adapters trained and that the checkpoint keeps the recipe's peft section
and the pretrained directory (with the frozen base entries it holds equal to that directory's)."""
import dataclasses
import json
import math
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
SFT = ROOT / "recipes" / "sft"
RECIPES = sorted(SFT.glob("*.yaml"))
LORA_RECIPES = [p for p in RECIPES if "peft" in yaml.safe_load(p.read_text())]


def expert_parallel_alternative(path: Path) -> int | None:
    """The ep of the expert-parallel layout a MoE recipe's header offers (its `--set ep=N` launch command)."""
    found = re.findall(r"--set ep=(\d+)", "".join(line for line in path.read_text().splitlines(keepends=True)
                                                  if line.startswith("#")))
    assert len(set(found)) <= 1, f"{path.name}: one ep in the header"
    return int(found[0]) if found else None


EP_RECIPES = [p for p in RECIPES if expert_parallel_alternative(p)]
GPU = "h100-sxm-80gb"

def shrunk_data(tmp_path: Path, tiny: Path) -> list[str]:
    """The shrunk run's data: the recipe's own data settings (chat, packing) on generated conversations, with the
    tests' tiny tokenizer (a ChatML template without generation tags) saved beside the shrunk model."""
    from tiny_tokenizer import chat_rows, make_tokenizer, write_jsonl

    make_tokenizer(tiny)
    data = write_jsonl(tmp_path / "sft.jsonl", chat_rows(64))
    return [f"data.dataset={data}", "data.eval_fraction=0.25", f"data.cache_dir={tmp_path / 'cache'}"]



# The shrunk run's loop: a few steps of short rows (train.epochs needs a dataset, so steps decide).
SHRUNK_TRAIN = ["train.epochs=0", "train.steps=3", "train.log_every=1", "data.seq_len=64", "train.lr=0.001",
                "train.warmup_steps=1", "train.save_every=0", "train.keep_last_n=0"]
MAX_SHRUNK_PROCESSES = 4  # 2 CPU cores: the shrunk layouts keep every kind of dimension at 2, data parallel first to go

# Size fields of the real configs and their shrunk values (the ones present in a config are replaced).
SHRUNK_SIZES = {"hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                "shared_expert_intermediate_size": 32, "num_experts": 8, "num_local_experts": 8,
                "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
                "vocab_size": 512, "max_position_embeddings": 512}
MESH_DEGREES = ("dp_replicate", "dp_shard", "cp", "tp", "pp")
# a QLoRA recipe's: every adapted weight a whole number of NF4's 64 x 256-value scale blocks, split evenly by 2
NF4_SHRUNK_SIZES = {"hidden_size": 256, "intermediate_size": 512, "head_dim": 64}


def test_the_four_recipes_are_there():
    assert {p.stem for p in RECIPES} >= {"llama-3.1-8b", "qwen3-32b", "llama-3.1-70b", "qwen3-30b-a3b"}, RECIPES


def test_the_moe_recipe_offers_expert_parallel():
    assert [p.stem for p in EP_RECIPES] == ["qwen3-30b-a3b"], EP_RECIPES


def test_the_lora_recipes_are_there():
    assert {p.stem for p in LORA_RECIPES} >= {"llama-3.1-70b-lora", "qwen3-30b-a3b-lora", "llama-3.1-70b-qlora-2gpu"}, \
        RECIPES


def header(path: Path) -> str:
    return "".join(line for line in path.read_text().splitlines(keepends=True) if line.startswith("#"))


def nnodes_of(path: Path) -> int:
    """The node count the recipe's header declares (``# nnodes: N``), checked against its launch command."""
    text = header(path)
    found = re.findall(r"^#\s*nnodes:\s*(\d+)\s*$", text, re.M)
    assert len(found) == 1, f"{path.name}: the header needs one '# nnodes: N' line"
    nodes = int(found[0])
    launch = re.findall(r"--nnodes (\d+)", text)
    if nodes > 1:
        assert launch and all(int(n) == nodes for n in launch), f"{path.name}: the launch command's --nnodes"
    assert f"ultrascale train recipes/sft/{path.name}" in text and "--init-from" in text, path.name
    return nodes


def gpu_of(path: Path) -> str:
    """The GPU preset the recipe is for: its header's ``# gpu: NAME``, else an H100 80 GB."""
    found = re.findall(r"^#\s*gpu:\s*(\S+)\s*$", header(path), re.M)
    return found[0] if found else GPU


def config_json(path: Path) -> Path:
    """The model's config.json the header names (``recipes/sft/configs/<model>.json``), else ``<recipe>.json``."""
    named = re.findall(r"recipes/sft/configs/([\w.-]+)\.json is that config", header(path).replace("\n# ", " "))
    config = SFT / "configs" / f"{named[0] if named else path.stem}.json"
    if not config.is_file() and path.stem.endswith("-lora"):  # a LoRA recipe of a model that has a recipe
        config = SFT / "configs" / f"{path.stem.removesuffix('-lora')}.json"
    assert config.is_file(), f"{path.name}: its model's config.json belongs in {config}"
    return config


def pretrained_dir(path: Path, tmp_path: Path) -> Path:
    """A directory holding the recipe's real config.json (no weights), as --init-from would name."""
    d = tmp_path / "real"
    d.mkdir()
    shutil.copy(config_json(path), d / "config.json")
    return d


def planner_layout(recipe, world: int):
    """The planner's ``Layout`` for a recipe's resolved layout and batch split."""
    from ultrascale_plugins.planner.cost import SEARCH_SETS, Layout

    p = recipe.parallel.resolve(world)
    extra = {k: v for k, v in recipe.parallel.to_dict().items() if k not in SEARCH_SETS}  # plugins' fields, as set
    return Layout(dp_replicate=p.dp_replicate, dp_shard=p.dp_shard, tp=p.tp, pp=p.pp, cp=p.cp, **extra,
                  zero_stage=p.zero_stage, micro_batch_size=recipe.train.micro_batch_size,
                  grad_accum=recipe.train.grad_accum, activation_checkpointing=p.activation_checkpointing,
                  pp_schedule=p.pp_schedule, pp_virtual_stages=p.pp_virtual_stages,
                  sequence_parallel=p.sequence_parallel and p.tp > 1, cp_method=p.cp_method,
                  mixed_precision="bf16" if p.mixed_precision == "bf16" else "no")


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.stem)
def test_full_layout_validates_and_fits(path, tmp_path, monkeypatch):
    from ultrascale_plugins.cli.main import check_recipe
    from ultrascale_plugins.planner.cost import CostModel, Workload, layout_from_string
    from ultrascale_plugins.planner.hardware import hardware_from_args
    from ultrascale_plugins.planner.model_spec import ModelSpec
    from ultrascale_plugins.data.recipe import load_recipe

    nodes = nnodes_of(path)
    real = pretrained_dir(path, tmp_path)
    fields = json.loads((real / "config.json").read_text())
    assert fields.get("model_type") and fields.get("architectures"), path.name
    assert "model" not in yaml.safe_load(path.read_text()), f"{path.name}: --init-from is the model section"
    recipe = load_recipe(path, nnodes=nodes, init_from=str(real))
    world = recipe.nproc * nodes
    config = recipe.model_config()
    assert config.model_type == fields["model_type"], path.name  # the --init-from directory's config is the model
    assert (config.hidden_size, config.num_hidden_layers) == (fields["hidden_size"], fields["num_hidden_layers"])
    assert recipe.data.dataset and recipe.data.format == "chat" and recipe.data.packing, path.name
    assert "bf16" in (recipe.parallel.mixed_precision, recipe.parallel.param_dtype), path.name
    if recipe.section("peft") is not None:
        return lora_layout_validates_and_fits(path, recipe, nodes, monkeypatch)
    # What `ultrascale train` checks before launch (meta model, TP plan, mesh, batch), but its memory check against
    # this machine: the recipe is for 80 GB GPUs, costed below.
    monkeypatch.setenv("ULTRASCALE_SKIP_MEMORY_CHECK", "1")
    check_recipe(recipe, nnodes=nodes)
    assert math.prod(getattr(recipe.parallel.resolve(world), d) for d in MESH_DEGREES) == world

    # The planner's estimate for exactly this layout (what `ultrascale plan --layout` prints) fits the GPU ...
    lay = planner_layout(recipe, world)
    hw = hardware_from_args(gpu_of(path))
    cost = CostModel(ModelSpec.of(config), hw,
                     Workload(recipe.data.seq_len, recipe.train.global_batch, "ultrascale", "adamw", "bf16"))
    result = cost.evaluate(lay)
    assert result.runnable, f"{path.name}: {result.not_runnable_because}"
    assert result.fits and result.memory_gb["total"] <= hw.memory_gb, f"{path.name}: {result.memory_gb}"
    # ... and the header's `ultrascale plan` command costs that same layout, quoting that total (within 10 %).
    text = header(path)
    quoted_layout = re.findall(r'--layout "([^"]+)"', text)
    assert len(quoted_layout) == 1, f"{path.name}: the header quotes one `ultrascale plan --layout` command"
    theirs = layout_from_string(quoted_layout[0], world).replace(mixed_precision="bf16")  # as `plan --precision bf16`
    assert (theirs.fields(), theirs.micro_batch_size, theirs.grad_accum) == \
        (lay.fields(), lay.micro_batch_size, lay.grad_accum), f"{path.name}: the quoted --layout is not the recipe's"
    assert f"--gpus {world} " in text and f"--seq-len {recipe.data.seq_len} " in text, path.name
    assert f"--gpu {hw.name} " in text, f"{path.name}: the header plans for its GPU ({hw.name})"
    assert f"--global-batch-size {recipe.train.global_batch} " in text, path.name
    quoted = re.findall(r"= ([\d.]+) GB per GPU", text)
    assert quoted, f"{path.name}: the header quotes the planner's total ('= N GB per GPU')"
    assert abs(float(quoted[0]) - result.memory_gb["total"]) <= 0.1 * result.memory_gb["total"], \
        f"{path.name}: the header says {quoted[0]} GB, the planner now {result.memory_gb['total']:.1f} GB"


@pytest.mark.parametrize("path", EP_RECIPES, ids=lambda p: p.stem)
def test_expert_parallel_alternative_validates_and_fits(path, tmp_path, monkeypatch):
    """The header's expert-parallel layout (`--set ep=N` over the recipe's): `ultrascale train`'s pre-launch checks
    at full size (ep against the real model's experts and the ranks it borrows, the experts on the meta device,
    ZeRO 2 or 3), its memory check on against 80 GB per GPU, and the header quoting that estimate within 10 %."""
    from ultrascale_plugins.cli.main import check_recipe
    from ultrascale_plugins.core.engine import estimate
    from ultrascale_plugins.planner.cost import coordinates_to_cost, peak_memory_gb
    from ultrascale_plugins.data.recipe import load_recipe

    ep, nodes = expert_parallel_alternative(path), nnodes_of(path)
    recipe = load_recipe(path, [f"ep={ep}"], nnodes=nodes, init_from=str(pretrained_dir(path, tmp_path)))
    world = recipe.nproc * nodes
    monkeypatch.delenv("ULTRASCALE_SKIP_MEMORY_CHECK", raising=False)
    check_recipe(recipe, nnodes=nodes, memory_gb=80)
    resolved = recipe.parallel.resolve(world)
    assert resolved.ep == ep > 1 and resolved.zero_stage >= 2
    assert (resolved.dp_shard * resolved.cp * resolved.tp) % ep == 0 and recipe.model_config().num_experts % ep == 0
    t = recipe.train
    mem = peak_memory_gb([estimate(resolved, recipe.model_config(), world_size=world, seq_len=recipe.data.seq_len,
                                   micro_batch=t.micro_batch_size, micro_batches=t.grad_accum, coords=coords,
                                   check=False) for coords in coordinates_to_cost(resolved)])
    text = header(path)
    quoted = re.findall(r"= ([\d.]+) GB per GPU", text[text.index(f"--set ep={ep}"):])
    assert quoted, f"{path.name}: the header quotes the ep layout's estimate after its command ('= N GB per GPU')"
    assert abs(float(quoted[0]) - mem["total"]) <= 0.1 * mem["total"], \
        f"{path.name}: the header says {quoted[0]} GB with ep={ep}, the estimate now {mem['total']:.1f} GB"


def lora_layout_validates_and_fits(path, recipe, nodes: int, monkeypatch) -> None:
    """A LoRA recipe: `ultrascale train`'s pre-launch checks, its memory check included, against its GPU (80 GB
    unless its header names another); the estimate they use (of the PEFT model on the meta device: only the adapters
    train; a QLoRA base in NF4 as torchao holds it) quoted in the header within 10 %, and its frozen base far above
    its adapters."""
    import torch
    from transformers import AutoModelForCausalLM

    from ultrascale_plugins.cli.main import check_recipe
    from ultrascale_plugins.core.engine import estimate
    from ultrascale_plugins.planner.cost import coordinates_to_cost, peak_memory_gb
    from ultrascale_plugins.features.peft.recipe_section import peft_model

    from ultrascale_plugins.planner.hardware import hardware_from_args

    world = recipe.nproc * nodes
    gpu_gb = hardware_from_args(gpu_of(path)).memory_gb
    monkeypatch.delenv("ULTRASCALE_SKIP_MEMORY_CHECK", raising=False)
    check_recipe(recipe, nnodes=nodes, memory_gb=gpu_gb)  # refuses a recipe whose estimate exceeds the GPU
    resolved = recipe.parallel.resolve(world)
    assert math.prod(getattr(resolved, d) for d in MESH_DEGREES) == world
    with torch.device("meta"):
        spec = recipe.section("peft")  # the frozen base in the recipe's dtype (bf16 by default), as the CLI builds it
        model = peft_model(AutoModelForCausalLM.from_config(recipe.model_config(), dtype=spec.torch_base_dtype), spec)
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert 0 < trainable < 0.05 * sum(p.numel() for p in model.parameters()), path.name
    t = recipe.train
    ests = [estimate(resolved, model.config, world_size=world, seq_len=recipe.data.seq_len,
                     micro_batch=t.micro_batch_size, micro_batches=t.grad_accum, coords=coords, model=model,
                     check=False) for coords in coordinates_to_cost(resolved)]
    mem = peak_memory_gb(ests)
    assert mem["total"] <= gpu_gb, (path.name, mem)
    if not recipe.parallel.cpu_offload:  # offloaded, the model states are in host memory
        assert mem["grads"] < 0.1 * mem["params"], (path.name, mem)
    if recipe.section("peft").quantize_base:  # the adapted weights as torchao holds NF4: about half a byte each
        bases = [p for n, p in model.named_parameters() if n.endswith("base_layer.weight")]
        nf4 = [p for p in bases if type(p).__name__ == "NF4Tensor"]
        assert nf4 and len(nf4) == len(bases), (len(nf4), len(bases))
    text = header(path)
    assert f"{trainable / 1e9:.1f}B trainable" in text or f"{trainable / 1e6:.0f}M trainable" in text, \
        f"{path.name}: the header names the trainable count ({trainable / 1e6:.0f}M)"
    quoted = re.findall(r"= ([\d.]+) GB per GPU", text)
    assert quoted, f"{path.name}: the header quotes the estimate's total ('= N GB per GPU')"
    assert abs(float(quoted[0]) - mem["total"]) <= 0.1 * mem["total"], \
        f"{path.name}: the header says {quoted[0]} GB, the estimate now {mem['total']:.1f} GB"


def shrunk_layout(parallel) -> dict:
    """The recipe's layout at small scale: every mesh degree above 1 becomes 2 (the same kinds of dimensions), then
    data-parallel degrees go back to 1 while the world exceeds ``MAX_SHRUNK_PROCESSES``; fp32 on CPU."""
    degrees = {d: (2 if getattr(parallel, d) != 1 else 1) for d in MESH_DEGREES}
    for d in ("dp_replicate", "dp_shard"):
        if math.prod(degrees.values()) > MAX_SHRUNK_PROCESSES:
            degrees[d] = 1
    return {**degrees, "mixed_precision": "no"}  # a bare no (YAML's false) reads as the choice "no"


def shrunk_model(real_config: Path, out: Path, layers: int, sizes: dict | None = None) -> None:
    """A model of the same type as ``real_config`` with every size field small (``sizes`` over ``SHRUNK_SIZES``),
    saved by ``save_pretrained`` (MoE experts per expert, the published checkpoints' format)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    fields = json.loads(real_config.read_text())
    model_type = fields.pop("model_type")
    for key, value in {**SHRUNK_SIZES, **(sizes or {})}.items():
        if key in fields:
            fields[key] = value
    fields["num_hidden_layers"] = layers
    if "max_window_layers" in fields:
        fields["max_window_layers"] = layers
    rope = fields.get("rope_scaling")
    if isinstance(rope, dict) and "original_max_position_embeddings" in rope:
        rope["original_max_position_embeddings"] = fields["max_position_embeddings"] // 4
    for key in ("bos_token_id", "eos_token_id", "pad_token_id"):  # token ids inside the small vocabulary
        if isinstance(fields.get(key), list):
            fields[key] = [1 + i for i in range(len(fields[key]))]
        elif fields.get(key) is not None:
            fields[key] = 1
    fields.pop("torch_dtype", None)
    fields["dtype"] = "float32"
    config = AutoConfig.for_model(model_type, **fields)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    model.save_pretrained(out, safe_serialization=True)


def ultrascale_train(*args, timeout=300):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONFAULTHANDLER": "1"}
    return subprocess.run([sys.executable, "-m", "ultrascale_plugins.cli.main", "train", *args], capture_output=True,
                          text=True, timeout=timeout, env=env, cwd=ROOT)


# layouts another recipe's shrunk run already covers (ZeRO-3 with bf16, on a dense or a MoE model, with or without
# LoRA; ZeRO-3 x TP + SP inside llama-3.1-70b's pp x tp x dp): run by benchmarks/sweep_tests.py, the rest in CI
SWEEP_ONLY = ("llama-3.1-8b", "qwen3-30b-a3b", "qwen3-30b-a3b-lora", "qwen3-32b")


@pytest.mark.slow
@pytest.mark.parametrize("path,ep", [pytest.param(p, None, id=p.stem,
                                                  marks=[pytest.mark.sweep] * (p.stem in SWEEP_ONLY))
                                     for p in RECIPES]
                         + [pytest.param(p, 2, id=f"{p.stem}-ep") for p in EP_RECIPES])
def test_shrunk_model_trains_in_the_recipes_layout(path, ep, tmp_path):
    """... and a MoE recipe's expert-parallel alternative: the same scaled-down layout with `--set ep=2`."""
    from ultrascale_plugins.data.recipe import load_recipe

    real = pretrained_dir(path, tmp_path)
    recipe = load_recipe(path, nnodes=nnodes_of(path), init_from=str(real))
    layout = shrunk_layout(recipe.parallel)
    if ep is not None:
        layout["ep"] = ep  # divides the shrunk dp_shard*cp*tp (2) and its 8 experts
    world = math.prod(layout[d] for d in MESH_DEGREES)
    tiny = tmp_path / "tiny"
    quantized = recipe.section("peft") is not None and recipe.section("peft").quantize_base
    shrunk_model(config_json(path), tiny, layers=4 if layout["pp"] > 1 else 2,
                 sizes=NF4_SHRUNK_SIZES if quantized else None)
    dp = layout["dp_replicate"] * layout["dp_shard"]
    batch = ["train.global_batch=%d" % (2 * dp), "train.micro_batch_size=1", "train.grad_accum=2"]
    sets = [*shrunk_data(tmp_path, tiny), *SHRUNK_TRAIN, *batch, f"train.save_dir={tmp_path / 'ckpt'}",
            *(f"{k}={v}" for k, v in layout.items())]
    peft = None
    if recipe.section("peft") is not None:  # the command line's override of one field of the recipe's peft section
        peft = dataclasses.replace(recipe.section("peft"), r=8)
        sets.append("peft.r=8")
    metrics = tmp_path / "metrics.json"
    proc = ultrascale_train(str(path), "--init-from", str(tiny), "--nproc", str(world), "--metrics", str(metrics),
                            *(a for s in sets for a in ("--set", s)))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    result = json.loads(metrics.read_text())
    assert result["world_size"] == world
    assert len(result["losses"]) == 3 and all(math.isfinite(x) for x in result["losses"]), result
    line = next(x for x in proc.stdout.splitlines() if x.startswith(f"ultrascale: {world} processes, layout "))
    assert f"model {json.loads(config_json(path).read_text())['model_type']} from {tiny}" in line, line
    assert all(f"{d}=2" in line for d in MESH_DEGREES if layout[d] == 2), line  # the scaled-down layout ran
    if ep is not None:
        assert f"experts over efsdp=1, ep={ep} (the ranks of dp_shard*cp*tp)" in line, line
    assert any((tmp_path / "ckpt").glob("step-*")), "the recipe's save_dir (overridden) got no checkpoint"
    if peft is not None:
        assert f"{peft.describe()}: " in line and "trainable" in line and "r=8 " in line, line
        lora_run_checked(peft, tiny, sorted((tmp_path / "ckpt").glob("step-*"))[-1], tmp_path)
    if peft is not None and path == LORA_RECIPES[0]:  # resumed without --init-from: the base from the recorded one
        metrics = tmp_path / "resumed.json"
        proc = ultrascale_train(str(path), "--resume", str(tmp_path / "ckpt"), "--nproc", str(world), "--metrics",
                                str(metrics), *(a for s in [*sets, "train.steps=4"] for a in ("--set", s)))
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
        assert len(json.loads(metrics.read_text())["losses"]) == 1  # step 4 only
        assert f"from {tiny} " in proc.stdout and "resumed from" in proc.stdout, proc.stdout[-2000:]


def lora_run_checked(peft, tiny: Path, checkpoint: Path, tmp_path: Path) -> None:
    """The shrunk LoRA run's checkpoint keeps the recipe with its peft section and the pretrained directory; its
    adapters were drawn (LoRA B from zero) and trained; the frozen base entries it holds (checkpoints may hold the
    adapters only) equal the pretrained directory's tensors bit for bit, fused experts included."""
    import torch
    from safetensors.torch import load_file
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    meta = json.loads((checkpoint / "ultrascale.json").read_text())
    assert meta["extra"]["recipe"]["peft"] == peft.to_dict(), meta["extra"]
    assert meta["extra"]["init_from"] == str(tiny)
    dcp_to_torch_save(checkpoint, tmp_path / "state.pt")
    saved = torch.load(tmp_path / "state.pt", weights_only=True)
    state = saved["model"] if isinstance(saved.get("model"), dict) else {
        k.removeprefix("model."): v for k, v in saved.items() if k.startswith("model.")}
    lora_b = [k for k in state if "lora_B" in k]
    assert lora_b and all(state[k].abs().max() > 0 for k in lora_b), "the adapters did not train (B stayed zero)"
    assert len([k for k in state if "lora_A" in k]) == len(lora_b)
    files = {}
    for f in sorted(tiny.glob("*.safetensors")):
        files.update(load_file(f))
    frozen = {k: k.replace(".base_layer", "").removeprefix("base_model.model.") for k in state if "lora_" not in k}
    for key, name in frozen.items():
        if name in files:
            assert torch.equal(state[key], files[name]), key
            continue
        stem, _, what = name.rpartition(".")  # fused experts: model.layers.N.mlp.experts, gate_up_proj / down_proj
        parts = ("gate_proj", "up_proj") if what == "gate_up_proj" else ("down_proj",)
        whole = torch.stack([torch.cat([files[f"{stem}.{e}.{p}.weight"] for p in parts])
                             for e in range(state[key].shape[0])])
        assert torch.equal(state[key], whole), key


def test_moe_checkpoint_in_transformers_format_loads(tmp_path):
    """What the MoE recipe's launch command reads: a directory save_pretrained wrote (the hub's format)."""
    from ultrascale_plugins.checkpoints.load import prepare

    moe = [p for p in RECIPES if "num_experts" in json.loads(config_json(p).read_text())]
    assert moe, "no mixture-of-experts recipe"
    shrunk_model(config_json(moe[0]), tmp_path / "tiny", layers=2)
    weights, _ = prepare(tmp_path / "tiny")
    assert weights.fused and weights.unexpected == []  # the per-expert tensors assemble the fused experts
