"""Export a checkpoint of a train_llm.py run in the Hugging Face layout (safetensors weights,
config and tokenizer), for transformers, vLLM, llama.cpp's converters and the rest. A run of a
copy of the kit (the script renamed, its create_model changed) works too: the model is rebuilt
by the script the run recorded, with the copy's own trained.py, utils.py and data.py.

    python scripts/export_hf.py outputs/demo              # the run's own hf/, written again
    python scripts/export_hf.py outputs/demo --out demo-hf
    python scripts/export_hf.py outputs/demo --checkpoint outputs/demo/checkpoints/step-000400 \
        --out demo-400

Without --out it writes the run's own hf/ (not while the run trains), from any checkpoint of
DDP (model.pt) or FSDP (dcp/) runs. An export is written as OUT.tmp and renamed: a whole one or
none, and one at a time (a second export to the same --out is told another is writing there).
--out must not exist yet, or be an earlier export (its train_llm.json tells): nothing else is
ever replaced, and files a user added to an earlier export are kept.
"""

import argparse
import contextlib
import difflib
import fcntl
import json
import os
import shutil
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import trained  # noqa: E402
import utils  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run by path, or by runpy)
import project  # noqa: E402  (the run's own trained.py and utils.py)


def save_hf(out, model, tokenizer, config, checkpoint=None, owned=False):
    """``model`` in the Hugging Face layout, with the tokenizer and the run's config as
    train_llm.json, written as out.tmp and renamed: a whole export or none.

    Only an earlier export (or an empty directory) is ever replaced: anything else at ``out``
    is refused, so a mistyped --out cannot delete a user's files or runs. ``owned``: ``out`` is
    a run's own hf/, which the run directory's layout reserves for it (DESIGN.md section 3).
    """
    out = Path(os.path.abspath(out))
    tmp, old = staging(out), out.with_name(f".{out.name}.replaced")
    replaceable(out, owned)
    held = claim(tmp, out)
    try:
        write_export(out, tmp, model, tokenizer, config, checkpoint)
        # The old export is renamed aside, not deleted in place: a kill while deleting it
        # would leave a directory without its marker, which no later export could replace.
        # (The hidden name is save_hf's own: one left by a kill is deleted the next time.)
        with locked(out.parent):  # (another export's renames wait: they use ``old`` too)
            shutil.rmtree(old, ignore_errors=True)
            if out.exists():
                os.rename(out, old)
            os.rename(tmp, out)
        shutil.rmtree(old, ignore_errors=True)  # (out's own claim still held: no other export)
    finally:
        os.close(held)


def write_export(out, tmp, model, tokenizer, config, checkpoint):
    """The export into ``tmp``, checked, with the files a user added to ``out`` copied; a
    failure deletes ``tmp`` and names the cause."""
    marker = trained.EXPORT_MARKER
    try:
        # The marker first: a half-written tmp that a kill leaves behind is then known as ours.
        (tmp / marker).write_text(json.dumps({**config, "exported_from": checkpoint}, indent=2))
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        check_export(tmp, model)
        written = sorted(str(p.relative_to(tmp)) for p in tmp.rglob("*") if p.is_file())
        (tmp / marker).write_text(json.dumps(
            {**config, "exported_from": checkpoint, "files": written}, indent=2))
        for name in added_by_user(out, written):  # a model card, eval results: kept (copies)
            (tmp / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(out / name, tmp / name)
    except Exception as e:  # safetensors reports a full disk as its own SafetensorError
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, NotTheModel):
            raise
        if (failure := utils.write_failure(out, e)) is None:
            raise
        raise failure from e


def replaceable(out, owned):
    """Refused (FileExistsError) unless ``out`` and its OUT.tmp are the run's own (``owned``),
    missing, or exports of the kit (its marker, train_llm.json, says so)."""
    for path in (out, staging(out)):
        if path.exists() and not owned and not is_export(path):
            raise FileExistsError(f"{path} exists and is not an export of this kit (it has no "
                                  f"{trained.EXPORT_MARKER}, or holds a run): not replacing it. "
                                  "Pass an --out that does not exist yet.")


