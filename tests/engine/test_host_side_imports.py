"""The host side of the engine imports no JAX: the allocator, scheduler, requests, beam
search and the engine itself run as plain Python (the runner alone owns the device), and so
do the engine's config, sampling parameters and outputs."""

from __future__ import annotations

import subprocess
import sys

HOST_MODULES = [
    "jaxpage.engine.block_allocator",
    "jaxpage.engine.block_hashing",
    "jaxpage.engine.host_pool",
    "jaxpage.engine.tiered_allocator",
    "jaxpage.engine.swap_cost",
    "jaxpage.engine.kv_sizing",
    "jaxpage.engine.request",
    "jaxpage.engine.beam_search",
    "jaxpage.engine.batch",
    "jaxpage.engine.scheduler",
    "jaxpage.engine.detokenizer",
    "jaxpage.engine.output_builder",
    "jaxpage.engine.engine",
    "jaxpage.constants",
    "jaxpage.config",
    "jaxpage.sampling_params",
    "jaxpage.outputs",
]


def test_host_modules_import_no_jax():
    code = (
        "import importlib, sys\n"
        f"for name in {HOST_MODULES!r}:\n"
        "    importlib.import_module(name)\n"
        "    loaded = [m for m in ('jax', 'jaxlib', 'pallas_kernels') if m in sys.modules]\n"
        "    assert not loaded, f'importing {name} imported {loaded}'\n"
        "from jaxpage.engine.engine import LLMEngine\n"
        "from jaxpage.engine.scheduler import Scheduler\n"
        "Scheduler(num_blocks=4, block_size=2, max_model_len=8, max_num_seqs=2,\n"
        "          max_num_batched_tokens=8).allocator.check_invariants()\n"
        "assert 'jax' not in sys.modules\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_the_check_sees_jax():
    """The same check fails for the runner, which does import JAX."""
    code = "import sys, jaxpage.engine.runner\nassert 'jax' not in sys.modules\n"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True).returncode != 0
