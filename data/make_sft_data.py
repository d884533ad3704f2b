#!/usr/bin/env python3
"""Build a small instruction-tuning set from CPython's own docstrings, for `--task sft`.

Each record asks about one public function or class of the standard library and answers
with the first paragraph of its docstring:

    {"instruction": "What does the function json.dumps do?",
     "input": "def dumps(obj, *, skipkeys=False, ...)",
     "output": "Serialize ``obj`` to a JSON formatted ``str``. ..."}

About half the records carry the signature as "input", so both forms of the template are
exercised. Deterministic like make_sample_data.py: sorted files, SHA-256 order, no hash().
The committed data/sft/ came from CPython 3.11.7:
    python data/make_sft_data.py --out data/sft
"""
import argparse
import ast
import hashlib
import json
from pathlib import Path

from make_sample_data import SKIP_DIRS, STDLIB, clean, read_text

MAX_ANSWER_CHARS = 400


def records():
    for path in sorted(STDLIB.rglob("*.py")):
        parts = path.relative_to(STDLIB).parts
        if any(p in SKIP_DIRS or p.startswith("_") for p in parts):
            continue
        module = ".".join(parts).removesuffix(".py").removesuffix(".__init__")
        try:
            tree = ast.parse(read_text(path))
        except SyntaxError:  # a few stdlib files are templates, not Python
            continue
        for node in tree.body:
            if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) or node.name.startswith("_"):
                continue
            doc = ast.get_docstring(node)
            answer = clean(doc.split("\n\n")[0]) if doc else ""
            if not 40 <= len(answer) <= MAX_ANSWER_CHARS:
                continue
            name = f"{module}.{node.name}"
            kind = "class" if isinstance(node, ast.ClassDef) else "function"
            signature = ""
            if isinstance(node, ast.FunctionDef):
                signature = f"def {node.name}({ast.unparse(node.args)})"
            key = hashlib.sha256(name.encode()).hexdigest()
            if signature and int(key[:2], 16) % 2:
                yield key, {"instruction": f"What does the {kind} {name} do?",
                            "input": signature, "output": answer}
            else:
                yield key, {"instruction": f"What does the {kind} {name} do?", "input": "",
                            "output": answer}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", default="data/sft")
    parser.add_argument("--val-fraction", type=float, default=0.05)
    parser.add_argument("--shards", type=int, default=8, help="training shards (one slot each)")
    args = parser.parse_args()
    ordered = [record for _, record in sorted(records(), key=lambda kv: kv[0])]
    n_val = max(1, int(len(ordered) * args.val_fraction))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    parts = {"val-000.jsonl": ordered[:n_val]}
    train = ordered[n_val:]
    for i in range(args.shards):  # round-robin, so the shards are the same size
        parts[f"train-{i:03d}.jsonl"] = train[i::args.shards]
    for name, part in parts.items():
        with open(out / name, "w", encoding="utf-8") as f:
            for record in part:
                f.write(json.dumps(record, ensure_ascii=False) + "\n")
        print(f"{out / name}: {len(part)} records")


if __name__ == "__main__":
    main()