def staging(out):
    """Where an export of ``out`` is written before it is renamed into place: OUT.tmp."""
    return out.with_name(out.name + ".tmp")


class ExportBusy(OSError):
    """Another export is writing the same --out."""

    def __init__(self, out):
        super().__init__(f"another export is writing {out} now (into {staging(out)}): nothing "
                         "was written. Wait for it to finish, or pass another --out.")


@contextlib.contextmanager
def locked(directory):
    """One export at a time in ``directory`` for the block (a file system without flock:
    unguarded)."""
    fd = os.open(directory, os.O_RDONLY)
    try:
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def busy(tmp):
    """Whether an export is writing ``tmp``: one that runs holds it locked (flock)."""
    try:
        fd = os.open(tmp, os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return False
    except BlockingIOError:
        return True
    except OSError:  # (a file system without flock)
        return False
    finally:
        os.close(fd)


def claim(tmp, out):
    """``tmp`` made anew for this export and locked till its descriptor (returned) is closed,
    what a killed export left there deleted; ExportBusy if another export holds it."""
    tmp.parent.mkdir(parents=True, exist_ok=True)
    with locked(tmp.parent):  # (no other export between the look and the mkdir)
        if busy(tmp):
            raise ExportBusy(out)
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir()
        fd = os.open(tmp, os.O_RDONLY)
        with contextlib.suppress(OSError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return fd


class NotTheModel(OSError):
    """An export that transformers loads as another model than the run's."""


def check_export(path, model):
    """The export at ``path``, loaded as any user loads it, against ``model``: every weight
    loads, and the logits of a fixed batch agree; else NotTheModel, naming the weights."""
    loaded, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, output_loading_info=True, dtype=next(model.parameters()).dtype)
    ids = torch.arange(16).remainder(model.get_input_embeddings().num_embeddings).view(1, -1)
    with torch.no_grad():
        expected = model.eval()(input_ids=ids).logits.float()
        diff = (loaded.eval()(input_ids=ids).logits.float() - expected).abs()
    missing, unexpected = sorted(info["missing_keys"]), sorted(info["unexpected_keys"])
    if missing or unexpected or diff.max() > 1e-3 * (1 + expected.abs().max()):
        raise NotTheModel(
            f"transformers loads the export as a model other than the run's: its logits differ "
            f"by up to {diff.max():.3g}; {len(missing)} weight(s) it would make at random (e.g. "
            f"{missing[:3]}), {len(unexpected)} it would drop (e.g. {unexpected[:3]}). Nothing "
            "was written. A model with modules of its own (adapters such as LoRA) turns itself "
            "into the plain architecture first: give it a merge_and_unload() that returns that "
            "model (as PEFT's models have; README, Changing the kit).")


def added_by_user(out, written):
    """The files of an earlier export at ``out`` that no export wrote (its marker lists what
    it wrote; an older one, which did not, wrote only top-level .json, .safetensors, .jinja,
    .txt and .model files) and that the new export (``written``) does not write again."""
    if not out.is_dir():
        return []
    try:
        ours = set(json.loads((out / trained.EXPORT_MARKER).read_text()).get("files") or [])
    except (OSError, ValueError, AttributeError):
        ours = set()
    if not ours:
        ours = {p.name for p in out.iterdir() if p.is_file() and p.suffix in
                (".json", ".safetensors", ".jinja", ".txt", ".model")}
    return [name for name in (str(p.relative_to(out)) for p in sorted(out.rglob("*"))
                              if p.is_file()) if name not in ours and name not in written]


def is_export(path):
    """Whether save_hf may replace ``path``: an empty directory, or one with its marker that
    is not (and does not hold) a run directory."""
    if not path.is_dir():
        return False
    names = {p.name for p in path.iterdir()}
    return not names or (trained.EXPORT_MARKER in names
                         and not {"state.json", "checkpoints"} & names)


def before_work(args):
    """The refusals said before the model is loaded, and --out settled: (whether it is the
    run's own hf/, the run's lock held for the export or None)."""
    run = (args.run_dir / "state.json").is_file() and (args.run_dir / "checkpoints").is_dir()
    if args.out is None and not run:
        if not args.run_dir.exists():
            sys.exit(no_such_run(args.run_dir))
        sys.exit(f"{args.run_dir} is no run directory: pass --out, the directory to write")
    if run and args.checkpoint and args.checkpoint.resolve().parent != \
            (args.run_dir / "checkpoints").resolve():
        sys.exit(f"--checkpoint {args.checkpoint} is not one of {args.run_dir}'s checkpoints "
                 f"(those in {args.run_dir / 'checkpoints'}): pass the run it belongs to")
    own = args.run_dir / "hf"  # the run's own export, which its layout reserves for it
    args.out = args.out or own
    owned, lock = run and args.out.resolve() == own.resolve(), None
    if owned:  # never beside a run that is training there, or another export of it: its lock
        lock = open(args.run_dir / ".lock", "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.exit(f"{args.run_dir} is training, or being exported (its lock is held): export "
                     "it once that has finished, or pass --out")
    out = Path(os.path.abspath(args.out))
    replaceable(out, owned)  # (save_hf makes sure again, and claims its OUT.tmp)
    if busy(staging(out)):
        raise ExportBusy(out)
    return owned, lock


def no_such_run(path):
    """The refusal of a run directory that does not exist, with the runs of names near it."""
    parent = path.parent
    runs = [p.name for p in parent.iterdir() if (p / "state.json").is_file()] \
        if parent.is_dir() else []
    near = difflib.get_close_matches(path.name, runs, n=3)
    return (f"{path}: no such run directory" + (f" (runs of names near it: {', '.join(near)})"
                                                 if near else "")
            + ". Pass the directory of a run of train_llm.py, as outputs/NAME")


def main():
    transformers.utils.logging.disable_progress_bar()  # no bars for loading tiny files
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run_dir", type=Path, help="an experiment directory of train_llm.py")
    parser.add_argument("--checkpoint", type=Path, default=None,
                        help="a checkpoint directory of that run (default: the newest complete)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the directory to write (default: the run's own hf/)")
    parser.add_argument("--script", default=None,
                        help="the training script whose create_model builds the model "
                             "(default: the one the run recorded)")
    parser.add_argument("--weights", default="model",
                        help="which weights of a checkpoint: model, or a training state of "
                             "your own that holds the model's (e.g. ema: README, Changing the "
                             "kit)")
    args = parser.parse_args()
    owned, _run_lock = before_work(args)  # (held till the export ends)
    source = args.checkpoint or args.run_dir
    kit = project.project_kit(source, args.script)  # a copy's own trained.py, if it has one
    model, tokenizer, config, checkpoint = project.load_trained(kit, source, args.script,
                                                                args.weights)
    if callable(getattr(model, "merge_and_unload", None)):  # adapters (LoRA) merged: plain
        model = model.merge_and_unload()
    trained.with_cache(model)  # generates with its KV cache (a copy's trained.py may not)
    if not isinstance(model, transformers.PreTrainedModel):
        sys.exit(f"{source} trained {type(model).__name__}, a model of its own (the "
                 "create_model of its training script), not a transformers one: there is no "
                 "Hugging Face layout to write. Its checkpoints are its export: build the model "
                 "with create_model and load model.pt with torch.load(..., weights_only=True).")
    checkpoint = checkpoint.resolve()  # (the one read: a run may have saved a newer one since)
    if owned and args.checkpoint is None:  # as the run writes it: the path inside the run
        checkpoint = checkpoint.relative_to(args.run_dir.resolve())
    save_hf(args.out, model, tokenizer, config or {}, checkpoint=str(checkpoint), owned=owned)
    print(f"Wrote {args.out}: load it with AutoModelForCausalLM.from_pretrained({str(args.out)!r})")


if __name__ == "__main__":
    try:
        main()
    except OSError as e:  # a missing or damaged run, an --out that is not ours, a full disk
        sys.exit(f"{type(e).__name__}: {e}")
    except KeyboardInterrupt:  # (a half-written export is written over by the same command)
        sys.exit("Stopped (Ctrl-C). The same command exports again, over what this one left.")
