"""The prefix caches' disk tier: entries kept across processes, within a byte budget.

A conversation outlives its process (`chat` closed and reopened, a server restarted to
change a flag, a laptop asleep): the memory tier's index (`prefix_cache.py`) names the
entries worth keeping (a turn's last store, an entry about to be evicted), which the
executor writes here from its tensors (`kv_store.py`), and on a miss looks here for one
that reaches further, which the executor reads back.

Files. One safetensors file per entry, in `<cache_dir>/prefix-cache/<model>/`, where
<model> hashes the model's identity (its folder, config, weight files' names, sizes
and times, tokenizer files, the dtype it runs in), so another model never reads them.
A file holds the entry's tokens and positions, each plain layer's keys and values
(8- or 4-bit with `bits`, else as computed; as held where `kv_bits` quantized them in
memory) and each checkpoint's state of the other
layers (as mlx-lm's `state` gives it), with CRC-32s of the header and of each tensor (a
reader checks the tensors on several threads: one CRC pass over a 32K-token conversation
of an 8B model would take longer than the read itself). It
is written under a temporary name, flushed to the disk and renamed into place, so a
reader sees a whole file or none; a file whose checksum or layout does not match (torn
by a crash, damaged) is ignored and removed. Processes may share the folder: a name
stands for the content (model, tokens, positions, checkpoint lengths, bits), renames
are atomic, and a file removed while another process reads it stays readable to that
reader.

Writes run on a writer thread: the worker hands it evaluated arrays and goes on; the
arrays are let go on the worker once written. The budget holds for the whole folder
(every model's files), least recently used out (a read touches a file's time). A
write that fails (a full disk, a read-only folder) turns the tier off with one warning:
the caches go on in memory.

Reads run on the worker when a plan says so, and only when they pay: the file's
size over the measured read rate (this process's reads, else the last process's, else
the measured write rate) against the predicted prefill of what the file adds.
"""

import hashlib
import importlib
import json
import logging
import os
import queue
import struct
import threading
import time
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import mlx.core as mx
import numpy as np

from ..core.quantized_kv import is_quantized
from .kv_store import Held, Snapshot, tree_nbytes
from .prefix_cache import Entry, extends

logger = logging.getLogger(__name__)
FORMAT = 2  # part of the model's folder name: another format is never read
FOLDER = "prefix-cache"
SUFFIX = ".safetensors"
QUANT_GROUP = 32  # KV quantized in groups of 32 along the head dimension
DEFAULT_READ_RATE = 200e6  # bytes/s assumed before any read or write was measured
STALE_S = 600.0  # a temporary file this old was left by a writer that died
MAX_PENDING = 4 << 30  # bytes of queued writes held (one entry always); past it one waits
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "tokenizer.model", "vocab.json", "merges.txt", "chat_template.jinja",
                   "chat_template.json", "config.json", "generation_config.json")
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".npz", ".bin")
_DTYPES = {mx.float32: "F32", mx.float16: "F16", mx.bfloat16: "BF16", mx.float64: "F64",
           mx.int8: "I8", mx.int16: "I16", mx.int32: "I32", mx.int64: "I64", mx.uint8: "U8",
           mx.uint16: "U16", mx.uint32: "U32", mx.uint64: "U64", mx.bool_: "BOOL"}
_NUMPY_DTYPES = {np.dtype(np.int32): "I32", np.dtype(np.int64): "I64"}
_SIZES = {"F32": 4, "F16": 2, "BF16": 2, "F64": 8, "I8": 1, "I16": 2, "I32": 4, "I64": 8,
          "U8": 1, "U16": 2, "U32": 4, "U64": 8, "BOOL": 1}
_CHECKSUM = b'"checksum":"'
_CRC_WIDTH = 8  # hex digits per CRC-32 in the header's checksum: the header's, then each tensor's
_CHECK_THREADS = 8


class BrokenFile(ValueError):
    """A file whose layout or checksum does not match what was written."""


def _local_folder(path: str) -> Path:
    folder = Path(path)
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download  # a hub id mlx-lm has downloaded

    return Path(snapshot_download(path, local_files_only=True))


