"""Cost of one layout: per-GPU memory, step time, tokens/s/GPU and MFU, from the dimensions' estimate hooks.

The plugins say what each rank holds and moves (``ultrascale_cost_estimate``); this module turns that into time with the
hardware's figures and a few global constants (``CONSTANTS``, stated in docs/planner.md with how they were chosen):

    micro-batch time = compute / (peak x efficiency) + exposed per-micro-batch communication
    step time        = micro-batch time x micro-batches x (1 + pipeline bubble) + exposed per-step communication

A collective costs its traffic over the bus bandwidth of the links it spans (inside a node or across how many
nodes, from the mesh axis's position: ``ultrascale_declare_mesh_axes``; an axis of a ``MeshView`` re-splits the ranks of its
source axes, innermost first) plus a latency per ring hop and call.
"""
from __future__ import annotations

import dataclasses
import math

from ..interface.config import ConfigError, ParallelConfig
from .constants import CONSTANTS
from .hardware import bus_share

GB = 1e9
# the layout fields the planner's search chooses itself (``search.layouts``: degrees, ZeRO stage, recomputation,
# schedule, precision) or derives from its batch split (``pp_microbatches``); a plugin offers values only for its
# other fields (``ultrascale_cost_search``), which the label names one by one
SEARCH_SETS = frozenset({"dp_replicate", "dp_shard", "zero_stage", "tp", "pp", "cp", "mixed_precision",
                         "activation_checkpointing", "sequence_parallel", "pp_schedule", "pp_microbatches",
                         "pp_virtual_stages", "cp_method"})


