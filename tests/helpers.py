"""What the test modules share: running the trainer as a user does, reading what a run wrote,
data of known content, pipelines cut and resumed, and the 2-rank runs on a corpus of
fixed-length documents. Fixtures and pytest hooks are in conftest.py."""

import array
import contextlib
import functools
import gzip
import hashlib
import importlib.util
import itertools
import json
import os
import queue
import random
import re
import resource
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import zlib
from pathlib import Path

import pyarrow
import pyarrow.parquet
import torch
from hypothesis import settings
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import utils  # noqa: E402
from data import Chunk, Count, Sequence  # noqa: E402, F401 (the tests' in-memory stages)

# One thread each: faster for a model this small, and the same float sums in every process.
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
TOY_VOCAB = ["<bos>", "<eos>", "<unk>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)]
LETTERS = "abcdefghijklmnopqrstuvwxyz"

# -- Property tests: the fast tier draws fewer examples -------------------------------------------

FAST_TIER_EXAMPLES = 10
settings.register_profile("fast", max_examples=FAST_TIER_EXAMPLES)


def examples(n):
    """max_examples for a property test: ``n``, or at most FAST_TIER_EXAMPLES under the "fast"
    hypothesis profile (conftest.py loads it for -m "not slow", before any test module is
    imported, so that this is read with it in place)."""
    if settings.get_current_profile_name() == "fast":
        return min(n, settings.default.max_examples)
    return n


# -- The trainer, run the way a user runs it ------------------------------------------------------

MAX_STEPS = 30  # train_args' --max-steps


def train_args(save_dir, model, name="run", **overrides):
    """train_llm.py's flags for a run of a few seconds: 32-token sequences, 30 steps (``model``
    None: no --model-name, as with --init-from)."""
    args = {"experiment-name": name, "save-dir": save_dir, **({"model-name": model} if model
                                                                else {}),
            "seq-length": 32, "batch-size": 4, "max-steps": MAX_STEPS, "lr": 1e-2,
            "warmup-steps": 5, "log-freq": 5, "val-freq": 10, "val-batches": 2,
            "ckpt-freq": 10, "wandb": "disabled", "tokenizer-threads": 1}
    args.update({key.replace("_", "-"): value for key, value in overrides.items()})
    return [f"--{key}={value}" for key, value in args.items()]


def train(args, timeout=120, script="train_llm.py"):
    """``python train_llm.py ARGS`` (or another ``script`` of the kit) from the kit's
    directory, to the end: its exit code and output, as subprocess.run gives them."""
    with tempfile.TemporaryDirectory() as tmp:
        out, err = Path(tmp, "out"), Path(tmp, "err")
        run = zygote().start([script, *map(str, args)], out, err)
        try:
            run.wait(timeout)
        finally:
            run.kill()
        return subprocess.CompletedProcess(run.args, run.returncode, out.read_text(),
                                           err.read_text())


def train_patched(prelude, args, timeout=120):
    """``python train_llm.py ARGS`` in a fresh process after ``prelude`` (Python that patches
    what the run will use: a failing allocation, a lowered limit), to the end."""
    code = (f"import runpy, sys\n{prelude}\nsys.argv = ['train_llm.py', *sys.argv[1:]]\n"
            "runpy.run_path('train_llm.py', run_name='__main__')\n")
    return subprocess.run([sys.executable, "-c", code, *map(str, args)], cwd=ROOT, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def export(run_dir):
    """``python scripts/export_hf.py RUN_DIR``: the run's hf/, as a user writes it."""
    result = train([run_dir], script="scripts/export_hf.py")
    assert result.returncode == 0, result.stderr
    return run_dir / "hf"


def start(args, log_path):
    """``python train_llm.py ARGS`` started, its stdout and stderr appended to ``log_path``:
    a handle with Popen's pid, poll, wait, send_signal and kill."""
    return zygote().start(["train_llm.py", *map(str, args)], log_path, log_path)


class Forked:
    """A train_llm.py run forked by tests/zygote.py: what the tests use of a Popen."""

    def __init__(self, server, pid, args):
        self.server, self.pid, self.args, self.returncode = server, pid, args, None

    def poll(self):
        if self.returncode is None and self.server.dead:
            raise RuntimeError("tests/zygote.py died: this run's end is unknown")
        return self.returncode

    def wait(self, timeout=None):
        with self.server.changed:
            if not self.server.changed.wait_for(
                    lambda: self.returncode is not None or self.server.dead, timeout):
                raise subprocess.TimeoutExpired(self.args, timeout)
        return self.poll()

    def send_signal(self, signum):
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):  # ended, not yet reported
                os.kill(self.pid, signum)

    def kill(self):
        self.send_signal(signal.SIGKILL)

    def terminate(self):
        self.send_signal(signal.SIGTERM)


class Zygote:
    """The client of one tests/zygote.py server, started with the string-hash seed ``seed``."""

    def __init__(self, seed):
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "tests/zygote.py")], cwd=ROOT,
                                     env={**ENV, "PYTHONHASHSEED": str(seed)},
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     bufsize=1)
        self.runs, self.started, self.dead = {}, queue.Queue(), False
        self.changed, self.lock = threading.Condition(), threading.Lock()
        threading.Thread(target=self._read, daemon=True, name="zygote").start()

    def _read(self):
        try:
            for line in self.proc.stdout:
                what, pid, *code = line.split()
                if what == "started":  # registered here, before its exit can be read
                    with self.changed:
                        self.runs[int(pid)] = Forked(self, int(pid), None)
                    self.started.put(self.runs[int(pid)])
                else:  # the run is reaped: its pid may be reused from now on
                    with self.changed:
                        self.runs.pop(int(pid)).returncode = int(code[0])
                        self.changed.notify_all()
        finally:  # the server died (or spoke out of protocol): nobody waits for ever
            with self.changed:
                self.dead = True
                self.changed.notify_all()
            self.started.put(None)

    def start(self, argv, stdout, stderr):
        with self.lock:  # one request and its answer at a time
            assert not self.dead, "tests/zygote.py died"
            self.proc.stdin.write(json.dumps({"argv": argv, "env": ENV, "stdout": str(stdout),
                                              "stderr": str(stderr)}) + "\n")
            run = self.started.get(timeout=60)
        assert run is not None, "tests/zygote.py died"
        run.args = argv
        return run


