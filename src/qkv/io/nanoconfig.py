"""nanoGPT's settings: its config files and ``--name=value`` overrides, read as data and mapped to qkv's.

nanoGPT's ``configurator.py`` runs a config file (``exec``) and then takes ``--name=value``
arguments (``literal_eval``, else the string). qkv runs nothing: a config file must be plain
assignments ``name = literal`` (numbers, strings, booleans, None, and arithmetic of numbers
such as ``5 * 8``), comments and blank lines; any other statement is refused, naming its
line. Each name maps to a :class:`~qkv.training.config.TrainConfig` field or to one of
the command's settings through :data:`SETTINGS` (the table in docs/gpt.md); a name with no
equivalent is refused by name, and the settings of nanoGPT's machinery (:data:`IGNORED`:
wandb, compile, device, ...) are skipped with a note.

:func:`read_settings` returns ``(name, value, where)`` triples; :func:`map_settings` turns
them into ``(fields, command, notes)``.
"""
from __future__ import annotations

import ast
import math
import operator
from pathlib import Path

from ..errors import ShapeError

# nanoGPT's train.py name -> (what it sets in qkv, its type). A TrainConfig field is named as it
# is; "command:X" is the command's setting X (--out, --data, --resume/--init-from, --log-interval).
SETTINGS = {
    "out_dir": ("command:out", str), "dataset": ("command:data", str), "init_from": ("command:init_from", str),
    "log_interval": ("command:log_interval", int), "eval_only": ("command:eval_only", bool),
    "eval_interval": ("eval_interval", int), "eval_iters": ("eval_iters", int),
    "always_save_checkpoint": ("keep_best", bool), "gradient_accumulation_steps": ("grad_accum", int),
    "batch_size": ("batch_size", int), "block_size": ("block_size", int), "n_layer": ("n_layer", int),
    "n_head": ("n_head", int), "n_embd": ("n_embd", int), "dropout": ("dropout", float), "bias": ("bias", bool),
    "learning_rate": ("lr", float), "max_iters": ("steps", int), "weight_decay": ("weight_decay", float),
    "beta1": ("beta1", float), "beta2": ("beta2", float), "grad_clip": ("grad_clip", float),
    "decay_lr": ("command:decay_lr", bool), "warmup_iters": ("warmup", int),
    "lr_decay_iters": ("lr_decay_steps", int), "min_lr": ("min_lr", float),
}
IGNORED = {"wandb_log": "qkv logs to log.json and loss.png", "wandb_project": "no wandb",
           "wandb_run_name": "no wandb", "compile": "qkv has no torch.compile (NumPy)",
           "device": "qkv trains on the CPU", "backend": "qkv's parallel runs use MPI (mpiexec), not torch.distributed",
           "dtype": "qkv trains in float32 (--dtype float64 for checks); no autocast"}
_ARITH = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
          ast.FloorDiv: operator.floordiv, ast.Pow: operator.pow}


# What a config file may hold, checked before anything is parsed or computed (a file from outside
# is hostile until checked): nanoGPT's own files are a few hundred bytes of short assignments.
MAX_FILE_BYTES = 1 << 20          # the file
MAX_VALUE_CHARS = 4096            # one assignment's source
MAX_NODES = 256                   # syntax nodes of one value
MAX_DEPTH = 32                    # nesting of one value
MAX_MAGNITUDE = 2.0 ** 63         # any number, the intermediate ones of arithmetic included


class _Budget(ValueError):
    """A value past what a config file may hold (the message says which bound)."""


def _checked(node) -> None:
    """Refuse a value of more than MAX_NODES nodes or deeper than MAX_DEPTH, by an explicit walk
    (never recursion: the tree may be 100,000 levels deep)."""
    stack, seen = [(node, 1)], 0
    while stack:
        n, depth = stack.pop()
        seen += 1
        if seen > MAX_NODES:
            raise _Budget(f"more than {MAX_NODES} syntax nodes")
        if depth > MAX_DEPTH:
            raise _Budget(f"nested deeper than {MAX_DEPTH}")
        stack.extend((child, depth + 1) for child in ast.iter_child_nodes(n))


