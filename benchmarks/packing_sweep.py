"""Which causal-LM model types keep packed samples apart: every model type of the installed transformers, measured.

    python benchmarks/packing_sweep.py                   # every type (rewrites both result files)
    python benchmarks/packing_sweep.py --types llama gpt2  # some types (merged into the files of this version)

``data.packing: true`` lays samples end to end in rows with ``position_ids`` restarting at 0 at each sample and no
attention mask; transformers then derives per-sample masks from the position_ids
(``masking_utils.find_packed_sequence_indices``), but only for models that build their masks there and take
position_ids. This sweep measures it instead of trusting it: each type's tiny model (benchmarks/compat/tiny.py,
fp32, eval mode) runs one packed row of three samples (lengths 7, 5, 9: ``input_ids``, ``position_ids`` 0..6, 0..4,
0..8, ``use_cache=False``, no attention mask) and each sample alone (``input_ids``, ``use_cache=False``); the logits
of every token are compared. Verdict per attention implementation (the default, sdpa where the model supports it,
and eager) and per type:

    apart       every implementation gives each packed token the logits of its sample alone
    crosses     some implementation lets packed samples see each other (logits differ)
    error       a forward raised (the first line is recorded), or the model is not deterministic
    untinyable  tiny.py cannot build the type small (reason recorded)

A type is ``apart`` only when it is apart under every implementation it supports. Flash / flex attention are not
measured (no GPU here); they take the same position_ids path in transformers.

Writes benchmarks/results/packing_by_model_type.json (details) and ultrascale_plugins/resources/packing_support.json
(the verdicts shipped with the package, read by ``ultrascale_plugins.data.packing_support``). The script prints its
own duration.
"""
from __future__ import annotations

import argparse
import datetime
import json
import platform
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

RESULTS = ROOT / "benchmarks" / "results" / "packing_by_model_type.json"
SHIPPED = ROOT / "ultrascale_plugins" / "resources" / "packing_support.json"
LENGTHS = (7, 5, 9)
TOL = 1e-4  # relative to the scale of the logits (max |logit| of the samples alone, at least 1)
VERDICTS = ("apart", "crosses", "error", "untinyable")


def _line(exc: BaseException) -> str:
    text = (str(exc).strip().splitlines() or [""])[0][:200]
    return f"{type(exc).__name__}: {text}"


def _logits(model, **inputs):
    import torch

    with torch.no_grad():
        out = model(**inputs, use_cache=False)
    logits = out.logits if hasattr(out, "logits") else out[0]
    return logits.float()


def compare_impl(model, samples) -> dict:
    """One attention implementation (already set on ``model``): {"result", "detail", "max_diff"}."""
    import torch

    ids = torch.cat(samples).unsqueeze(0)
    pos = torch.cat([torch.arange(len(s)) for s in samples]).unsqueeze(0)
    try:
        alone = [_logits(model, input_ids=s.unsqueeze(0))[0] for s in samples]
        again = _logits(model, input_ids=samples[0].unsqueeze(0))[0]
    except Exception as exc:  # noqa: BLE001 - the failure is the result
        return {"result": "error", "detail": f"forward of one sample alone raised {_line(exc)}", "max_diff": None}
    if not torch.equal(alone[0], again):
        return {"result": "error", "detail": "the forward is not deterministic (same input, different logits), so "
                "packing cannot be measured", "max_diff": float((alone[0] - again).abs().max())}
    try:
        packed = _logits(model, input_ids=ids, position_ids=pos)[0]
    except Exception as exc:  # noqa: BLE001
        return {"result": "error", "detail": f"packed forward (position_ids, no mask) raised {_line(exc)}",
                "max_diff": None}
    reference = torch.cat(alone)
    if packed.shape != reference.shape:
        return {"result": "error", "detail": f"packed logits have shape {tuple(packed.shape)}, the samples alone "
                f"{tuple(reference.shape)}", "max_diff": None}
    scale = max(float(reference.abs().max()), 1e-6)
    tol = TOL * scale
    if not torch.isfinite(packed).all() or not torch.isfinite(reference).all():
        return {"result": "error", "detail": "non-finite logits", "max_diff": None}
    diffs = (packed - reference).abs().reshape(len(reference), -1).amax(-1)
    starts = [0]
    for s in samples[:-1]:
        starts.append(starts[-1] + len(s))
    per_sample = ", ".join(f"{float(diffs[a:a + len(s)].max()):.2g}" for a, s in zip(starts, samples))
    max_diff = float(diffs.max())
    # Control: the same row without position_ids (one long sample). The later samples then do see the earlier
    # ones, so their logits must move by far more than the tolerance, or the comparison could not see a crossing.
    try:
        control = _logits(model, input_ids=ids)[0]
        control_diff = float((control - reference).abs()[len(samples[0]):].max())
    except Exception:  # noqa: BLE001 - the control is only a sensitivity check
        control_diff = None
    moved = "n/a" if control_diff is None else f"{control_diff:.2g}"
    if max_diff <= tol:
        if control_diff is not None and control_diff <= 10 * tol:
            return {"result": "error", "detail": f"inconclusive: the row read as one sample moves the later samples' "
                    f"logits by only {control_diff:.2g} (tolerance {tol:.2g})", "max_diff": max_diff}
        return {"result": "apart", "detail": f"every packed token equals its sample alone: max |logit diff| "
                f"{max_diff:.2g} <= {tol:.2g} (1e-4 x max |logit|); the row as one sample moves them by "
                f"{moved}", "max_diff": max_diff}
    return {"result": "crosses", "detail": f"packed samples see each other: max |logit diff| per sample {per_sample} "
            f"(tolerance {tol:.2g}; the row as one sample: {moved})",
            "max_diff": max_diff}


