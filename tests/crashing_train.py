"""train_llm.py that dies, like a SIGKILL (os._exit: no cleanup, no flush), just before the
K-th file-system step of its checkpoint save for step CRASH_STEP. The steps counted: every
fsync (each file written is fsynced), rename, replace and rmtree that the save makes.

    CRASH_STEP=4 CRASH_AT=3 python tests/crashing_train.py --experiment-name ... (train_llm flags)

CRASH_AT=0 dies nowhere and writes the steps of that save, by name, to CRASH_COUNT_FILE.
"""

import os
import runpy
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import utils  # noqa: E402

crash_step, crash_at = int(os.environ["CRASH_STEP"]), int(os.environ["CRASH_AT"])
counted = {"inside": False, "n": 0, "names": []}


def counting(module, name):
    real = getattr(module, name)

    def step(*args, **kwargs):
        if counted["inside"]:
            counted["n"] += 1
            counted["names"].append(name)
            if counted["n"] == crash_at:
                os._exit(137)
        return real(*args, **kwargs)
    setattr(module, name, step)


for module, name in [(os, "fsync"), (os, "rename"), (os, "replace"), (shutil, "rmtree")]:
    counting(module, name)

real_save = utils.save_checkpoint


def save_checkpoint(exp_dir, step, *args, **kwargs):
    counted["inside"] = step == crash_step
    try:
        return real_save(exp_dir, step, *args, **kwargs)
    finally:
        if counted["inside"] and crash_at == 0:
            Path(os.environ["CRASH_COUNT_FILE"]).write_text(",".join(counted["names"]))
        counted["inside"] = False


utils.save_checkpoint = save_checkpoint
sys.argv = [str(ROOT / "train_llm.py"), *sys.argv[1:]]
runpy.run_path(str(ROOT / "train_llm.py"), run_name="__main__")
