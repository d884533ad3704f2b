#!/usr/bin/env python3
"""Train the kit's default tokenizer and write the tiny GPT-2 config.

1. A byte-level BPE tokenizer (GPT-2 style, vocab 8192) is trained with the
   `tokenizers` library on the train shards of data/sample (all domains; --data
   takes what train_llm.py's --dataset takes: files, globs, directories) and
   saved to --out (the kit ships assets/tokenizer/) so that, offline,
       AutoTokenizer.from_pretrained("assets/tokenizer")
   returns a fast tokenizer with bos == eos == "<|endoftext|>" and a separate
   pad token "<|pad|>". Byte-level means every string round-trips exactly
   (decode(encode(x)) == x) and no input is ever "unknown".
2. assets/tiny-gpt2/config.json: a 4-layer, 128-wide GPT-2 whose vocabulary
   and special-token ids match the tokenizer. All dropout is 0 so a forward
   pass uses no randomness (needed for bit-exact resume of training).

Both outputs are deterministic: the same data gives byte-identical files.
Regenerate the shipped ones with (after data/make_sample_data.py):
    python scripts/train_tokenizer.py --data 'data/sample/*/train-*.jsonl' \
        --out assets/tokenizer --config-out assets/tiny-gpt2 --overwrite
Without --overwrite it writes into new or empty directories only (default: outputs/). Both are
written into hidden directories beside them and moved into place once they load: a full disk
or a kill leaves no half-written tokenizer.
"""
import argparse
import json
import os
import shutil
import sys
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import data  # noqa: E402
import utils  # noqa: E402

EOS = "<|endoftext|>"  # GPT-2's single document separator, also used as bos
PAD = "<|pad|>"        # a separate pad token, so padding is never confused with eos


def iter_texts(files):
    """The "text" of every record, shard after shard, read as training reads them (JSON Lines,
    Parquet, text; a bad record stops it naming its shard and line)."""
    for record in data.Files(files, n_active_shards=1, required_fields=["text"]):
        yield record["text"]


def train_tokenizer(files, vocab_size):
    tok = Tokenizer(models.BPE())  # no unk token: byte-level never needs one
    # GPT-2's regex split + mapping of every byte to a printable character.
    # add_prefix_space=False: "hello" is not silently turned into " hello".
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # Only fixes character offsets; unlike a TemplateProcessing post-processor
    # it adds no special tokens, so tokenizer("hello") is just the text's ids.
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS, PAD],  # ids 0 and 1
        # Seed the vocabulary with all 256 byte symbols, even ones absent from
        # the data, so any input can be encoded.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        min_frequency=2,
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(files), trainer=trainer)
    return tok


def write_tokenizer(tok, args, out):
    """The tokenizer into ``out``, loaded back as a user will, checked, and returned."""
    # Imported late: transformers is slow to import and training the tokenizer does not need it.
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    hf_tok = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=EOS, eos_token=EOS, unk_token=EOS, pad_token=PAD,
        model_max_length=args.max_length,
        clean_up_tokenization_spaces=False,  # would turn " ." into "." on decode
    )
    hf_tok.save_pretrained(out)
    # transformers 5 records its internal class name "TokenizersBackend";
    # "PreTrainedTokenizerFast" names the same class in 5.x and also loads in 4.x.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text(encoding="utf-8"))
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n", encoding="utf-8")

    # ---- check what a user of the kit will see: a fresh, offline load
    tok2 = AutoTokenizer.from_pretrained(out)
    assert isinstance(tok2, PreTrainedTokenizerFast), type(tok2)
    assert tok2.bos_token == tok2.eos_token == EOS and tok2.pad_token == PAD
    assert tok2("hello")["input_ids"] == tok2.encode("hello", add_special_tokens=False)
    samples = [next(iter_texts([f])) for f in args.files[::4]] + [
        "  leading spaces, tabs\t and\nnewlines  ", "naïve café — 日本語 🐍 \x00\x7f", ""]
    for text in samples:
        assert tok2.decode(tok2(text, verbose=False)["input_ids"]) == text, text[:80]
    return tok2