def model_identity(path: str, dtype) -> str:
    """What names a model's files: its folder, its config and tokenizer files (their
    bytes), its weight files (names, sizes, modification times) and the dtype it runs
    in. Weights are not hashed (gigabytes); a file rewritten in place changes its time."""
    folder = _local_folder(path)
    parts: list = [FORMAT, str(folder.resolve()), str(dtype)]
    for file in sorted(folder.iterdir()):
        if file.name in TOKENIZER_FILES:
            parts.append([file.name, hashlib.sha1(file.read_bytes()).hexdigest()])
        elif file.suffix in WEIGHT_SUFFIXES:
            stat = file.stat()
            parts.append([file.name, stat.st_size, stat.st_mtime_ns])
    return hashlib.sha1(json.dumps(parts).encode()).hexdigest()[:20]


@dataclass
class DiskStats:
    """What the disk tier has done in this process (`Engine.stats()["disk"]`)."""

    written: int = 0  # files written
    written_bytes: int = 0
    write_seconds: float = 0.0
    reads: int = 0  # files read back into memory
    read_bytes: int = 0
    read_seconds: float = 0.0
    recomputed: int = 0  # files not read: prefilling what they add was predicted faster
    broken: int = 0  # files ignored and removed: their layout or checksum did not match
    evicted: int = 0  # files removed to keep the budget
    predicted_read_s: float = 0.0  # the last decision: the file's size over the read rate
    predicted_prefill_s: float = 0.0  # ... against the prefill of what it adds
    off: str = ""  # why the tier is off ("" while it works)

    @property
    def read_rate(self) -> float:
        """Bytes per second of this process's reads (0 before the first)."""
        return self.read_bytes / self.read_seconds if self.read_seconds > 0 else 0.0


# a cache state as JSON and named arrays ----------------------------------------------

def _encode(tree, name: str, arrays: dict):
    if isinstance(tree, mx.array):
        arrays[name] = tree
        return {"a": name}
    if isinstance(tree, (list, tuple)):
        items = [_encode(item, f"{name}.{i}", arrays) for i, item in enumerate(tree)]
        return {"t": items} if isinstance(tree, tuple) else items
    if isinstance(tree, dict) and all(isinstance(k, str) for k in tree):
        return {"d": {k: _encode(v, f"{name}.{k}", arrays) for k, v in tree.items()}}
    if tree is None or isinstance(tree, (bool, int, float, str)):
        return {"v": tree}
    raise TypeError(f"a cache state holding {type(tree).__name__} cannot be stored")


def _decode(tree, arrays: dict):
    if isinstance(tree, list):
        return [_decode(item, arrays) for item in tree]
    if "a" in tree:
        return arrays[tree["a"]]
    if "t" in tree:
        return tuple(_decode(item, arrays) for item in tree["t"])
    if "d" in tree:
        return {k: _decode(v, arrays) for k, v in tree["d"].items()}
    return tree["v"]


def _class_name(kind) -> str:
    return f"{kind.__module__}:{kind.__qualname__}"


def _cache_class(name: str):
    """A cache class by name, only from the packages that define model caches."""
    module, _, qualname = name.partition(":")
    if not module.startswith(("mlx_lm.", "mlx_vlm.", "specprefill_engine.")):
        raise BrokenFile(f"cache class {name!r} is not a model cache")
    kind = importlib.import_module(module)
    for part in qualname.split("."):
        kind = getattr(kind, part)
    if not hasattr(kind, "from_state"):
        raise BrokenFile(f"cache class {name!r} cannot be rebuilt from its state")
    return kind


def quantized(x: mx.array, bits: int) -> tuple:
    """`x` as mx.quantize stores it (weights, scales, biases), in groups along its
    last axis; lazy."""
    return mx.quantize(x, group_size=QUANT_GROUP, bits=bits)


def dequantized(parts: tuple, bits: int) -> mx.array:
    return mx.dequantize(*parts, group_size=QUANT_GROUP, bits=bits)


