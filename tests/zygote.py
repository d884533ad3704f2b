"""A fork server for the tests' train_llm.py runs: it imports once what the script imports
(torch, transformers, the GPT-2 model code, data.py, utils.py; about 5 s of CPU per process),
then forks a child per run, which runs train_llm.py as __main__ with that run's argv,
environment and output files and exits as a process does (atexit, thread joins, its exit
code). helpers.train and helpers.start use it: a test pays a run, not an interpreter start.

Protocol, one JSON line per request on stdin: {"argv": [script, args...], "env": {...},
"stdout": path, "stderr": path}. It answers on stdout "started PID" for each request, in
order, and "exited PID CODE" when a child ends (CODE as subprocess gives it: -N for a signal).
One thread: a child forked here inherits no lock that another thread held.
"""

import atexit
import builtins
import gc
import json
import os
import select
import signal
import sys
import threading
import types
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # as train_llm.py sets it before torch loads
import transformers.models.gpt2.modeling_gpt2  # noqa: E402, F401  (the tests' model)
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402, F401

import train_llm  # noqa: E402, F401  (its imports: torch.distributed, data, utils, ...)


def run(request):
    """In the child: become the run's process, run the script and exit as the interpreter
    does (non-daemon threads joined, atexit handlers, the exit code, a traceback for an
    uncaught exception), but without tearing down the modules: that would touch, and so
    copy, every page shared with the server (1.4 s). Never returns."""
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644), fd)
    os.environ.clear()
    os.environ.update(request["env"])
    sys.argv = list(request["argv"])  # as typed: ["train_llm.py", ...], run from the kit
    script = Path(sys.argv[0]).resolve()
    sys.path[:2] = [str(script.parent)]  # the script's directory, not also tests/
    # As `python train_llm.py` runs it: a module __main__ whose __file__ is the absolute path
    # (runpy.run_path would also put that path into sys.argv[0]).
    module = types.ModuleType("__main__")
    module.__file__, module.__builtins__ = str(script), builtins
    sys.modules["__main__"] = module
    code = 0
    try:
        exec(compile(script.read_bytes(), str(script), "exec"), module.__dict__)
    except SystemExit as e:
        if isinstance(e.code, int) or e.code is None:
            code = (e.code or 0) & 0xFF
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except KeyboardInterrupt:  # as Python leaves on an unhandled Ctrl-C: killed by SIGINT
        sys.excepthook(*sys.exc_info())
        code = -signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        code = 1
    threading._shutdown()  # what Py_Finalize does first
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    if code < 0:
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    os._exit(code)


def main():
    gc.freeze()  # what is loaded now is never collected: a child's GC passes copy none of it
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)  # a Python handler, so that it wakes select
    requests = os.fdopen(0, "rb", buffering=0, closefd=False)
    pending = b""
    while True:
        ready, _, _ = select.select([requests, wake_r], [], [])
        if wake_r in ready:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if not pid:
                    break
                print("exited", pid, os.waitstatus_to_exitcode(status), flush=True)
        if requests in ready:
            chunk = os.read(requests.fileno(), 1 << 16)
            if not chunk:  # the tests are gone
                return
            pending += chunk
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                sys.stdout.flush()
                pid = os.fork()
                if pid == 0:
                    signal.set_wakeup_fd(-1)
                    signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                    os.close(wake_r)
                    os.close(wake_w)
                    run(json.loads(line))
                print("started", pid, flush=True)


if __name__ == "__main__":
    main()
