"""One of two processes serving one engine over both processes' devices (4 virtual CPU
devices each, tp 8, gloo collectives on 127.0.0.1):

    python mh_worker.py PROCESS_ID PORT MODEL_DIR MODE

Process 0 serves the tensor-parallel workload of tp_worker.py and prints its result as
JSON; process 1 follows. MODE "loop" keeps process 0 generating (for the test that kills
process 1): it prints "generating" once it has served a first request.
"""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=4"
os.environ["JAX_PLATFORMS"] = "cpu"

import json  # noqa: E402
import sys  # noqa: E402

import jax  # noqa: E402

jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jaxpage.distributed as dist  # noqa: E402
from jaxpage import LLM, SamplingParams  # noqa: E402


def main(process_id: int, port: int, path: str, mode: str) -> None:
    dist.initialize(f"127.0.0.1:{port}", 2, process_id, heartbeat_timeout_seconds=10)
    assert jax.device_count() == 8 and jax.local_device_count() == 4
    from tp_worker import ENGINE_FOR_TOKENS, workload

    llm = LLM(path, tensor_parallel_size=8, **ENGINE_FOR_TOKENS)
    llm.engine.runner.call_timeout = 20.0
    if not dist.is_leader():
        dist.follow(llm)
        return
    if mode == "loop":
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        for i in range(100_000):
            llm.generate([list(range(3, 12))], params, use_tqdm=False)
            if i == 0:
                print("generating", flush=True)
        return
    result = workload(llm)
    dist.stop(llm)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main(int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4])
