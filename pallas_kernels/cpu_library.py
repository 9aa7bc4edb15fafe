"""Builds, caches and loads jaxpage's CPU kernel library and registers its XLA FFI targets.

The library's C++ sources live in `pallas_kernels/cpu/`: a header per op family (attention,
set_rows, the small and packed matmuls (float and int8 weights) with the AMX tile path, the
multi-LoRA deltas, the layer glue, the decoder layer, the greedy draw, and what they share),
compiled as one translation unit, `cpu/ffi.cc`, which holds the XLA FFI handlers
(docs/kernels.md describes the layout); `cpu_ops` holds the JAX functions that call it. It is
compiled on first use with the machine's C++ compiler (`g++ -O3 -march=native`, about 35-45 s
on a 2-core CPU; `start_build` begins it early, beside a model's load) into a cache directory,
as `cpu_kernels-<key>.so`, the key hashing every source file of `cpu/`, the flags, the jaxlib
version and the CPU; `available()` says whether that worked, and callers fall back to the jnp
path when it did not (no compiler, another platform).
Build-time facts the ops depend on are read back from the library: `wide_vectors()`
(AVX-512), `bf16_dot_compiled()` (AVX512-BF16) and `packed_tiles()` (AMX-BF16 usable by this
process).

Environment: `JAXPAGE_NO_CPU_KERNEL` (any value) turns the library off; `JAXPAGE_CACHE_DIR`
(or the older `JAXPAGE_CACHE`) moves the build cache; `JAXPAGE_CPU_KERNEL_LIB` names a
prebuilt shared library of the same sources to register instead of building one (for checks
that need another build, e.g. `scripts/check_cpu_kernel_sanitizers.py`'s build with ASan and
UBSan); `JAXPAGE_CPU_KERNEL_STAGE_CLOCK=1` builds the decoder layer's stage clock in
(`stage_clock`); `JAXPAGE_CPU_KERNEL_MARCH` builds for another target than the machine's own
(`-march=VALUE` for `-march=native`: `x86-64-v3` is AVX2 and FMA, `x86-64` no vector
extension past SSE2), so that an AVX-512 machine can check the AVX2 and portable code paths
(a library of its own in the cache; slow tests of the packed matmuls run them).
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
import warnings
from concurrent.futures import Future
from pathlib import Path

import jax

_SOURCE_DIR = Path(__file__).with_name("cpu")  # ffi.cc and the headers it includes
TARGET = "jaxpage_paged_attention"
TARGET_BF16 = "jaxpage_paged_attention_bf16"
TARGET_SET_ROWS = "jaxpage_set_rows"
TARGET_QUANTIZED = "jaxpage_paged_attention_quantized"
TARGET_SMALL_MATMUL = "jaxpage_small_matmul"
TARGET_PACKED_MATMUL = "jaxpage_packed_matmul"
TARGET_PACKED_MATMUL_INT8 = "jaxpage_packed_matmul_int8"
TARGET_GREEDY_DRAW = "jaxpage_greedy_draw"
TARGET_ADD_RMS_NORM = "jaxpage_add_rms_norm"
TARGET_SILU_MUL = "jaxpage_silu_mul"
TARGET_QKV_ROPE = "jaxpage_qkv_rope"
TARGET_DECODER_LAYER = "jaxpage_decoder_layer"
TARGET_LORA_MATMUL = "jaxpage_lora_matmul"


def _cache_dir() -> Path:
    # the same root as jaxpage.cache_dir.cache_root (not imported: this package stands alone)
    root = os.environ.get("JAXPAGE_CACHE_DIR") or os.environ.get("JAXPAGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "jaxpage")
    return Path(root)


def _cpu_id() -> str:
    """What -march=native depends on: the CPU's model and flags."""
    try:
        with open("/proc/cpuinfo") as f:
            lines = [line for line in f if line.startswith(("model name", "flags"))][:2]
    except OSError:
        lines = []
    return platform.machine() + "".join(lines)


_FLAGS = ["-O3", "-march=native", "-std=c++17", "-shared", "-fPIC",
          # vectorize the loops marked `omp simd` and reassociate their sums (no OpenMP runtime);
          # not -ffast-math: the kernel relies on -inf and NaN behaving as IEEE says
          "-fopenmp-simd", "-fassociative-math", "-fno-signed-zeros", "-fno-trapping-math"]


def _flags() -> list[str]:
    """The build's flags: `_FLAGS`, the decoder layer's stage clock where
    JAXPAGE_CPU_KERNEL_STAGE_CLOCK=1 (`stage_clock`; a library of its own in the cache), and
    `-march=VALUE` for `-march=native` where JAXPAGE_CPU_KERNEL_MARCH is set."""
    value = os.environ.get("JAXPAGE_CPU_KERNEL_STAGE_CLOCK", "0")
    if value not in ("0", "1"):
        raise ValueError(f"JAXPAGE_CPU_KERNEL_STAGE_CLOCK must be '0' or '1', got {value!r}")
    flags = _FLAGS + (["-DJAXPAGE_STAGE_CLOCK"] if value == "1" else [])
    march = os.environ.get("JAXPAGE_CPU_KERNEL_MARCH")
    if march:
        if not march.replace("-", "").replace("_", "").isalnum():
            raise ValueError(f"JAXPAGE_CPU_KERNEL_MARCH must name a GCC -march target, got "
                             f"{march!r}")
        flags = [f"-march={march}" if f == "-march=native" else f for f in flags]
    return flags


