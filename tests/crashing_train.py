"""train_llm.py that dies, like a SIGKILL (os._exit: no cleanup, no flush), just before the
K-th file-system step of its checkpoint save for step CRASH_STEP. The steps counted: every
fsync (each file written is fsynced), rename, replace and rmtree that the save makes, in the
thread that writes it (the background writer, or the training thread with
--checkpoint-writer sync).

    CRASH_STEP=4 CRASH_AT=3 python tests/crashing_train.py --experiment-name ... (train_llm flags)

CRASH_AT=0 dies nowhere and writes the steps of that save, by name, to CRASH_COUNT_FILE.
HOLD_STEP=4: the save of step 4 never gets to write (it waits until the process is killed),
so a test can kill the run while that write is in flight.
"""

import os
import runpy
import shutil
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import utils  # noqa: E402

crash_step, crash_at = int(os.environ.get("CRASH_STEP", -1)), int(os.environ.get("CRASH_AT", 0))
hold_step = int(os.environ.get("HOLD_STEP", -1))
counted = {"inside": None, "n": 0, "names": []}  # inside: the thread that is saving


def counting(module, name):
    real = getattr(module, name)

    def step(*args, **kwargs):
        if counted["inside"] == threading.get_ident():
            counted["n"] += 1
            counted["names"].append(name)
            if counted["n"] == crash_at:
                os._exit(137)
        return real(*args, **kwargs)
    setattr(module, name, step)


for module, name in [(os, "fsync"), (os, "rename"), (os, "replace"), (shutil, "rmtree")]:
    counting(module, name)

real_save = utils.write_checkpoint


def write_checkpoint(exp_dir, step, *args, **kwargs):
    if step == hold_step:
        threading.Event().wait()  # until the test kills the process
    counted["inside"] = threading.get_ident() if step == crash_step else None
    try:
        return real_save(exp_dir, step, *args, **kwargs)
    finally:
        if counted["inside"] and crash_at == 0:
            Path(os.environ["CRASH_COUNT_FILE"]).write_text(",".join(counted["names"]))
        counted["inside"] = None


utils.write_checkpoint = write_checkpoint
sys.argv = [str(ROOT / "train_llm.py"), *sys.argv[1:]]
runpy.run_path(str(ROOT / "train_llm.py"), run_name="__main__")
