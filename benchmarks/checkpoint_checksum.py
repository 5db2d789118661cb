"""What a checkpoint's checksums cost: hashing a 1 GB shard, against writing and reading it.

Part 1, one file: a shard-sized file of random float32 bytes (``--gb``, default 1 GiB) is written and fsynced, read
back from the disk (its pages dropped from the cache first with ``posix_fadvise(DONTNEED)``) and from the page cache,
and hashed from the page cache by each candidate (SHA-256, SHA-1, MD5, BLAKE2b from hashlib; CRC-32 and Adler-32 from
zlib), plus the package's own ``file_digest`` (CRC-32) from the disk. What a save adds is a hash from the page cache
(the shard was just written); what a load's verification adds is a read from the disk and a hash, after which the
load itself finds the shard in the page cache. Each row gives wall time and this process's CPU time (user + system):
on a shared machine the wall time of a hash includes waiting for a core, its CPU time does not.

Part 2, end to end in one process: a Llama whose model and AdamW state make a ~1 GB shard (``--hidden``,
``--layers``, ``--vocab``), saved with ``save_checkpoint`` with its checksums and with hashing replaced by a no-op,
and loaded with ``load_checkpoint`` verifying and with ``ULTRASCALE_SKIP_CHECKSUMS=1``, from the page cache and
from the disk; plus the time spent summing inside a save. Times are medians of ``--repeats``, the two variants
alternating.

    python benchmarks/checkpoint_checksum.py --dir /tmp/ckpt-sum --out benchmarks/results/checkpoint_checksum_1gb.json
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import shutil
import statistics
import time
import warnings
import zlib
from pathlib import Path

import torch

CHUNK = 4 * 2**20


def drop_cache(path: Path) -> None:
    """Evict ``path``'s clean pages from the page cache (no root needed), so the next read comes from the disk."""
    for f in ([path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_through(path: Path, update=None) -> None:
    """Read ``path`` in chunks into one buffer, handing each chunk to ``update`` (a hash) if given."""
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        while n := f.readinto(buffer):
            if update is not None:
                update(view[:n])


class Crc:
    """zlib's running checksums behind hashlib's ``update``."""

    def __init__(self, fn):
        self.fn, self.value = fn, fn(b"")

    def update(self, data) -> None:
        self.value = self.fn(data, self.value)


HASHES = {"sha256": lambda: hashlib.sha256(), "sha1": lambda: hashlib.sha1(), "md5": lambda: hashlib.md5(),
          "blake2b": lambda: hashlib.blake2b(), "crc32": lambda: Crc(zlib.crc32),
          "adler32": lambda: Crc(zlib.adler32)}


def timed2(fn) -> tuple[float, float]:
    """(wall seconds, CPU seconds of this process) of ``fn()``."""
    t, c = time.perf_counter(), time.process_time()
    fn()
    return time.perf_counter() - t, time.process_time() - c


def one_file(directory: Path, nbytes: int, repeats: int) -> dict:
    from ultrascale_plugins.checkpoints.checksums import file_digest

    path = directory / "shard.bin"
    data = torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(0)).numpy().tobytes()

    def write() -> None:
        with open(path, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    def cold(fn):
        def run():
            drop_cache(path)
            return timed2(fn)
        return run

    rows: dict[str, list[tuple[float, float]]] = {}
    for _ in range(repeats):
        rows.setdefault("write + fsync", []).append(timed2(write))
        rows.setdefault("read from disk", []).append(cold(lambda: read_through(path))())
        read_through(path)  # into the page cache
        rows.setdefault("read from page cache", []).append(timed2(lambda: read_through(path)))
        for name, make in HASHES.items():
            rows.setdefault(f"{name} from page cache", []).append(
                timed2(lambda: read_through(path, make().update)))
        rows.setdefault("sha256 in memory (no read)", []).append(timed2(lambda: hashlib.sha256(data).digest()))
        rows.setdefault("crc32 in memory (no read)", []).append(timed2(lambda: zlib.crc32(data)))
        rows.setdefault("file_digest (crc32) from disk", []).append(cold(lambda: file_digest(path))())
    path.unlink()
    out = {}
    for k, v in rows.items():
        wall, cpu = statistics.median(w for w, _ in v), statistics.median(c for _, c in v)
        out[k] = {"wall_s": round(wall, 3), "cpu_s": round(cpu, 3), "gb_per_wall_s": round(nbytes / 1e9 / wall, 2),
                  "gb_per_cpu_s": round(nbytes / 1e9 / cpu, 2)}
    return out


def end_to_end(directory: Path, args) -> dict:
    import ultrascale_plugins as us
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ultrascale_plugins.checkpoints.sharded import load_checkpoint, save_checkpoint
    from ultrascale_plugins.checkpoints import checksums

    us.init_distributed(timeout=1800)
    cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 11 // 4,
                      num_hidden_layers=args.layers, num_attention_heads=16, num_key_value_heads=16,
                      tie_word_embeddings=False)
    torch.manual_seed(0)
    pmodel = us.parallelize(AutoModelForCausalLM.from_config(cfg), us.ParallelConfig())
    opt = pmodel.build_optimizer(torch.optim.AdamW, lr=1e-4)
    pmodel.train_step({"input_ids": torch.randint(0, args.vocab, (1, 16))})
    opt.step()
    opt.zero_grad()
    n_params = sum(p.numel() for p in pmodel.parameters())
    real, hashing_s = checksums.file_digest, []

    def counted(path):  # the package's own summing, its time added up per save
        t = time.perf_counter()
        digest = real(path)
        hashing_s[-1] += time.perf_counter() - t
        return digest

    rows: dict[str, list[tuple[float, float]]] = {}
    for i in range(args.repeats):  # the saves: the two variants alternating, which goes first too
        for hashing in ((False, True), (True, False))[i % 2]:
            if hashing:
                hashing_s.append(0.0)
            checksums.file_digest = counted if hashing else (lambda path: "-")  # the same save, nothing summed
            label, name = ("save with checksums", "summed") if hashing else ("save, no checksums", "plain")
            rows.setdefault(label, []).append(
                timed2(lambda: save_checkpoint(pmodel, opt, directory / name, step=i, keep_last_n=1)))
    checksums.file_digest = real
    for i in range(args.repeats):  # the loads of the last checkpoint with checksums, verified or not
        for where in ("page cache", "disk"):
            for skip in (("1", ""), ("", "1"))[i % 2]:
                if where == "disk":
                    drop_cache(directory / "summed")
                os.environ[checksums.SKIP_ENV] = skip
                label = f"load from {where}, " + ("not verified" if skip else "verified")
                rows.setdefault(label, []).append(timed2(lambda: load_checkpoint(pmodel, opt,
                                                                                 directory=directory / "summed")))
    os.environ.pop(checksums.SKIP_ENV, None)
    ckpt = (directory / "summed").glob("step-*")
    shard_bytes = sum(f.stat().st_size for c in ckpt for f in c.glob("*.distcp"))
    return {"params_millions": round(n_params / 1e6, 1), "shard_bytes": shard_bytes,
            "summing_inside_a_save_s": round(statistics.median(hashing_s), 3),
            "rows": {k: {"wall_s": round(statistics.median(w for w, _ in v), 3),
                         "cpu_s": round(statistics.median(c for _, c in v), 3),
                         "wall_s_each": [round(w, 3) for w, _ in v]} for k, v in rows.items()}}


def machine() -> str:
    model = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
                 platform.processor())
    flags = next((line for line in open("/proc/cpuinfo") if line.startswith("flags")), "")
    sha = "SHA extensions" if " sha_ni" in flags else "no SHA extensions"
    return f"{platform.machine()} ({model}, {sha}), {os.cpu_count()} cores, torch {torch.__version__}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/ultrascale-checksum-bench")
    ap.add_argument("--gb", type=float, default=1.0, help="the file of part 1, in GiB")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=16000)
    ap.add_argument("--skip-end-to-end", action="store_true")
    ap.add_argument("--out")
    args = ap.parse_args()
    warnings.filterwarnings("ignore")
    directory = Path(args.dir)
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    result = {"date": time.strftime("%Y-%m-%d"), "machine": machine(),
              "command": "python benchmarks/checkpoint_checksum.py " + " ".join(
                  f"--{k.replace('_', '-')}" + ("" if v is True else f" {v}") for k, v in vars(args).items()
                  if v not in (None, False)),
              "file_bytes": int(args.gb * 2**30), "load_average_at_start": round(os.getloadavg()[0], 1)}
    result["one_file"] = one_file(directory, result["file_bytes"], args.repeats)
    print(json.dumps(result, indent=1), flush=True)
    if not args.skip_end_to_end:
        result["end_to_end"] = end_to_end(directory, args)
        print(json.dumps(result["end_to_end"], indent=1), flush=True)
    shutil.rmtree(directory, ignore_errors=True)
    result["load_average_at_end"] = round(os.getloadavg()[0], 1)  # other processes sharing the cores
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
