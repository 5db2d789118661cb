"""``ultrascale plan --dry-run`` without ``--layout``: the search's first candidates, each run once on fake tensors.

The planner ranks layouts by arithmetic; this checks its first ``--dry-run-top`` runnable candidates against the
package's real step at full size (``us.dry_run``): for each, the planner's live bytes beside the dry run's peak
(the largest over the rank roles it traces) and where that peak falls. A candidate the dry run does not run is
listed with the one-line reason, not skipped.
"""
from __future__ import annotations

MB = 2 ** 20


def check_candidates(cost, results, gpus: int, seq_len: int, top: int, routing: str = "uniform") -> list[dict]:
    """One row per candidate among the first ``top`` runnable ``results``: the layout, the planner's total
    (before the allocator's constants), the dry run's peak (the largest over its rank roles), the difference,
    where, seconds; or the refusal. ``routing``: the assumption an expert-parallel candidate runs under."""
    from ..core.dry_run import dry_run, refusal

    rows = []
    for result in [r for r in results if r.runnable][:top]:
        lay = result.layout.replace(mixed_precision=cost.work.precision)
        config = lay.config()
        row = {"layout": lay.label()}
        reason = refusal(config)
        if reason:
            rows.append({**row, "not_run": reason})
            continue
        report = dry_run(cost.spec.config, config, world_size=gpus, seq_len=seq_len,
                         micro_batch_size=lay.micro_batch_size, grad_accum=lay.grad_accum, routing=routing)
        totals = [(next(x for x in role.rows() if x["what"] == "memory total"), role) for role in report.roles]
        total, role = max(totals, key=lambda item: item[0]["dry_run"])
        rows.append({**row, "estimate_bytes": total["estimate"], "dry_run_bytes": total["dry_run"],
                     "diff_pct": total["diff_pct"], "role": role.role, "peak_where": role.peak_where,
                     "seconds": round(report.seconds, 1)})
    return rows


def table(rows: list[dict]) -> str:
    """The candidates' rows as the plan prints them (``--json`` carries the rows themselves)."""
    lines = ["dry run of the first candidates (fake tensors; the estimate before the allocator's constants):",
             f"  {'#':>2} {'estimate MB':>12} {'dry run MB':>12} {'diff':>8} {'s':>6}  layout, where the peak falls"]
    for i, row in enumerate(rows, 1):
        if "not_run" in row:
            lines.append(f"  {i:>2} {'':>12} {'':>12} {'':>8} {'':>6}  {row['layout']}: not run: {row['not_run']}")
            continue
        diff = "" if row["diff_pct"] is None else f"{row['diff_pct']:+.1f} %"
        lines.append(f"  {i:>2} {row['estimate_bytes'] / MB:12.0f} {row['dry_run_bytes'] / MB:12.0f} {diff:>8} "
                     f"{row['seconds']:6.1f}  {row['layout']}; {row['role']}: {row['peak_where']}")
    return "\n".join(lines)
