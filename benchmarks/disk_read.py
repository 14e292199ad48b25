"""Where a restore's read time goes: a prefix-cache-sized safetensors file (an 8B model's
KV at `--tokens`, bfloat16) read back by each way in turn, from the page cache and cold,
each way's GB/s: MLX's loader from a file object (the disk tier's way) and from a path,
the CRC-32 over the loaded arrays, a plain read into host memory, the CRC-32 over host
bytes (one thread, and per tensor over threads), and host bytes to device arrays.

    .venv/bin/python benchmarks/disk_read.py --tokens 4096
    python benchmarks/disk_read.py --tokens 32768                      # H200
"""

import argparse
import os
import tempfile
import time
import zlib
from concurrent.futures import ThreadPoolExecutor

import specprefill_engine  # noqa: F401  (optimized BLAS before MLX)
import mlx.core as mx
import numpy as np

LAYERS, KV_HEADS, HEAD_DIM = 36, 8, 128  # Qwen3-8B


def drop(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tokens", type=int, default=4096)
    args = parser.parse_args()
    shape = (1, KV_HEADS, args.tokens, HEAD_DIM)
    arrays = {f"kv.{i}.{n}": mx.random.normal(shape).astype(mx.bfloat16)
              for i in range(LAYERS) for n in "kv"}
    mx.eval(arrays)
    path = os.path.join(tempfile.mkdtemp(prefix="specprefill-read-"), "kv.safetensors")
    mx.save_safetensors(path, arrays)
    del arrays
    size = os.path.getsize(path)
    print(f"device {mx.default_device()}, file {size / 1e9:.2f} GB, {os.cpu_count()} cores")

    def timed(name, fn, cold=False):
        if cold:
            drop(path)
        started = time.perf_counter()
        out = fn()
        seconds = time.perf_counter() - started
        print(f"  {name}{' (cold)' if cold else ''}: {seconds:.3f} s, {size / 1e9 / seconds:.2f} GB/s",
              flush=True)
        return out

    def load_file():
        with open(path, "rb") as f:
            loaded = mx.load(f, format="safetensors")
            mx.eval(loaded)
        return loaded

    def load_path():
        loaded = mx.load(path)
        mx.eval(loaded)
        return loaded

    def read_host():
        buffer = np.empty(size, dtype=np.uint8)
        with open(path, "rb", buffering=0) as f:
            view, done = memoryview(buffer), 0
            while done < size:
                done += f.readinto(view[done:done + (64 << 20)])
        return buffer

    for cold in (False, True):
        loaded = timed("mx.load(file object) + eval", load_file, cold)
        timed("CRC-32 over the loaded arrays", lambda: [zlib.crc32(memoryview(a)) for a in loaded.values()])
        del loaded
        loaded = timed("mx.load(path) + eval", load_path, cold)
        del loaded
        host = timed("read into host memory", read_host, cold)
        timed("CRC-32 over host bytes, one thread", lambda: zlib.crc32(host))
        pieces = np.array_split(host, LAYERS * 2)
        with ThreadPoolExecutor(min(8, os.cpu_count())) as pool:
            timed("CRC-32 per tensor, threads", lambda: list(pool.map(zlib.crc32, pieces)))
        timed("host bytes to device arrays", lambda: mx.eval(
            [mx.array(p[: p.size // 2 * 2].view(np.uint16)).view(mx.bfloat16) for p in pieces]))
        del host, pieces
    os.remove(path)


if __name__ == "__main__":
    main()
