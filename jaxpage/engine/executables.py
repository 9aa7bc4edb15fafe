"""Compiled step executables kept on disk, so a restart neither traces nor lowers its steps.

JAX's persistent compilation cache skips XLA's compile on a restart, but its key is the lowered
program: every step shape is still traced through the model's Python and lowered to StableHLO
first. For SmolLM2's 146 warm-up shapes on a 2-core Xeon that was most of the warm-up (a
restart with every executable in JAX's cache took 0.76x the first start). This store keys each
executable by what produced it instead, so a restart deserializes it directly:

- the context: the source of jaxpage and pallas_kernels (Python and C++) and of the model's
  class, the versions of jax, jaxlib and numpy, the platform and its version, the devices, the
  CPU (XLA:CPU compiles for the host's instruction set), `XLA_FLAGS` and JAX's configuration;
- the call: the step function's name, the runner's shape key, the static arguments' repr, and
  every argument's tree structure, shape, dtype, weak type and sharding.

Any change to any of these is a different entry (a miss compiles as before). An entry is
written whole (to a temporary file, then renamed) and one that cannot be read is compiled
again and rewritten. Only what XLA compiled in this process is written, never an executable
JAX's persistent cache supplied (`_compile_fresh`). The store serves one process on one
device; tensor-parallel and multi-process runners do not use it. Entries are pickles that
load native code: the directory must be as trusted as the code itself (as JAX's own
compilation cache must).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import functools
import hashlib
import logging
import os
import pickle
import platform
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax import monitoring

try:  # JAX's settings as thread-local overrides (`_compile_fresh`); private, so guarded
    from jax._src import config as jax_config
except ImportError:  # pragma: no cover - a jax that moved them: the monitoring guard alone
    jax_config = None

logger = logging.getLogger(__name__)

# where engines built from now on keep their compiled steps (None: nowhere); `keep_in` sets it
_directory: str | None = None

_SOURCE_ROOTS = ("jaxpage", "pallas_kernels")
_SOURCE_SUFFIXES = (".py", ".cc", ".h")
# JAX settings that say where caches live or how much is logged, not what a program computes
_UNRELATED_CONFIG = ("cache", "log", "debug_log", "explain", "profil")


def keep_in(directory: str | os.PathLike | None) -> None:
    """Keep the compiled steps of engines built from now on under `directory` (None: do not
    keep them). `jaxpage.engine_args.enable_compile_cache` calls it, beside JAX's cache."""
    global _directory
    _directory = None if directory is None else os.fspath(directory)


def kept_in() -> str | None:
    """Where engines built now keep their compiled steps (`keep_in`), or None."""
    return _directory


def _source_digest(model: Any) -> str:
    """sha256 of the engine's sources and of the file defining the model's class."""
    return _digest_files(getattr(sys.modules.get(type(model).__module__), "__file__", None))


