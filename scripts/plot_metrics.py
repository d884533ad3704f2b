"""Plot runs' training loss, validation loss and throughput from their metrics.jsonl, and, for
runs that mix domains (--mix, --odm), each domain's probability and validation loss; print a
table of their final metrics. Several runs are drawn on the same axes, each in a look of its
own; runs that differ only by --seed (their state.json says) are one configuration, drawn as
their mean with a band from their minimum to their maximum, and in the table as mean ± sd.

    python scripts/plot_metrics.py outputs/demo             # writes outputs/demo/metrics.png
    python scripts/plot_metrics.py outputs/adamw-s* outputs/muon-s* --out compare.png \\
        --table compare.csv                                 # (or .md)
"""

import argparse
import csv
import itertools
import json
import statistics
import sys
import tempfile
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # draw to a file; no display needed
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.lines import Line2D  # noqa: E402

# Colour and line style cycle together: 20 runs (lcm of 10 and 4) never share a look.
COLOURS, STYLES = plt.get_cmap("tab10").colors, ("-", "--", ":", "-.")
DOMAIN_COLOURS = plt.get_cmap("Dark2").colors  # (in their panels, apart from the runs')
FINAL = {"loss": "train loss", "val_loss": "validation loss", "tokens_per_s": "tokens/s"}


def read_rows(exp_dir):
    """The step lines of a run's metrics.jsonl (a torn last line and notes left out)."""
    path = exp_dir / "metrics.jsonl"
    if not path.is_file():
        sys.exit(f"{path}: no such file. Pass the directory of a run of train_llm.py "
                 "(outputs/NAME) that has trained a step.")
    rows = []
    for number, line in enumerate(path.read_bytes().splitlines(), 1):
        try:
            text = line.decode()
        except UnicodeDecodeError as e:  # (train_llm.py writes ASCII: a damaged file, an edit)
            sys.exit(f"{path}, line {number}: byte {line[e.start]:#04x} is not UTF-8, so the "
                     "file cannot be read; nothing was drawn. Mend or delete that line "
                     "(train_llm.py writes it as ASCII JSON), and rerun.")
        try:
            rows.append(json.loads(text))
        except ValueError:  # the torn last line of a run that is being killed
            pass
    rows = [row for row in rows if isinstance(row, dict) and "step" in row]  # (not a note)
    if not rows:
        sys.exit(f"{path} holds no step yet: nothing to plot.")
    return rows