def _sources_digest(source: Path) -> bytes:
    """Every source file of the directory `source` (headers included), sorted by name: each
    name and its contents."""
    files = sorted(p for p in source.iterdir() if p.is_file() and p.suffix in (".cc", ".h"))
    return b"\0".join(part for p in files for part in (p.name.encode(), p.read_bytes()))


def _build(source: Path = _SOURCE_DIR) -> Path:
    """Compile the library (`source`/ffi.cc, with -I `source`), or reuse a build of the same
    sources and flags for this jaxlib and CPU: the cache key hashes every .cc and .h file of
    the directory (names and contents), the flags, the jaxlib version and the CPU. `source`: a
    directory holding another version of `cpu/` (a variant to measure against this one:
    scripts/lab/ab_env_switch.py --source)."""
    import jaxlib

    source = Path(source)
    if not (source / "ffi.cc").is_file():
        raise RuntimeError(f"{source} holds no ffi.cc (a copy of pallas_kernels/cpu/)")
    flags = _flags()
    key = hashlib.sha256(b"\0".join([
        _sources_digest(source), " ".join(flags).encode(), jaxlib.__version__.encode(),
        _cpu_id().encode()])).hexdigest()
    library = _cache_dir() / f"cpu_kernels-{key[:16]}.so"
    if library.exists():
        return library
    compiler = os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")
    if compiler is None:
        raise RuntimeError("no C++ compiler found (set CXX)")
    library.parent.mkdir(parents=True, exist_ok=True)
    # build beside the target and rename: concurrent processes never load a half-written file
    with tempfile.TemporaryDirectory(dir=library.parent) as tmp:
        partial = Path(tmp) / library.name
        cmd = [compiler, *flags, "-isystem", jax.ffi.include_dir(), "-I", str(source), "-o",
               str(partial), str(source / "ffi.cc")]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if result.returncode:
            raise RuntimeError(f"{' '.join(cmd)} failed:\n{result.stderr[-2000:]}")
        os.replace(partial, library)
    return library


_started: Future | None = None  # a build `start_build` began, which `loaded()` waits for
_start_lock = threading.Lock()


def start_build() -> None:
    """Begin building the library (where it will be built at all and is not yet) on a thread
    of its own, so that whatever the caller does next runs beside the compiler: a first start
    loads and converts its model meanwhile, on a 2-core CPU 10-15 s of the ~45 s build.
    `loaded()` waits for it; a failure surfaces there, as a build of its own would. The
    compiler is a process of its own, so this thread only waits on it."""
    global _started
    if (os.environ.get("JAXPAGE_NO_CPU_KERNEL") or os.environ.get("JAXPAGE_CPU_KERNEL_LIB")
            or loaded.cache_info().currsize):
        return
    with _start_lock:
        if _started is not None:
            return
        _started = future = Future()

    def build() -> None:
        try:
            future.set_result(_build())
        except BaseException as e:  # noqa: BLE001 - handed to loaded(), which reports it
            future.set_exception(e)

    # a daemon: a process that exits before the build ends is not held up by it
    threading.Thread(target=build, name="jaxpage-kernel-build", daemon=True).start()


def _library_path() -> Path:
    """The shared library to register: `JAXPAGE_CPU_KERNEL_LIB` if set, else our build
    (the one `start_build` began, if it did)."""
    prebuilt = os.environ.get("JAXPAGE_CPU_KERNEL_LIB")
    if prebuilt:
        if not Path(prebuilt).is_file():
            raise RuntimeError(f"JAXPAGE_CPU_KERNEL_LIB={prebuilt} is not a file")
        return Path(prebuilt)
    with _start_lock:
        started = _started
    return _build() if started is None else started.result()


