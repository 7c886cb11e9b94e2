"""vLLM KV-transfer connector over the package's stream segments: disaggregated prefill and
decode on one host (docs/engines.md, "Disaggregated prefill and decode").

    kv_transfer_config = {"kv_connector": "ExpertArenaConnector",
                          "kv_connector_module_path": "expert_arena.vllm_kv",
                          "kv_role": "kv_producer",      # the prefill engine; the decode
                                                         # engine: "kv_consumer"
                          "kv_connector_extra_config": {"directory": "/dev/shm"}}

The prefill engine (kv_producer or kv_both) puts each prompt's full KV blocks, one tensor per
request and layer (key "<request id>/<layer name>": exact keys, never a prefix), into its
StreamProducer's segments as vLLM saves each layer (an index_select straight into the
reserved space: one copy), and when every layer of the request is published, writes a small
index entry (JSON, written to a temporary name and renamed) named by a hash of the prompt's
tokens: the decode engine finds what a prefill engine computed for the same tokens without any
channel of its own. The decode engine (kv_consumer or kv_both) answers vLLM's
get_num_new_matched_tokens from the index, opens the layers' tensors zero-copy, copies the
blocks into its own KV cache (a copy_ per run of blocks), releases each layer's tensor once
copied and removes the entry; a tensor it cannot open (its producer was killed and swept, the
block was aborted or expired) is reported to vLLM (get_block_ids_with_load_errors), which
recomputes those tokens.

What is compared before any byte is copied: the model and its effective configuration
(hf_overrides applied), revision, quantization, vLLM's version, its dtype and the KV cache's
dtype and scales, block size, parallel sizes and rank, KV heads and head size (the scheduler,
from the entry), and every layer's name, dtype and per-block shape and the block dimension
(the worker, from the KV cache tensors vLLM registered, never an assumed layout). A mismatch
is refused with a warning naming both sides, and those tokens are computed. An entry or a
cache file another user owns is refused by name.

Lifetimes: a block is read by `readers` decode engines (default 1; each takes its turn by
creating <entry>.read<k> exclusively, the last removes the entry), each zero-copy from the one
copy in the segments, and freed when the last has released it; an aborted or failed request's
blocks are aborted by the prefill engine at its next step (after the writes of the steps
before, which ran already), with their entry; blocks nobody loaded
expire after `ttl_seconds`; the producer's close (engine exit) removes its entries and its
segments; a killed producer's segments (and an entry it was writing, under a temporary name)
are swept by the next producer or consumer to start, and its entries are removed by the
consumer that fails to load them or by the next producer.

With transfer "cache", the prefill engine's KV cache itself lives in a file of `directory`
(ea-kvcache-NAME-PID-...: the pages of vLLM's buffer mapped onto it at the same addresses when
vLLM registers the cache, the private ones given back first; _SharedCache) and an entry names
the prompt's blocks in it: vLLM wrote them there, nothing is copied on the prefill side, and the
decode engine copies each run of blocks straight from the file into its cache (out of the file
mapped once and kept while it exists, _core.MappedFile; every run of a load in one call
without the GIL: one copy; a file truncated under the mapping is a load error naming the run,
never a SIGBUS; pread where it cannot be mapped). The prefill engine keeps those blocks
(vLLM's delayed free, as with its NIXL connector) until the entry is read by its last reader,
withdrawn (an abort, a preemption) or expired (ttl_seconds, or beyond half the cache held),
and no decode engine holds the entry's shared lock (flock) that it copies under; a prefix
that several prompts share is one copy in that cache, read by every decode engine of the
host. A KV cache that does not fit the directory (or is on a device) stays private and the
prompts go through the segments.

Across hosts: a prefill engine with `listen` (and `listen_token` or `token_file`) serves its
segments through the stream's front door, and each finished request's kv_transfer_params carry
its entries; a decode engine given them with the request (by a proxy, as vLLM's NIXL connector
works) loads from a producer in `remote_producers` with `remote_token`, after the same checks
as an index file's and the prompt's own digest.

Options (kv_connector_extra_config): directory (segments and index, default /dev/shm),
spill_directory (default /var/tmp), name (logical name shared by the engines that exchange KV,
default "kv"), segment_bytes (default 64 MiB), max_segments (default 16), ttl_seconds
(default 600), readers (default 1), listen, listen_token, remote_token, token_file,
remote_producers, load, transfer (_OPTIONS).
"""

from __future__ import annotations

import array
import atexit
import ctypes
import dataclasses
import errno
import fcntl
import hashlib
import json
import logging
import math
import mmap
import os
import platform
import queue
import re
import reprlib
import secrets
import threading
import time
from typing import Any

import numpy
import torch

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole)

import expert_arena

logger = logging.getLogger("expert_arena.vllm_kv")

# Prompts are hashed in chunks of this many tokens, whatever the engines' block size (a
# multiple of it): the decode engine finds an entry of a producer with another block size and
# refuses it by name, instead of missing it silently.
HASH_TOKENS = 16
ENTRY_VERSION = 1
_ENTRY_LIMIT = 1 << 20  # bytes: an index entry is a few KiB; a bigger file is not one

_OPTIONS = {
    "directory": "directory of the stream segments and of the index (default /dev/shm)",
    "spill_directory": "where a full producer spills (default /var/tmp)",
    "name": "logical name the prefill and decode engines share (default \"kv\")",
    "segment_bytes": "bytes of one stream segment (default 64 MiB)",
    "max_segments": "segments the producer may grow to (default 16)",
    "ttl_seconds": "seconds a prompt's KV waits for a decode engine (default 600)",
    "readers": "decode engines that read each prompt's KV (the prefill engine's setting, "
               "default 1): its blocks are freed when that many have read them, or expire",
    "listen": "ADDR:PORT the prefill engine serves its KV on to decode engines on other hosts "
              "(UCX, through the stream's front door; default: none)",
    "listen_token": "the token a remote decode engine must present (the prefill engine's)",
    "remote_token": "the token the decode engine presents to a remote prefill engine",
    "token_file": "a file holding the token, for either role, instead of listen_token or "
                  "remote_token in a configuration vLLM logs",
    "remote_producers": "the ADDR:PORT list of prefill engines a decode engine fetches from "
                        "across hosts (default: none; kv_transfer_params naming any other "
                        "address are refused)",
    "transfer": "\"cache\": the prefill engine's KV cache is a file in `directory` that a "
                "decode engine on this host copies a prompt's blocks from (one copy; the "
                "prefill engine keeps those blocks until every reader has copied them, or they "
                "expire, holding half its cache at most); \"segments\" (default): the "
                "prefill engine copies each prompt's blocks into its stream segments as it "
                "saves them (two copies; its blocks free at once; spills at the cap; what "
                "listen serves)",
    "load": "\"async\" (default): the decode engine copies a prompt's KV on a thread of its "
            "own while its other requests run (the request waits for it, as with vLLM's NIXL "
            "connector); \"sync\": at the start of the step that computes the request, "
            "which every request of that step waits for",
    "huge_pages": "true (default): a decode engine's own KV cache, where it is host memory, "
                  "moved onto 2 MiB pages by a thread as the engine starts (MADV_COLLAPSE, "
                  "Linux 6.1+; loads into it run faster: docs/engines.md); false: left as "
                  "vLLM allocated it",
}
_MAX_READERS = 64

_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,32}$")
# An entry's file name (entry_path), claims (".read...") and temporaries (".tmp-...") after it.
_ENTRY_NAME = re.compile(r"^ea-kv-([A-Za-z0-9_.-]{1,32})-[0-9a-f]{40}-r[0-9]+\.json")

# What this process's connectors did: the decode engine's test and an operator read them.
_COUNTERS_LOCK = threading.Lock()
_COUNTERS = {
    "lookups": 0, "matched_tokens": 0, "refused": 0,
    "saved_requests": 0, "saved_blocks": 0, "saved_bytes": 0,
    "loaded_requests": 0, "loaded_blocks": 0, "loaded_bytes": 0,
    "loaded_mapped_bytes": 0,  # of those, copied out of a prefill engine's cache file mapped
    "load_error_blocks": 0, "aborted_requests": 0, "expired_requests": 0,
    "withdrawn_requests": 0,  # a shared cache's entries withdrawn at a preemption
    "kv_cache_huge_bytes": 0,  # of a decode engine's own KV cache moved onto 2 MiB pages
}


def counters() -> dict:
    """This process's connector counters (both roles: in a single-process engine the scheduler
    and the worker share them)."""
    with _COUNTERS_LOCK:
        return dict(_COUNTERS)


def _count(**delta):
    with _COUNTERS_LOCK:
        for k, v in delta.items():
            _COUNTERS[k] += v


class _Options:
    def __init__(self, extra: dict):
        unknown = sorted(set(extra) - set(_OPTIONS))
        if unknown:
            raise ValueError("expert_arena.vllm_kv: unknown kv_connector_extra_config key(s) %s; "
                             "the options are: %s" % (", ".join(map(repr, unknown)), "; ".join(
                                 "%s: %s" % kv for kv in _OPTIONS.items())))
        self.directory = os.fspath(extra.get("directory", "/dev/shm"))
        self.spill_directory = os.fspath(extra.get("spill_directory", "/var/tmp"))
        self.name = str(extra.get("name", "kv"))
        if not _NAME.match(self.name):
            raise ValueError("expert_arena.vllm_kv: name %r must be 1-32 characters of "
                             "[A-Za-z0-9_.-]" % self.name)
        self.segment_bytes = int(extra.get("segment_bytes", 64 << 20))
        self.max_segments = int(extra.get("max_segments", 16))
        self.ttl_seconds = float(extra.get("ttl_seconds", 600))
        self.readers = extra.get("readers", 1)
        if type(self.readers) is not int or not 1 <= self.readers <= _MAX_READERS:
            raise ValueError("expert_arena.vllm_kv: readers %r must be an integer from 1 to %d"
                             % (self.readers, _MAX_READERS))
        if not os.path.isdir(self.directory):
            raise ValueError("expert_arena.vllm_kv: directory %r is not a directory"
                             % self.directory)
        self.listen = extra.get("listen")
        token = None
        if extra.get("token_file") is not None:
            try:
                with open(os.fspath(extra["token_file"])) as f:
                    token = f.read().strip()
            except OSError as e:
                raise ValueError("expert_arena.vllm_kv: token_file: %s" % e) from None
            if not token:
                raise ValueError("expert_arena.vllm_kv: token_file %r is empty"
                                 % extra["token_file"])
        self.listen_token = extra.get("listen_token", token)
        self.remote_token = extra.get("remote_token", token)
        if self.listen is not None and not self.listen_token:
            raise ValueError("expert_arena.vllm_kv: listen needs listen_token or token_file: "
                             "a remote decode engine must present a token")
        producers = extra.get("remote_producers", [])
        if isinstance(producers, str):
            producers = [producers]
        if not isinstance(producers, list) or not all(isinstance(a, str) for a in producers):
            raise ValueError("expert_arena.vllm_kv: remote_producers must be a list of "
                             "\"ADDR:PORT\" strings")
        self.remote_producers = set(producers)
        self.load = extra.get("load", "async")
        if self.load not in ("async", "sync"):
            raise ValueError("expert_arena.vllm_kv: load %r must be \"async\" or \"sync\""
                             % (self.load,))
        self.transfer = extra.get("transfer", "segments")
        if self.transfer not in ("cache", "segments"):
            raise ValueError("expert_arena.vllm_kv: transfer %r must be \"cache\" or "
                             "\"segments\"" % (self.transfer,))
        self.huge_pages = extra.get("huge_pages", True)
        if type(self.huge_pages) is not bool:
            raise ValueError("expert_arena.vllm_kv: huge_pages %r must be true or false"
                             % (self.huge_pages,))
        if self.transfer == "cache" and self.listen is not None:
            raise ValueError("expert_arena.vllm_kv: listen serves the stream's segments to "
                             "other hosts: it needs transfer \"segments\"")
        if self.remote_producers and not self.remote_token:
            raise ValueError("expert_arena.vllm_kv: remote_producers needs remote_token or "
                             "token_file")

    def entry_path(self, digest: str, rank: int) -> str:
        return os.path.join(self.directory, "ea-kv-%s-%s-r%d.json" % (self.name, digest, rank))

    def owns(self, name: str) -> bool:
        """Whether the file `name` is one of this connector name's entries, or an entry's
        claim or temporary file (ea-kv-NAME-DIGEST-rRANK.json...): the entries of a connector
        whose name begins with this one and a dash are not."""
        match = _ENTRY_NAME.match(name)
        return match is not None and match.group(1) == self.name