def configuration(exp_dir):
    """What makes a run what it is, but for its seed: the fingerprint in its state.json
    ("config": every flag that shapes the run) and its schedule's length; None without one."""
    try:
        state = json.loads((exp_dir / "state.json").read_text())
        config = dict(state["config"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    seed = config.pop("seed", None)
    return {**config, "decay_steps": state.get("decay_steps")}, seed


def group_runs(exp_dirs):
    """[(label, [(name, seed, rows), ...])]: one group per configuration, in the order given,
    labelled by the flags that tell the groups apart (else by its first run's name)."""
    groups, configs = {}, {}
    for exp_dir in exp_dirs:
        config, seed = configuration(exp_dir) or (None, None)
        key = json.dumps(config, sort_keys=True) if config else str(exp_dir)
        configs[key] = config
        groups.setdefault(key, []).append((exp_dir.name, seed, read_rows(exp_dir)))
    known = [c for c in configs.values() if c]
    differ = [flag for flag in sorted({f for c in known for f in c})
              if len({json.dumps(c.get(flag)) for c in known}) > 1
              and not any(isinstance(c.get(flag), dict) for c in known)]  # (file digests)
    labels = [", ".join(f"{flag}={configs[key].get(flag)}" for flag in differ if configs[key])
              or runs[0][0] for key, runs in groups.items()]
    return [(label if labels.count(label) == 1 else f"{label} ({runs[0][0]})", runs)
            for label, runs in zip(labels, groups.values())]


def series(rows, key):
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    return [step for step, _ in points], [value for _, value in points]


def draw(ax, runs, key, label=None, **style):
    """A run's series, or a group's: the mean over its runs at the steps all of them logged,
    with a band from their minimum to their maximum."""
    curves = [dict(zip(*series(rows, key))) for _, _, rows in runs]
    steps = sorted(set.intersection(*(set(c) for c in curves)))
    if not steps:
        return
    values = [[c[s] for c in curves] for s in steps]
    ax.plot(steps, [statistics.mean(v) for v in values], label=label, **style)
    if len(runs) > 1:
        ax.fill_between(steps, [min(v) for v in values], [max(v) for v in values],
                        color=style["color"], alpha=0.2, linewidth=0)


def figure(groups):
    """The figure of ``groups`` (group_runs): loss (train and validation), the domains' panels
    where runs mix domains, throughput; one legend, outside the axes."""
    domains = sorted({key[len("mix/p_"):] for _, runs in groups for _, _, rows in runs
                      for key in rows[-1] if key.startswith("mix/p_")})
    fig, axes = plt.subplots(4 if domains else 2, 1, sharex=True, layout="constrained",
                             figsize=(10, 11 if domains else 6))
    loss_ax, speed_ax = axes[0], axes[-1]
    handles = [Line2D([], [], color="grey", linewidth=0.8, label="train loss"),
               Line2D([], [], color="grey", marker="o", label="validation loss")]
    for (label, runs), colour, style in zip(groups, itertools.cycle(COLOURS),
                                            itertools.cycle(STYLES)):
        look = {"color": colour, "linestyle": style}
        if len(runs) > 1:
            label += f" (mean of {len(runs)} runs; band: min-max)"
        draw(loss_ax, runs, "loss", label, linewidth=0.8, alpha=0.7, **look)
        draw(loss_ax, runs, "val_loss", marker="o", **look)
        draw(speed_ax, runs, "tokens_per_s", **look)
        for domain, domain_colour in zip(domains, itertools.cycle(DOMAIN_COLOURS)):
            draw(axes[1], runs, f"mix/p_{domain}", linestyle=style, color=domain_colour)
            draw(axes[2], runs, f"val_loss/{domain}", marker="o", linestyle=style,
                 color=domain_colour)
        handles.append(Line2D([], [], label=label, **look))
    loss_ax.set_ylabel("loss (nats/token)")
    if domains:
        axes[1].set_ylabel("sampling probability")
        axes[2].set_ylabel("validation loss (by domain)")
        handles += [Line2D([], [], color=c, linewidth=4, label=f"domain {d}")
                    for d, c in zip(domains, itertools.cycle(DOMAIN_COLOURS))]
    for ax in axes:
        ax.grid(alpha=0.3)
    speed_ax.set_ylabel("tokens / s")
    speed_ax.set_xlabel("optimizer step")
    fig.legend(handles=handles, loc="outside right upper", fontsize="small")
    loss_ax.set_title(" vs ".join(label for label, _ in groups) if len(groups) <= 3
                      else f"{sum(len(runs) for _, runs in groups)} runs")
    return fig


def final_table(groups):
    """A row per configuration: its runs, their seeds and last step, and each FINAL metric's
    last value as mean and sd over the runs (sd: None for one run)."""
    table = []
    for label, runs in groups:
        row = {"configuration": label, "runs": " ".join(name for name, _, _ in runs),
               "seeds": " ".join(str(seed) for _, seed, _ in runs),
               "step": "/".join(sorted({str(rows[-1]["step"]) for _, _, rows in runs}))}
        for key in FINAL:
            last = [values[-1] for _, _, rows in runs if (values := series(rows, key)[1])]
            row[f"{key}_mean"] = statistics.mean(last) if last else None
            row[f"{key}_sd"] = statistics.stdev(last) if len(last) > 1 else None
        table.append(row)
    return table


def markdown(table):
    def cell(row, key):
        mean, sd = row[f"{key}_mean"], row[f"{key}_sd"]
        return "" if mean is None else f"{mean:.4g}" + ("" if sd is None else f" ± {sd:.2g}")

    lines = ["| configuration | runs | seeds | step | " + " | ".join(FINAL.values()) + " |",
             "|---|---|---|---:|" + "---:|" * len(FINAL)]
    lines += ["| " + " | ".join([row["configuration"], row["runs"], row["seeds"], row["step"],
                                 *(cell(row, key) for key in FINAL)]) + " |" for row in table]
    return "\n".join(lines) + "\n"


MARK = "train_llm plot_metrics.py"  # a PNG's Software: an image this script may replace


def ours(path, default):
    """Whether ``path`` is an image this script wrote (its mark, or at the default
    RUN/metrics.png any Matplotlib PNG, which an unmarked image of the script is): else kept."""
    from PIL import Image
    try:
        with Image.open(path) as image:
            software = image.info.get("Software", "")
    except (OSError, ValueError):
        return False
    return software == MARK or default and software.startswith("Matplotlib")


def unwritable(path, flag):
    """Why ``path``, named by ``flag`` (None: the default RUN/metrics.png), cannot be written,
    said before any work; None if it can, or if its run is missing (read_rows says so)."""
    if path is None or flag is None and not path.parent.is_dir():
        return None
    what, other = ((f"{flag} {path}", f"another {flag}") if flag else
                   (str(path), "--out, an image in a folder you can write"))
    if not path.parent.is_dir():
        return (f"{what}: there is no folder {path.parent} to write it in; nothing was drawn. "
                f"Make it (mkdir -p {path.parent}), or pass {other}")
    try:  # (tried, not os.access: that asks for the real user, and misses read-only disks)
        if path.exists():
            open(path, "ab").close()  # (appends nothing: the file as it was)
        else:
            tempfile.TemporaryFile(dir=path.parent).close()
    except OSError as e:
        where = "it" if path.exists() else f"in {path.parent}"
        return f"{what}: cannot write {where} ({e.strerror}); nothing was drawn. Pass {other}"
    return None


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("exp_dirs", type=Path, nargs="+",
                        help="experiment directories of train_llm.py (several: compared)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the image (default: RUN/metrics.png; with several runs required)")
    parser.add_argument("--table", type=Path, default=None,
                        help="also write the table of final metrics: NAME.csv, else markdown")
    args = parser.parse_args()
    if args.out is None and len(args.exp_dirs) > 1:
        parser.error("several runs: pass --out, the image to write (say compare.png)")
    if len({exp_dir.name for exp_dir in args.exp_dirs}) < len(args.exp_dirs):
        parser.error("two runs of one name: pass directories whose names differ")
    out = args.out or args.exp_dirs[0] / "metrics.png"
    out = out if out.suffix else out.with_suffix(".png")  # (what savefig would write)
    if out.suffix.lower() != ".png":
        parser.error(f"--out {out}: the image is a PNG; name it NAME.png")
    if out.exists() and not ours(out, default=args.out is None):
        parser.error(f"{out} is there and is no image of plot_metrics.py: nothing was replaced; "
                     "pass another --out")
    for path, flag in ((out, args.out and "--out"), (args.table, "--table")):
        if refusal := unwritable(path, flag):
            parser.error(refusal)
    groups = group_runs(args.exp_dirs)
    figure(groups).savefig(out, dpi=120, metadata={"Software": MARK})
    table = final_table(groups)
    print(markdown(table) + f"(final values: mean ± sd over seeds)\n{out}")
    if args.table and args.table.suffix == ".csv":
        with open(args.table, "w", newline="") as f:
            writer = csv.DictWriter(f, fieldnames=list(table[0]))
            writer.writeheader()
            writer.writerows(table)
    elif args.table:
        args.table.write_text(markdown(table))


if __name__ == "__main__":
    main()