def _number(x, what: str = "a number"):
    if isinstance(x, (int, float)) and not isinstance(x, bool) and not abs(x) < MAX_MAGNITUDE:
        raise _Budget(f"{what} of magnitude 2**63 or more")
    return x


def _value(node):
    """A literal, or arithmetic of number literals; anything else raises ValueError. Every number,
    the intermediate results of the arithmetic included, stays below 2**63 in magnitude: a power
    is bounded before it is computed, so ``((10**64)**64)**64`` is refused at once."""
    if isinstance(node, ast.BinOp) and type(node.op) in _ARITH:
        a, b = _value(node.left), _value(node.right)
        if not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in (a, b)):
            raise ValueError("arithmetic of numbers only")
        if isinstance(node.op, ast.Pow) and abs(a) > 1 and b > 0 and b * math.log2(abs(a)) >= 63:
            raise _Budget("a power of magnitude 2**63 or more")
        return _number(_ARITH[type(node.op)](a, b))
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        x = _value(node.operand)
        if not isinstance(x, (int, float)) or isinstance(x, bool):
            raise ValueError("a sign before a number only")
        return -x if isinstance(node.op, ast.USub) else x
    value = ast.literal_eval(node)
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return _number(value)
    if isinstance(value, (str, bool)) or value is None:
        return value
    raise ValueError("a number, a string, True/False or None")


def _parse(text: str, path: Path):
    """The module's syntax tree, or a ShapeError: a file past MAX_FILE_BYTES, a statement past
    MAX_VALUE_CHARS, or one the parser cannot hold (RecursionError, MemoryError) is refused
    before the parser is asked to build it whole."""
    if len(text.encode("utf-8")) > MAX_FILE_BYTES:
        raise ShapeError(f"the nanoGPT config file {path} is larger than {MAX_FILE_BYTES >> 20} MiB; nanoGPT's "
                         f"config files are a few lines of name = value")
    for number, line in enumerate(text.splitlines(), 1):
        if len(line) > MAX_VALUE_CHARS:
            raise ShapeError(f"{path} line {number}: longer than {MAX_VALUE_CHARS} characters; qkv reads a nanoGPT "
                             f"config file as short assignments (name = value)")
    try:
        return ast.parse(text, filename=str(path))
    except SyntaxError as err:
        raise ShapeError(f"{path} line {err.lineno}: not Python that nanoGPT's configurator could read: "
                         f"{err.msg}") from None
    except (RecursionError, MemoryError):
        raise ShapeError(f"{path}: nested too deeply to read; qkv reads a nanoGPT config file as plain "
                         f"assignments (name = value)") from None


def read_config_file(path) -> list[tuple[str, object, str]]:
    """The assignments of a nanoGPT config file, ``(name, value, "FILE line N")``, in order."""
    path = Path(path)
    try:
        if path.stat().st_size > MAX_FILE_BYTES:
            raise ShapeError(f"the nanoGPT config file {path} is larger than {MAX_FILE_BYTES >> 20} MiB; nanoGPT's "
                             f"config files are a few lines of name = value")
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as err:
        raise ShapeError(f"the nanoGPT config file {path} cannot be read: {err}") from None
    tree = _parse(text, path)
    lines = text.splitlines()
    out = []
    for node in tree.body:
        where = f"{path} line {node.lineno}"
        shown = lines[node.lineno - 1].strip() if node.lineno <= len(lines) else ""
        ok = isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name)
        try:
            if ok:
                _checked(node.value)
            value = _value(node.value) if ok else None
        except _Budget as err:
            raise ShapeError(f"{where}: {shown[:80]!r}: a value with {err}; qkv reads a nanoGPT config file as "
                             f"plain assignments of short literals") from None
        except (ValueError, TypeError, SyntaxError, ZeroDivisionError, OverflowError, RecursionError, MemoryError):
            ok = False
        if not ok:
            raise ShapeError(f"{where}: {shown!r}: qkv reads a nanoGPT config file as plain assignments "
                             f"(name = a number, string, True/False or arithmetic of numbers) and runs nothing; "
                             f"write the value out, or pass it as --name=value")
        out.append((node.targets[0].id, value, where))
    return out