def prompt_digests(token_ids) -> list:
    """Hex digests of the prompt's prefixes of HASH_TOKENS, 2*HASH_TOKENS, ... tokens (a
    running SHA-256 of the tokens as int32): equal prefixes have equal digests in every
    process, unlike vLLM's own block hashes, whose seed is random per process."""
    h = hashlib.sha256(b"expert_arena.vllm_kv/1")
    out = []
    tokens = list(token_ids)
    for start in range(0, len(tokens) - HASH_TOKENS + 1, HASH_TOKENS):
        h.update(array.array("q", tokens[start:start + HASH_TOKENS]).tobytes())
        out.append(h.copy().hexdigest()[:40])
    return out


def tail_digest(token_ids) -> str:
    """Hex digest of exactly these tokens (all of a prompt's tokens but its last): names an
    entry's tail, the KV of the prompt's last, partial block."""
    h = hashlib.sha256(b"expert_arena.vllm_kv/tail/1")
    h.update(array.array("q", list(token_ids)).tobytes())
    return h.hexdigest()[:40]


def _tail_tokens(entry: dict, tokens: list, length: int, block_size: int) -> int:
    """How many tokens past `length` (the entry's whole blocks, all of them loaded) this
    prompt loads from the entry's tail: every one but the prompt's last (vLLM computes it for
    its logits) when they are the tokens the entry's tail was computed for, else none."""
    tail = entry.get("tail")
    if tail is None or entry["tokens"] != length:
        return 0
    n = tail["tokens"]
    if not 0 < n < block_size or length + n != len(tokens) - 1:
        return 0
    return n if tail["digest"] == tail_digest(tokens[:length + n]) else 0


# Per engine: KV cache scales an engine computes from its own first batch
# (calculate_kv_scales with a quantized cache) are its own, so its KV is nobody else's.
_ENGINE_SCALES = "computed by engine %s" % secrets.token_hex(8)


def _identity(vllm_config, kv_cache_config) -> dict:
    """What both engines must agree on for one's KV to be the other's (the scheduler's view;
    the worker checks the tensors themselves): the model as vLLM runs it (its effective
    configuration, hf_overrides applied: RoPE's settings shape every key; its revision and
    quantization: the weights that compute the KV), vLLM's version, the KV cache's dtype, its
    scales, block size and parallel layout."""
    import vllm
    from .vllm import _digest, effective_config
    model = vllm_config.model_config
    cache = vllm_config.cache_config
    parallel = vllm_config.parallel_config
    quantized_cache = str(cache.cache_dtype) not in ("auto", "bfloat16", "float16", "float32")
    out = {
        "model": str(model.model),
        "config": _digest(effective_config(model))[:32],
        "revision": str(model.revision),
        "quantization": str(model.quantization),
        "vllm": str(vllm.__version__),
        "dtype": str(model.dtype),
        "cache_dtype": str(cache.cache_dtype),
        "kv_scales": _ENGINE_SCALES if quantized_cache and getattr(
            cache, "calculate_kv_scales", False) else "from the checkpoint",
        "block_size": int(cache.block_size),
        "tensor_parallel_size": int(parallel.tensor_parallel_size),
        "pipeline_parallel_size": int(parallel.pipeline_parallel_size),
        # (A context-parallel rank holds a slice of every block's tokens.)
        "context_parallel": "%d/%d" % (
            int(getattr(parallel, "prefill_context_parallel_size", 1) or 1),
            int(getattr(parallel, "decode_context_parallel_size", 1) or 1)),
    }
    groups = getattr(kv_cache_config, "kv_cache_groups", None) or []
    specs = []
    for g in groups:
        spec = g.kv_cache_spec
        specs.append({"type": type(spec).__name__,
                      "layers": len(g.layer_names),
                      "num_kv_heads": getattr(spec, "num_kv_heads", None),
                      "head_size": getattr(spec, "head_size", None),
                      "dtype": str(getattr(spec, "dtype", ""))})
    out["groups"] = specs
    return out


# What a log line shows of a value that came from a file or a client: a repr cut short (a
# nesting deeper than maxlevel is "..." rather than a RecursionError).
_SHOWN = reprlib.Repr()
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother = 3, 160, 160
_SHOWN.maxlist = _SHOWN.maxdict = _SHOWN.maxtuple = _SHOWN.maxset = 6


def _differences(mine: dict, theirs: dict) -> list:
    keys = sorted(set(mine) | set(theirs))
    return ["%s: %s here, %s in the producer" % (k if k in mine else _SHOWN.repr(k),
                                                  _SHOWN.repr(mine.get(k)),
                                                  _SHOWN.repr(theirs.get(k)))
            for k in keys if mine.get(k) != theirs.get(k)]