def _impls(model, samples) -> dict:
    """{implementation: comparison} for the default implementation (sdpa where supported) and eager."""
    impls = []
    try:  # the default implementation: sdpa where the model supports it
        model.set_attn_implementation("sdpa")
        impls.append("sdpa")
    except Exception:  # noqa: BLE001 - no sdpa: eager is the default
        pass
    impls.append("eager")
    results = {}
    for impl in impls:
        if impl != "sdpa":
            try:
                model.set_attn_implementation(impl)
            except Exception as exc:  # noqa: BLE001
                results[impl] = {"result": "error", "detail": f"set_attn_implementation raised {_line(exc)}",
                                 "max_diff": None}
                continue
        results[impl] = compare_impl(model, samples)
    return results


def layer_variants(model_type: str) -> list[list[str]]:
    """Extra ``layer_types`` to measure: the tiny config keeps only the first layers' kinds, and a default config
    may use fewer kinds than the checkpoints (lfm2's default has no conv layers, its checkpoints do). One variant
    with every kind of the default config when the tiny one lacks some, and one per layer kind (of
    transformers' ``ALLOWED_LAYER_TYPES``, MLP kinds aside) that the type's config or modeling source names but
    its default config does not use."""
    import inspect

    from compat.tiny import default_config, tiny_config
    from transformers import configuration_utils as cu

    tiny = tiny_config(model_type)
    layer_types = getattr(tiny, "layer_types", None)
    if not layer_types or not isinstance(layer_types, (list, tuple)):
        return []
    n = len(layer_types)
    full = default_config(model_type)
    full = full if type(full) is type(tiny) else next(
        (getattr(full, a) for a in ("text_config", "language_config", "llm_config", "decoder")
         if type(getattr(full, a, None)) is type(tiny)), full)
    full_kinds = list(dict.fromkeys(getattr(full, "layer_types", None) or layer_types))
    variants = []
    if set(full_kinds) - set(layer_types):
        variants.append([full_kinds[i % len(full_kinds)] for i in range(n)])
    source = ""
    for module_name in {type(tiny).__module__, type(tiny).__module__.replace("configuration_", "modeling_")}:
        try:
            source += inspect.getsource(sys.modules.get(module_name) or __import__(module_name, fromlist=["_"]))
        except Exception:  # noqa: BLE001
            pass
    mlp = set(getattr(cu, "ALLOWED_MLP_LAYER_TYPES", ()))
    for kind in getattr(cu, "ALLOWED_LAYER_TYPES", ()):
        if kind in full_kinds or kind in mlp or (f'"{kind}"' not in source and f"'{kind}'" not in source):
            continue
        pattern = [kind] + full_kinds
        variants.append([pattern[i % len(pattern)] for i in range(n)])
    return variants


SLIDING = {"sliding_window": 4, "use_sliding_window": True}  # shorter than the samples: windows inside them too


def _sliding_window(model_type: str):
    from compat.tiny import tiny_config

    return getattr(tiny_config(model_type), "sliding_window", None)


def _has(model_type: str, name: str) -> bool:
    from compat.tiny import tiny_config

    return hasattr(tiny_config(model_type), name)


