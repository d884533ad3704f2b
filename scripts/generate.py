"""Continue a prompt with a trained model: a run directory (its newest checkpoint, no export
needed), a checkpoint directory, a Hugging Face directory (a run's hf/) or a Hub name. A run
of any copy of the kit works: its model is rebuilt by the training script the run recorded,
with the copy's own trained.py, utils.py and data.py.

    python scripts/generate.py outputs/demo --prompt "The river"
    python scripts/generate.py outputs/demo-sft --prompt "Name three colors." --max-new-tokens 60

A model fine-tuned with --task sft sees the prompt laid out as it was trained: in the
instruction template, or in the tokenizer's chat template if it was trained on conversations
('messages'); --no-template gives the bare prompt. The same --seed gives the same text.
"""

import argparse
import sys
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import trained  # noqa: E402
import utils  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run by path, or by runpy)
import project  # noqa: E402  (the run's own trained.py and utils.py)


def main():
    transformers.utils.logging.disable_progress_bar()  # no bars for loading tiny files
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="run directory, checkpoint directory, HF directory or name")
    parser.add_argument("--prompt", required=True, type=trained.utf8, help="the text to continue")
    parser.add_argument("--max-new-tokens", type=utils.at_least(1), default=50,
                        help="tokens to generate")
    parser.add_argument("--temperature", type=utils.finite(0), default=0.8,
                        help="sampling temperature (0: greedy, always the likeliest token)")
    parser.add_argument("--top-k", type=utils.at_least(1), default=50,
                        help="sample among the K likeliest")
    parser.add_argument("--seed", type=utils.at_least(0, 2**32 - 1), default=0,
                        help="seed of the sampling")
    parser.add_argument("--device", type=utils.torch_device,
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-template", action="store_true",
                        help="do not wrap the prompt in the SFT instruction template")
    parser.add_argument("--script", default=None,
                        help="the training script whose create_model builds the model "
                             "(default: the one the run recorded)")
    parser.add_argument("--weights", default="model",
                        help="which weights of a checkpoint: model, or a training state of "
                             "your own that holds the model's (e.g. ema: README, Changing the "
                             "kit)")
    args = parser.parse_args()

    kit = project.project_kit(args.model, args.script)  # a copy's own trained.py, if it has one
    model, tokenizer, config, _ = project.load_trained(kit, args.model, args.script,
                                                       args.weights)
    model.to(args.device).eval()
    layout = None if args.no_template else kit.prompt_format(config)  # as it was trained
    print(kit.prompt_text(tokenizer, args.prompt, layout)
          + kit.generate(model, tokenizer, args.prompt, max_new_tokens=args.max_new_tokens,
                         temperature=args.temperature, top_k=args.top_k, seed=args.seed,
                         prompt_format=layout))


if __name__ == "__main__":
    try:
        main()
    except OSError as e:  # a missing or damaged run, a name that is neither a path nor on the Hub
        sys.exit(f"{type(e).__name__}: {e}")