SERVERS = itertools.count()


@functools.cache
def server(seed):
    return Zygote(seed)


def zygote():
    """Two servers, with other string-hash seeds, taken in turn: a straight run and its
    resumed copy do not share one (as two `python` processes would not), so an order that
    follows a set's hashing still shows up as a difference."""
    return server(next(SERVERS) % 2 + 1)


def script(name, argv, capsys, monkeypatch):
    """Run scripts/NAME.py in this process (no start-up cost); what it printed."""
    monkeypatch.setattr(sys, "argv", [name, *map(str, argv)])
    runpy.run_path(str(ROOT / "scripts" / f"{name}.py"), run_name="__main__")
    return capsys.readouterr().out


@contextlib.contextmanager
def small_disk(limit):
    """In this process, till the block ends: a file written past ``limit`` bytes fails with
    EFBIG (RLIMIT_FSIZE; Python ignores SIGXFSZ), as on a full disk."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))


def small_disk_of(limit):
    """small_disk for a process of its own: its preexec_fn (subprocess.run)."""
    return lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))


@contextlib.contextmanager
def read_only(make):
    """A directory that ``make(path)`` makes, then read-only to this process till the block
    ends: mode 0o555, and as root (whom no mode stops) the process acting as nobody, who can
    import nothing then; so that nobody may reach it, it lies in a new directory of /tmp."""
    with tempfile.TemporaryDirectory() as tmp:
        os.chmod(tmp, 0o755)
        path = Path(tmp, "ro")
        make(path)
        path.chmod(0o555)
        root = os.geteuid() == 0
        if root:
            os.setegid(65534)
            os.seteuid(65534)
        try:
            yield path
        finally:
            if root:
                os.seteuid(0)
                os.setegid(0)
            path.chmod(0o755)


def script_module(name):
    """scripts/NAME.py imported as a module (its main() not run), for its functions."""
    spec = importlib.util.spec_from_file_location(f"{name}_script", ROOT / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def refused(result, *words):
    """A non-zero exit whose message holds these words, and no traceback."""
    assert result.returncode != 0, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    for word in words:
        assert word in result.stderr, (word, result.stderr[-2000:])


def copy_kit(dest, script="my_train.py", create_model=None, edits=()):
    """The kit as a learner copies it into a project: train_llm.py (renamed ``script``),
    data.py, utils.py, trained.py and muon.py in ``dest``, without assets/ or data/;
    ``create_model``, source text, replaces the script's create_model; ``edits``: (old, new)
    text replaced once."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in ("data.py", "utils.py", "trained.py", "muon.py"):
        shutil.copy(ROOT / name, dest / name)
    text = (ROOT / "train_llm.py").read_text()
    if create_model:
        start = text.index("def create_model(args):")
        end = text.index("\n\n\ndef ", start)
        text = text[:start] + textwrap.dedent(create_model).strip() + text[end:]
    for old, new in edits:
        assert text.count(old) == 1, old
        text = text.replace(old, new)
    (dest / script).write_text(text)
    return dest / script