def measure(model_type: str, seed: int = 0) -> dict:
    """The verdict of one model type: {"result", "detail", "max_diff", "impls": {impl: {...}}}; the implementations
    of ``layer_variants`` are keyed ``impl[layer_types=...]``."""
    import torch
    import transformers
    from compat.tiny import VOCAB, Untinyable, build_model

    transformers.logging.set_verbosity_error()
    warnings.filterwarnings("ignore")
    try:
        model = build_model(model_type, seed=seed)  # eager attention, fp32
    except Untinyable as exc:
        return {"result": "untinyable", "detail": str(exc), "max_diff": None, "impls": {}}
    except Exception as exc:  # noqa: BLE001
        return {"result": "untinyable", "detail": f"build fails: {_line(exc)}", "max_diff": None, "impls": {}}
    model.eval()
    embed = model.get_input_embeddings()
    vocab = min(VOCAB, int(embed.num_embeddings)) if embed is not None else VOCAB
    g = torch.Generator().manual_seed(seed)
    samples = [torch.randint(3, vocab, (n,), generator=g) for n in LENGTHS]  # ids 0-2 are pad/bos/eos
    results = _impls(model, samples)
    del model
    skipped = []
    try:
        variants = layer_variants(model_type)
    except Exception as exc:  # noqa: BLE001
        variants, skipped = [], [f"layer variants: {_line(exc)}"]
    for layer_types in variants:
        label = f"[layer_types={','.join(layer_types)}]"
        overrides = {"layer_types": list(layer_types)}
        if any("sliding" in kind for kind in layer_types) and not _sliding_window(model_type):
            # a config without sliding layers may carry no window (qwen2: None, qwen2_moe: 0)
            overrides.update({k: v for k, v in SLIDING.items() if k == "sliding_window" or _has(model_type, k)})
            label = label[:-1] + f",sliding_window={SLIDING['sliding_window']}]"
        try:
            model = build_model(model_type, seed=seed, overrides=overrides).eval()
        except Exception as exc:  # noqa: BLE001 - a kind the type does not take: nothing to measure
            skipped.append(f"{label} does not build ({_line(exc)[:80]})")
            continue
        variant = _impls(model, samples)
        del model
        if any(r["detail"].startswith("forward of one sample alone raised") for r in variant.values()):
            skipped.append(f"{label} does not run alone")
            continue
        results.update({impl + label: r for impl, r in variant.items()})
    note = f" (skipped: {'; '.join(skipped)})" if skipped else ""
    for verdict in ("crosses", "error", "apart"):
        bad = [impl for impl, r in results.items() if r["result"] == verdict]
        if bad:
            first = results[bad[0]]
            diffs = [r["max_diff"] for r in results.values() if r["max_diff"] is not None]
            return {"result": verdict, "detail": f"{' '.join(bad)}: {first['detail']}{note}",
                    "max_diff": max(diffs) if diffs else None, "impls": results}
    raise AssertionError(results)


def versions() -> dict:
    import torch
    import transformers

    return {"transformers": transformers.__version__, "torch": torch.__version__}


def main(argv=None) -> int:
    from compat.tiny import causal_lm_types

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--types", nargs="*", help="model types to run (default: every causal-LM type)")
    args = parser.parse_args(argv)
    start = time.time()
    ver = versions()
    every = causal_lm_types()
    if args.types:
        unknown = [t for t in args.types if t not in every]
        if unknown:
            print(f"not causal-LM model types of transformers {ver['transformers']}: {', '.join(unknown)}")
            return 2
    types = args.types or sorted(every)
    old = json.loads(RESULTS.read_text()) if RESULTS.exists() else {}
    merged = dict(old.get("types", {})) if args.types and old.get("transformers") == ver["transformers"] else {}
    if args.types and old and old.get("transformers") != ver["transformers"]:
        print(f"results of transformers {old.get('transformers')} are dropped: run the whole sweep for "
              f"{ver['transformers']}")
    for i, model_type in enumerate(types, 1):
        t0 = time.time()
        r = measure(model_type)
        merged[model_type] = r
        print(f"[{i}/{len(types)}] {model_type:28s} {r['result']:10s} {time.time() - t0:5.1f}s  {r['detail'][:110]}",
              flush=True)
    merged = dict(sorted(merged.items()))
    command = "python benchmarks/packing_sweep.py" + (" --types " + " ".join(args.types) if args.types else "")
    report = {**ver, "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": f"{platform.node()} {platform.machine()} {platform.processor() or ''} CPU".replace("  ", " "),
              "command": command, "tolerance": f"max |logit diff| <= {TOL} x max |logit| of the samples alone",
              "lengths": list(LENGTHS), "types": merged}
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(report, indent=1) + "\n")
    shipped = {"transformers": ver["transformers"]}
    for verdict in VERDICTS:
        shipped[verdict] = sorted(t for t, r in merged.items() if r["result"] == verdict)
    SHIPPED.write_text(json.dumps(shipped, indent=1) + "\n")
    counts = ", ".join(f"{v} {len(shipped[v])}" for v in VERDICTS)
    print(f"{len(merged)} types: {counts}")
    print(f"wrote {RESULTS.relative_to(ROOT)} and {SHIPPED.relative_to(ROOT)}")
    print(f"duration {time.time() - start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