@functools.cache  # once a process per model file (~40 ms: every source read)
def _digest_files(model_file: str | None) -> str:
    repo = Path(__file__).resolve().parents[2]
    files = sorted(p for root in _SOURCE_ROOTS for p in (repo / root).rglob("*")
                   if p.suffix in _SOURCE_SUFFIXES and p.is_file())
    if model_file:
        files.append(Path(model_file).resolve())
    digest = hashlib.sha256()
    for path in files:
        digest.update(str(path.relative_to(repo) if path.is_relative_to(repo) else path).encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


def _cpu_identity() -> str:
    """The CPU's model name and feature flags (Linux), else the machine's name."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    keep = [line for line in text.splitlines()
            if line.split(":")[0].strip() in ("model name", "flags", "Features")]
    return "\n".join(sorted(set(keep)))


def context_digest(model: Any, devices: list) -> str:
    """What every executable of a runner depends on besides its own arguments (module doc)."""
    import jaxlib

    values = getattr(jax.config, "values", {})  # every jax_* option and its value
    config = sorted((name, repr(value)) for name, value in values.items()
                    if not any(word in name for word in _UNRELATED_CONFIG))
    parts = [
        _source_digest(model), jax.__version__, jaxlib.__version__, np.__version__,
        *(f"{d.platform} {d.device_kind} {d.id} {d.client.platform_version}" for d in devices),
        _cpu_identity(), os.environ.get("XLA_FLAGS", ""), repr(config),
    ]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()


def _describe(leaf: Any) -> str:
    """A leaf's type as the executable sees it: shape, dtype, weak type (`~`), sharding."""
    return f"{jax.typeof(leaf)} {getattr(leaf, 'sharding', None)}"


class ExecutableStore:
    """Compiled step functions on disk under `directory`, for the runner of one context
    (`context_digest`) whose executables run on `device`."""

    def __init__(self, directory: str | os.PathLike, context: str, device: Any) -> None:
        self.directory = Path(directory)
        self.context = context
        self.device = device
        self.loaded = 0  # executables read from disk
        self.prefetched = 0  # of those, read by a `WarmupPrefetch` before they were asked for
        self.saved = 0  # executables compiled and written
        self.unkept = 0  # executables JAX's cache supplied, which cannot be kept (`_compile_fresh`)
        self.used: list[str] = []  # the entries read or written, in order
        self._warned = False

    def _path(self, key: tuple, static: tuple, args: tuple) -> Path:
        leaves, tree = jax.tree.flatten(args)
        text = "\n".join([self.context, repr(key), *map(repr, static), str(tree),
                          *map(_describe, leaves)])
        return self.directory / f"{hashlib.sha256(text.encode()).hexdigest()}.jaxexe"

    def get(self, key: tuple, jitted: Any, static: tuple, args: tuple) -> Any:
        """The compiled `jitted(*static, *args)` for this shape, called with `*args`: read
        from disk (or taken from a `WarmupPrefetch` that read it), else lowered, compiled and
        written."""
        path = self._path(key, static, args)
        with _prefetch_lock:
            prefetched = _prefetched.pop(path.name, None)
        try:
            if prefetched is not None:
                executable = prefetched.result()
            else:
                executable = _load(path, self.device)
        except OSError:
            pass  # not kept yet
        except Exception as e:  # noqa: BLE001 - a damaged or foreign entry: compile anew
            logger.warning("compiled step %s unreadable (%s: %s); compiling it again",
                           path.name, type(e).__name__, e)
        else:
            self.loaded += 1
            self.prefetched += prefetched is not None
            self.used.append(path.name)
            return executable
        compiled, fresh = _compile_fresh(jitted.lower(*static, *args))
        if not fresh:
            self.unkept += 1
            if self.unkept == 1:
                logger.info("compiled step %s came from JAX's persistent cache and is not "
                            "kept (it would not run once serialized)", path.name)
            return compiled
        try:
            _save(path, compiled)
            self.saved += 1
            self.used.append(path.name)
        except Exception as e:  # noqa: BLE001 - no entry kept: the next start compiles it
            if not self._warned:
                self._warned = True
                logger.warning("compiled steps are not kept in %s (%s: %s)", self.directory,
                               type(e).__name__, e)
        return compiled


def _write_whole(path: Path, data: bytes) -> None:
    """`data` written to a temporary file beside `path`, then renamed to it: a reader finds
    the old file or the new one, never part of one (a failed write leaves neither)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = None
    try:
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False) as f:
            temporary = f.name
            f.write(data)
        os.replace(temporary, path)
    except BaseException:
        if temporary is not None:
            Path(temporary).unlink(missing_ok=True)
        raise


def _save(path: Path, compiled: Any) -> None:
    """`compiled` kept at `path`, where `_load` finds it."""
    from jax.experimental import serialize_executable

    _write_whole(path, pickle.dumps(serialize_executable.serialize(compiled)))


def _load(path: Path, device: Any) -> Any:
    """The executable kept at `path`, loaded onto `device` (OSError: there is none)."""
    from jax.experimental import serialize_executable

    serialized, in_tree, out_tree = pickle.loads(path.read_bytes())
    return serialize_executable.deserialize_and_load(
        serialized, in_tree, out_tree, backend=device.client, execution_devices=[device])


# entries a WarmupPrefetch is loading, by file name (a name is the whole key: any store that
# asks for that name wants that executable), taken by `ExecutableStore.get`
_prefetched: dict[str, concurrent.futures.Future] = {}
_prefetch_lock = threading.Lock()


class WarmupPrefetch:
    """Loads, on threads of its own, the compiled steps the last warm-up of the same engine
    configuration used, while the process goes on loading the model (the server's start),
    and then stands in for most of the warm-up where it loaded all of them (`warm_up`).

    Deserializing is most of a restart's warm-up (SmolLM2's 146 steps: ~40 ms each on a
    2-core Xeon, 5-6 s) and, unlike tracing, releases the GIL: two threads load them in half
    the time, and they start before the model is loaded. Which entries to load is a manifest
    beside them, `warmup-<digest of the configuration>.txt`: the context they were compiled
    in (`context_digest`) and the entries the warm-up took, in order, rewritten after a
    warm-up that ran. A stale manifest costs only time: entries are still found by their
    whole key, and one the engine does not ask for is never used."""

    def __init__(self, directory: str | os.PathLike, configuration: str, device: Any) -> None:
        self.directory = Path(directory)
        digest = hashlib.sha256(configuration.encode()).hexdigest()[:32]
        self.manifest = self.directory / f"warmup-{digest}.txt"
        try:
            lines = self.manifest.read_text().split("\n")
        except OSError:
            lines = []
        self.context = lines[0].removeprefix("context ") if lines else ""
        self.names = [n for n in lines[1:] if n.endswith(".jaxexe")]
        self.ahead = 0  # steps loaded ahead where they stood in for the warm-up
        if self.names and device.platform == "cpu":
            from pallas_kernels import cpu_library

            cpu_library.loaded()  # the steps' custom calls resolve as they load
        workers = max(1, min(len(self.names), os.cpu_count() or 1))
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, "jaxpage-prefetch")
        self._futures = [self._pool.submit(_load, self.directory / n, device)
                         for n in self.names]
        with _prefetch_lock:
            _prefetched.update(zip(self.names, self._futures, strict=True))

    def warm_up(self, engine: Any) -> tuple[int, float]:
        """`engine.warmup()`, unless every step the last warm-up of this configuration took,
        compiled by this same code for this device (the manifest's context is the engine's
        store's), is loaded: then those wait for their first use and only the warm-up's
        first step runs (a warm-up would ask for exactly them; one its shapes no longer ask
        for, such as a pool sized anew, only misses and compiles when first used). Returns
        (compilations or loads, seconds)."""
        start = time.perf_counter()
        store = getattr(getattr(engine, "runner", None), "executable_store", None)
        if (store is not None and self.names and self.context == store.context
                and all(f.exception() is None for f in self._futures)):
            self._pool.shutdown(wait=False)
            self.ahead = len(self.names)
            # one step all the same: a process's first step costs more than the rest (0.75 s
            # more for SmolLM2 on a 2-core Xeon, much of it pages touched the first time),
            # which would otherwise fall on the first request
            compiles, _ = engine.warmup(1)
            return compiles, time.perf_counter() - start
        try:
            return engine.warmup()
        finally:
            self.finish(store)

    def finish(self, store: ExecutableStore | None) -> None:
        """Drop the steps not taken, and remember those `store` took (after its warm-up)."""
        with _prefetch_lock:
            for name, future in zip(self.names, self._futures, strict=True):
                if _prefetched.get(name) is future:
                    del _prefetched[name]
                future.cancel()
        self._pool.shutdown(wait=False, cancel_futures=True)
        if store is None or (store.context, store.used) == (self.context, self.names):
            return
        text = "\n".join([f"context {store.context}", *store.used]) + "\n"
        try:
            _write_whole(self.manifest, text.encode())
        except OSError as e:
            logger.warning("warm-up manifest not written to %s (%s)", self.manifest, e)


def prefetch_warmup(config: Any) -> WarmupPrefetch | None:
    """Start loading the steps the last warm-up of `config` (an `EngineConfig`) used, where
    compiled steps are kept and its engine is one device in one process; else None."""
    if (_directory is None or jax.process_count() != 1
            or getattr(config, "tensor_parallel_size", 1) != 1
            or getattr(config, "data_parallel_size", 1) != 1):
        return None
    return WarmupPrefetch(_directory, repr(config), jax.devices()[0])


def _compile_fresh(lowered: Any) -> tuple[Any, bool]:
    """`lowered.compile()`, and whether XLA compiled it here (False: JAX's persistent cache
    supplied it). An executable JAX loaded from its cache serializes without its compiled
    functions on XLA:CPU, and an entry made of it fails when it runs ("Function
    broadcast_select_fusion not found"), so only a fresh compile may be kept.

    JAX decides once a process whether its cache is used (at the first compile), so turning
    the cache off around this call does not bypass it. Instead the store's compiles are never
    written to JAX's cache (its minimum compile time is infinite for them) and are looked up
    under keys that include the program's source locations, which no ordinary compile writes;
    a hit that still happens (someone wrote such keys) is seen through JAX's monitoring
    events. All three are thread-local or per-thread, so other threads compile as before."""
    _listen_for_cache_hits()
    overrides = (("persistent_cache_min_compile_time_secs", float("inf")),
                 ("compilation_cache_include_metadata_in_key", True))
    _compiling.hit, _compiling.active = False, True
    try:
        with contextlib.ExitStack() as stack:
            for name, value in overrides:
                state = getattr(jax_config, name, None)  # a jax without it: its default
                if state is not None:
                    stack.enter_context(state(value))
            compiled = lowered.compile()
    finally:
        _compiling.active = False
    return compiled, not _compiling.hit


_CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
_compiling = threading.local()  # .active: this thread is in `_compile_fresh`; .hit: it hit


def _on_event(event: str, **kwargs: Any) -> None:
    if event == _CACHE_HIT_EVENT and getattr(_compiling, "active", False):
        _compiling.hit = True


@functools.cache
def _listen_for_cache_hits() -> None:
    monitoring.register_event_listener(_on_event)
