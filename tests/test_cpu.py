"""Training on a CPU: the tokenizer backend's thread pool never starts beside the kit's own
tokenizing threads, and memory a step frees is reused by the next without faulting it in
again. (What these buy in speed: benchmarks/bench_cpu.py and benchmarks/bench_data.py.)"""

import subprocess
import sys
from pathlib import Path

import pytest
from helpers import ENV, ROOT


def run_python(code, env=ENV):
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    return result.stdout.split()


@pytest.mark.slow
def test_a_tokenizer_called_before_the_pipeline_starts_no_thread_pool():
    """The backend's rayon pool starts at its first batched call unless TOKENIZERS_PARALLELISM
    says no; the kit's import says so first, whatever the environment held."""
    code = """if True:
        import os
        import data
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained("assets/tokenizer")
        before = len(os.listdir("/proc/self/task"))
        tok.backend_tokenizer.encode_batch(["some text to tokenize"] * 4096)
        print(before, len(os.listdir("/proc/self/task")))"""
    before, after = run_python(code, {**ENV, "TOKENIZERS_PARALLELISM": "true"})
    assert after == before
    # The test can fail: without the kit's import, the same call starts the pool.
    before, after = run_python(code.replace("import data", "pass"),
                               {**ENV, "TOKENIZERS_PARALLELISM": "true"})
    assert int(after) > int(before)


def huge_pages_always():
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.exists() and "[always]" in path.read_text()


@pytest.mark.slow
@pytest.mark.skipif(huge_pages_always(), reason="faults counted in 2 MiB pages, not 4 KiB")
def test_memory_a_cpu_step_frees_is_reused_without_faulting_it_in_again():
    """A 64 MiB tensor (bigger than glibc's mmap threshold) allocated and freed at each step:
    after utils.keep_freed_memory, the steps after the first few cost almost no page faults
    (the heap settles: in 46 runs, by the 9th step at the latest); without it, each costs one
    per 4 KiB page."""
    code = """if True:
        import resource
        import torch, utils
        if KEEP:
            utils.keep_freed_memory()
        def faults():
            return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
        for i in range(24):
            if i == 16:
                start = faults()
            step = torch.ones(16 << 20)  # 64 MiB, touched
            del step
        print(faults() - start)  # over the last 8 steps"""
    pages = (64 << 20) // 4096
    (kept,) = run_python(code.replace("KEEP", "True"))
    (plain,) = run_python(code.replace("KEEP", "False"))
    assert int(plain) > 6 * pages  # what the test would catch
    assert int(kept) < pages // 2