def write_config(tok2, args, config_out):
    """The tiny GPT-2 config that matches the tokenizer, into ``config_out``, and a model
    built from it: its parameters."""
    from transformers import AutoConfig, AutoModelForCausalLM, GPT2Config

    config = GPT2Config(
        vocab_size=len(tok2),
        n_positions=args.max_length, n_embd=128, n_layer=4, n_head=4,
        activation_function="gelu_pytorch_tanh",  # GPT-2's GELU as one kernel, not a formula
        resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, summary_first_dropout=0.0,
        bos_token_id=tok2.bos_token_id, eos_token_id=tok2.eos_token_id,
        pad_token_id=tok2.pad_token_id,
    )
    config.save_pretrained(config_out)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(config_out))
    return sum(p.numel() for p in model.parameters())  # lm_head is tied to wte


def staging(path):
    """A new hidden directory beside ``path`` (this process's: a kill's is never reused)."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.mkdir(parents=True)
    return tmp


def place(tmp, path):
    """The files of ``tmp`` moved to ``path``: the directory renamed where there is none (or
    an empty one), else file by file (--overwrite: the files of ``path`` it does not write
    are kept), each whole."""
    if path.is_dir() and not any(path.iterdir()):
        path.rmdir()
    if not path.exists():
        os.rename(tmp, path)
    else:
        for file in tmp.iterdir():
            os.replace(file, path / file.name)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--data", default="data/sample/*/train-*.jsonl",
                    help="training text: shards, globs, {a,b} patterns or directories")
    ap.add_argument("--out", type=Path, default=Path("outputs/tokenizer"))
    ap.add_argument("--config-out", type=Path, default=Path("outputs/tiny-gpt2"))
    ap.add_argument("--vocab-size", type=utils.at_least(258), default=8192,
                    help="at least the 256 bytes and the 2 special tokens")
    ap.add_argument("--max-length", type=utils.at_least(2), default=512,
                    help="model_max_length = n_positions")
    ap.add_argument("--overwrite", action="store_true",
                    help="write over the files of --out and --config-out (the shipped assets/)")
    args = ap.parse_args()
    if not args.overwrite:  # (a directory with files: the shipped assets, a user's own)
        for path in (args.out, args.config_out):
            if path.exists() and (not path.is_dir() or any(path.iterdir())):
                sys.exit(f"{path} exists and is not empty: nothing written. Pick another "
                         "--out/--config-out, or pass --overwrite to replace its files.")

    # Sorted so the training stream, hence the merges, is the same every run.
    try:
        files = args.files = sorted(data.expand_urls(args.data))
        if not any(text.strip() for text in iter_texts(files)):  # (stops at the first text)
            sys.exit(f"--data {args.data}: its records hold no text to learn from: nothing "
                     "written.")
        tok = train_tokenizer(files, args.vocab_size)
    except (OSError, ValueError) as e:  # no such files, a bad record: one paragraph
        sys.exit(f"--data {args.data}: {e}")

    # Each output is written into a hidden directory beside it and moved into place once both
    # are whole and load: a full disk or a kill leaves no half-written tokenizer, and no
    # --out/--config-out that would refuse the rerun.
    staged, placed = [], []
    try:
        for path in (args.out, args.config_out):  # (made here: a refused mkdir is told too)
            staged.append((path, staging(path)))
        path = args.out
        tok2 = write_tokenizer(tok, args, staged[0][1])
        path = args.config_out
        n_params = write_config(tok2, args, staged[1][1])
        for path, tmp in staged:
            place(tmp, path)
            placed.append(str(path))
    except Exception as e:  # the tokenizers library says "... (os error 28)": no OSError
        if isinstance(e, AssertionError) or (failure := utils.write_failure(path, e)) is None:
            raise
        sys.exit(f"{failure}. " + (f"Written: {', '.join(placed)} only; rerun with --overwrite."
                                   if placed else "Nothing was written."))
    finally:
        for _, tmp in staged:
            shutil.rmtree(tmp, ignore_errors=True)
    print(f"tokenizer: {len(tok2)} tokens (incl. specials) -> {args.out}/")
    print(f"tiny-gpt2: {n_params:,} parameters -> {args.config_out}/config.json")

    # ---- tokens per byte per domain: a rough "difficulty" hint
    print(f"{'domain':<12}{'bytes':>11}{'tokens':>10}{'tok/byte':>10}")
    for domain in sorted({Path(f).parent.name for f in files}):
        texts = list(iter_texts([f for f in files if Path(f).parent.name == domain]))
        n_bytes = sum(len(t.encode("utf-8")) for t in texts)
        n_tokens = sum(len(enc.ids) for enc in tok.encode_batch(texts))
        print(f"{domain:<12}{n_bytes:>11,}{n_tokens:>10,}{n_tokens / n_bytes:>10.3f}")


if __name__ == "__main__":
    main()