def read_override(arg: str) -> tuple[str, object, str]:
    """nanoGPT's ``--name=value`` (``literal_eval``, else the string itself)."""
    name, _, text = arg[2:].partition("=")
    if len(text) > MAX_VALUE_CHARS:
        raise ShapeError(f"--{name}=...: a value of {len(text)} characters, more than {MAX_VALUE_CHARS}; nanoGPT's "
                         f"settings are short literals")
    try:
        tree = ast.parse(text, mode="eval")
        _checked(tree.body)
        value = ast.literal_eval(tree.body)   # nanoGPT's configurator: literal_eval, no arithmetic
        _number(value)
    except _Budget as err:
        raise ShapeError(f"--{name}=...: a value with {err}") from None
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError, ZeroDivisionError, OverflowError):
        value = text
    return name, value, arg


def _typed(name: str, value, kind, where: str):
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, float) and value.is_integer():
        return int(value)  # 12 * 1024 / 4 in a config file
    if type(value) is not kind:
        raise ShapeError(f"{where}: nanoGPT's {name} must be {'a' if kind is not int else 'an'} "
                         f"{kind.__name__}; got {type(value).__name__} {value!r}")
    return value


def map_settings(items) -> tuple[dict, dict, list[str]]:
    """``(fields, command, notes)`` of nanoGPT settings ``items`` (later ones win, as nanoGPT):
    TrainConfig fields, the command's settings (``out``, ``data`` = ``data/<dataset>``,
    ``resume``, ``init_from``, ``log_interval``, ``eval_only``, ``decay_lr``) and a note for each
    ignored one. A name without an equivalent, or a value of the wrong type, is a ShapeError
    naming it and where it was set."""
    fields, command, notes = {}, {}, []
    for name, value, where in items:
        if name in IGNORED:
            notes.append(f"note: {where}: nanoGPT's {name} = {value!r} is ignored ({IGNORED[name]})")
            continue
        if name not in SETTINGS:
            raise ShapeError(f"{where}: nanoGPT's {name!r} has no equivalent in qkv train gpt (the settings it "
                             f"takes: {', '.join(sorted(SETTINGS))}; see 'Coming from nanoGPT' in docs/gpt.md)")
        target, kind = SETTINGS[name]
        value = _typed(name, value, kind, where)
        if target == "keep_best":
            value = not value                       # always_save_checkpoint=False keeps the best
        if target == "command:init_from":
            command.pop("init_from", None)
            command.pop("resume", None)
            if value == "resume":
                command["resume"] = True
            elif value != "scratch":
                command["init_from"] = value
            continue
        if target == "command:data":
            value = str(Path("data") / value)       # nanoGPT's os.path.join('data', dataset)
        if target.startswith("command:"):
            command[target.split(":", 1)[1]] = value
        else:
            fields[target] = value
    return fields, command, notes


def nanogpt_config(cfg, *, dataset: str, out_dir: str) -> dict:
    """nanoGPT's ``config`` dict (what its train.py saves in ckpt.pt) of a TrainConfig ``cfg``."""
    back = {target: name for name, (target, _) in SETTINGS.items() if not target.startswith("command:")}
    out = {name: getattr(cfg, target) for target, name in back.items()}
    out["always_save_checkpoint"] = not cfg.keep_best
    out.update(out_dir=out_dir, dataset=dataset, init_from="resume", decay_lr=True, eval_only=False,
               log_interval=1, wandb_log=False, compile=False, device="cpu", dtype="float32", backend="gloo")
    return out