class Layout:
    """One candidate: a value for each layout field the plugins of its ``registry`` declare
    (``ultrascale_declare_fields``), at the field's default unless given (``Layout(tp=2, ep=4)``, read as
    ``layout.tp``), and the batch split, the planner's own: ``micro_batch_size`` rows per micro-batch and
    ``grad_accum`` micro-batches per step (the pipeline's, with pp > 1). It holds only the values that differ from
    their field's default (``values``, in declaration order), so a layout equals, and hashes as, one that never named
    a field at its default. ``registry``: the one whose fields it is checked against and whose defaults it reads (a
    ``CostModel``'s layouts are made under the cost model's); the process's when none is given. It is not part of
    equality or hashing, and ``replace``, ``without`` and ``config`` keep it."""

    def __init__(self, *, micro_batch_size: int = 1, grad_accum: int = 1, registry=None, **values):
        from ..interface.fields import suggest

        registry = _registry_or_default(registry)
        declared = registry.fields.by_name
        for name in values:
            if name not in declared:
                raise ConfigError(f"Layout: no plugin declares a layout field '{name}'. Fix: "
                                  f"{suggest(name, declared)}")
        held = tuple((f.name, tuple(values[f.name]) if isinstance(values[f.name], list) else values[f.name])
                     for f in declared.values() if f.name in values and values[f.name] != f.default)
        object.__setattr__(self, "values", held)
        object.__setattr__(self, "micro_batch_size", micro_batch_size)
        object.__setattr__(self, "grad_accum", grad_accum)
        object.__setattr__(self, "registry", registry)

    def __getattr__(self, name: str):
        """A layout field's value: the one given, else the field's default."""
        if name.startswith("__") or name in ("values", "micro_batch_size", "grad_accum", "registry"):
            raise AttributeError(name)  # copy and pickle probing, or a copy not yet filled
        for key, value in self.values:
            if key == name:
                return value
        field = self.registry.fields.by_name.get(name)
        if field is None:
            raise AttributeError(f"Layout has no field '{name}': no plugin declares it")
        return field.default

    def __setattr__(self, name, value):
        raise AttributeError(f"Layout is immutable: use layout.replace({name}=...)")

    def _key(self) -> tuple:
        return self.values, self.micro_batch_size, self.grad_accum

    def __eq__(self, other) -> bool:
        return isinstance(other, Layout) and self._key() == other._key()

    def __hash__(self) -> int:
        return hash(self._key())

    def __repr__(self) -> str:
        given = [f"{k}={v!r}" for k, v in self.values]
        split = f"micro_batch_size={self.micro_batch_size}, grad_accum={self.grad_accum}"
        return f"Layout({', '.join([*given, split])})"

    def replace(self, **changes) -> "Layout":
        """This layout with ``changes`` (field values, ``micro_batch_size``, ``grad_accum``)."""
        return Layout(**{"micro_batch_size": self.micro_batch_size, "grad_accum": self.grad_accum,
                         **dict(self.values), **changes}, registry=self.registry)

    def without(self, *names: str) -> "Layout":
        """This layout with the fields ``names`` at their defaults."""
        return Layout(micro_batch_size=self.micro_batch_size, grad_accum=self.grad_accum, registry=self.registry,
                      **{k: v for k, v in self.values if k not in names})

    @property
    def world(self) -> int:
        return self.dp_replicate * self.dp_shard * self.tp * self.pp * self.cp

    @property
    def dp(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def extra(self) -> dict:
        """The values of the fields the search does not choose itself (a plugin's: ``ep``, ``chunked_loss``), by
        name."""
        return {k: v for k, v in sorted(self.values) if k not in SEARCH_SETS}

    def fields(self) -> dict:
        """The ``ParallelConfig`` fields of this layout: those not at their default, and with pp > 1 the
        micro-batches per step."""
        out = {k: list(v) if isinstance(v, tuple) else v for k, v in self.values}
        if self.pp > 1:
            out["pp_microbatches"] = self.grad_accum
        if "param_dtype" in out:  # the weights held in bf16 compute in it: no mixed precision
            out["mixed_precision"] = "no"
        return out

    def config(self) -> ParallelConfig:
        """This layout as a ``ParallelConfig`` of its registry."""
        return self.registry.config(**self.fields())

    def label(self) -> str:
        parts = [f"dp={self.dp}" + (f"({self.dp_replicate}x{self.dp_shard})" if self.dp_replicate > 1 else ""),
                 f"tp={self.tp}", f"pp={self.pp}", f"cp={self.cp}", *(f"{k}={v}" for k, v in self.extra.items()),
                 f"zero={self.zero_stage}",
                 f"mbs={self.micro_batch_size}", f"ga={self.grad_accum}",
                 f"recompute={self.activation_checkpointing}"]
        if self.pp > 1:
            parts.append(f"schedule={self.pp_schedule}" + (f"x{self.pp_virtual_stages}"
                                                             if self.pp_virtual_stages > 1 else ""))
        return ",".join(parts)


@dataclasses.dataclass(frozen=True)
class Workload:
    seq_len: int
    global_batch: int  # sequences per optimizer step
    profile: str = "ultrascale"
    optimizer: str = "adamw"
    precision: str = "bf16"  # ParallelConfig.mixed_precision: "bf16" or "no" (fp32)
    adapters: object = None  # an ``interface.estimates.Adapters`` (LoRA): only they train, the base is frozen


@dataclasses.dataclass
class Result:
    layout: Layout
    fits: bool
    memory_gb: dict
    step_s: float
    tokens_per_s_per_gpu: float
    mfu: float
    dominant: str
    runnable: bool
    not_runnable_because: str = ""
    times_s: dict = dataclasses.field(default_factory=dict)
    comm_gb: dict = dataclasses.field(default_factory=dict)  # per optimizer step, by mesh axis (slowest rank)
    # hardware FLOPs utilization: the MFU with recomputed forwards counted as work (Korthikanti et al.'s HFU; what
    # Megatron-LM's printed TFLOP/s measure under activation checkpointing). Equal to the MFU without recomputation.
    hfu: float = 0.0
    # the model states (weights, gradients, optimizer; device and host) of every GPU over the model's parameters:
    # 16 for fp32 AdamW whatever the sharding, less with bf16 or low-bit states, about 2 for LoRA on a bf16 base
    bytes_per_param: float = 0.0
    # how full the fullest memory is: device memory over the GPU's, or host memory over the host's share per GPU
    # (offloaded states), whichever is larger; fits when <= 1
    load: float = 0.0

    def to_json(self) -> dict:
        lay = self.layout
        return {"dp_replicate": lay.dp_replicate, "dp_shard": lay.dp_shard, "tp": lay.tp, "pp": lay.pp,
                "cp": lay.cp, "zero_stage": lay.zero_stage, "micro_batch_size": lay.micro_batch_size,
                "grad_accum": lay.grad_accum, "activation_checkpointing": lay.activation_checkpointing,
                "pp_schedule": lay.pp_schedule if lay.pp > 1 else None,
                "pp_virtual_stages": lay.pp_virtual_stages if lay.pp > 1 else None,
                "sequence_parallel": bool(lay.fields().get("sequence_parallel", False)), **lay.extra,
                "fits": self.fits, "memory_gb": {k: round(v, 3) for k, v in self.memory_gb.items()},
                "tokens_per_s_per_gpu": round(self.tokens_per_s_per_gpu, 1), "mfu": round(self.mfu, 4),
                "hfu": round(self.hfu, 4), "bytes_per_param": round(self.bytes_per_param, 2),
                "step_s": round(self.step_s, 4), "dominant": self.dominant, "runnable": self.runnable,
                **({"not_runnable_because": self.not_runnable_because} if not self.runnable else {}),
                "times_s": {k: round(v, 5) for k, v in self.times_s.items()},
                "comm_gb_per_step": {k: round(v, 4) for k, v in self.comm_gb.items()}}


class CostModel:
    """Costs layouts of one model on one machine for one workload (caches what layouts share)."""

    def __init__(self, spec, hardware, workload: Workload, constants: dict | None = None, pm=None):
        self.spec, self.hw, self.work = spec, hardware, workload
        # a calibrated profile's fitted constants (``hardware.constants``), then the caller's
        self.c = {**CONSTANTS, **dict(hardware.constants), **(constants or {})}
        self.pm = _registry_or_default(pm)
        self._runnable: dict = {}
        self._plans: dict = {}
        self._offered: dict = {}  # per candidate: its resolved config and the plugins' ``SearchOffer``s
        self._choices: dict = {}
        self.searched: set = set()  # the plugin fields the search has tried (``plugin_choices``)
        self.savers: set = set()  # those of them offered as memory savers (a ``SearchOffer``'s savers and lossy)
        self._flops_token = None  # model FLOPs per token of the workload (the MFU's numerator per token)
        self._experts = None  # a mixture of experts' routed experts: ``expert_figures``

    # ---- checks -----------------------------------------------------------------------------------------
    def check_batch(self, lay: Layout) -> None:
        rows = lay.dp * lay.micro_batch_size * lay.grad_accum
        if rows != self.work.global_batch:
            raise ConfigError(f"layout {lay.label()}: dp x mbs x ga = {lay.dp} x {lay.micro_batch_size} x "
                              f"{lay.grad_accum} = {rows}, but the global batch is {self.work.global_batch} "
                              "sequences. Fix: choose mbs and ga so that their product with dp is the global batch")

    def runnable(self, lay: Layout) -> tuple[bool, str]:
        """Whether this engine runs the layout (every plugin's checks that need no process group)."""
        key = (lay.values, lay.grad_accum if lay.pp > 1 else 0)
        if key not in self._runnable:
            from ..core.engine import validate

            try:
                validate(lay.config(), self.spec.config, lay.world, self.pm)
                adapters = self.work.adapters
                if adapters is not None and adapters.quantized and (lay.tp > 1 or lay.pp > 1):
                    # what features/peft/quantized_base.py refuses on the model itself
                    raise ConfigError(f"a {adapters.quantized.upper()} base (QLoRA) splits only along its rows "
                                      "(ZeRO) and cannot be rebuilt in a pipeline stage: not under tp or pp. Fix")
                self._runnable[key] = (True, "")
            except ConfigError as exc:
                self._runnable[key] = (False, str(exc).split(". Fix")[0])
        return self._runnable[key]

    def plugin_choices(self, lay: Layout, world: int, savers: int = 0) -> list[dict]:
        """Every combination of the values the plugins offer for ``lay`` (``ultrascale_cost_search``: their
        ``choices``), as dicts of field values; ``[{}]`` when none offers any. ``savers`` 1: instead, every
        combination of those with the memory savers that cost time (their ``savers``), each also at its current
        value, less the combinations with none of them on (the first pass costed those); 2: every combination with
        those and the ones that change the numbers (their ``lossy``) with at least one of the latter on. ``[]`` when
        none is offered."""
        import itertools

        key = (lay.values, savers)
        if key in self._choices:
            return self._choices[key]
        config, answers = self._search_offers(lay, world)
        offered = self._offers("choices", [a.choices for a in answers], {})
        combos = [dict(zip(offered, values)) for values in itertools.product(*offered.values())] or [{}]
        if savers:
            saving = self._offers("savers", [a.savers for a in answers], offered)
            lossy = {} if savers < 2 else self._offers("lossy", [a.lossy for a in answers], {**offered, **saving})
            self.savers.update(saving, lossy)
            every = {name: list(dict.fromkeys([getattr(config, name)] + values))
                     for name, values in {**saving, **lossy}.items()}
            must = lossy if savers >= 2 else saving  # at least one of these on: the earlier pass costed the rest
            on = [dict(zip(every, values)) for values in itertools.product(*every.values())
                  if any(v != getattr(config, n) for n, v in zip(every, values) if n in must)]
            combos = [{**c, **s} for c in combos for s in on]
        self._choices[key] = combos
        return combos

    def _search_offers(self, lay: Layout, world: int) -> tuple:
        """(``lay``'s config resolved for ``world``, the plugins' ``SearchOffer``s for it): the hook is asked once
        per candidate, whichever of its parts a pass takes."""
        from ..interface.search_offer import SearchOffer

        if lay.values not in self._offered:
            config = self.pm.resolve(lay.config(), world, check=False)
            answers = self.pm.hook.ultrascale_cost_search(config=config, model_config=self.spec.config,
                                                          world_size=world)
            for answer in answers:
                if not isinstance(answer, SearchOffer):
                    raise ConfigError(f"ultrascale_cost_search answered {answer!r}, not a SearchOffer. Fix: return "
                                      "SearchOffer(choices={field: [value, ...]}) (interface.search_offer) or None")
            self._offered[lay.values] = (config, answers)
        return self._offered[lay.values]

    def _offers(self, part: str, answers, taken: dict) -> dict:
        """The plugins' ``part`` of their ``SearchOffer``s, checked: only declared plugin fields, each offered by
        one plugin (not in ``taken`` either), as non-empty lists of valid values."""
        hook = f"ultrascale_cost_search ({part})"
        declared = self.pm.fields
        offered: dict = {}
        for answer in answers:
            for name, values in (answer or {}).items():
                if name in SEARCH_SETS:
                    raise ConfigError(f"{hook} offered {name}={values!r}, a field the planner's search sets "
                                      "itself. Fix: offer only your plugin's own layout fields")
                if name not in declared:
                    raise ConfigError(f"{hook} offered {name}={values!r}, but no plugin declares a layout field "
                                      f"'{name}'. Fix: declare it (ultrascale_declare_fields) or offer a declared field")
                if name in offered or name in taken:
                    raise ConfigError(f"{hook}: two plugins offer values of '{name}' ({ {**taken, **offered}[name]!r} "
                                      f"and {values!r}). Fix: offer only your plugin's own layout fields")
                if not isinstance(values, (list, tuple)) or not values:
                    raise ConfigError(f"{hook} offered {name}={values!r}, not a non-empty list. "
                                      f"Fix: return {{'{name}': [value, ...]}}")
                offered[name] = [declared.by_name[name].validate(v) for v in dict.fromkeys(values)]
        self.searched.update(offered)
        return offered

    # ---- the estimate hooks ---------------------------------------------------------------------------------
    def estimates(self, lay: Layout):
        """An ``Estimate`` per rank that can be the most loaded (``coordinates_to_cost``: the dimensions say which,
        e.g. a pipeline's first two stages and the ones holding the last)."""
        from ..core.engine import estimate, model_plan
        from ..interface.estimates import meta_model

        model = meta_model(self.spec.config)
        config = lay.config()
        plan_key = (lay.tp, tuple(lay.extra.items()))  # a plugin's field may edit the plan (ep: the experts' view)
        if plan_key not in self._plans:
            self._plans[plan_key] = model_plan(model, config, self.pm)
        out = []
        for coords in coordinates_to_cost(config, self.pm):
            out.append(estimate(config, self.spec.config, world_size=lay.world, seq_len=self.work.seq_len,
                                micro_batch=lay.micro_batch_size, micro_batches=lay.grad_accum,
                                coords=coords, model=model, profile=self.work.profile,
                                optimizer=self.work.optimizer, check=False, pm=self.pm, plan=self._plans[plan_key],
                                dp_overlap=self.c["dp_overlap"], gather_overlap=self.c["gather_overlap"],
                                **({"adapters": self.work.adapters} if self.work.adapters is not None else {})))
        return out

    def memory(self, ests) -> dict:
        return peak_memory_gb(ests, self.c)

    # ---- time ----------------------------------------------------------------------------------------------
    def axis_nodes(self, lay: Layout) -> dict:
        """(degree, nodes spanned by one group) of each mesh axis (axes inner in the mesh have consecutive ranks),
        and of each axis of a mesh view: a view re-splits the ranks of its source axes, its innermost axis starting
        where the innermost source axis does (expert parallelism's ep: the innermost ep ranks of dp_shard*cp*tp)."""
        config = self.pm.resolve(lay.config(), lay.world, check=False)
        axes = self.pm.axes(config)
        g = self.hw.gpus_per_node

        def nodes(degree: int, span: int) -> int:
            return 1 if span <= g else min(degree, math.ceil(span / g))

        out, strides, stride = {}, {}, 1
        for axis in reversed(axes):  # innermost first
            strides[axis.name] = stride
            span = stride * axis.degree
            out[axis.name] = (axis.degree, nodes(axis.degree, span))
            stride = span
        for view in self.pm.views(config, axes):
            stride = min(strides[name] for name in view.source)
            for axis in reversed(view.axes):
                span = stride * axis.degree
                out.setdefault(axis.name, (axis.degree, nodes(axis.degree, span)))
                stride = span
        return out

    def term_time(self, term, nodes: dict) -> float:
        degree, n_nodes = nodes.get(term.axis, (2, 1))
        if degree <= 1:
            return 0.0
        # a term's bytes are those handed to the collective; this share of them leaves each rank
        factor = bus_share(term.collective, degree)
        bw = self.hw.bus_bandwidth(term.collective, n_nodes, degree)
        if term.collective == "p2p":
            latency = self.c["p2p_latency_s" if n_nodes <= 1 else "p2p_latency_inter_node_s"]
        else:
            latency = self.c["collective_latency_s"] * math.ceil(math.log2(degree))
        return term.nbytes * factor / bw + term.calls * latency

    def expert_figures(self) -> tuple[float, int, float]:
        """(share of the training FLOPs per token in routed experts, elements of one expert's largest matrix,
        top-k / experts): what sizes an expert's matmul. (0, 0, 1) for a dense model."""
        if self._experts is None:
            from ..interface.estimates import flops_per_token
            from ..interface.moe_config import expert_share

            mc = self.spec.config
            records = self.spec.records(self.work.adapters)
            experts = {r.name for r in records if r.active < 1 and not r.adapter and len(r.shape) == 3}
            if not experts:
                self._experts = (0.0, 0, 1.0)
            else:
                whole = sum(flops_per_token(records, mc, self.work.seq_len, layers=0))
                rest = sum(flops_per_token([r for r in records if r.name not in experts], mc, self.work.seq_len,
                                           layers=0))
                total = self.spec.flops_per_token(self.work.seq_len, self.work.adapters)
                width = max(math.prod(r.shape[1:]) for r in records if r.name in experts)
                self._experts = (min(1.0, max(0.0, (whole - rest) / total)), width, expert_share(mc))
        return self._experts

    def kernel_times(self, lay: Layout, est, tokens_mb: int, recompute: float) -> dict:
        """On ``est``'s rank, what a calibrated profile's constants price beyond the matmuls (nothing on the
        presets: their constants are 0, the matmul efficiency having been chosen against whole GPU steps, which
        holds these): ``attention_flops`` per micro-batch, taken out of the matmuls' FLOPs and priced at
        ``attention_efficiency`` instead (``attention``, seconds per micro-batch); ``elementwise`` (seconds per
        micro-batch): ``element_s`` per token and element of a layer's activations on the rank's layers
        (``calibration_fit.layer_elements``: ÷ t, the norms ÷ t only under sequence parallel) and of the loss (3·V
        per token, the fp32 logits' tensors the memory counts), plus ``layer_call_s`` per layer call, the
        recomputed forward again; ``optimizer`` (seconds per step): the optimizer's step on the device, not when
        it steps on the host."""
        from .calibration_fit import layer_elements

        c, mc = self.c, self.spec.config
        layers = mc.num_hidden_layers / lay.pp
        tokens = tokens_mb / lay.cp
        out = {"attention_flops": 0.0, "attention": 0.0}
        if c["attention_efficiency"]:
            heads = mc.num_attention_heads
            dim = getattr(mc, "head_dim", None) or mc.hidden_size // heads
            out["attention_flops"] = 12 * layers * heads * dim * self.work.seq_len * tokens * recompute / lay.tp
            out["attention"] = out["attention_flops"] / (self.hw.tflops * 1e12 * c["attention_efficiency"])
        sp = bool(lay.fields().get("sequence_parallel", False))
        elements = layers * layer_elements(mc, lay.tp, sp) * recompute + 3 * mc.vocab_size
        out["elementwise"] = c["element_s"] * tokens * elements + c["layer_call_s"] * layers * recompute
        on_device = "optimizer" not in est.on_host and c["optimizer_elements_s"]
        out["optimizer"] = est.factors.get("optimizer_elements", 0.0) / c["optimizer_elements_s"] if on_device else 0.0
        return out

    def evaluate(self, lay: Layout) -> Result:
        self.check_batch(lay)
        ests = self.estimates(lay)
        mem = self.memory(ests)
        spec, work, hw = self.spec, self.work, self.hw
        mc = spec.config
        nodes = self.axis_nodes(lay)
        if self._flops_token is None:
            self._flops_token = spec.flops_per_token(work.seq_len, work.adapters)
        flops_token = self._flops_token
        recompute = max(e.factors.get("recompute_flops", 1.0) for e in ests)
        tokens_mb = lay.micro_batch_size * work.seq_len
        # one micro-batch's work on one rank: its share of tp x cp x pp
        mb_flops = flops_token * tokens_mb * recompute / (lay.tp * lay.cp * lay.pp)
        ffn = getattr(mc, "intermediate_size", None) or 4 * mc.hidden_size
        kernel = 2 * tokens_mb / lay.cp * mc.hidden_size * ffn / lay.tp / 1e9  # GFLOP of one MLP matmul
        eff = self.c["matmul_efficiency"] * kernel / (kernel + self.c["half_efficiency_gflop"])
        # a mixture of experts: each expert's matmul sees its share of the tokens (top-k / experts of them), unless
        # a dimension says otherwise (``expert_matmul_gflop``: expert parallelism gathers ep ranks' tokens)
        expert_flops, expert_width, routed = self.expert_figures()
        expert_kernel = 2 * tokens_mb / lay.cp * routed * expert_width / lay.tp / 1e9
        times = {"compute": 0.0, "bubble": 0.0}
        slowest, slowest_est = 0.0, ests[0]
        for est in ests:  # the pipeline runs at the pace of its slowest rank
            # work beyond the model's FLOPs on this rank (PEFT merging adapters into fused expert weights)
            kernels = self.kernel_times(lay, est, tokens_mb, recompute)
            t_compute = ((mb_flops * (1 - expert_flops) - kernels["attention_flops"]
                          + est.factors.get("extra_flops", 0.0)) / (hw.tflops * 1e12 * eff))
            if expert_flops:
                k_e = est.factors.get("expert_matmul_gflop", expert_kernel)
                eff_e = self.c["matmul_efficiency"] * k_e / (k_e + self.c["half_efficiency_gflop"])
                t_compute += mb_flops * expert_flops / (hw.tflops * 1e12 * eff_e)
            per_mb = {t.axis: 0.0 for t in est.terms}
            per_step = dict(per_mb)
            for t in est.terms:
                exposed = self.term_time(t, nodes) * (1 - t.overlap)
                (per_mb if t.per == "micro_batch" else per_step)[t.axis] += exposed
            t_kernels = kernels["attention"] + kernels["elementwise"]
            t_mb = t_compute + t_kernels + sum(per_mb.values())
            bubble = est.factors.get("bubble", 0.0)
            # offloaded states (cpu_offload): the copies over the host link, exposed, and the optimizer on the host
            host = (est.factors.get("host_copy_bytes", 0.0) / (hw.host_link_gbps * GB)
                    + est.factors.get("host_step_elements", 0.0) * min(lay.world, hw.gpus_per_node)
                    / self.c["host_step_elements_s"])
            step = t_mb * lay.grad_accum * (1 + bubble) + sum(per_step.values()) + host + kernels["optimizer"]
            if step > slowest:
                slowest, slowest_est = step, est
                times = {"compute": t_compute * lay.grad_accum, "bubble": t_mb * lay.grad_accum * bubble}
                if host:
                    times["host"] = host
                for key in ("attention", "elementwise"):
                    if kernels[key]:
                        times[key] = kernels[key] * lay.grad_accum
                if kernels["optimizer"]:
                    times["optimizer"] = kernels["optimizer"]
                for axis in per_mb:
                    times[f"comm_{axis}"] = per_mb[axis] * lay.grad_accum + per_step[axis]
        tokens_step = work.global_batch * work.seq_len
        tps = tokens_step / (slowest * lay.world)
        mfu = tps * flops_token / (hw.tflops * 1e12)
        dominant = max(times, key=times.get)
        ok, why = self.runnable(lay)
        states = sum(sum(e.memory[k] for k in ("params", "grads", "optimizer")) for e in ests) / len(ests)
        load = max(mem["total"] / hw.memory_gb, mem.get("host", 0.0) / hw.host_memory_gb)
        return Result(lay, load <= 1, mem, slowest, tps, mfu, dominant, ok, why, times,
                      {k: v / GB for k, v in slowest_est.comm.items()}, hfu=mfu * recompute,
                      bytes_per_param=states * lay.world / spec.total_params, load=load)


def coordinates_to_cost(config, pm=None) -> list[dict]:
    """The ranks (mesh coordinates) that can be the most loaded, from the step's schedule
    (``ultrascale_cost_schedule``: a pipeline's first, second and last stages); ``[{}]`` when all cost alike."""
    import itertools

    from ..interface.step_schedule import StepSchedule

    pm = pm if pm is not None else config.registry
    axes = (pm.hook.ultrascale_cost_schedule(config=config) or StepSchedule()).coordinates
    return [dict(zip(axes, combo)) for combo in itertools.product(*axes.values())] or [{}]


def peak_memory_gb(ests, constants: dict | None = None) -> dict:
    """GB per category of the most loaded of ``ests`` (one ``Estimate`` per rank), with the allocator's slack on
    activations and its workspaces (``CONSTANTS``), and the ``total``: their sum, or the optimizer step's memory
    when that is larger (``Estimate.total_memory``)."""
    c = {**CONSTANTS, **(constants or {})}

    def gb(est) -> dict:
        mem = {k: (0.0 if k in est.on_host else v / GB) for k, v in est.memory.items()}
        mem["activations"] *= c["fragmentation"]
        mem["other"] += c["memory_overhead_gb"]
        backward = sum(mem[k] for k in ("params", "grads", "optimizer", "activations", "other"))
        if est.on_host or est.host_bytes:  # in host memory, beside the device's categories (not in its total)
            mem["host"] = est.host_memory / GB
        # the optimizer step's peak, when it is the larger (small activations, foreach AdamW's temporary)
        mem["total"] = max(backward, est.optimizer_step_memory / GB + c["memory_overhead_gb"])
        return mem

    return max((gb(e) for e in ests), key=lambda m: m["total"])


# the short names of a --layout string (the planner's table's), beside every layout field's own name
SHORT = {"zero": "zero_stage", "recompute": "activation_checkpointing", "schedule": "pp_schedule",
         "virtual": "pp_virtual_stages", "sp": "sequence_parallel", "precision": "mixed_precision"}


def layout_from_string(text: str, world: int | None = None, registry=None) -> Layout:
    """``"dp=8,tp=1,pp=1,cp=1,zero=1,mbs=2,ga=16,recompute=none"`` (``SHORT`` names, or any layout field's own:
    dp_replicate=, dp_shard=, cp_method=, ep=8, ...) as a Layout; a field left out is at its default, and sequence
    parallelism is on with tp > 1 unless ``sp=`` says otherwise, as the search costs it. ``dp`` alone is sharded
    (ZeRO-2/3) or replicated (ZeRO-0/1) the way this engine runs it. The fields are ``registry``'s (a cost
    model's: ``cost.pm``), the process's when none is given."""
    registry = _registry_or_default(registry)
    declared = {f.name: f for f in registry.fields if f.name != "layout" and not f.name.startswith("auto_")
                and f.type in (int, float, str, bool)}
    split = ("dp", "mbs", "ga")  # the degree of data parallelism, and the planner's batch split
    values: dict = {}
    counts: dict = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or (key not in split and key not in SHORT and key not in declared):
            import difflib

            close = difflib.get_close_matches(key, [*split, *SHORT, *declared], n=1)
            hint = f"did you mean '{close[0]}'? " if sep and close else ""
            raise ConfigError(f"--layout {text!r}: {part!r} is not KEY=VALUE with KEY one of "
                              f"{', '.join([*split, *SHORT])}, or a plugin's layout field ({', '.join(declared)}). "
                              f"Fix: {hint}e.g. --layout \"dp=8,tp=1,pp=1,cp=1,zero=1,mbs=2,ga=16,recompute=none\"")
        if key in split:
            try:
                counts[key] = int(value.strip())
            except ValueError:
                raise ConfigError(f"--layout: {key}={value!r} must be int. Fix: e.g. {key}=1") from None
        else:
            values[SHORT.get(key, key)] = _field_value(declared[SHORT.get(key, key)], key, value.strip())
    dp = counts.get("dp")
    rep, shard = values.pop("dp_replicate", None), values.pop("dp_shard", None)
    if dp is not None and (rep or shard) and dp != (rep or 1) * (shard or 1):
        raise ConfigError(f"--layout: dp={dp} but dp_replicate x dp_shard = {(rep or 1) * (shard or 1)}. Fix: give "
                          "dp alone, or make it their product")
    rep = rep or 1
    shard = shard or (dp // rep if dp else 1)
    values.setdefault("sequence_parallel", values.get("tp", 1) > 1)
    lay = Layout(dp_replicate=rep, dp_shard=shard, micro_batch_size=counts.get("mbs", 1),
                 grad_accum=counts.get("ga", 1), registry=registry, **values)
    if world is not None and lay.world != world:
        raise ConfigError(f"--layout {text!r}: dp x tp x pp x cp = {lay.world}, but --gpus is {world}. Fix: make "
                          "the degrees multiply to the GPU count")
    return lay


def _field_value(field, key: str, text: str):
    """``text`` as a value of the layout ``field`` (checked as the field checks it); errors name ``key`` as
    written."""
    try:
        value = text.lower() in ("1", "true", "yes", "on") if field.type is bool else field.type(text)
    except ValueError:
        raise ConfigError(f"--layout: {key}={text!r} must be {field.type.__name__}. Fix: e.g. "
                          f"{key}={field.default}") from None
    try:
        return field.validate(value)
    except ConfigError as exc:
        raise ConfigError(f"--layout: {key}={text}: {exc}") from None


def _registry_or_default(registry):
    """``registry``, or the process's for a ``Layout``, layout string or ``CostModel`` made without one: the
    planner's edge (``ultrascale plan`` is a front end's, the validation tables are the planner's own, tests make
    ``Layout(tp=2)`` by hand); ``layout: auto`` costs through the config's own registry."""
    from ..core.registry import given_or_default

    return given_or_default(registry)
