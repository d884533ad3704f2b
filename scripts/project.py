"""The trained.py, utils.py and data.py that the kit's scripts (generate.py, export_hf.py,
evaluate.py) use for a run: those beside the script that trained it. A copy of the kit keeps its
own beside its script, and may have changed them; the scripts then work with those, not with
the kit's."""

import contextlib
import importlib.util
import json
import logging
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import trained  # noqa: E402  (the kit's own)
import utils  # noqa: E402

LOGGER = logging.getLogger(__name__)
MODULES = ("data", "utils", "trained")  # in import order: each imports those before it


def project_kit(path, script=None):
    """The trained module (its .utils and .data beside it) of the project whose script
    trained the run (or checkpoint) at ``path``, or ``script``'s; the kit's where the run names
    no script, or one without the three files beside it, or ones that cannot serve the scripts."""
    if script is None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            state = trained.find_checkpoint(path) / "state.json"
            script = json.loads(state.read_text())["script"]
    folder = Path(script).resolve().parent if script else utils.KIT
    if folder == utils.KIT or not all((folder / f"{n}.py").is_file() for n in MODULES[:2]):
        return trained
    kit = {name: sys.modules.get(name) for name in MODULES}
    try:
        if not (folder / "trained.py").is_file():  # (its utils.py held what trained.py holds)
            raise ImportError(f"{folder} has no trained.py: it is a copy of an older kit")
        for name in MODULES:
            spec = importlib.util.spec_from_file_location(name, folder / f"{name}.py")
            sys.modules[name] = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(sys.modules[name])
    except Exception as e:  # the kit's own, as before: said, not a traceback
        LOGGER.warning(f"Using the kit's trained.py, utils.py and data.py, not {folder}'s: {e}")
        sys.modules.update(kit)
        return trained
    return sys.modules["trained"]


def load_trained(kit, path, script=None, weights="model"):
    """``kit.load_trained(path, script)``, with ``weights`` naming the set of a checkpoint's
    weights to load: model, or a training state of your own that holds the model's (extra in
    train_llm.py; an EMA, torch.optim.swa_utils.AveragedModel, saves them as "module.NAME"
    beside its count "n_averaged")."""
    model, tokenizer, config, ckpt_dir = kit.load_trained(path, script)
    if weights == "model":
        return model, tokenizer, config, ckpt_dir
    if not Path(path).exists() or (Path(path) / "config.json").exists():
        sys.exit(f"{path} is a Hugging Face model: it holds one set of weights; --weights "
                 f"{weights} reads a run's or a checkpoint's")
    if weights in kit.utils.KIT_STATES[1:] or weights.startswith("rng-rank"):
        sys.exit(f"{weights}.pt is the {weights.replace('_', ' ')} state of the run, not a "
                 "model's weights: pass --weights model, or the name of training state of "
                 "your own that holds weights (extra, e.g. ema)")
    try:  # NAME.pt, or NAME's part of --fsdp's dcp/
        state = kit.checkpoint_weights(ckpt_dir, weights)
    except (FileNotFoundError, KeyError):
        if not ckpt_dir.exists():
            sys.exit(f"{ckpt_dir} was deleted while it was read (its run went on): run the "
                     "same command again, which reads the newest checkpoint")
        sys.exit(f"{ckpt_dir} holds no weights named {weights!r} (no {weights}.pt, nor in dcp/)")
    if "n_averaged" in state:
        state = {k.removeprefix("module."): v for k, v in state.items() if k != "n_averaged"}
    model.load_state_dict(state)
    return model, tokenizer, config, ckpt_dir
