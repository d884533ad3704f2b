"""Make the kit's offline evaluation tasks from the sample corpus's validation documents.

    python assets/eval/make_eval_tasks.py      # writes assets/eval/{cloze,bpb}.jsonl

Two tasks that lm-evaluation-harness runs without internet (assets/eval/*.yaml describe them;
scripts/evaluate.py scores a run on them):

- kit_cloze (multiple choice): the first ~300 characters of a validation document, and four
  continuations of ~80 characters: its own, and the continuations of three other documents of
  the same domain at the same place. Accuracy of picking the document's own (chance: 0.25).
- kit_bpb (bits per byte): the first 2,000 characters of validation documents, scored as a
  whole (rolling log-likelihood): bits per byte, byte and word perplexity.

Deterministic: the same corpus gives byte-identical files.
"""

import json
import random
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # (the kit: this file is in assets/eval/)
CONTEXT, CONTINUATION, PER_DOMAIN = 300, 80, 25


def cut(text, at):
    """``at`` moved back to the blank before it, so that no word is split."""
    blank = text.rfind(" ", 0, at)
    return blank if blank > at // 2 else at


def documents(domain):
    texts = []
    for shard in sorted((ROOT / "data/sample" / domain).glob("val-*.jsonl")):
        texts += [json.loads(line)["text"] for line in shard.read_text().splitlines()]
    return [t for t in texts if len(t) >= CONTEXT + CONTINUATION + 20]


def main():
    rng = random.Random(0)
    cloze, bpb = [], []
    for domain in sorted(p.name for p in (ROOT / "data/sample").iterdir() if p.is_dir()):
        texts = documents(domain)
        parts = []
        for text in texts:
            a = cut(text, CONTEXT)
            b = cut(text, a + CONTINUATION)
            parts.append((text[:a], text[a:b]))
        for i, (context, ending) in enumerate(parts[:PER_DOMAIN]):
            others = rng.sample([p[1] for j, p in enumerate(parts) if j != i], 3)
            choices = [ending, *others]
            rng.shuffle(choices)
            cloze.append({"domain": domain, "context": context, "choices": choices,
                          "gold": choices.index(ending)})
        bpb += [{"domain": domain, "text": text[:cut(text, 2000)]}
                for text in texts[:PER_DOMAIN // 2]]
    out = ROOT / "assets/eval"
    out.mkdir(exist_ok=True)
    for name, rows in (("cloze", cloze), ("bpb", bpb)):
        (out / f"{name}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        print(f"{out / name}.jsonl: {len(rows)} documents")


if __name__ == "__main__":
    main()
