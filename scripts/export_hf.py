"""Export a checkpoint of a train_llm.py run in the Hugging Face layout (safetensors weights,
config and tokenizer), for transformers, vLLM, llama.cpp's converters and the rest.

    python scripts/export_hf.py outputs/demo --out demo-hf
    python scripts/export_hf.py outputs/demo --checkpoint outputs/demo/checkpoints/step-000400 \
        --out demo-400

A run writes {run}/hf/ by itself when it ends; this does the same for any checkpoint, from
DDP (model.pt) or FSDP (dcp/) runs. Run it from the directory the run was started in: the
run's --model-name and --tokenizer are read from there.
"""

import argparse
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
    parser.add_argument("--out", type=Path, required=True, help="the directory to write")
    args = parser.parse_args()
    model, tokenizer, config = utils.load_trained(args.checkpoint or args.run_dir)
    utils.save_hf(args.out, model, tokenizer, config)
    print(f"Wrote {args.out}: load it with AutoModelForCausalLM.from_pretrained({str(args.out)!r})")


if __name__ == "__main__":
    main()
