"""Export a checkpoint of a train_llm.py run in the Hugging Face layout (safetensors weights,
config and tokenizer), for transformers, vLLM, llama.cpp's converters and the rest. A run of a
copy of the kit (the script renamed, its create_model changed) works too: the model is rebuilt
by the script the run recorded, with the copy's own utils.py and data.py.

    python scripts/export_hf.py outputs/demo              # the run's own hf/, written again
    python scripts/export_hf.py outputs/demo --out demo-hf
    python scripts/export_hf.py outputs/demo --checkpoint outputs/demo/checkpoints/step-000400 \
        --out demo-400

A run writes {run}/hf/ by itself when it ends; without --out this writes it again (after a kill
or a full disk during that export), and it does the same for any checkpoint, from DDP
(model.pt) or FSDP (dcp/) runs. --out must not exist yet, or be an earlier export (its
train_llm.json tells): nothing else is ever replaced.
"""

import argparse
import fcntl
import sys
from pathlib import Path

import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import utils  # noqa: E402


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
    run = (args.run_dir / "state.json").is_file() and (args.run_dir / "checkpoints").is_dir()
    if args.out is None and not run:  # (said before the model is loaded)
        sys.exit(f"{args.run_dir} is no run directory: pass --out, the directory to write")
    source = args.checkpoint or args.run_dir
    kit = utils.project_utils(source, args.script)  # a copy's own utils.py, if it has one
    model, tokenizer, config = kit.load_trained(source, script=args.script, weights=args.weights)
    if not isinstance(model, transformers.PreTrainedModel):
        sys.exit(f"{source} trained {type(model).__name__}, a model of its own (the "
                 "create_model of its training script), not a transformers one: there is no "
                 "Hugging Face layout to write. Its checkpoints are its export: build the model "
                 "with create_model and load model.pt with torch.load(..., weights_only=True).")
    if (source / "config.json").exists():  # already Hugging Face files: re-exported as they are
        checkpoint = source
    else:
        checkpoint = kit.find_checkpoint(source).resolve()
    own = args.run_dir / "hf"  # the run's own export, which its layout reserves for it
    args.out = args.out or own
    owned = run and args.out.resolve() == own.resolve()
    if owned:  # never beside a run that is training there (and may be exporting): its lock
        lock = open(args.run_dir / ".lock", "a")
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.exit(f"{args.run_dir} is training: export it once it has finished, or pass --out")
    if owned and args.checkpoint is None:  # as the run writes it: the path inside the run
        checkpoint = checkpoint.relative_to(args.run_dir.resolve())
    kit.save_hf(args.out, model, tokenizer, config or {}, checkpoint=str(checkpoint),
                owned=owned)
    print(f"Wrote {args.out}: load it with AutoModelForCausalLM.from_pretrained({str(args.out)!r})")


if __name__ == "__main__":
    try:
        main()
    except OSError as e:  # a missing or damaged run, an --out that is not ours, a full disk
        sys.exit(f"{type(e).__name__}: {e}")
