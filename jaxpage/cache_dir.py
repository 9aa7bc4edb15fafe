"""Where jaxpage keeps what it builds once and reuses across runs.

`cache_root()` is `$JAXPAGE_CACHE_DIR`, else `$JAXPAGE_CACHE` (the older name, still
honoured), else `$XDG_CACHE_HOME/jaxpage`, else `~/.cache/jaxpage`. Under it:

    gguf/   GGUF models converted once to jaxpage checkpoints (jaxpage.loading.gguf_cache)
    xla/    JAX's persistent compilation cache of the CLIs (unless $JAX_COMPILATION_CACHE_DIR)
    cpu_kernels-*.so     the C++ CPU kernel library (pallas_kernels.cpu_library)

Deleting the directory is always safe: everything in it is rebuilt on demand.
"""

from __future__ import annotations

import os

ENV = "JAXPAGE_CACHE_DIR"


def cache_root() -> str:
    """The cache directory (not created here)."""
    root = os.environ.get(ENV) or os.environ.get("JAXPAGE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"),
        "jaxpage")
    return os.path.abspath(os.path.expanduser(root))
