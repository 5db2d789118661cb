"""Bounded memory on a corpus larger than it: tokenize a multi-GB JSON-lines corpus into the cache, then read
training batches from it, and report each phase's peak resident memory against the corpus size.

    python benchmarks/data_memory.py --gb 2            # writes benchmarks/results/data_memory_2gb.json

The corpus is generated (random words, documents of 50-2,000 words) in a scratch directory; the tokenizer is the
tests' tiny byte-level BPE (tests/tiny_tokenizer.py). Each phase runs in a fresh process: (1) tokenize into the
cache (``tokenized_cache.prepare``: ``datasets`` memory-maps the Arrow files), (2) a data-parallel rank's reads:
open the cache, then 200 global batches of 16 rows x 2,048 tokens at random steps across epochs, rank 0 of 8.

Two memory figures per phase: ``peak_anon_mb``, the peak over time of the anonymous memory (``Pss_Anon`` from
``/proc/PID/smaps_rollup``: heap, arrays — what a process cannot give back — with pages that forked tokenizing
processes still share with their parent counted once) summed over the process and its children, sampled every
0.1 s — the bounded-memory claim is about this one; and ``peak_rss_mb`` (``ru_maxrss``), which also
counts the pages of the memory-mapped files that were touched: page cache the kernel reclaims under pressure.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))


def write_corpus(path: Path, gb: float) -> int:
    from tiny_tokenizer import WORDS

    rng = random.Random(0)
    target, written, docs = gb * 2**30, 0, 0
    with path.open("w") as f:
        while written < target:
            line = json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(50, 2000)))}) + "\n"
            f.write(line)
            written += len(line)
            docs += 1
    return docs


def peak_mb(children: bool = False) -> float:
    own = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kids = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss if children else 0
    return max(own, kids) / 1024


class AnonPeak:
    """The peak of Pss_Anon summed over this process and its descendants, sampled in a thread."""

    def __init__(self, every: float = 0.1):
        import threading

        self.peak_kb, self.first_kb, self._stop = 0, None, threading.Event()
        self._thread = threading.Thread(target=self._run, args=(every,), daemon=True)
        self._thread.start()

    @staticmethod
    def _tree(root: int) -> list[int]:
        children: dict[int, list[int]] = {}
        for status in Path("/proc").glob("[0-9]*/stat"):
            try:
                fields = status.read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            children.setdefault(int(fields[1]), []).append(int(status.parent.name))
        out, todo = [], [root]
        while todo:
            pid = todo.pop()
            out.append(pid)
            todo += children.get(pid, [])
        return out

    def _run(self, every: float) -> None:
        while not self._stop.wait(every):
            total = 0
            for pid in self._tree(os.getpid()):
                try:
                    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
                        if line.startswith("Pss_Anon:"):
                            total += int(line.split()[1])
                except OSError:
                    pass
            self.peak_kb = max(self.peak_kb, total)
            if self.first_kb is None:  # after the imports, before the phase's work: the baseline
                self.first_kb = total

    def stop(self) -> float:
        self._stop.set()
        self._thread.join()
        return self.peak_kb / 1024


def phase_tokenize(corpus: str, model: str, cache: str, procs: int) -> dict:
    from ultrascale_plugins.data.recipe import DataSpec
    from ultrascale_plugins.data.tokenized_cache import prepare

    spec = DataSpec(dataset=corpus, seq_len=2048, cache_dir=cache, num_proc=procs)
    anon = AnonPeak()
    start = time.perf_counter()
    tok = prepare(spec, model)
    return {"seconds": time.perf_counter() - start, "samples": len(tok.lengths), "tokens": int(tok.lengths.sum()),
            "peak_anon_mb": anon.stop(), "start_anon_mb": anon.first_kb / 1024, "peak_rss_mb": peak_mb(),
            "peak_rss_children_mb": peak_mb(children=True),
            "cache_bytes": sum(p.stat().st_size for p in Path(tok.path).rglob("*") if p.is_file())}


def phase_read(corpus: str, model: str, cache: str) -> dict:
    from ultrascale_plugins.data.packed_rows import DatasetBatches
    from ultrascale_plugins.data.recipe import DataSpec
    from ultrascale_plugins.data.tokenized_cache import prepare

    spec = DataSpec(dataset=corpus, seq_len=2048, cache_dir=cache)
    anon = AnonPeak()
    start = time.perf_counter()
    data = DatasetBatches(prepare(spec, model, build=False), spec, global_batch=16, seed=0)
    opened = time.perf_counter() - start
    rng = random.Random(1)
    steps = [rng.randrange(3 * data.steps_per_epoch) for _ in range(200)]  # across three epochs
    start = time.perf_counter()
    for s in steps:
        data.local_rows(s, 0, 8)
    reads = time.perf_counter() - start
    return {"open_seconds": opened, "rows_per_epoch": data.train.rows_per_epoch,
            "mean_ms_per_rank_batch": 1000 * reads / len(steps), "peak_anon_mb": anon.stop(),
            "start_anon_mb": anon.first_kb / 1024,
            "peak_rss_mb": peak_mb()}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=2.0)
    ap.add_argument("--scratch", default="/tmp/ultrascale_data_memory")
    ap.add_argument("--procs", type=int, default=2, help="tokenizing processes")
    ap.add_argument("--retokenize", action="store_true", help="drop the cache entry first (measure tokenizing)")
    ap.add_argument("--phase", choices=["tokenize", "read"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    scratch = Path(args.scratch)
    corpus, model, cache = scratch / "corpus.jsonl", scratch / "tokenizer", scratch / "cache"
    if args.phase:  # a child: one phase, its figures as JSON on stdout
        out = phase_tokenize(str(corpus), str(model), str(cache), args.procs) if args.phase == "tokenize" \
            else phase_read(str(corpus), str(model), str(cache))
        print(json.dumps(out))
        return
    began = time.perf_counter()
    scratch.mkdir(parents=True, exist_ok=True)
    if not corpus.exists():
        write_corpus(corpus, args.gb)
    if not model.exists():
        from tiny_tokenizer import make_tokenizer

        make_tokenizer(model)
    if args.retokenize and (cache / "tokenized").exists():
        import shutil

        shutil.rmtree(cache / "tokenized")
    result = {"date": datetime.date.today().isoformat(),
              "machine": f"{platform.machine()}, {os.cpu_count()} cores, "
                         f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f} GB RAM",
              "command": f"python benchmarks/data_memory.py --gb {args.gb}", "corpus_bytes": corpus.stat().st_size}
    for phase in ("tokenize", "read"):
        proc = subprocess.run([sys.executable, __file__, "--gb", str(args.gb), "--scratch", str(scratch),
                               "--procs", str(args.procs), "--phase", phase], capture_output=True, text=True)
        if proc.returncode:
            sys.exit(proc.stderr[-3000:])
        result[phase] = json.loads(proc.stdout.strip().splitlines()[-1])
    result["total_seconds"] = time.perf_counter() - began
    out = ROOT / "benchmarks" / "results" / f"data_memory_{args.gb:g}gb.json"
    out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