def _tensors(entry: Entry, held: Held, bits: int) -> tuple[list, dict]:
    """The entry (its index entry and tensors) as (name, array) pairs, lazy, and the
    metadata that rebuilds it."""
    tensors = [("tokens", entry.tokens.astype(np.int32))]
    if entry.positions is not None:
        tensors.append(("positions", entry.positions.astype(np.int64)))
    layers = []
    for i, layer in enumerate(held.kv):
        if layer is None:
            layers.append("state")
            continue
        if is_quantized(layer):  # quantized in memory (kv_bits): written as it is held
            keys, values, group_size, kv_bits = layer
            layers.append(f"q{kv_bits}g{group_size}")
            for name, parts in zip("kv", (keys, values)):
                tensors += [(f"kv.{i}.{name}", parts[0]), (f"kv.{i}.{name}.scales", parts[1]),
                            (f"kv.{i}.{name}.biases", parts[2])]
            continue
        quantize = bits and layer[0].shape[-1] % QUANT_GROUP == 0 and \
            mx.issubdtype(layer[0].dtype, mx.floating)
        layers.append(f"kv{bits}" if quantize else "kv")
        for name, x in zip("kv", layer):
            if quantize:
                w, scales, biases = quantized(x, bits)
                tensors += [(f"kv.{i}.{name}", w), (f"kv.{i}.{name}.scales", scales),
                            (f"kv.{i}.{name}.biases", biases)]
            else:
                tensors.append((f"kv.{i}.{name}", x))
    checkpoints = {}
    for length, snap in held.checkpoints.items():
        arrays: dict = {}
        states = {str(i): {"class": _class_name(kind),
                           "state": _encode(state, f"cp.{length}.{i}", arrays)}
                  for i, (kind, state) in snap.layers.items()}
        checkpoints[str(length)] = {"fed": snap.fed, "layers": states}
        tensors += list(arrays.items())
    meta = {"layers": layers, "checkpoints": checkpoints, "keep": entry.keep,
            "prompt": entry.prompt,
            "densified": entry.densified, "nbytes": held.nbytes}
    return tensors, meta


def file_name(identity: str, entry: Entry, bits: int) -> str:
    """Names the content: another process storing the same entry writes the same name."""
    digest = hashlib.sha1(f"{identity}:{bits}:{sorted(entry.checkpoints)}".encode())
    digest.update(entry.tokens.astype(np.int32).tobytes())
    if entry.positions is not None:
        digest.update(b"positions" + entry.positions.astype(np.int64).tobytes())
    return digest.hexdigest()[:32] + SUFFIX


def _no_checksum(tensors: int) -> str:
    return "0" * _CRC_WIDTH * (tensors + 1)