def _read_entry(path: str):
    """The parsed entry at `path`, None when there is none, or raises ValueError naming what
    is wrong with it."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        return _parsed_entry(fd, path)
    finally:
        os.close(fd)


def _own_file(fd: int, what: str) -> os.stat_result:
    """The fstat of `fd`, or ValueError when another user owns the file: a user who can write
    to the directory (/dev/shm is everyone's) must not hand this engine an entry or a cache
    that it would load as a prompt's KV (the stream's segments are refused alike)."""
    st = os.fstat(fd)
    if st.st_uid != os.geteuid():
        raise ValueError("%s belongs to uid %d, not to this engine's uid %d: another user's "
                         "file is not read" % (what, st.st_uid, os.geteuid()))
    return st


def _parsed_entry(fd: int, path: str):
    _own_file(fd, "index entry %s" % path)
    data = os.pread(fd, _ENTRY_LIMIT + 1, 0)
    if len(data) > _ENTRY_LIMIT:
        raise ValueError("index entry %s is larger than %d bytes" % (path, _ENTRY_LIMIT))
    try:
        entry = json.loads(data)
    except (ValueError, RecursionError) as e:  # RecursionError: nested deeper than json reads
        raise ValueError("index entry %s is not JSON: %s" % (path, e)) from None
    return _checked_entry(entry, "index entry %s" % path)


def _checked_entry(entry, where: str) -> dict:
    """`entry` (from an index file or a request's kv_transfer_params) if it has the form of
    one, or raises ValueError naming `where` and what is wrong."""
    if not isinstance(entry, dict) or entry.get("version") != ENTRY_VERSION:
        raise ValueError("%s is not a version %d entry" % (where, ENTRY_VERSION))
    tokens, layers, identity = entry.get("tokens"), entry.get("layers"), entry.get("identity")
    # A stream entry's layers are descriptors (hex); a shared cache entry's (transfer "cache")
    # describe the layers of the file it names, whose blocks it lists.
    cache = entry.get("cache")
    if cache is not None and (not isinstance(cache, dict)
                              or not isinstance(cache.get("file"), str)
                              or not isinstance(cache.get("blocks"), list)
                              or not all(type(b) is int for b in cache["blocks"])):
        raise ValueError("%s: its cache is not a file and blocks" % where)
    tail = entry.get("tail")
    if tail is not None and (not isinstance(tail, dict) or type(tail.get("tokens")) is not int
                             or not isinstance(tail.get("digest"), str)):
        raise ValueError("%s: its tail is not tokens and a digest" % where)
    kind = dict if cache is not None else str
    if type(tokens) is not int or tokens <= 0 or not isinstance(layers, dict) or not layers \
            or not isinstance(identity, dict) \
            or not all(isinstance(k, str) and isinstance(v, kind) for k, v in layers.items()):
        raise ValueError("%s lacks tokens, layers or identity" % where)
    readers = entry.setdefault("readers", 1)
    if type(readers) is not int or not 1 <= readers <= _MAX_READERS:
        raise ValueError("%s: readers %s is not from 1 to %d" % (where, _SHOWN.repr(readers),
                                                                 _MAX_READERS))
    return entry


def _unlink(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
    except PermissionError:
        pass  # another user's file in a sticky directory (/dev/shm): not this engine's


def _claims(path: str) -> list:
    """The readers' claim files of the entry at `path` (<entry>.read<k>)."""
    directory, base = os.path.split(path)
    try:
        return [os.path.join(directory, n) for n in os.listdir(directory)
                if n.startswith(base + ".read")]
    except OSError:
        return []


def _remove_entry(path: str) -> None:
    """The entry and its readers' claims."""
    _unlink(path)
    for claim in _claims(path):
        _unlink(claim)


def _claim(path: str, readers: int):
    """This engine's turn among the entry's `readers` (0 ... readers - 1), taken by creating
    <entry>.read<k> exclusively; None when every reader has had its turn."""
    if readers == 1:
        return 0
    for k in range(readers):
        try:
            fd = os.open("%s.read%d" % (path, k),
                         os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                         0o600)
        except FileExistsError:
            continue
        os.close(fd)
        return k
    return None


_TEMPORARY = ".json.tmp-"  # an entry being written: <entry>.tmp-<pid>-<thread>


def _write_entry(path: str, entry: dict, keep: bool = False):
    """Written whole under a temporary name, then renamed: a reader sees all of it or none.
    The temporary file is locked (flock: its open file's) until it has its name, so that a
    writer killed before the rename leaves a file the next engine knows for abandoned
    (_remove_abandoned_temporaries). With `keep`, returns the entry's open file, unlocked (a
    shared cache's entry: _CacheSend)."""
    tmp = "%s.tmp-%d-%d" % (path, os.getpid(), threading.get_ident())
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        os.write(fd, json.dumps(entry, separators=(",", ":")).encode())
        os.rename(tmp, path)
        if keep:
            fcntl.flock(fd, fcntl.LOCK_UN)
            kept, fd = fd, None
            return kept
    except BaseException:
        _unlink(tmp)
        raise
    finally:
        if fd is not None:
            os.close(fd)
    return None


def _remove_abandoned_temporaries(directory: str, owns) -> None:
    """Removes the temporary entries (`owns(name)`: of this connector's name) that no writer
    holds: their writer was
    killed between creating and renaming them. One whose writer is between creating and
    locking it is removed too; its rename then fails and that prompt is not published."""
    for name in os.listdir(directory):
        if not owns(name) or _TEMPORARY not in name:
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue  # renamed or removed meanwhile, or not ours to open
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue  # another user's: not this engine's to judge (nor to remove)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # Still this file under this name (not one made since under the same name).
            abandoned = os.fstat(fd).st_ino == os.lstat(path).st_ino
        except (BlockingIOError, FileNotFoundError):
            abandoned = False  # its writer is alive, or it renamed it meanwhile
        finally:
            os.close(fd)
        if abandoned:
            logger.warning("expert_arena.vllm_kv: removing %s: its writer was killed before it "
                           "renamed it", path)
            _unlink(path)


# ------------------------------------------------- the shared KV cache (transfer "cache")

# A prefill engine's KV cache as a file in the connector's directory:
# ea-kvcache-<name>-<pid>-<8 hex>. Its engine holds a shared flock on it while it lives: a file
# nobody holds is a killed engine's, removed by the next connector of the name to start.
_CACHE_FILE = re.compile(r"^ea-kvcache-([A-Za-z0-9_.-]{1,32})-[0-9]{1,10}-[0-9a-f]{8}$")
_CACHE_ALIGN = 2 << 20  # each storage of the cache starts on a 2 MiB boundary of the file
_LOCK_TRIES = 100  # times 1 ms: how long a decode engine waits for an entry's shared lock


def _owned_cache_file(name: str, connector_name: str) -> bool:
    match = _CACHE_FILE.match(name)
    return match is not None and match.group(1) == connector_name


def _sweep_cache_files(directory: str, connector_name: str) -> None:
    """Removes the shared KV cache files of this connector name that no engine holds (their
    engine was killed). A decode engine copying from one keeps its open file."""
    for name in os.listdir(directory):
        if not _owned_cache_file(name, connector_name):
            continue
        path = os.path.join(directory, name)
        try:
            fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError:
            continue
        try:
            if os.fstat(fd).st_uid != os.geteuid():
                continue  # another user's: not this engine's to judge (nor to remove)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            abandoned = os.fstat(fd).st_ino == os.lstat(path).st_ino
        except (BlockingIOError, FileNotFoundError):
            abandoned = False
        finally:
            os.close(fd)
        if abandoned:
            logger.warning("expert_arena.vllm_kv: removing %s: the prefill engine whose KV "
                           "cache it was is gone", path)
            _unlink(path)


def _pieces(shape, stride, dim: int, elsize: int):
    """(count, bytes, steps) of one block of a cache tensor along `dim`: the block is `count`
    runs of `bytes` contiguous bytes, the k-th at the block's start plus the dot product of
    k's index over the dimensions before `dim` with `steps` (byte strides), or None when the
    dimensions after `dim` are not contiguous."""
    run = elsize
    for n, s in zip(reversed(shape[dim + 1:]), reversed(stride[dim + 1:])):
        if n != 1 and s * elsize != run:
            return None
        run *= n
    lead = list(shape[:dim])
    count = 1
    for n in lead:
        count *= n
    return count, run, [s * elsize for s in stride[:dim]]


def _piece_offsets(lead_shape, steps):
    """Byte offsets of the runs of one block (row-major over the dimensions before the block
    dimension)."""
    offsets = [0]
    for n, step in zip(lead_shape, steps):
        offsets = [o + i * step for o in offsets for i in range(n)]
    return offsets


_LIBC = ctypes.CDLL(None, use_errno=True)
_LIBC.mmap.restype = ctypes.c_void_p
_LIBC.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_LIBC.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_MAP_FIXED = 0x10
_MADV_DONTNEED = 4
_MADV_HUGEPAGE = 14
_MADV_COLLAPSE = 25
_HUGE = 2 << 20
# madvise(2) by its system call number, not through libc's function: UCX, loaded in a decode
# engine that fetches from other hosts, patches libc's madvise in place as it starts
# (UCX_MEM_MMAP_HOOK_MODE=bistro), and a thread inside that function meanwhile crashed the
# engine (SIGSEGV at address 0; the front-door test, about one run in three). The advice
# given here frees nothing, so UCX has nothing to hear of it.
_SYS_MADVISE = {"x86_64": 28, "aarch64": 233, "ppc64le": 205, "s390x": 219,
                "riscv64": 233}.get(platform.machine())
_LIBC.syscall.restype = ctypes.c_long


def _madvise(addr: int, length: int, advice: int) -> int:
    """madvise(2): 0, or -1 with ctypes.get_errno() set."""
    if _SYS_MADVISE is None:
        return _LIBC.madvise(addr, length, advice)
    return _LIBC.syscall(ctypes.c_long(_SYS_MADVISE), ctypes.c_void_p(addr),
                         ctypes.c_size_t(length), ctypes.c_long(advice))


def _collapse_pages(ranges, stopped, done):
    """MADV_COLLAPSE over [a, b) of each of `ranges` (2 MiB aligned), one 2 MiB page a call
    (stopped() is asked before each; done(n) told of each page made), a busy page tried again
    a few times. Returns None, or the last error (EINVAL: a kernel without MADV_COLLAPSE,
    before Linux 6.1, which ends the work)."""
    error = None
    for a, b in ranges:
        for at in range(a, b, _HUGE):
            if stopped():
                return error
            n = min(_HUGE, b - at)
            for attempt in range(4):  # EAGAIN: this page busy (being written, locked)
                if _madvise(at, n, _MADV_COLLAPSE) == 0:
                    done(n)
                    err = 0
                    break
                err = ctypes.get_errno()
                if err != errno.EAGAIN:
                    break
                time.sleep(0.05 * (attempt + 1))
            if err:
                error = os.strerror(err)
                if err == errno.EINVAL:
                    return error
    return error


class _HostPages:
    """A decode engine's own KV cache in host memory (vLLM's tensors, this process's
    anonymous memory, which a kernel with transparent huge pages on "madvise" keeps on 4 KiB
    pages) moved onto 2 MiB pages by a thread while the engine starts: a load writes each
    block with one page walk per 2 MiB instead of 512 (bench/kv_connector_bench.py
    --dst-pages 2m 4k measures the two; docs/engines.md has the figures). MADV_HUGEPAGE marks
    the ranges first (on a kernel without MADV_COLLAPSE, before 6.1, khugepaged then collapses
    them in its own time);
    collapsing anonymous memory in use is what khugepaged does all the time (the 6.18 quirk of
    _SharedCache is a file's). Only the whole 2 MiB pages inside each tensor's bytes."""

    def __init__(self, caches: dict):
        spans = {}
        for tensor, _ in caches.values():
            if tensor.device.type != "cpu" or tensor.numel() == 0:
                continue
            extent = 1 + sum((n - 1) * st for n, st in zip(tensor.shape, tensor.stride()))
            first = tensor.data_ptr()
            spans[first] = max(spans.get(first, 0), first + extent * tensor.element_size())
        merged = []
        for a, b in sorted(spans.items()):
            if merged and a <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], b)
            else:
                merged.append([a, b])
        self.ranges = [(-(-a // _HUGE) * _HUGE, b // _HUGE * _HUGE) for a, b in merged]
        self.ranges = [r for r in self.ranges if r[1] > r[0]]
        self.total = sum(b - a for a, b in self.ranges)
        self.huge_bytes = 0
        self.error = None
        self.seconds = None
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="expert_arena-kv-pages",
                                        daemon=True)

    def start(self) -> "_HostPages":
        self._thread.start()
        return self

    def _run(self) -> None:
        start = time.monotonic()
        try:  # behind the engine's own threads as it starts (this thread only)
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)
        except OSError:
            pass
        try:
            self.error = self._collapse()
        finally:
            self.seconds = time.monotonic() - start
        logger.info("expert_arena.vllm_kv: %d of %d MiB of this engine's KV cache on 2 MiB "
                    "pages in %.1f s%s", self.huge_bytes >> 20, self.total >> 20,
                    self.seconds, "" if self.error is None else " (%s)" % self.error)

    def _collapse(self):
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                if "[never]" in f.read():  # the host's operator turned them off: so be it
                    return "transparent huge pages are off on this host (enabled: never)"
        except OSError:
            pass
        for a, b in self.ranges:
            if _madvise(a, b - a, _MADV_HUGEPAGE) != 0:
                return "MADV_HUGEPAGE: %s" % os.strerror(ctypes.get_errno())

        def done(n):
            self.huge_bytes += n
            _count(kv_cache_huge_bytes=n)
        return _collapse_pages(self.ranges, lambda: self._stop, done)

    def wait(self, timeout=None) -> bool:
        """True once the thread has ended."""
        self._thread.join(timeout)
        return not self._thread.is_alive()

    def close(self) -> None:
        self._stop = True
        if self._thread.is_alive():
            self._thread.join()


def _tmpfs_huge(directory: str):
    """What makes a tmpfs directory's pages 2 MiB by itself ("huge=always", "huge=within_size"
    of its mount, or "shmem_enabled=force"), or None."""
    try:
        with open("/sys/kernel/mm/transparent_hugepage/shmem_enabled") as f:
            if "[force]" in f.read():
                return "shmem_enabled=force"
    except OSError:
        pass
    path = os.path.realpath(directory)
    best, options = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                fields = line.split()
                mount = fields[4].replace("\\040", " ")
                tail = fields[fields.index("-") + 1:]
                if (path == mount or path.startswith(mount.rstrip("/") + "/")) \
                        and len(mount) >= len(best):
                    best, options = mount, tail[2] if tail[0] == "tmpfs" else ""
    except (OSError, ValueError, IndexError):
        return None
    for option in options.split(","):
        if option in ("huge=always", "huge=within_size"):
            return option
    return None


class _SharedCache:
    """The prefill engine's KV cache moved into one shared file (transfer "cache"): vLLM
    writes each layer's KV there itself, and a decode engine on this host copies a prompt's
    blocks straight out of it (pread into its own cache: one copy, and no mapping of
    another process's memory that a truncation could turn into SIGBUS).

    The move is of the memory, not of the tensors: the whole pages of each storage vLLM
    allocated (one buffer for every layer in vLLM 0.32) are mapped again, at the same
    addresses, onto the file (mmap MAP_FIXED | MAP_SHARED), so every tensor over them, whoever
    made it (MLA's and Mamba's layers bind views of their own), keeps its pointer and now
    writes into the file. Their bytes are vLLM's zeros (nothing ran on the cache yet), as the
    file's are. The storage's first and last pages, which it shares with the allocator's
    header or another allocation, stay private; sync_edges writes its bytes there into the
    file before each entry is published. The private pages are given back before the file's
    are allocated, so the cache is never held twice."""

    def __init__(self, options, caches: dict):
        self.path = None
        self.layers = {}  # name -> {"offset", "shape", "stride", "dim", "dtype"}
        page = mmap.PAGESIZE
        spans = {}  # storage data pointer -> its end
        for name, (tensor, dim) in caches.items():
            if tensor.device.type != "cpu":
                raise ValueError("layer %s's KV cache is on %s: a shared KV cache file is "
                                 "host memory" % (name, tensor.device))
            if _pieces(list(tensor.shape), list(tensor.stride()), dim,
                       tensor.element_size()) is None:
                raise ValueError("layer %s's KV cache (shape %s, strides %s) is not contiguous "
                                 "within a block" % (name, list(tensor.shape),
                                                     list(tensor.stride())))
            storage = tensor.untyped_storage()
            spans[storage.data_ptr()] = storage.data_ptr() + storage.nbytes()
        # Each storage's pages [lo, hi) at a file offset with the address's place in a 2 MiB
        # page (huge pages can back both). Only its whole pages are mapped onto the file: a
        # first or last page it shares (with the allocator's header, another allocation) stays
        # private, and those of its bytes are written into the file before each entry that
        # could name them (sync_edges).
        self._storages = []  # (start, end, file offset of lo, lo)
        total = 0
        for start, end in sorted(spans.items()):
            lo = start // page * page
            offset = -(-total // _CACHE_ALIGN) * _CACHE_ALIGN + lo % _CACHE_ALIGN
            self._storages.append((start, end, offset, lo))
            total = offset + -(-end // page) * page - lo
        total = -(-total // _CACHE_ALIGN) * _CACHE_ALIGN
        for name, (tensor, dim) in caches.items():
            start, _, offset, lo = next(x for x in self._storages
                                        if x[0] == tensor.untyped_storage().data_ptr())
            self.layers[name] = {
                "offset": offset + tensor.data_ptr() - lo,
                "shape": list(tensor.shape), "stride": list(tensor.stride()), "dim": dim,
                "dtype": expert_arena._stream_name(tensor.dtype)}
        free = os.statvfs(options.directory)
        if free.f_bavail * free.f_frsize < total:
            raise OSError(errno.ENOSPC, "%s has %d MiB free, the KV cache takes %d MiB" % (
                options.directory, free.f_bavail * free.f_frsize >> 20, total >> 20))
        while True:
            name = "ea-kvcache-%s-%d-%s" % (options.name, os.getpid(), secrets.token_hex(4))
            path = os.path.join(options.directory, name)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW
                         | os.O_CLOEXEC, 0o600)
            fcntl.flock(fd, fcntl.LOCK_SH)  # alive; released by the kernel at a kill
            try:
                if os.lstat(path).st_ino == os.fstat(fd).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)  # swept (taken for a dead engine's) before it was locked: anew
        try:
            os.ftruncate(fd, total)
            # The whole pages go back to the kernel first (zeros stay zeros), then the file's
            # pages are allocated: a full file system is an error here, with nothing moved
            # yet, never a SIGBUS at a later touch.
            whole = [(-(-start // page) * page, end // page * page, offset, lo)
                     for start, end, offset, lo in self._storages]
            for first, last, _, _ in whole:
                if last > first:
                    _LIBC.madvise(first, last - first, _MADV_DONTNEED)
            os.posix_fallocate(fd, 0, total)
            for first, last, offset, lo in whole:
                if last <= first:
                    continue
                got = _LIBC.mmap(first, last - first, mmap.PROT_READ | mmap.PROT_WRITE,
                                 mmap.MAP_SHARED | _MAP_FIXED, fd, offset + first - lo)
                if got != first:
                    err = ctypes.get_errno()
                    raise OSError(err, "mapping the KV cache onto %s: %s" % (
                        path, os.strerror(err)))
        except BaseException:
            os.close(fd)
            _unlink(path)
            raise
        self.path, self._fd, self.total = path, fd, total
        # On 2 MiB pages: a decode engine's pread copies from them at 0.84-1.05x of a memcpy,
        # from 4 KiB pages at 0.49-0.60x (bench/kv_connector_bench.py, --directory on a
        # huge=always tmpfs against /dev/shm), and the prefill engine's attention walks fewer
        # pages. A tmpfs mounted huge=always or within_size gave them already; elsewhere a
        # thread collapses the cache (MADV_COLLAPSE, Linux 6.1+, whatever the mount's huge=)
        # while the engine goes on starting: fresh 2 MiB pages cost seconds per GiB in some
        # VMs. Where the kernel cannot, the cache stays on 4 KiB pages.
        self.huge_bytes = 0
        self.collapse_error = None
        self.directory_huge = _tmpfs_huge(options.directory)
        self._stop = False
        huge = 2 << 20
        ranges = [(-(-first // huge) * huge, last // huge * huge) for first, last, _, _ in whole]
        self._collapser = threading.Thread(target=self._collapse,
                                           args=([r for r in ranges if r[1] > r[0]],),
                                           name="expert_arena-kv-collapse", daemon=True)
        self._collapser.start()

    def _collapse(self, ranges) -> None:
        """One 2 MiB page at a time, each collapsed at most once: on Linux 6.18 a collapse over
        a page that is 2 MiB already makes later writes through the mapping miss the file
        (docs/page-backing.md), hence also none on a tmpfs that makes 2 MiB pages itself."""
        start = time.monotonic()
        if self.directory_huge:
            self.collapse_error = "the tmpfs makes 2 MiB pages itself (%s)" % self.directory_huge
            ranges = []

        def done(n):
            self.huge_bytes += n
        error = _collapse_pages(ranges, lambda: self._stop, done)
        if error is not None:
            self.collapse_error = error
        logger.info("expert_arena.vllm_kv: %d of %d MiB of the KV cache on 2 MiB pages in "
                    "%.1f s%s", self.huge_bytes >> 20, self.total >> 20,
                    time.monotonic() - start,
                    "" if self.collapse_error is None else " (%s)" % self.collapse_error)

    def mismatch(self, caches: dict, block_ids):
        """What differs between this engine's memory and the file in the first 4 KiB of a
        save's first and last blocks of one layer (None: nothing): the file must be what the
        engine computed (a kernel that lost writes to a collapsed page would show here)."""
        name = next(iter(caches))
        tensor, dim = caches[name]
        elsize = tensor.element_size()
        count, run, _ = _pieces(list(tensor.shape), list(tensor.stride()), dim, elsize)
        for b in dict.fromkeys((block_ids[0], block_ids[-1])):
            step = tensor.stride(dim) * elsize * b
            n = min(run, 4096)
            mine = ctypes.string_at(tensor.data_ptr() + step, n)
            theirs = os.pread(self._fd, n, self.layers[name]["offset"] + step)
            if mine != theirs:
                return ("block %d of layer %s reads back from %s unlike the engine's memory "
                        "(%d MiB on 2 MiB pages)" % (b, name, self.path, self.huge_bytes >> 20))
        return None

    def sync_edges(self) -> None:
        """The bytes of each storage in its first and last pages (kept private) written into
        the file: what vLLM wrote there is in the file for the entries published after."""
        page = mmap.PAGESIZE
        for start, end, offset, lo in self._storages:
            first, last = -(-start // page) * page, end // page * page
            edges = [(start, end)] if last <= first else [(start, first), (last, end)]
            for at, stop in edges:
                if stop > at:
                    os.pwrite(self._fd, ctypes.string_at(at, stop - at), offset + at - lo)

    def close(self) -> None:
        """Removes the file (the engine's tensors keep their mapping until they go)."""
        if self.path is not None:
            self._stop = True
            self._collapser.join()
            _unlink(self.path)
            os.close(self._fd)
            self.path = None


def _check_cache_layer(name, desc, file_size: int, elsize: int) -> None:
    """Raises ValueError unless `desc` (an entry's description of one layer of a shared KV
    cache file) has the form of one and lies inside the file's `file_size` bytes."""
    if not isinstance(desc, dict):
        raise ValueError("layer %s of the cache is not described" % _SHOWN.repr(name))
    offset, shape, stride, dim = (desc.get(k) for k in ("offset", "shape", "stride", "dim"))
    def ints(xs):
        return isinstance(xs, list) and all(type(x) is int and x >= 0 for x in xs)
    if type(offset) is not int or offset < 0 or not ints(shape) or not ints(stride) \
            or len(shape) != len(stride) or not shape or type(dim) is not int \
            or not 0 <= dim < len(shape):
        raise ValueError("layer %s of the cache: offset, shape, stride or dim is not one"
                         % _SHOWN.repr(name))
    last = sum((n - 1) * s for n, s in zip(shape, stride)) if all(shape) else -1
    if offset + (last + 1) * elsize > file_size:
        raise ValueError("layer %s of the cache ends past the %d bytes of the cache file"
                         % (_SHOWN.repr(name), file_size))
    if _pieces(shape, stride, dim, elsize) is None:
        raise ValueError("layer %s of the cache is not contiguous within a block"
                         % _SHOWN.repr(name))


def _block_runs(desc: dict, src_blocks, target, dim: int, dst_ids) -> list:
    """[source offset, destination address, bytes] of every run that copies block
    src_blocks[i] of a layer laid out as `desc` says (offset, shape, stride, dim; in bytes
    from the source's start, a file or a tensor) into target's block dst_ids[i] along `dim`,
    adjacent runs merged. ValueError when the layouts' blocks differ or a block is out of
    range."""
    elsize = target.element_size()
    src_count, run, src_steps = _pieces(desc["shape"], desc["stride"], desc["dim"], elsize)
    dst = _pieces(list(target.shape), list(target.stride()), dim, elsize)
    if dst is None or dst[:2] != (src_count, run):
        raise ValueError("the producer's blocks are %d runs of %d bytes, this engine's are not"
                         % (src_count, run))
    src_runs = _piece_offsets(desc["shape"][:desc["dim"]], src_steps)
    dst_runs = _piece_offsets(list(target.shape[:dim]), dst[2])
    src_block = desc["stride"][desc["dim"]] * elsize
    dst_block = target.stride(dim) * elsize
    base = target.data_ptr()
    runs = []
    for s, d in zip(src_blocks, dst_ids):
        if not 0 <= s < desc["shape"][desc["dim"]]:
            raise ValueError("block %d is not one of the producer's %d" % (
                s, desc["shape"][desc["dim"]]))
        if not 0 <= d < target.shape[dim]:
            raise ValueError("block %d is not one of this engine's %d" % (d, target.shape[dim]))
        for so, do in zip(src_runs, dst_runs):
            off = desc["offset"] + s * src_block + so
            addr = base + d * dst_block + do
            if runs and runs[-1][0] + runs[-1][2] == off and runs[-1][1] + runs[-1][2] == addr:
                runs[-1][2] += run
            else:
                runs.append([off, addr, run])
    return runs


def _runs_array(runs: list):
    return numpy.array(runs, dtype=numpy.uint64).reshape(-1, 3)


def _read_runs(fd: int, runs: list, source=None) -> int:
    """The runs (file offset, address, bytes) read from `fd` in one call without the GIL:
    copied out of `source`, the file mapped (_core.MappedFile), when given, else with pread
    (_core.read_runs); a file shorter than they say (truncated under the copy too) is a
    ValueError."""
    try:
        if source is not None:
            return source.copy_runs(_runs_array(runs))
        return expert_arena._core.read_runs(fd, _runs_array(runs))
    except ValueError as e:
        raise ValueError("the cache file is shorter than the entry says (%s)" % e) from None


def _cache_target(cache, dim: int, dst_blocks, staged: bool):
    """(where the blocks are copied to, its block ids): the cache itself when it is in host
    memory, else (or `staged`) a host tensor of the blocks, scattered into the cache after."""
    if cache.device.type == "cpu" and not staged:
        return cache, list(dst_blocks)
    shape = list(cache.shape)
    shape[dim] = len(dst_blocks)
    return torch.empty(shape, dtype=cache.dtype), list(range(len(dst_blocks)))


def copy_cache_blocks(fd: int, desc: dict, src_blocks, cache, dim: int, dst_blocks,
                      staged: bool = False, source=None) -> int:
    """Copies blocks src_blocks[i] of one layer of a shared KV cache file (open at `fd`,
    described by `desc`, checked by _check_cache_layer) into `cache`'s blocks dst_blocks[i]
    along `dim`, every run read in one call without the GIL: straight into a host cache,
    through a host tensor into a device's (`staged` takes that way for a host cache too);
    out of `source`, the file mapped (_core.MappedFile), when given, else with pread.
    Returns the bytes copied; a file shorter than the entry says is a ValueError."""
    target, dst_ids = _cache_target(cache, dim, dst_blocks, staged)
    total = _read_runs(fd, _block_runs(desc, src_blocks, target, dim, dst_ids), source)
    if target is not cache:
        scatter_blocks(cache, dim, list(dst_blocks), target.to(cache.device))
    return total


@dataclasses.dataclass
class _Save:
    req_id: str
    block_ids: list
    tokens: int   # of its whole blocks
    digest: str   # of those tokens (the entry's name)
    tail: Any = None  # {"tokens", "digest"}: the partial block after them (tail_digest)


@dataclasses.dataclass
class _Load:
    req_id: str
    block_ids: list  # the engine's blocks that receive the entry's blocks first..first+count
    first: int
    # One per tensor-parallel rank: an index entry's path, or the entry itself when it came
    # with the request (kv_transfer_params of a prefill engine on another host).
    entries: list
    tokens: int = 0  # loaded (the last block partial when the entry's tail is)


@dataclasses.dataclass
class _Job:
    """A load between its three steps: begun on the engine's thread (the entry read, checked
    and claimed: every system call but the copy), copied (on the loader's thread when the load
    is asynchronous), ended on the engine's thread (checked again, let go of)."""
    load: _Load
    path: Any                   # its local index entry; None: it came with the request
    last_reader: bool = False   # this engine removes the entry once it copied
    entry_fd: Any = None        # a shared cache's entry, locked (shared) until the end
    cache_fd: Any = None        # the prefill engine's shared KV cache file
    source: Any = None          # ... mapped (_core.MappedFile), or None: read with pread
    mapped: bool = False        # copied out of `source`
    runs: list = dataclasses.field(default_factory=list)    # read from it: [offset, addr, n]
    staged: list = dataclasses.field(default_factory=list)  # (device cache, dim, host blocks)
    layers: list = dataclasses.field(default_factory=list)  # segments: (name, (desc, shape))
    views: list = dataclasses.field(default_factory=list)   # ... opened, released at the end
    nbytes: int = 0
    error: Any = None           # what the copy raised

    def close(self) -> None:
        for view in self.views:
            view.release()
        self.views = []
        self.source = None
        for fd in (self.cache_fd, self.entry_fd):
            if fd is not None:
                os.close(fd)  # (an entry's lock with it)
        self.cache_fd = self.entry_fd = None


def _contiguous_strides(shape) -> list:
    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return strides


@dataclasses.dataclass
class _CacheSend:
    """A request whose blocks a decode engine copies from this engine's shared KV cache
    (transfer "cache"): vLLM keeps them until finished_sending names it. Its entry's open file
    (None: not published, or let go) is what decode engines lock (flock, shared) while they
    copy: the blocks are let go once the entry is read by its last reader (unlinked by it),
    withdrawn or expired (unlinked here), and an exclusive lock shows nobody copies."""
    fd: Any
    path: str
    time: float
    withdrawn: bool = False
    finished: bool = False  # vLLM finished the request (its blocks wait for this engine)


@dataclasses.dataclass
class ExpertArenaConnectorMetadata(KVConnectorMetadata):
    saves: list = dataclasses.field(default_factory=list)
    loads: list = dataclasses.field(default_factory=list)
    aborted: list = dataclasses.field(default_factory=list)  # request ids
    # Requests vLLM preempted whose blocks a shared cache's entry names: vLLM freed those
    # blocks, another request may write them in this very step.
    preempted: list = dataclasses.field(default_factory=list)
    release: list = dataclasses.field(default_factory=list)  # held beyond half the cache


def scatter_blocks(cache, dim: int, block_ids, src) -> None:
    """cache's blocks block_ids[i] (along `dim`) = src's block i: one copy_ per run of
    consecutive blocks (index_copy_ of bf16 ran at half the speed of copy_ here)."""
    i, n = 0, len(block_ids)
    while i < n:
        j = i + 1
        while j < n and block_ids[j] == block_ids[j - 1] + 1:
            j += 1
        cache.narrow(dim, block_ids[i], j - i).copy_(src.narrow(dim, i, j - i))
        i = j


def gather_blocks(cache, dim: int, block_ids, out) -> None:
    """out (host memory, the blocks along `dim`) = cache's blocks block_ids: gathered straight
    into `out` from a host cache (one index_select), on the device first from a device's."""
    index = torch.tensor(block_ids, dtype=torch.long, device=cache.device)
    if cache.device.type == "cpu":
        torch.index_select(cache, dim, index, out=out)
    else:
        out.copy_(torch.index_select(cache, dim, index))  # synchronous: published after


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
        return int(get_tensor_model_parallel_rank())
    except Exception:  # no parallel state (a scheduler process): rank 0
        return 0


def _aborted_status(request) -> bool:
    status = getattr(request, "status", None)
    name = getattr(status, "name", str(status))
    return name in ("FINISHED_ABORTED", "FINISHED_ERROR")


class ExpertArenaConnector(KVConnectorBase_V1):
    """A KVConnectorBase_V1 over the package's stream segments (module docstring)."""

    def __init__(self, vllm_config, role, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        config = vllm_config.kv_transfer_config
        self._options = _Options(dict(config.kv_connector_extra_config or {}))
        self._saves_kv = bool(config.is_kv_producer)
        self._loads_kv = bool(config.is_kv_consumer)
        self._block_size = int(vllm_config.cache_config.block_size)
        if self._block_size % HASH_TOKENS:
            raise ValueError("expert_arena.vllm_kv: the block size (%d) must be a multiple of "
                             "%d tokens" % (self._block_size, HASH_TOKENS))
        self._identity = _identity(vllm_config, kv_cache_config)
        self._tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self._async = self._options.load == "async"
        self._lock = threading.Lock()
        if role == KVConnectorRole.SCHEDULER:
            self._need_load: dict = {}       # req id -> (entry paths, first block, count)
            self._ready_loads: list = []     # _Load of this step (blocks allocated)
            self._load_failed: set = set()   # req ids whose asynchronous load failed
            self._saving: dict = {}          # req id -> [request, block ids]
            self._saved: dict = {}           # req id -> its entry's digest (None: no block)
            self._cache_saved: set = set()   # req ids of saves (transfer "cache")
            self._held: dict = {}            # ... finished, their blocks held: id -> count
            self._release: list = []         # ... to let go of before they are read
            self._num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
            self._aborted: list = []
            self._refused: set = set()       # entries already refused (one warning each)
        else:
            self._rank = _tp_rank()
            self._caches: dict = {}          # layer name -> (tensor, block dim)
            self._layout_problem = None
            self._producer = None
            self._consumer = None
            self._pending: dict = {}         # req id -> {"save": _Save, "layers": {name: desc}}
            self._published: dict = {}       # req id -> (keys, entry path, time)
            self._cache = None               # _SharedCache (transfer "cache", a producer)
            self._host_pages = None          # _HostPages (a decode engine's own cache)
            self._mapped: dict = {}          # (st_dev, st_ino) -> _core.MappedFile
            self._sends: dict = {}           # req id -> _CacheSend (transfer "cache")
            self._load_errors: set = set()
            self._loader = None              # the thread of asynchronous loads, once started
            self._loads = None               # its queue of _Job (None: stop)
            self._copied: list = []          # jobs it copied, ended by get_transfer_results
            self._recv_done: set = set()     # req ids whose asynchronous load ended
            self._recv_failed: set = set()   # ... and failed (their tokens are computed)
            self._closed = False
            # Segments of producers that were killed (spilled ones too): swept before this
            # engine adds its own. A producer sweeps both again as it starts.
            for directory in dict.fromkeys((self._options.directory,
                                            self._options.spill_directory)):
                if directory != self._options.directory and not os.path.isdir(directory):
                    continue  # no producer made it yet
                try:
                    expert_arena.sweep(directory)
                except OSError as e:
                    logger.warning("expert_arena.vllm_kv: sweeping %s: %s", directory, e)
            try:
                _remove_abandoned_temporaries(self._options.directory,
                                              self._options.owns)
                _sweep_cache_files(self._options.directory, self._options.name)
            except OSError as e:
                logger.warning("expert_arena.vllm_kv: listing %s: %s", self._options.directory, e)
            if self._saves_kv:
                listening = {}
                if self._options.listen is not None:
                    listening = dict(listen=self._options.listen,
                                     listen_token=self._options.listen_token)
                self._producer = expert_arena.StreamProducer(
                    self._options.directory, logical_name="kv-" + self._options.name,
                    segment_bytes=self._options.segment_bytes,
                    max_segments=self._options.max_segments,
                    spill_directory=self._options.spill_directory, quiet=True, **listening)
                self._remove_orphan_entries()
            if self._loads_kv:
                remote = {}
                if self._options.remote_token:
                    remote = dict(remote_token=self._options.remote_token)
                self._consumer = expert_arena.StreamConsumer(
                    self._options.directory, spill_directory=self._options.spill_directory,
                    quiet=True, **remote)
            atexit.register(self.shutdown)

    # ---------------------------------------------------------------- scheduler side

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int):
        if not self._loads_kv or not self._plain_text(request):
            return 0, False
        with self._lock:
            if request.request_id in self._load_failed:
                # vLLM computes it from scratch now; matching it again would load it again.
                return 0, False
        tokens = list(request.prompt_token_ids or [])
        # vLLM computes at least the prompt's last token itself (it needs its logits). An
        # entry is found by the whole blocks of a prefix; the tail after them is loaded too
        # when it is this prompt's (_tail_tokens), alone when the whole blocks are this
        # engine's already (its prefix cache: num_computed_tokens is `limit` then).
        limit = (len(tokens) - 1) // self._block_size * self._block_size
        if limit == 0 or limit < num_computed_tokens:
            return 0, False
        _count(lookups=1)
        digests = prompt_digests(tokens[:limit])
        params = getattr(request, "kv_transfer_params", None)
        if isinstance(params, dict) and "expert_arena" in params:
            return self._match_remote(request, params["expert_arena"], tokens, digests, limit,
                                      num_computed_tokens)
        # From the longest prefix down to the blocks this engine has (only a tail to load
        # there), never an empty one.
        shortest = max(num_computed_tokens, self._block_size)
        for length in range(limit, shortest - 1, -self._block_size):
            digest = digests[length // HASH_TOKENS - 1]
            paths = [self._options.entry_path(digest, r) for r in range(self._tp_size)]
            entry = self._usable_entry(paths[0], length)
            if entry is None:
                continue
            if not all(os.path.exists(p) for p in paths[1:]):
                continue
            loaded = length + _tail_tokens(entry, tokens, length, self._block_size)
            if loaded <= num_computed_tokens:  # no tail: this engine has its blocks
                break
            return self._matched(request, paths, loaded, num_computed_tokens)
        return 0, False

    def _matched(self, request, entries, tokens: int, num_computed_tokens: int):
        """Loads tokens num_computed_tokens ... tokens of the request from `entries`: whole
        blocks (the first already this engine's, from its prefix cache), and the last one
        partial when the entry's tail is loaded (vLLM computes the rest of that block)."""
        with self._lock:
            self._need_load[request.request_id] = (
                entries, num_computed_tokens // self._block_size,
                -(-(tokens - num_computed_tokens) // self._block_size),
                tokens - num_computed_tokens)
        return tokens - num_computed_tokens, self._async

    def _match_remote(self, request, params, tokens: list, digests, limit: int,
                      num_computed_tokens: int):
        """get_num_new_matched_tokens for a request that came with a remote prefill engine's
        entries (kv_transfer_params, which a client of vLLM's server can send too: checked
        like a file, and only the remote_producers' addresses are fetched from)."""
        try:
            entries = params.get("entries") if isinstance(params, dict) else None
            if not isinstance(entries, list) or len(entries) != self._tp_size:
                raise ValueError("not one entry per tensor-parallel rank (%d)" % self._tp_size)
            entries = [_checked_entry(e, "entry %d" % i) for i, e in enumerate(entries)]
            for i, e in enumerate(entries):
                if "cache" in e:
                    raise ValueError("entry %d names a prefill engine's KV cache file: such "
                                     "entries are read from this host's index, never taken "
                                     "from a request" % i)
            if not self._options.remote_producers:
                raise ValueError("they name a prefill engine on another host, and this "
                                 "engine's remote_producers is empty")
            length = entries[0]["tokens"]
            if any(e["tokens"] != length for e in entries) or length % self._block_size \
                    or length > limit:
                raise ValueError("%d tokens do not fit this prompt's %d loadable tokens in "
                                 "blocks of %d" % (length, limit, self._block_size))
            tail = _tail_tokens(entries[0], tokens, length, self._block_size)
            for i, e in enumerate(entries):
                if e.get("digest") != digests[length // HASH_TOKENS - 1]:
                    raise ValueError("entry %d is the KV of other tokens than this prompt's" % i)
                if e.get("tail") != entries[0].get("tail"):
                    raise ValueError("entry %d's tail is not entry 0's" % i)
                differences = _differences(self._identity, e["identity"])
                if differences:
                    raise ValueError("entry %d: %s" % (i, "; ".join(differences)))
                for name, hexed in e["layers"].items():
                    try:
                        fields = expert_arena.decode_descriptor(bytes.fromhex(hexed))
                    except ValueError as why:
                        raise ValueError("entry %d: layer %s's descriptor: %s"
                                         % (i, _SHOWN.repr(name), why)) from None
                    address = fields.get("remote")
                    if address not in self._options.remote_producers:
                        raise ValueError("entry %d: layer %s is served by %r, not one of "
                                         "remote_producers" % (i, _SHOWN.repr(name), address))
        except (ValueError, TypeError, AttributeError, OSError) as e:
            _count(refused=1)
            logger.warning("expert_arena.vllm_kv: refusing the KV in the kv_transfer_params of "
                           "request %s: %s; computing the prompt", request.request_id, e)
            return 0, False
        if length + tail <= num_computed_tokens:
            return 0, False
        return self._matched(request, entries, length + tail, num_computed_tokens)

    def _plain_text(self, request) -> bool:
        # The tokens alone do not identify a prompt with images or a LoRA adapter.
        return not getattr(request, "mm_features", None) and \
            getattr(request, "lora_request", None) is None

    def _usable_entry(self, path: str, length: int):
        try:
            entry = _read_entry(path)
        except (OSError, ValueError) as e:
            self._refuse_once(path, "expert_arena.vllm_kv: %s; computing the prompt" % e)
            return None
        if entry is None:
            return None
        differences = _differences(self._identity, entry["identity"])
        if entry["tokens"] < length:
            differences.append("the entry holds %d tokens, not %d" % (entry["tokens"], length))
        if differences:
            self._refuse_once(path, "expert_arena.vllm_kv: refusing the KV of %s (producer %s): "
                              "%s; computing the prompt" % (path, entry.get("producer"),
                                                            "; ".join(differences)))
            return None
        return entry

    def _refuse_once(self, path, message):
        _count(refused=1)
        with self._lock:
            if path in self._refused:
                return
            self._refused.add(path)
        logger.warning("%s", message)

    def update_connector_output(self, connector_output):
        failed = getattr(connector_output, "failed_recving", None)
        sent = getattr(connector_output, "finished_sending", None)
        with self._lock:
            if failed:
                self._load_failed.update(failed)
            for req_id in sent or ():
                self._held.pop(req_id, None)

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        with self._lock:
            load = self._need_load.pop(request.request_id, None)
            if load is not None and num_external_tokens > 0:
                # The request's blocks (the ones it holds already first): the load goes out
                # with this step's metadata, whether or not the request runs in it (an
                # asynchronous one waits for it).
                entries, first, count, tokens = load
                block_ids = list(blocks.get_block_ids()[0])
                self._ready_loads.append(_Load(request.request_id,
                                               block_ids[first:first + count], first, entries,
                                               tokens))
            if self._saves_kv and self._plain_text(request) \
                    and request.request_id not in self._saved:
                self._saving[request.request_id] = [request, None]

    def build_connector_meta(self, scheduler_output) -> KVConnectorMetadata:
        meta = ExpertArenaConnectorMetadata()
        with self._lock:
            meta.loads, self._ready_loads = self._ready_loads, []
            for load in meta.loads:
                _count(matched_tokens=load.tokens)
            for new in scheduler_output.scheduled_new_reqs:
                block_ids = list(new.block_ids[0])
                if new.req_id in self._saving:
                    self._saving[new.req_id][1] = block_ids
            cached = scheduler_output.scheduled_cached_reqs
            resumed = getattr(cached, "resumed_req_ids", set())
            for i, req_id in enumerate(cached.req_ids):
                state = self._saving.get(req_id)
                new_ids = cached.new_block_ids[i]
                if state is None or new_ids is None:
                    continue
                if req_id in resumed or state[1] is None:
                    state[1] = list(new_ids[0])
                else:
                    state[1].extend(new_ids[0])
            for req_id, state in list(self._saving.items()):
                request, block_ids = state
                scheduled = scheduler_output.num_scheduled_tokens.get(req_id)
                if scheduled is None or block_ids is None:
                    continue
                prompt = list(request.prompt_token_ids or [])
                if request.num_computed_tokens + scheduled < len(prompt):
                    continue  # a chunk of a longer prefill: saved with its last chunk
                del self._saving[req_id]
                self._saved[req_id] = None
                # The blocks a decode engine of this prompt loads: every token but the last,
                # which it computes (it needs its logits). The entry is named by its whole
                # blocks (a decode engine finds a prefix of its own prompt by them); the
                # partial block after them is its tail, loaded by a prompt of these tokens.
                loadable = len(prompt) - 1
                full = loadable // self._block_size
                if full <= 0:
                    continue
                whole = full * self._block_size
                digest = prompt_digests(prompt[:whole])[-1]
                tail = None
                if loadable > whole:
                    tail = {"tokens": loadable - whole, "digest": tail_digest(prompt[:loadable])}
                self._saved[req_id] = digest
                meta.saves.append(_Save(req_id, block_ids[:full + (tail is not None)], whole,
                                        digest, tail))
                if self._options.transfer == "cache":
                    self._cache_saved.add(req_id)
            meta.aborted, self._aborted = self._aborted, []
            preempted = getattr(scheduler_output, "preempted_req_ids", None) or ()
            meta.preempted = [r for r in preempted if r in self._cache_saved]
            meta.release, self._release = self._release, []
        return meta

    def request_finished(self, request, block_ids):
        digest = None
        with self._lock:
            self._need_load.pop(request.request_id, None)
            self._load_failed.discard(request.request_id)
            self._saving.pop(request.request_id, None)
            if request.request_id in self._saved:
                digest = self._saved.pop(request.request_id)
                if _aborted_status(request):
                    self._aborted.append(request.request_id)
                    digest = None
            delayed = request.request_id in self._cache_saved
            self._cache_saved.discard(request.request_id)
            if delayed:
                # Half the cache at most is held for decode engines: beyond, the oldest
                # go as if expired, and the prefill engine never waits ttl_seconds for blocks
                # of its own.
                self._held[request.request_id] = len(block_ids or ())
                excess = sum(self._held.values()) - self._num_blocks // 2
                for req_id in list(self._held):
                    if excess <= 0 or not self._num_blocks:
                        break
                    if req_id not in self._release:
                        self._release.append(req_id)
                        excess -= self._held[req_id]
        if delayed:
            # A decode engine copies its blocks straight from this engine's KV cache: they
            # stay this request's until the worker reports them read, withdrawn (an abort),
            # expired or never published (finished_sending).
            return True, None
        # The saves ran inside the forward passes that computed the blocks: nothing of this
        # request's is read after it returns, so vLLM may free its blocks now. A listening
        # prefill engine hands the request's entries (their descriptors name its address) to
        # whoever routes the request on (vLLM returns them as the output's kv_transfer_params,
        # as its own NIXL connector does): a decode engine on another host loads from them.
        if digest is None or self._options.listen is None:
            return False, None
        entries = []
        for rank in range(self._tp_size):
            path = self._options.entry_path(digest, rank)
            try:
                entry = _read_entry(path)
            except (OSError, ValueError) as e:
                logger.warning("expert_arena.vllm_kv: request %s: %s", request.request_id, e)
                entry = None
            if entry is None:
                return False, None
            entries.append(entry)
        return False, {"expert_arena": {"entries": entries}}

    # ---------------------------------------------------------------- worker side

    def register_kv_caches(self, kv_caches: dict):
        num_blocks = getattr(self._kv_cache_config, "num_blocks", None)
        if num_blocks is None:
            num_blocks = self._vllm_config.cache_config.num_gpu_blocks
        caches = {}
        for name, tensor in kv_caches.items():
            if not isinstance(tensor, torch.Tensor):
                self._layout_problem = "layer %s's KV cache is a %s, not one tensor" % (
                    name, type(tensor).__name__)
                break
            dims = [d for d, n in enumerate(tensor.shape) if n == num_blocks]
            if len(dims) != 1:
                self._layout_problem = (
                    "layer %s's KV cache of shape %s has %s dimension of the %d blocks" % (
                        name, list(tensor.shape), "no" if not dims else "more than one",
                        num_blocks))
                break
            caches[name] = (tensor, dims[0])
        if self._layout_problem is not None:
            logger.warning("expert_arena.vllm_kv: %s: this engine neither saves nor loads KV",
                           self._layout_problem)
            caches = {}
        self._caches = caches
        if caches and self._saves_kv and self._options.transfer == "cache":
            try:
                self._cache = _SharedCache(self._options, caches)
            except (OSError, ValueError, RuntimeError, TypeError) as e:
                logger.warning("expert_arena.vllm_kv: the KV cache cannot be shared (%s): "
                               "prompts go through the stream's segments", e)
            else:
                logger.info("expert_arena.vllm_kv: the KV cache (%d MiB, %d layers) is %s",
                            self._cache.total >> 20, len(caches), self._cache.path)
        if caches and self._loads_kv and self._cache is None and self._options.huge_pages:
            pages = _HostPages(caches)
            if pages.total:  # (a device's cache has no host pages)
                self._host_pages = pages.start()

    def _layer_layout(self, tensor, dim):
        shape = list(tensor.shape)
        del shape[dim]
        return shape

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if self._producer is not None:
            for req_id in meta.preempted:  # before this step's forward may write the blocks
                send = self._sends.get(req_id)
                if send is not None and send.fd is not None and not send.withdrawn:
                    self._withdraw(send)
                    _count(withdrawn_requests=1)
            self._abort(meta.aborted)
            for req_id in meta.release:
                send = self._sends.get(req_id)
                if send is not None and send.fd is not None and not send.withdrawn:
                    self._withdraw(send)
                    _count(expired_requests=1)
            self._expire()
        if self._consumer is None:
            return
        for load in meta.loads:
            # Begun and ended on this thread; copied on the loader's for an asynchronous load,
            # in one call without the GIL (_Job).
            job = self._begin(load)
            if job is None:
                if self._async:
                    with self._lock:
                        self._recv_done.add(load.req_id)
                        self._recv_failed.add(load.req_id)
            elif self._async:
                self._submit(job)
            else:
                self._copy(job)
                self._end(job)

    def _submit(self, job: _Job) -> None:
        with self._lock:
            if self._loader is None:
                self._loads = queue.SimpleQueue()
                self._loader = threading.Thread(target=self._load_loop, daemon=True,
                                                name="expert_arena-kv-load")
                self._loader.start()
        self._loads.put(job)

    def _load_loop(self) -> None:
        """The thread of asynchronous loads: each job's bytes copied into its request's blocks
        (which vLLM schedules nothing on until it is reported), then handed back to the
        engine's thread, which ends it (get_transfer_results)."""
        while True:
            job = self._loads.get()
            if job is None:
                return
            self._copy(job)
            with self._lock:
                self._copied.append(job)

    def _end_copied(self) -> None:
        """Ends the asynchronous loads the loader copied since the last call: reported
        finished, and failed where they did (every one of their tokens is computed)."""
        with self._lock:
            copied, self._copied = self._copied, []
        for job in copied:
            ok = self._end(job)
            with self._lock:
                self._recv_done.add(job.load.req_id)
                if not ok:
                    self._recv_failed.add(job.load.req_id)

    def _begin(self, load: _Load):
        """The load's entry read and checked against this engine's KV cache, its reader's
        turn claimed, what to copy listed (_Job): every system call of a load but the copy,
        on the engine's thread. None when it cannot load (logged, its blocks computed)."""
        source = load.entries[self._rank] if self._rank < len(load.entries) else None
        # A remote entry (checked by the scheduler) has no file here: no claim, nothing to
        # remove; the producer frees each block when its readers released it, or expires it.
        path = source if isinstance(source, str) else None
        job = _Job(load=load, path=path)
        try:
            entry = self._locked_entry(job) if path else \
                source if isinstance(source, dict) else None
            if entry is None:
                raise ValueError("index entry %s is gone" % path)
            if "cache" in entry and path:
                self._begin_cache(job, entry)
            else:
                job.close()  # only a shared cache's entry is held (locked) until the end
                self._begin_segments(job, entry)
        except (OSError, ValueError) as e:
            logger.warning("expert_arena.vllm_kv: request %s: %s; recomputing %d blocks",
                           load.req_id, e, len(load.block_ids))
            job.close()
            self._failed(load, path)
            return None
        return job

    def _begin_segments(self, job: _Job, entry: dict) -> None:
        plan = self._load_plan(entry, job.load)
        turn = _claim(job.path, entry["readers"]) if job.path else 0
        if turn is None:
            raise ValueError("index entry %s was read by its %d readers already"
                             % (job.path, entry["readers"]))
        # Its last reader removes the entry: the blocks go back to the producer as this
        # engine releases each layer's view.
        job.last_reader = bool(job.path) and turn == entry["readers"] - 1
        job.layers = list(plan.items())

    def _locked_entry(self, job: _Job) -> dict:
        """The local entry of `job`, opened (job.entry_fd) and read under its shared lock: a
        shared cache's is withdrawn only under an exclusive one (a segments entry is never
        locked otherwise)."""
        path = job.path
        try:
            job.entry_fd = fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ValueError("index entry %s is gone" % path) from None
        for _ in range(_LOCK_TRIES):
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                time.sleep(0.001)
        else:
            raise ValueError("index entry %s stays locked" % path)
        if os.fstat(fd).st_nlink == 0:
            raise ValueError("index entry %s was withdrawn (its request aborted or "
                             "expired)" % path)
        return _parsed_entry(fd, path)

    def _begin_cache(self, job: _Job, entry: dict) -> None:
        """_begin of an entry naming blocks of a prefill engine's shared KV cache, copied from
        its file while this engine holds the entry's shared lock (the prefill engine frees the
        blocks only once it can lock the entry exclusively, after withdrawing it)."""
        path, load = job.path, job.load
        cache = entry.get("cache")
        if not cache or not _owned_cache_file(cache["file"], self._options.name):
            raise ValueError("index entry %s names %s, not a KV cache file of this "
                             "connector's name" % (path, _SHOWN.repr(cache and cache["file"])))
        blocks = cache["blocks"]
        if len(blocks) < load.first + len(load.block_ids):
            raise ValueError("index entry %s holds %d blocks, %d are needed" % (
                path, len(blocks), load.first + len(load.block_ids)))
        layers = self._checked_layers(entry)
        cache_path = os.path.join(self._options.directory, cache["file"])
        try:
            job.cache_fd = os.open(cache_path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except FileNotFoundError:
            raise ValueError("the producer's KV cache %s is gone" % cache_path) from None
        st = _own_file(job.cache_fd, "the producer's KV cache %s" % cache_path)
        size = st.st_size
        job.source = self._mapped_cache(job.cache_fd, st, cache_path)
        for name, desc in layers.items():
            tensor, dim = self._caches[name]
            mine = self._layer_layout(tensor, dim)
            dtype = expert_arena._stream_name(tensor.dtype)
            _check_cache_layer(name, desc, size, tensor.element_size())
            theirs = list(desc["shape"])
            del theirs[desc["dim"]]
            if desc.get("dtype") != dtype or theirs != mine:
                raise ValueError("layer %s: the producer's KV is %s %s blocks, this "
                                 "engine's are %s %s" % (name, _SHOWN.repr(desc.get("dtype")),
                                                          theirs, dtype, mine))
        src = blocks[load.first:load.first + len(load.block_ids)]
        for name, desc in layers.items():
            tensor, dim = self._caches[name]
            target, dst_ids = _cache_target(tensor, dim, load.block_ids, False)
            job.runs.extend(_block_runs(desc, src, target, dim, dst_ids))
            if target is not tensor:  # a device's cache: through host memory
                job.staged.append((tensor, dim, target))
        turn = _claim(path, entry["readers"])
        if turn is None:
            raise ValueError("index entry %s was read by its %d readers already"
                             % (path, entry["readers"]))
        job.last_reader = turn == entry["readers"] - 1

    def _mapped_cache(self, fd: int, st, path: str):
        """The prefill engine's KV cache file at `fd` mapped in this engine (one mapping per
        file, kept while it exists: its runs are then copied at memcpy's speed, without a
        system call per run), or None (it is read with pread)."""
        for key in [k for k, m in self._mapped.items() if not m.mapped]:
            del self._mapped[key]  # its file was removed: the mapping was let go
        key = (st.st_dev, st.st_ino)
        source = self._mapped.get(key)
        if source is None or source.size != st.st_size:
            try:
                source = expert_arena._core.MappedFile(fd, "the producer's KV cache %s" % path)
            except (OSError, ValueError) as e:
                logger.warning("expert_arena.vllm_kv: %s cannot be mapped (%s); it is read "
                               "with pread", path, e)
                source = None
            self._mapped[key] = source
        return source

    def _copy(self, job: _Job) -> None:
        """The job's bytes into this engine's KV cache: for a host cache every run in one
        call without the GIL (the loader's thread then needs the GIL back once or twice, not
        once per run from an engine whose step loop holds it). What fails is job.error."""
        load = job.load
        try:
            if job.cache_fd is not None:
                job.nbytes = _read_runs(job.cache_fd, job.runs, job.source)
                job.mapped = job.source is not None
                for cache, dim, target in job.staged:
                    scatter_blocks(cache, dim, load.block_ids, target.to(cache.device))
                return
            try:
                job.views = self._consumer.open_many([plan[0] for _, plan in job.layers])
            except (OSError, ValueError, RuntimeError) as e:
                job.error = "the producer's KV cannot be opened (%s)" % e
                return
            runs = []
            for (name, plan), view in zip(job.layers, job.views):
                cache, dim = self._caches[name]
                shape = plan[1]
                count = len(load.block_ids)
                if cache.device.type == "cpu":
                    desc = {"offset": 0, "shape": shape, "dim": dim,
                            "stride": _contiguous_strides(shape)}
                    base = view.address
                    for off, addr, n in _block_runs(desc, range(load.first, load.first + count),
                                                    cache, dim, load.block_ids):
                        runs.append([base + off, addr, n])
                else:
                    src = view.torch().narrow(dim, load.first, count)
                    scatter_blocks(cache, dim, load.block_ids, src.to(cache.device))
                    del src  # the share goes back when the view's last tensor does
                job.nbytes += count * math.prod(shape) // shape[dim] * cache.element_size()
            if runs:
                expert_arena._core.copy_runs(_runs_array(runs))
        except Exception as e:  # noqa: BLE001 - the engine keeps serving; vLLM recomputes
            job.error = "loading its KV failed (%s: %s)" % (type(e).__name__,
                                                           _SHOWN.repr(str(e)))

    def _end(self, job: _Job) -> bool:
        """A copied job checked (a shared cache's entry withdrawn meanwhile: the prefill engine
        may have written other KV into those blocks), its entry let go by its last reader, its
        files closed and views released; False (logged, its blocks computed) if it failed."""
        load, path = job.load, job.path
        try:
            if job.error is not None:
                raise ValueError(job.error)
            if job.entry_fd is not None and os.fstat(job.entry_fd).st_size == 0:
                # Withdrawn while this engine copied (its request preempted or aborted).
                raise ValueError("index entry %s was withdrawn while its blocks were copied"
                                 % path)
            if job.last_reader:
                _remove_entry(path)  # the producer lets go of the blocks
        except (OSError, ValueError) as e:
            logger.warning("expert_arena.vllm_kv: request %s: %s; recomputing %d blocks",
                           load.req_id, e, len(load.block_ids))
            self._failed(load, path)
            return False
        finally:
            job.close()
        _count(loaded_requests=1, loaded_blocks=len(load.block_ids), loaded_bytes=job.nbytes,
               loaded_mapped_bytes=job.nbytes if job.mapped else 0)
        return True

    def _checked_layers(self, entry) -> dict:
        """The entry's layers, if they are this engine's (else ValueError)."""
        if self._layout_problem is not None:
            raise ValueError(self._layout_problem)
        layers = entry["layers"]
        if set(layers) != set(self._caches):
            raise ValueError("the producer's layers (%d) are not this engine's (%d): %s" % (
                len(layers), len(self._caches),
                _SHOWN.repr(sorted(set(layers) ^ set(self._caches)))))
        return layers

    def _load_plan(self, entry, load: _Load) -> dict:
        """{layer: (descriptor bytes, the blocks' shape)} after checking every layer against
        this engine's KV cache: a mismatch raises ValueError before any byte is copied."""
        layers = self._checked_layers(entry)
        need = load.first + len(load.block_ids)
        plan = {}
        for name, hexed in layers.items():
            try:
                descriptor = bytes.fromhex(hexed)
            except ValueError:
                raise ValueError("layer %s's descriptor is not hex" % name) from None
            fields = expert_arena.decode_descriptor(descriptor)
            cache, dim = self._caches[name]
            theirs = list(fields["shape"])
            mine = self._layer_layout(cache, dim)
            dtype = expert_arena._stream_name(cache.dtype)
            if fields["dtype"] != dtype or len(theirs) != len(mine) + 1 \
                    or theirs[:dim] + theirs[dim + 1:] != mine:
                raise ValueError("layer %s: the producer's KV is %s %s, this engine's blocks are "
                                 "%s %s along dimension %d" % (name, fields["dtype"], theirs,
                                                               dtype, mine, dim))
            if theirs[dim] < need:
                raise ValueError("layer %s: the producer saved %d blocks, %d are needed" % (
                    name, theirs[dim], need))
            plan[name] = (descriptor, theirs)
        return plan

    def _failed(self, load: _Load, path) -> None:
        if not self._async:
            # A synchronous load failed in the step that computes the request: vLLM recomputes
            # these blocks. An asynchronous one is reported failed as a whole (_load_loop).
            with self._lock:
                self._load_errors.update(load.block_ids)
        _count(load_error_blocks=len(load.block_ids))
        if path:
            _remove_entry(path)

    def wait_for_layer_load(self, layer_name: str) -> None:
        # start_load_kv copied every layer already (a CPU copy has nothing to overlap with).
        return

    def save_kv_layer(self, layer_name: str, kv_layer, attn_metadata, **kwargs: Any) -> None:
        if self._producer is None or self._cache is not None or not self._has_meta():
            return  # (a shared cache: vLLM wrote the layer into it already)
        meta = self._get_connector_metadata()
        layer = self._caches.get(layer_name)
        if layer is None:
            return
        cache, dim = layer
        for save in meta.saves:
            state = self._pending.setdefault(save.req_id, {"save": save, "layers": {},
                                                           "failed": None})
            if state["failed"] is not None or layer_name in state["layers"]:
                continue
            key = "%s/%s" % (save.req_id, layer_name)
            shape = list(cache.shape)
            shape[dim] = len(save.block_ids)
            try:
                reservation = self._producer.reserve(key, tuple(shape), cache.dtype)
                with reservation:
                    gather_blocks(cache, dim, save.block_ids, reservation.torch())
                    state["layers"][layer_name] = reservation.publish(
                        readers=self._options.readers)
            except (OSError, ValueError, RuntimeError, TypeError) as e:
                state["failed"] = "layer %s: %s" % (layer_name, e)

    def _has_meta(self) -> bool:
        return self._connector_metadata is not None

    def wait_for_save(self):
        if self._producer is not None and self._options.transfer == "cache" \
                and self._has_meta():
            self._publish_cache_saves(self._get_connector_metadata().saves)
        if self._producer is None or not self._pending:
            return
        for req_id, state in list(self._pending.items()):
            save = state["save"]
            keys = ["%s/%s" % (req_id, n) for n in state["layers"]]
            if state["failed"] is None and set(state["layers"]) != set(self._caches):
                state["failed"] = "%d of %d layers were saved" % (len(state["layers"]),
                                                                   len(self._caches))
            path = self._options.entry_path(save.digest, self._rank)
            del self._pending[req_id]
            # A prompt published already (by this engine or another) is not published twice.
            if state["failed"] is not None or os.path.exists(path):
                if state["failed"] is not None:
                    logger.warning("expert_arena.vllm_kv: request %s's KV is not published: %s",
                                   req_id, state["failed"])
                for k in keys:
                    self._producer.abort(k)
                continue
            entry = {"version": ENTRY_VERSION, "producer": self._producer.instance_name,
                     "identity": self._identity, "tokens": save.tokens, "created": time.time(),
                     "digest": save.digest, **({"tail": save.tail} if save.tail else {}),
                     "readers": self._options.readers,
                     "layers": {n: d.hex() for n, d in state["layers"].items()}}
            try:
                _write_entry(path, entry)
            except OSError as e:
                logger.warning("expert_arena.vllm_kv: request %s: writing %s: %s", req_id, path, e)
                for k in keys:
                    self._producer.abort(k)
                continue
            with self._lock:
                self._published[req_id] = (keys, path, time.monotonic())
            nbytes = sum(expert_arena.decode_descriptor(d)["length"]
                         for d in state["layers"].values())
            _count(saved_requests=1, saved_blocks=len(save.block_ids), saved_bytes=nbytes)

    def _publish_cache_saves(self, saves) -> None:
        """Entries naming each save's blocks in the shared KV cache (transfer "cache"; with
        the cache private, the saves went through the segments and are only tracked here)."""
        for save in saves:
            path = self._options.entry_path(save.digest, self._rank)
            send = _CacheSend(None, path, time.monotonic())
            self._sends[save.req_id] = send
            # A prompt published already (by this engine or another) is not published twice.
            if self._cache is None or os.path.exists(path):
                continue
            self._cache.sync_edges()
            problem = self._cache.mismatch(self._caches, save.block_ids)
            if problem is not None:
                # Never a silently wrong prompt: nothing more is published from this cache,
                # and what was is withdrawn (decode engines compute those prompts).
                logger.error("expert_arena.vllm_kv: %s; this engine publishes no KV from its "
                             "cache any more", problem)
                for other in self._sends.values():
                    if other.fd is not None and not other.withdrawn:
                        self._withdraw(other)
                self._cache = None
                continue
            elsize = {n: t.element_size() for n, (t, _) in self._caches.items()}
            entry = {"version": ENTRY_VERSION, "producer": self._producer.instance_name,
                     "identity": self._identity, "tokens": save.tokens, "created": time.time(),
                     "digest": save.digest, **({"tail": save.tail} if save.tail else {}),
                     "readers": self._options.readers,
                     "layers": {n: self._cache.layers[n] for n in self._caches},
                     "cache": {"file": os.path.basename(self._cache.path),
                               "blocks": list(save.block_ids)}}
            try:
                send.fd = _write_entry(path, entry, keep=True)
            except OSError as e:
                logger.warning("expert_arena.vllm_kv: request %s: writing %s: %s", save.req_id,
                               path, e)
                continue
            nbytes = 0
            for n, layer in self._cache.layers.items():
                count, run, _ = _pieces(layer["shape"], layer["stride"], layer["dim"], elsize[n])
                nbytes += count * run * len(save.block_ids)
            _count(saved_requests=1, saved_blocks=len(save.block_ids), saved_bytes=nbytes)

    def _withdraw(self, send: _CacheSend) -> None:
        """The entry of `send` away (if it is still the one this engine wrote): no decode
        engine starts on it now, and one that copies from it meanwhile sees it emptied when it
        has copied (its last reader only removes it) and drops what it copied."""
        send.withdrawn = True
        os.ftruncate(send.fd, 0)
        try:
            if os.lstat(send.path).st_ino == os.fstat(send.fd).st_ino:
                _remove_entry(send.path)
        except FileNotFoundError:
            pass

    def _let_go_of_sends(self, finished_req_ids) -> set:
        """The requests whose blocks vLLM may free now (finished_sending): finished, and their
        entry never published, or read by its last reader, withdrawn or expired, with no
        decode engine copying (the entry's exclusive lock)."""
        now = time.monotonic()
        done = set()
        for req_id, send in list(self._sends.items()):
            if req_id in finished_req_ids:
                send.finished = True
            if send.fd is not None:
                if not send.withdrawn:
                    if os.fstat(send.fd).st_nlink == 0:
                        send.withdrawn = True  # its last reader removed it
                    elif now - send.time > self._options.ttl_seconds:
                        self._withdraw(send)
                        _count(expired_requests=1)
                if not send.withdrawn:
                    continue
                try:
                    fcntl.flock(send.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    continue  # a decode engine copies its blocks still
                os.close(send.fd)
                send.fd = None
            if send.finished:
                del self._sends[req_id]
                done.add(req_id)
        return done

    def _abort(self, req_ids) -> None:
        for req_id in req_ids:
            send = self._sends.get(req_id)
            if send is not None and send.fd is not None and not send.withdrawn:
                self._withdraw(send)
                _count(aborted_requests=1)
            with self._lock:
                published = self._published.pop(req_id, None)
            if published is None:
                continue
            keys, path, _ = published
            _remove_entry(path)
            for k in keys:
                self._producer.abort(k)
            _count(aborted_requests=1)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            old = [r for r, (_, _, t) in self._published.items()
                   if now - t > self._options.ttl_seconds]
        for req_id in old:
            with self._lock:
                keys, path, _ = self._published.pop(req_id)
            _remove_entry(path)
            for k in keys:
                self._producer.abort(k)
            _count(expired_requests=1)

    def _remove_orphan_entries(self) -> None:
        """Entries whose segments are all gone (their producer was killed, then swept), and
        readers' claims whose entry is gone."""
        names = os.listdir(self._options.directory)
        for name in names:
            if self._options.owns(name) and ".json.read" in name and \
                    name[:name.index(".json.read")] + ".json" not in names:
                _unlink(os.path.join(self._options.directory, name))
        for name in names:
            if not self._options.owns(name) or not name.endswith(".json"):
                continue
            path = os.path.join(self._options.directory, name)
            try:
                if os.lstat(path).st_uid != os.geteuid():
                    continue  # another user's: never read, not this engine's to remove
            except FileNotFoundError:
                continue
            try:
                entry = _read_entry(path)
                segments = set()
                if entry is not None and "cache" in entry:
                    segments.add(os.path.join(self._options.directory,
                                              os.path.basename(entry["cache"]["file"])))
                    entry["layers"] = {}
                for hexed in (entry or {}).get("layers", {}).values():
                    fields = expert_arena.decode_descriptor(bytes.fromhex(hexed))
                    where = self._options.spill_directory if fields.get("spilled") \
                        else self._options.directory
                    segments.add(os.path.join(where, fields["segment"]))
            except (OSError, ValueError) as e:
                logger.warning("expert_arena.vllm_kv: removing index entry %s: %s", path, e)
                _remove_entry(path)
                continue
            if entry is not None and not any(os.path.exists(s) for s in segments):
                _remove_entry(path)

    def get_transfer_results(self, finished_req_ids):
        """The asynchronous loads that ended since the last call, and those of them that
        failed (in finished_recving too, as vLLM expects), taken together; the requests whose
        blocks in a shared KV cache this engine lets go of (finished_sending)."""
        from vllm.distributed.kv_transfer.kv_connector.v1.base import \
            KVConnectorTransferResults
        self._end_copied()
        with self._lock:
            done, self._recv_done = self._recv_done, set()
            failed, self._recv_failed = self._recv_failed, set()
        sent = self._let_go_of_sends(finished_req_ids or ()) if self._sends else set()
        return KVConnectorTransferResults(finished_sending=sent, finished_recving=done,
                                          failed_recving=failed)

    def get_finished(self, finished_req_ids):
        results = self.get_transfer_results(finished_req_ids)
        return results.finished_sending or None, results.finished_recving or None

    def get_block_ids_with_load_errors(self) -> set:
        with self._lock:
            errors, self._load_errors = self._load_errors, set()
        return errors

    def _close_cache(self) -> None:
        """Every entry of the shared KV cache withdrawn, the decode engines copying from it
        waited for (a few seconds at most: what they copy after is theirs, from the file they
        hold open), and the file removed."""
        sends = [s for s in self._sends.values() if s.fd is not None]
        self._sends = {}
        deadline = time.monotonic() + 5
        for send in sends:
            if not send.withdrawn:
                self._withdraw(send)
            while True:
                try:
                    fcntl.flock(send.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    if time.monotonic() > deadline:
                        break
                    time.sleep(0.01)
            os.close(send.fd)
        if self._cache is not None:
            self._cache.close()

    def kv_cache_pages(self, wait_seconds: float = 0) -> dict:
        """Where this engine's own KV cache stands on 2 MiB pages (worker side, a decode
        engine; {} when it is not being moved): bytes, huge_bytes, seconds (None while the
        thread works, which it is given up to wait_seconds to end), error."""
        pages = self._host_pages
        if pages is None:
            return {}
        pages.wait(wait_seconds)
        return {"bytes": pages.total, "huge_bytes": pages.huge_bytes,
                "seconds": pages.seconds, "error": pages.error}

    def stream_stats(self) -> dict:
        """The producer's stream stats and pending blocks (worker side): in a shared KV cache,
        the requests whose blocks it holds for decode engines ("<req id>/cache")."""
        if self._producer is None or self._producer.closed:
            return {}
        held = ["%s/cache" % r for r, s in self._sends.items() if s.fd is not None]
        return {"stats": self._producer.stats(), "pending": self._producer.pending() + held}

    def shutdown(self):
        if self._role == KVConnectorRole.SCHEDULER or self._closed:
            return
        self._closed = True
        if self._loader is not None:
            # The loads queued before exit end first: the consumer closes after them.
            self._loads.put(None)
            self._loader.join(timeout=60)
            self._end_copied()
        if self._producer is not None:
            with self._lock:
                published, self._published = self._published, {}
            for keys, path, _ in published.values():
                _remove_entry(path)
            self._close_cache()
            self._producer.close()
        if self._consumer is not None:
            self._consumer.close()
        if self._host_pages is not None:
            self._host_pages.close()
        self._mapped = {}
        # An engine that ends before its process (vLLM's LLM made again in one process) lets go
        # of its KV cache tensors: nothing here refers to them any more.
        self._caches = {}
        atexit.unregister(self.shutdown)
