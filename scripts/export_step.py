"""Export the engine step for TPU and CUDA and count the KV pool traffic outside the kernel.

The whole step: the model forward with the attention kernel inside, the KV pool donated.

    python scripts/export_step.py            # SmolLM2-135M and Llama-3-8B shapes, both platforms

Lowering needs no accelerator: `jax.export` builds the StableHLO module each platform would
compile. From the module it reads (a) whether every pool argument is aliased to an output
(donation holds, so the step updates the pool in place), and (b) every op other than the
attention kernel and the K/V write (one scatter per layer and pool) that reads or writes a
pool-sized tensor, with the bytes it moves. An engine that pads, copies, concatenates or
transposes its pool per step shows up in (b). It prints the same count for the decode kernel
the engine used before (`paged_decode_attention_tpu`, which padded a head_dim-64 pool to 128
lanes on every call) as the "before" number.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import math
import re
import sys
import warnings

import jax
import jax.numpy as jnp

from jaxpage.attention import AttentionMetadata, pool_head_dim
from jaxpage.engine.runner import _forward_fn
from jaxpage.models.config import ModelConfig
from jaxpage.models.llama import LlamaModel, param_shapes

MODELS = {
    "smollm2-135m": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=49152, hidden_size=576,
        intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64,
        max_position_embeddings=8192, tie_word_embeddings=True),
    "llama-3-8b": ModelConfig(
        architecture="LlamaForCausalLM", vocab_size=128256, hidden_size=4096,
        intermediate_size=14336, num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
        max_position_embeddings=8192),
}
BACKEND = {"tpu": "pallas_tpu", "cuda": "pallas_gpu"}
# (num_tokens, num_seqs, max_query_len): a decode step of 64 sequences; a mixed step of 62
# decode tokens and two chunks (the ragged kernels take both in one call)
STEPS = {"decode": (64, 64, 1), "mixed": (512, 64, 512)}
# the ops allowed to touch the pool: the kernel (a custom call, or a call of the function
# holding it), the K/V write (a scatter), a reshape (a bitcast of the contiguous pool), the
# return of the updated pool, and the `lax.platform_dependent` dispatch of the write (bits.py:
# a case on the lowering platform, a constant XLA folds; the ops in its branches are held to
# this same list)
POOL_OPS = ("stablehlo.custom_call", "func.call", "stablehlo.scatter", "stablehlo.reshape",
            "func.return", "stablehlo.case", "stablehlo.return")


@dataclasses.dataclass
class StepExport:
    model: str
    platform: str
    step: str
    num_pool_args: int
    aliased_pool_args: int
    kernel_calls: int  # calls handing the pool to the function that holds the kernel
    has_kernel: bool
    kv_writes: int
    pool_ops: list  # (op name, bytes of its pool-sized operands and results), every op

    @property
    def foreign_ops(self) -> list:
        """The ops other than POOL_OPS that read or write a pool-sized array."""
        return [(name, nbytes) for name, nbytes in self.pool_ops if name not in POOL_OPS]

    @property
    def foreign_bytes(self) -> int:
        return sum(nbytes for _, nbytes in self.foreign_ops)


def abstract_step(config: ModelConfig, platform: str, step: str, *, block_size: int = 32,
                  num_blocks: int = 4096, max_model_len: int = 8192, dtype=jnp.bfloat16):
    """(jitted step, its abstract arguments, pool shape) for one engine step."""
    num_tokens, num_seqs, max_query_len = STEPS[step]
    backend = BACKEND[platform]
    pool_shape = (config.num_kv_heads, num_blocks, block_size,
                  pool_head_dim(backend, config.head_dim))
    params = jax.tree.map(lambda shape: jax.ShapeDtypeStruct(shape, dtype),
                          param_shapes(config), is_leaf=lambda x: isinstance(x, tuple))
    pool = [tuple(jax.ShapeDtypeStruct(pool_shape, dtype) for _ in "kv")
            for _ in range(config.num_layers)]

    def i32(*shape):
        return jax.ShapeDtypeStruct(shape, jnp.int32)

    width = max_model_len // block_size
    md = AttentionMetadata(
        slot_mapping=i32(num_tokens), block_tables=i32(num_seqs, width), seq_lens=i32(num_seqs),
        query_start_loc=i32(num_seqs + 1), logits_indices=i32(num_seqs),
        max_query_len=max_query_len, backend=backend)
    fn = jax.jit(_forward_fn, static_argnums=(0, 1), donate_argnums=3)
    return fn, (LlamaModel(config), platform, params, pool, i32(num_tokens), i32(num_tokens),
                md), pool_shape


def export(fn, args, platform: str) -> jax.export.Exported:
    triton = jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=DeprecationWarning)
        return jax.export.export(fn, platforms=[platform], disabled_checks=[triton])(*args)


def pool_ops(text: str, pool_shape: tuple) -> list:
    """Every op the module runs (functions expanded at each call) with a pool-like operand
    or result (shaped [num_kv_heads, num_blocks, ...] or [num_kv_heads, num_blocks *
    block_size, ...]: the pool, a view of it, or a padded copy), with the bytes of those
    values: [(name, bytes), ...], one entry per execution."""
    from jax._src.interpreters import mlir as jax_mlir  # the context jax.export parses with
    from jax.extend.mlir import ir

    heads, blocks, block_size = pool_shape[:3]

    def pool_bytes(value) -> int:
        if not isinstance(value.type, ir.RankedTensorType):
            return 0
        tensor = ir.RankedTensorType(value.type)
        shape = list(tensor.shape)
        if len(shape) < 3 or shape[0] != heads or shape[1] not in (blocks, blocks * block_size):
            return 0
        return math.prod(shape) * tensor.element_type.width // 8

    def walk(op, found):
        for region in op.regions:
            for block in region.blocks:
                for child in block.operations:
                    child = child.operation
                    nbytes = sum(map(pool_bytes, [*child.operands, *child.results]))
                    if nbytes:
                        found.append((child.name, nbytes))
                    if child.name == "func.call":  # the callee's ops run once per call
                        callee = ir.FlatSymbolRefAttr(child.attributes["callee"]).value
                        walk(functions[callee], found)
                    walk(child, found)
        return found

    with jax_mlir.make_ir_context():
        module = ir.Module.parse(text)
        functions = {ir.StringAttr(op.attributes["sym_name"]).value: op.operation
                     for op in module.body.operations if op.operation.name == "func.func"}
        return walk(functions["main"], [])


def export_step(model: str, platform: str, step: str) -> StepExport:
    config = MODELS[model]
    fn, args, pool_shape = abstract_step(config, platform, step)
    exported = export(fn, args, platform)
    text = exported.mlir_module()
    main = next(line for line in text.splitlines() if "func.func public @main" in line)
    pool_type = "tensor<" + "x".join(map(str, pool_shape)) + "xbf16>"
    pool_args = [arg for arg in re.split(r"%arg\d+: ", main)[1:] if arg.startswith(pool_type)]
    kernel = "tpu_custom_call" if platform == "tpu" else "__gpu$xla.gpu.triton"
    ops = pool_ops(text, pool_shape)
    return StepExport(
        model=model, platform=platform, step=step, num_pool_args=len(pool_args),
        aliased_pool_args=sum("tf.aliasing_output" in arg or "jax.buffer_donor" in arg
                              for arg in pool_args),
        kernel_calls=sum(name == "func.call" for name, _ in ops), has_kernel=kernel in text,
        kv_writes=sum(name == "stablehlo.scatter" for name, _ in ops), pool_ops=ops)


def before_bytes(model: str) -> int:
    """Pool bytes the previous TPU decode path moved per decode step outside its kernel: the
    decode kernel padded each layer's unpadded K and V pool to 128 lanes on every call."""
    from pallas_kernels.paged_decode_tpu import paged_decode_attention_tpu

    config = MODELS[model]
    num_seqs, block_size, num_blocks, width = 64, 32, 4096, 8192 // 32
    pool = jax.ShapeDtypeStruct((config.num_kv_heads, num_blocks, block_size, config.head_dim),
                                jnp.bfloat16)
    q = jax.ShapeDtypeStruct((num_seqs, config.num_heads, config.head_dim), jnp.bfloat16)
    i32 = functools.partial(jax.ShapeDtypeStruct, dtype=jnp.int32)
    exported = export(jax.jit(paged_decode_attention_tpu), (
        q, pool, pool, i32((num_seqs, width)), i32((num_seqs,))), "tpu")
    layer = sum(nbytes for name, nbytes in pool_ops(exported.mlir_module(), pool.shape)
                if name not in POOL_OPS)
    return layer * config.num_layers


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default=",".join(MODELS))
    args = parser.parse_args(argv)
    print(f"{'model':<14} {'platform':<8} {'step':<7} {'pool args':>9} {'aliased':>7} "
          f"{'kernels':>7} {'writes':>6} {'bytes outside kernel/step':>26}")
    ok = True
    for model in args.models.split(","):
        for platform in ("tpu", "cuda"):
            for step in STEPS:
                result = export_step(model, platform, step)
                ok &= result.aliased_pool_args == result.num_pool_args and not result.foreign_ops
                print(f"{model:<14} {platform:<8} {step:<7} {result.num_pool_args:>9} "
                      f"{result.aliased_pool_args:>7} {result.kernel_calls:>7} "
                      f"{result.kv_writes:>6} {result.foreign_bytes:>26,}")
                for op, nbytes in result.foreign_ops[:5]:
                    print(f"    {op}: {nbytes:,} bytes")
        print(f"{model:<14} before: the TPU decode kernel's per-call pad moved "
              f"{before_bytes(model):,} bytes per decode step outside the kernel")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