def _header(tensors: list, meta: dict) -> bytes:
    """The safetensors header of (name, dtype name, array) tensors, its length prefix
    included, with a zero checksum."""
    spec, offset = {}, 0
    for name, dtype, x in tensors:
        size = int(np.prod(x.shape, dtype=np.int64)) * _SIZES[dtype]
        spec[name] = {"dtype": dtype, "shape": list(x.shape), "data_offsets": [offset, offset + size]}
        offset += size
    spec["__metadata__"] = {"specprefill": json.dumps(meta, separators=(",", ":")),
                            "checksum": _no_checksum(len(tensors))}
    text = json.dumps(spec, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text


def _read_header(f) -> tuple[bytes, dict, int]:
    """(the raw header with its length prefix, the parsed header, the data's size)."""
    prefix = f.read(8)
    if len(prefix) < 8:
        raise BrokenFile("shorter than a header")
    (length,) = struct.unpack("<Q", prefix)
    if length > 1 << 28:
        raise BrokenFile("a header longer than any this tier writes")
    text = f.read(length)
    if len(text) < length:
        raise BrokenFile("the header is cut")
    try:
        header = json.loads(text)
    except ValueError as error:
        raise BrokenFile(f"the header is not JSON ({error})") from None
    end = 0
    for name, spec in header.items():
        if name == "__metadata__":
            continue
        start, stop = spec["data_offsets"]
        if start != end or stop - start != int(np.prod(spec["shape"], dtype=np.int64)) * \
                _SIZES[spec["dtype"]]:
            raise BrokenFile(f"tensor {name!r} does not lie where its shape says")
        end = stop
    return prefix + text, header, end


def _header_crc(raw_header: bytes, tensors: int) -> int:
    """CRC-32 of the header as written, with a zero checksum."""
    at = raw_header.index(_CHECKSUM) + len(_CHECKSUM)
    end = at + _CRC_WIDTH * (tensors + 1)
    return zlib.crc32(raw_header[:at] + _no_checksum(tensors).encode() + raw_header[end:])


def _checksum(crcs) -> str:
    return "".join(f"{crc:08x}" for crc in crcs)


@dataclass(eq=False)
class _Job:
    path: Path
    tensors: list
    meta: dict
    nbytes: int  # the file's size
    supersedes: list  # files this one makes redundant, removed once it is in place
    seq: int = 0


class DiskCache:
    """The folder shared by every model's tier, its budget, writer thread and rates."""

    def __init__(self, root: Path, max_bytes: int, bits: int = 0):
        self.root = Path(root)
        self.max_bytes = max_bytes
        self.bits = bits
        self.stats = DiskStats()
        self.saved_rates = self._load_rates()
        self._lock = threading.Lock()
        self._queue: "queue.Queue" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._pending: list = []  # jobs the worker holds until the writer lets them go
        self._seq = 0
        self._released = 0  # jobs the writer has let go of, in order
        self._warned: set = set()

    @property
    def off(self) -> bool:
        return bool(self.stats.off)

    def tier(self, identity: str) -> "DiskTier":
        return DiskTier(self, identity)

    def warn_once(self, kind: str, message: str, *args) -> None:
        if kind not in self._warned:
            self._warned.add(kind)
            logger.warning(message, *args)

    def turn_off(self, error: BaseException) -> None:
        """The folder cannot be written (full, read-only): memory only from now on."""
        with self._lock:
            if self.stats.off:
                return
            self.stats.off = f"{type(error).__name__}: {error}"
        self.warn_once("off", "prefix cache on disk: cannot write to %s (%s); the prefix "
                       "caches stay in memory only", self.root, self.stats.off)

    # rates -----------------------------------------------------------------------

    def _load_rates(self) -> dict:
        try:
            saved = json.loads((self.root / "rates.json").read_text())
            return {k: float(v) for k, v in saved.items() if float(v) > 0}
        except (OSError, ValueError, TypeError, AttributeError):
            return {}

    def _save_rates(self) -> None:
        rates = dict(self.saved_rates)
        stats = self.stats
        if stats.read_seconds > 0:
            rates["read"] = stats.read_rate
        if stats.write_seconds > 0:
            rates["write"] = stats.written_bytes / stats.write_seconds
        if rates == self.saved_rates or self.off:
            return
        path = self.root / "rates.json"
        tmp = path.with_name(f".rates.{os.getpid()}.tmp")
        try:
            tmp.write_text(json.dumps(rates))
            os.replace(tmp, path)
        except OSError:
            pass  # the rates are measured again next time

    def read_rate(self) -> float:
        """Bytes per second a read is expected at: this process's reads, else the last
        process's, else the measured write rate (reads are seldom slower), else a slow
        SSD's."""
        if self.stats.read_seconds > 0:
            return self.stats.read_rate
        if "read" in self.saved_rates:
            return self.saved_rates["read"]
        if self.stats.write_seconds > 0:
            return self.stats.written_bytes / self.stats.write_seconds
        return self.saved_rates.get("write", DEFAULT_READ_RATE)

    # writing (the writer thread) ------------------------------------------------------

    def submit(self, job: _Job) -> bool:
        """Queue a write (on the worker); False when it is not taken."""
        self._prune()
        if self.off:
            return False
        if job.nbytes > self.max_bytes:
            self.warn_once("budget", "prefix cache on disk: an entry of %.1f MB is larger "
                           "than the budget of %.1f MB and is not written (raise "
                           "prefix_cache_disk_bytes / --disk-cache-gb)", job.nbytes / 1e6,
                           self.max_bytes / 1e6)
            return False
        queued = sum(pending.nbytes for pending in self._pending)
        if queued and queued + job.nbytes > MAX_PENDING:
            logger.debug("prefix cache on disk: %d writes queued; %s waits", len(self._pending),
                         job.path.name)
            return False  # not written now: kept in memory, offered again when evicted
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="specprefill-disk-writer",
                                            daemon=True)
            self._thread.start()
        self._seq += 1
        job.seq = self._seq
        self._pending.append(job)
        self._queue.put(job)
        return True

    def _prune(self) -> None:
        """Let go, on the worker, of the arrays of jobs the writer is done with."""
        released = self._released
        self._pending = [job for job in self._pending if job.seq > released]

    def _run(self) -> None:
        while True:
            job = self._queue.get()
            if job is None:
                return
            if not self.off:
                self._write(job)
            seq = job.seq
            del job  # the worker's `_prune` lets the arrays go, on its own thread
            with self._lock:
                self._released = seq

    def _write(self, job: _Job) -> None:
        started = time.perf_counter()
        tmp = job.path.with_name(f".{job.path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
        try:
            job.path.parent.mkdir(parents=True, exist_ok=True)
            self._write_file(job, tmp)
            os.replace(tmp, job.path)
        except Exception as error:  # a full disk, a read-only folder, arrays it cannot read
            try:
                tmp.unlink(missing_ok=True)
            except OSError:
                pass
            self.turn_off(error)
            return
        for path in job.supersedes:
            try:
                path.unlink(missing_ok=True)
            except OSError:
                pass
        with self._lock:
            self.stats.written += 1
            self.stats.written_bytes += job.nbytes
            self.stats.write_seconds += time.perf_counter() - started
        self._evict()

    @staticmethod
    def _write_file(job: _Job, tmp: Path) -> None:
        header = _header(job.tensors, job.meta)
        at = header.index(_CHECKSUM) + len(_CHECKSUM)
        crcs = [zlib.crc32(header)]
        with open(tmp, "wb") as f:
            f.write(header)
            for _, _, x in job.tensors:
                data = np.ascontiguousarray(np.asarray(x))  # the worker evaluated it
                crcs.append(zlib.crc32(data))
                f.write(data.data)
                del data
            f.seek(at)
            f.write(_checksum(crcs).encode())
            f.flush()
            os.fsync(f.fileno())

    def _evict(self) -> None:
        """Least recently used files out until the folder is within the budget; a
        writer's temporary file left for `STALE_S` goes too."""
        files, total, now = [], 0, time.time()
        try:
            folders = [e for e in os.scandir(self.root) if e.is_dir()]
        except OSError:
            return
        for folder in folders:
            try:
                listing = list(os.scandir(folder.path))
            except OSError:
                continue
            for item in listing:
                try:
                    stat = item.stat()
                except OSError:
                    continue
                if item.name.endswith(".tmp"):
                    if now - stat.st_mtime > STALE_S:
                        _remove(Path(item.path))
                    else:
                        total += stat.st_size
                elif item.name.endswith(SUFFIX):
                    files.append((stat.st_mtime, stat.st_size, Path(item.path)))
                    total += stat.st_size
        for _, size, path in sorted(files):
            if total <= self.max_bytes:
                break
            if _remove(path):
                with self._lock:
                    self.stats.evicted += 1
            total -= size

    def close(self, timeout: float = 120.0) -> None:
        """Finish the queued writes (at shutdown: the last turn's entry is among them)."""
        if self._thread is not None:
            self._queue.put(None)
            self._thread.join(timeout)
            if self._thread.is_alive():
                logger.warning("prefix cache on disk: writes still running after %.0f s "
                               "were abandoned", timeout)
            else:
                self._thread = None
        self._prune()
        self._save_rates()


def _remove(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:  # another process removed it first, or the folder is read-only
        return False


class DiskTier:
    """One model's files in a `DiskCache`: the index the memory tier consults (its
    files' tokens, positions and checkpoints, read from their headers), writes and
    reads."""

    def __init__(self, cache: DiskCache, identity: str):
        self.cache = cache
        self.identity = identity
        self.folder = cache.root / identity
        self.index: dict = {}  # file name -> ((inode, size), its index Entry)
        self.sizes: dict = {}  # file name -> bytes on disk
        self.mine: dict = {}  # file name -> its index Entry: written by this process
        try:
            self.folder.mkdir(parents=True, exist_ok=True)
        except OSError as error:
            cache.turn_off(error)

    @property
    def stats(self) -> DiskStats:
        return self.cache.stats

    # the index -------------------------------------------------------------------

    def entries(self) -> list:
        """This model's files as index entries (no key), oldest first, which `find`'s
        logic (tokens, positions, checkpoint lengths) runs on unchanged."""
        if self.cache.off:
            return []
        try:
            listing = [e for e in os.scandir(self.folder)
                       if e.name.endswith(SUFFIX) and not e.name.startswith(".")]
        except OSError:
            return []
        seen, stubs = set(), []
        for item in listing:
            try:
                stat = item.stat()
            except OSError:
                continue
            key = (stat.st_ino, stat.st_size)
            known = self.index.get(item.name)
            if known is None or known[0] != key:
                stub = self._stub(Path(item.path))
                if stub is None:
                    continue
                known = self.index[item.name] = (key, stub)
                self.sizes[item.name] = stat.st_size
            seen.add(item.name)
            stubs.append((stat.st_mtime, known[1]))
        for name in set(self.index) - seen:
            del self.index[name]
            self.sizes.pop(name, None)
        return [stub for _, stub in sorted(stubs, key=lambda pair: pair[0])]

    def _stub(self, path: Path) -> Optional[Entry]:
        try:
            with open(path, "rb") as f:
                raw, header, _ = _read_header(f)
                meta = json.loads(header["__metadata__"]["specprefill"])

                def array(name, dtype):
                    spec = header[name]
                    start, stop = spec["data_offsets"]
                    f.seek(len(raw) + start)
                    return np.frombuffer(f.read(stop - start), dtype=dtype)

                tokens = array("tokens", np.int32)
                positions = array("positions", np.int64) if "positions" in header else None
        except FileNotFoundError:
            return None  # removed by another process meanwhile
        except (BrokenFile, OSError, ValueError, KeyError, TypeError) as error:
            self._broken(path, error)
            return None
        checkpoints = tuple(sorted(int(length) for length in meta["checkpoints"]))
        return Entry(tokens, positions, "state" not in meta["layers"], checkpoints,
                     nbytes=int(meta["nbytes"]), keep=float(meta["keep"]),
                     densified=bool(meta["densified"]), disk=path.name,
                     prompt=int(meta.get("prompt", 0)))

    def _broken(self, path: Path, error: BaseException) -> None:
        logger.warning("prefix cache on disk: %s is broken (%s); ignored and removed",
                       path.name, error)
        with self.cache._lock:
            self.stats.broken += 1
        _remove(path)
        self.index.pop(path.name, None)

    # reading (the worker) -------------------------------------------------------------

    def pays(self, stub: Entry, prefill_s: float) -> bool:
        """Whether reading the file is predicted faster than the prefill it saves."""
        read_s = self.sizes.get(stub.disk, 0) / self.cache.read_rate()
        with self.cache._lock:
            self.stats.predicted_read_s, self.stats.predicted_prefill_s = read_s, prefill_s
            if read_s >= prefill_s:
                self.stats.recomputed += 1
        logger.debug("prefix cache on disk: %s %s: reading predicted at %.3f s, prefilling "
                     "at %.3f s", stub.disk, "read" if read_s < prefill_s else "not read",
                     read_s, prefill_s)
        return read_s < prefill_s

    def read(self, stub: Entry) -> Optional[Held]:
        """The file's tensors, or None when it is gone, broken (then removed) or not what
        `stub` (its index entry) says."""
        path = self.folder / stub.disk
        started = time.perf_counter()
        try:
            with open(path, "rb") as f:
                raw, header, size = _read_header(f)
                held = os.fstat(f.fileno())
                if held.st_size != len(raw) + size:
                    raise BrokenFile("its size is not the header's")
                arrays = mx.load(str(path))  # by path: MLX reads a file object slower
                mx.eval(arrays)
            if os.stat(path).st_ino != held.st_ino:  # replaced meanwhile (renames are atomic)
                return None
            order = sorted((n for n in header if n != "__metadata__"),
                           key=lambda n: header[n]["data_offsets"][0])
            with ThreadPoolExecutor(_CHECK_THREADS) as pool:  # zlib lets go of the GIL
                crcs = list(pool.map(lambda n: zlib.crc32(memoryview(arrays[n])), order))
            if _checksum([_header_crc(raw, len(order)), *crcs]) != \
                    header["__metadata__"]["checksum"]:
                raise BrokenFile("the checksum does not match")
            held = self._held(json.loads(header["__metadata__"]["specprefill"]), arrays)
            if tuple(held.checkpoints) != tuple(stub.checkpoints):
                raise BrokenFile("its checkpoints are not its header's")
        except FileNotFoundError:
            self.index.pop(stub.disk, None)
            return None
        except (BrokenFile, OSError, ValueError, KeyError, TypeError, RuntimeError) as error:
            self._broken(path, error)
            return None
        try:
            os.utime(path)  # recently used: the last to be evicted
        except OSError:
            pass
        with self.cache._lock:
            self.stats.reads += 1
            self.stats.read_bytes += len(raw) + size
            self.stats.read_seconds += time.perf_counter() - started
        return held

    @staticmethod
    def _held(meta: dict, arrays: dict) -> Held:
        kv = []
        for i, kind in enumerate(meta["layers"]):
            if kind == "state":
                kv.append(None)
            elif kind == "kv":
                kv.append((arrays[f"kv.{i}.k"], arrays[f"kv.{i}.v"]))
            elif kind.startswith("q"):  # quantized in memory: read back as it was held
                kv_bits, group_size = (int(x) for x in kind[1:].split("g"))
                kv.append((*(tuple(arrays[f"kv.{i}.{n}{part}"] for part in
                                   ("", ".scales", ".biases")) for n in "kv"),
                           group_size, kv_bits))
            else:
                bits = int(kind[2:])
                kv.append(tuple(dequantized((arrays[f"kv.{i}.{n}"], arrays[f"kv.{i}.{n}.scales"],
                                             arrays[f"kv.{i}.{n}.biases"]), bits) for n in "kv"))
        checkpoints = {}
        for length, spec in meta["checkpoints"].items():
            layers = {int(i): (_cache_class(layer["class"]), _decode(layer["state"], arrays))
                      for i, layer in spec["layers"].items()}
            checkpoints[int(length)] = Snapshot(layers, spec["fed"],
                                                tree_nbytes(list(layers.values())))
        held = Held(kv, dict(sorted(checkpoints.items())))
        mx.eval(held.kv)
        return held

    # writing (the worker hands over) ----------------------------------------------------

    def write(self, entry: Entry, held: Held) -> Optional[str]:
        """Queue the file of an entry (its index entry and its tensors); its name, or
        None when it is not taken."""
        if self.cache.off:
            return None
        bits = self.cache.bits
        try:
            tensors, meta = _tensors(entry, held, bits)
        except TypeError as error:
            self.cache.warn_once("state", "prefix cache on disk: %s", error)
            return None
        meta.update(format=FORMAT, identity=self.identity)
        specs = []
        for name, x in tensors:  # bfloat16 goes out as its bits (numpy has no bfloat16)
            if isinstance(x, np.ndarray):
                specs.append((name, _NUMPY_DTYPES[x.dtype], x))
            else:
                specs.append((name, _DTYPES[x.dtype],
                              x.view(mx.uint16) if x.dtype == mx.bfloat16 else x))
        mx.eval([x for _, _, x in specs if isinstance(x, mx.array)])
        name = file_name(self.identity, entry, bits)
        known = {stub.disk: stub for _, stub in self.index.values()} | self.mine
        supersedes = [old for old, stub in known.items() if old != name and _covers(entry, stub)]
        nbytes = len(_header(specs, meta)) + sum(x.nbytes for _, _, x in specs)
        job = _Job(self.folder / name, specs, meta, nbytes, [self.folder / n for n in supersedes])
        if not self.cache.submit(job):
            return None
        for old in supersedes:
            self.mine.pop(old, None)
        self.mine[name] = Entry(entry.tokens, entry.positions, entry.cuts_anywhere,
                                entry.checkpoints, disk=name)
        return name


def _covers(new: Entry, old: Entry) -> bool:
    """`new` holds everything `old` does: its tokens and positions first, and each of its
    checkpoints."""
    return extends(new, old) and new.cuts_anywhere == old.cuts_anywhere and \
        set(old.checkpoints) <= set(new.checkpoints)