# An EMA of the weights as training state of one's own (train_llm.py's ``extra``), added as the
# README's "Changing the kit" shows: copy_kit's ``edits``.
EMA = """    extra = {}
    ema = AveragedModel(utils.unwrap(model), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optimizers[-1].register_step_post_hook(lambda *_: ema.update_parameters(utils.unwrap(model)))
    extra["ema"] = ema
"""
EMA_EDITS = (("    extra = {}\n", EMA), ("import data\n", "from torch.optim.swa_utils import "
                                          "AveragedModel, get_ema_multi_avg_fn\n\nimport data\n"))


def trainer_pipeline(flags, tokenizer=None):
    """A function that builds the training pipeline a run of ``train_llm.py FLAGS`` builds
    (train_llm.build_pipeline, rank 0 of 1), anew each call: for run_with_cuts, which cuts it
    and loads its state into a new one, as a resumed run does with its loader-rank0.json.
    ``tokenizer``: the one --tokenizer names, unless given."""
    import train_llm  # (only the tests that build the trainer's pipeline need the script)
    args = train_llm.parse_args(["--experiment-name=pipeline", *map(str, flags)])
    tokenizer = tokenizer or AutoTokenizer.from_pretrained(args.tokenizer)
    return lambda: train_llm.build_pipeline(args.dataset, tokenizer, args, 0, 1, train=True)


# -- Waiting for and killing a run ----------------------------------------------------------------