@functools.cache
def loaded() -> ctypes.CDLL | None:
    """The kernel's library, built and registered with XLA (compiles it on first call), or
    None where that failed."""
    if os.environ.get("JAXPAGE_NO_CPU_KERNEL"):
        return None
    try:
        library = ctypes.cdll.LoadLibrary(str(_library_path()))
        jax.ffi.register_ffi_target(
            TARGET, jax.ffi.pycapsule(library.JaxpagePagedAttention), platform="cpu")
        jax.ffi.register_ffi_target(
            TARGET_BF16, jax.ffi.pycapsule(library.JaxpagePagedAttentionBf16), platform="cpu")
        jax.ffi.register_ffi_target(
            TARGET_SET_ROWS, jax.ffi.pycapsule(library.JaxpageSetRows), platform="cpu")
        jax.ffi.register_ffi_target(
            TARGET_QUANTIZED, jax.ffi.pycapsule(library.JaxpagePagedAttentionQuantized),
            platform="cpu")
        jax.ffi.register_ffi_target(
            TARGET_SMALL_MATMUL, jax.ffi.pycapsule(library.JaxpageSmallMatmul), platform="cpu")
        jax.ffi.register_ffi_target(
            TARGET_PACKED_MATMUL, jax.ffi.pycapsule(library.JaxpagePackedMatmul),
            platform="cpu")
        jax.ffi.register_ffi_target(
            TARGET_GREEDY_DRAW, jax.ffi.pycapsule(library.JaxpageGreedyDraw), platform="cpu")
        for target, handler in ((TARGET_ADD_RMS_NORM, library.JaxpageAddRmsNorm),
                                (TARGET_SILU_MUL, library.JaxpageSiluMul),
                                (TARGET_QKV_ROPE, library.JaxpageQkvRope),
                                (TARGET_DECODER_LAYER, library.JaxpageDecoderLayer),
                                (TARGET_LORA_MATMUL, library.JaxpageLoraMatmul),
                                (TARGET_PACKED_MATMUL_INT8, library.JaxpagePackedMatmulInt8)):
            jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(handler), platform="cpu")
    except Exception as e:  # noqa: BLE001 - any failure means: use the jnp path
        warnings.warn(f"jaxpage: CPU attention kernel unavailable, using the jnp path ({e})",
                      stacklevel=3)
        return None
    return library


def available() -> bool:
    """Whether the kernel is built and registered with XLA (compiles it on first call)."""
    return loaded() is not None


def wide_vectors() -> bool:
    """Whether the kernel library was built for 16-float vectors (AVX-512; False when it is not
    available). `small_matmul`'s walks are written in them, and without AVX-512 GCC lowers them
    through the stack: there they lose to XLA's dot (8 rows of a [576, 1536] weight on a 2-core
    AMD EPYC Zen 3, 2026-12-01: ~4 ms against 0.3-0.6), so models route few-row matmuls to them
    only where this holds (`jaxpage.layers.linear.matmul_f32`). `packed_matmul` is written in
    the machine's own width either way."""
    library = loaded()
    return library is not None and library.JaxpageVectorLanes() == 16


def bf16_dot_compiled() -> bool:
    """Whether the kernel was built with the AVX512-BF16 path for bfloat16 pools (False when
    the kernel is not available)."""
    library = loaded()
    return library is not None and bool(library.JaxpagePagedAttentionBf16Dot())


def packed_tiles() -> bool:
    """Whether `packed_matmul` runs bfloat16 on AMX tiles where asked (`tiles`): the kernel
    built for a CPU with AMX-BF16 (Sapphire Rapids and later) and Linux letting this process use
    the tile registers (False when the kernel is not available)."""
    library = loaded()
    return library is not None and bool(library.JaxpagePackedTiles())


# the decoder layer's stages, in the order the stage clock reports them (cpu/thread_team.h)
LAYER_STAGES = ("start", "qkv", "rope", "write", "attn_prep", "attention", "attn_finish", "o",
                "norm1", "gate_up", "silu", "down", "norm2")


def stage_clock(reset: bool = False) -> dict | None:
    """What the decoder layer's stage clock has summed since the last reset, or None where the
    library was built without it (JAXPAGE_CPU_KERNEL_STAGE_CLOCK=1 before the first kernel
    call builds one with it): `calls`, `seconds` per stage (LAYER_STAGES: the calling thread's
    wall time in each, summed over the calls), the helper threads' `joins`, their
    `join_seconds` (from being scheduled to starting, summed), `late_joins` (over 50 us) and
    `join_buckets`, the joins by lateness: bucket b those of [2^b - 1, 2^(b+1) - 1) ns, the
    last every later one (`join_quantile` reads them)."""
    library = loaded()
    if library is None:
        return None
    n, buckets = len(LAYER_STAGES), library.JaxpageStageClockJoinBuckets()
    out = (ctypes.c_double * (n + 3 + buckets))()
    library.JaxpageStageClock.restype = ctypes.c_int64
    calls = library.JaxpageStageClock(out, ctypes.c_int(int(reset)))
    if calls < 0:
        return None
    return {"calls": calls, "seconds": dict(zip(LAYER_STAGES, out[:n], strict=True)),
            "joins": int(out[n]), "join_seconds": out[n + 1], "late_joins": int(out[n + 2]),
            "join_buckets": [int(c) for c in out[n + 3:]]}


def join_quantile(buckets: list[int], q: float) -> float:
    """An upper bound (seconds) on the q-quantile of the helpers' lateness from `stage_clock`'s
    `join_buckets`: the upper edge of the bucket the quantile falls in (inf in the last one;
    NaN with no joins)."""
    total = sum(buckets)
    if not total:
        return float("nan")
    seen = 0
    for b, count in enumerate(buckets):
        seen += count
        if seen >= q * total:
            return float("inf") if b == len(buckets) - 1 else (2 ** (b + 1) - 1) * 1e-9
    return float("inf")