def wait_for(condition, proc, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert proc.poll() is None, f"training exited early with {proc.returncode}"
        assert time.monotonic() < deadline, "timed out waiting for training"
        time.sleep(0.01)


def kill_at(proc, exp_dir, step, delay=0.0, kill=None, timeout=120):
    """SIGKILL the run once it has logged ``step``, ``delay`` seconds later (in the next
    step's data fetch, its validation or a save); it must not have finished by then."""
    wait_for(lambda: last_step(exp_dir) >= step, proc, timeout)
    time.sleep(delay)
    (kill or proc.kill)()
    assert proc.wait() != 0, f"the run finished before the kill after step {step}"


def straight_and_killed(args, tmp_path, at=13):
    """The run ``args(name)`` (flags whose --save-dir is ``tmp_path``) twice: "straight", and
    "killed": SIGKILLed once it has logged each step of ``at`` (one, or several in turn) and
    rerun to the end. Their directories, and the steps the reruns said they resumed from."""
    result = train(args("straight"))
    assert result.returncode == 0, result.stderr[-3000:]
    log = tmp_path / "log.txt"
    for step in [at] if isinstance(at, int) else at:
        kill_at(start(args("killed"), log), tmp_path / "killed", step)
    result = train(args("killed"))
    assert result.returncode == 0, result.stderr[-3000:]
    return (tmp_path / "straight", tmp_path / "killed",
            resumed_steps(log.read_text() + result.stderr))


# -- What a run wrote -----------------------------------------------------------------------------

def wandb_history(exp_dir, run_id):
    """(step, loss) of every history record of a wandb offline run, all its segments (what
    `wandb sync` uploads), read back from their transaction logs."""
    from wandb.proto.wandb_internal_pb2 import Record
    return sorted((r.history.step.num, json.loads(next(
        i.value_json for i in r.history.item if (i.key or "/".join(i.nested_key)) == "loss")))
        for path in (exp_dir / "wandb").glob(f"offline-run-*-{run_id}/run-{run_id}.wandb")
        for r in utils.wandb_records(path, Record) if r.HasField("history"))


def metrics(exp_dir):
    return [json.loads(line) for line in (exp_dir / "metrics.jsonl").read_text().splitlines()]


def last_step(exp_dir):
    """The last step metrics.jsonl holds a whole line for (a resumed run first cuts the
    file back to its checkpoint, so this can go down; a restart from scratch moves it aside,
    so it can be gone between two looks)."""
    try:
        lines = (exp_dir / "metrics.jsonl").read_text().split("\n")[:-1]
    except FileNotFoundError:
        lines = []
    return json.loads(lines[-1])["step"] if lines else 0


def global_step(exp_dir):
    state = exp_dir / "state.json"  # replaced atomically, so never read half-written
    return json.loads(state.read_text())["global_step"] if state.exists() else 0


def resumable_step(exp_dir):
    """The step a rerun resumes from: the newest complete checkpoint's (a kill between a
    checkpoint's rename and the state.json update still resumes from the new one)."""
    state, _ = utils.run_state(exp_dir)
    return state["global_step"] if state else 0


def resumed_steps(log_text):
    """The steps that the restarts of a run said they resumed from."""
    return [int(n) for n in re.findall(r"Resuming .* from .*, step (\d+) of", log_text)]


def digest(path):
    return hashlib.sha256(path.read_bytes()).hexdigest()


def snapshot(directory):
    """{relative path: sha256} of every file under a directory but train.log (a refused start
    is logged there too)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "train.log"}


def copy_run(run, tmp_path):
    subprocess.run(["cp", "-r", str(run), str(tmp_path / "k")], check=True)
    return tmp_path / "k"


def assert_same_run(exp_dir, reference):
    final = f"checkpoints/step-{MAX_STEPS:06d}"
    model, expected = (torch.load(d / final / "model.pt", weights_only=True)
                       for d in (exp_dir, reference))
    assert model.keys() == expected.keys()
    for name in model:
        assert torch.equal(model[name], expected[name]), name
    for name in ("optimizer.pt", "loader-rank0.json"):
        assert digest(exp_dir / final / name) == digest(reference / final / name), name
    # Every step logged exactly once, with the very same numbers.
    keys = ("step", "loss", "grad_norm", "lr", "val_loss")
    assert ([[row.get(k) for k in keys] for row in metrics(exp_dir)]
            == [[row.get(k) for k in keys] for row in metrics(reference)])


# -- Data of known content ------------------------------------------------------------------------

def toy_tokenizer(same_bos_eos=False):
    """A word-level tokenizer with predictable ids: "a" -> 3, "b" -> 4, ..., "z" -> 28."""
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(TOY_VOCAB)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    eos = "<bos>" if same_bos_eos else "<eos>"
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token=eos,
                                   unk_token="<unk>", name_or_path="toy")


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def write_lines(path, lines):
    """Lines (without their newlines) as a JSON Lines shard; .gz compresses."""
    body = "".join(line + "\n" for line in lines).encode()
    path.write_bytes(gzip.compress(body, mtime=0) if str(path).endswith(".gz") else body)
    return str(path)


def write_shard(path, records, row_group_size=2):
    """Records as a shard of the kind its name says: JSON Lines, Parquet, or a JSON array
    (.json, pretty-printed like Alpaca's alpaca_data.json); .gz compresses."""
    path = str(path)
    if path.endswith(".parquet"):
        table = pyarrow.Table.from_pylist(records) if records else pyarrow.table({"text": []})
        pyarrow.parquet.write_table(table, path, row_group_size=row_group_size)
        return path
    if ".json" in path and ".jsonl" not in path:
        body = json.dumps(records, indent=4).encode()
    else:
        body = "".join(json.dumps(r) + "\n" for r in records).encode()
    with open(path, "wb") as f:
        f.write(gzip.compress(body, mtime=0) if path.endswith(".gz") else body)
    return path


def split_capacity(urls):
    """The most input splits these shards can be cut into, worked out without Files: a
    compressed JSON Lines shard stays whole, Parquet is cut between row groups, plain JSON
    Lines and JSON arrays (.json here) anywhere (into empty ranges, if need be)."""
    def most(url):
        if url.endswith(".parquet"):
            return max(1, pyarrow.parquet.ParquetFile(url).num_row_groups)
        return 1 if url.endswith((".jsonl.gz", ".jsonl.zst")) else float("inf")
    return sum(map(most, urls))


def records_per_split(files):
    """The records in each split of a Files over plain JSON Lines, counted without its readers:
    a split owns the non-blank lines that start inside its byte range."""
    counts = []
    for url, start, end in files.splits:
        with open(url, "rb") as f:
            data = f.read()
        starts = [q for q in range(start, len(data) if end is None else end)
                  if q == 0 or data[q - 1] == ord("\n")]
        counts.append(sum(1 for q in starts if data[q:data.find(b"\n", q)].strip()))
    return counts


# -- Pipelines cut and resumed --------------------------------------------------------------------

def comparable(item):
    return {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in item.items()}


def take(pipe, n):
    out = []
    for _ in range(n):
        try:
            out.append(comparable(next(pipe)))
        except StopIteration:
            break
    return out


def run_with_cuts(make, cuts, total):
    """Items of a pipeline that is cut (state -> JSON -> new pipeline) at each of `cuts`."""
    out, pipe = [], make()
    for cut in sorted(cuts):
        out += take(pipe, cut - len(out))
        state = json.loads(json.dumps(pipe.state_dict()))
        pipe.close()
        pipe = make()
        pipe.load_state_dict(state)
    out += take(pipe, total - len(out))
    pipe.close()
    return out


def stage(pipe, cls):
    while not isinstance(pipe, cls):
        pipe = pipe.src
    return pipe



def older_tokenize_state(tokenize, upstream, handed):
    """A Tokenize state as older versions saved it: the upstream state before its batch, the
    samples handed out since (``handed``: their texts) and a crc32 of their texts' crc32s."""
    crcs = [zlib.crc32(text.encode("utf-8", "surrogatepass")) for text in handed]
    return {"config": tokenize.config, "upstream": upstream, "skip": len(handed),
            "crc": zlib.crc32(array.array("I", crcs).tobytes())}


# -- A corpus whose documents can be read off the tokens: "d17 q w e ..." -------------------------

N_IDS = 2000


def word_tokenizer():
    """Document ids d0 ... d1999 and the letters, one token each; BOS and EOS apart."""
    words = ["<bos>", "<eos>", "<unk>", *(f"d{i}" for i in range(N_IDS)), *LETTERS]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>",
                                   unk_token="<unk>", name_or_path="words")


WORD_TOKENIZER = word_tokenizer()
ID_OF = {WORD_TOKENIZER.convert_tokens_to_ids(f"d{i}"): i for i in range(N_IDS)}


def write_corpus(directory, sizes, *, words=None, seed=0, first_id=0):
    """Shards of documents "d<id> <letters>"; ids are unique over the corpus (from
    ``first_id``); returns how many. With ``words`` every document has exactly that many
    letters, else 0-9 at random."""
    rng = random.Random(seed)
    directory.mkdir(parents=True, exist_ok=True)
    doc_id = first_id
    for i, size in enumerate(sizes):
        lines = []
        for _ in range(size):
            n = words if words is not None else rng.randrange(10)
            lines.append(json.dumps({"text": " ".join([f"d{doc_id}", *rng.choices(LETTERS, k=n)])}))
            doc_id += 1
        (directory / f"train-{i:03d}.jsonl").write_text("".join(line + "\n" for line in lines))
    return doc_id - first_id


# -- The trainer on that corpus, on 1 or 2 ranks (torchrun on CPU with gloo) ----------------------

CORPUS_STEPS = 12


def corpus_args(save_dir, model, corpus, name="run", **overrides):
    args = {"experiment-name": name, "save-dir": save_dir, **({"model-name": model} if model
                                                                else {}),
            "dataset": corpus / "train/*.jsonl", "val-dataset": corpus / "val/*.jsonl",
            "tokenizer": corpus / "tokenizer", "seq-length": 32, "batch-size": 4,
            "max-steps": CORPUS_STEPS, "lr": 1e-2, "warmup-steps": 3, "log-freq": 4,
            "val-freq": 6, "val-batches": 3, "ckpt-freq": 4, "wandb": "disabled",
            "tokenizer-threads": 1, "active-shards": 4, "shuffle-buffer": 1}
    args.update({key.replace("_", "-"): value for key, value in overrides.items()})
    return [f"--{key}" if value is True else f"--{key}={value}" for key, value in args.items()]


def ranks_command(args, ranks):
    if ranks == 1:
        return [sys.executable, "train_llm.py", *args]
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", "train_llm.py", *args]


def run_ranks(args, ranks, timeout=180):
    result = subprocess.run(ranks_command(args, ranks), cwd=ROOT, env=ENV, capture_output=True,
                            text=True, timeout=timeout)
    assert result.returncode == 0, result.stderr[-3000:]
    return result


def loader_states(exp_dir, step=None):
    state = json.loads((exp_dir / "state.json").read_text())
    ckpt = exp_dir / (f"checkpoints/step-{step:06d}" if step else state["checkpoint"])
    return [json.loads((ckpt / f"loader-rank{r}.json").read_text())
            for r in range(state["world_size"])]


def consumed(states):
    """{slot: (url, byte offset)} after the documents each rank handed past Tokenize, and
    the sequences still buffered (none with fixed-length documents and --shuffle-buffer 1)."""
    slots, buffered = {}, 0
    for state in states:
        node = state
        while "skip" not in node:  # down to Tokenize's state
            buffered += len(node.get("rest", [])) + len(node.get("buffer", []))
            node = node["upstream"]
        # Tokenize's upstream state is where the documents it handed out end (no piece of a
        # cut document was handed out here: the corpus has none).
        assert node["skip"] == 0, node
        for slot in node["upstream"]["slots"]:
            assert slot["pos"] % 4 not in slots, "two ranks read the same slot"
            slots[slot["pos"] % 4] = (slot["url"], slot["offset"])
    return slots, buffered


def assert_same_weights(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def final_model(exp_dir):
    path = exp_dir / f"checkpoints/step-{CORPUS_STEPS:06d}/model.pt"
    return torch.load(path, weights_only=True)
