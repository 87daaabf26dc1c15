"""``qkv convert SRC DST``: checkpoints between qkv, nanoGPT and transformers (qkv.io.convert).

- ``SRC`` a nanoGPT ``ckpt.pt``: ``DST`` a folder ``qkv sample`` reads (its vocabulary from
  ``data/<dataset>/meta.pkl``, as nanoGPT's ``sample.py`` finds it, or ``--meta``).
- ``SRC`` a folder ``qkv train gpt`` wrote: ``DST`` ending in ``.pt`` is nanoGPT's ``ckpt.pt``
  (``sample.py`` and ``train.py --init_from=resume`` read it); ``--to hf`` makes ``DST`` a
  transformers ``GPT2LMHeadModel`` folder.
"""
from __future__ import annotations

from pathlib import Path

from ..extras import require
from .common import UsageError, named_path, out_folder

HELP = "convert a checkpoint: nanoGPT's ckpt.pt to a qkv folder, a qkv folder to ckpt.pt or (--to hf) a GPT-2 folder"
DESCRIPTION = HELP + """.

qkv convert out-shakespeare-char/ckpt.pt out-qkv        nanoGPT -> qkv (then: qkv sample out-qkv)
qkv convert out-gpt nano/ckpt.pt                        qkv -> nanoGPT (python sample.py --out_dir=nano)
qkv convert out-gpt gpt2-folder --to hf                 qkv -> transformers' GPT2LMHeadModel

DST must be new (a folder new or empty, a .pt file not there; a meta.pkl beside ckpt.pt not
there or the same): qkv convert never replaces a file it did not write, unless --force. Each
file is written whole (a new folder appears whole) or not at all.

A model the target cannot compute (a hybrid layer, RoPE, grouped kv heads, SwiGLU; for
nanoGPT also the tanh GELU, which its nn.GELU() is not) is refused, naming what it has."""


def add_arguments(parser) -> None:
    parser.add_argument("src", metavar="SRC", help="nanoGPT's ckpt.pt, or a folder qkv train gpt wrote")
    parser.add_argument("dst", metavar="DST", help="a folder (from ckpt.pt; with --to hf), or a file ending in .pt")
    parser.add_argument("--to", choices=["qkv", "nanogpt", "hf"], default=None,
                        help="the target (default: nanogpt when DST ends in .pt, qkv when SRC is a .pt)")
    parser.add_argument("--meta", metavar="PATH", default=None,
                        help="from ckpt.pt: the meta.pkl with its characters (default: data/<dataset>/meta.pkl "
                        "of the dataset the checkpoint names, under the current folder, as nanoGPT's sample.py)")
    parser.add_argument("--force", action="store_true",
                        help="write into a DST that holds files already, replacing those of the names it writes "
                        "(without it, DST must be new: a folder new or empty, a .pt file not there)")
    parser.add_argument("--dataset", metavar="NAME", default=None,
                        help="to ckpt.pt: config['dataset'] (nanoGPT's sample.py reads data/NAME/meta.pkl; default: "
                        "the run's data folder's or text file's name)")


def _target(args, src: Path, dst: Path) -> str:
    kind = args.to or ("qkv" if src.is_file() else "nanogpt" if dst.suffix == ".pt" else None)
    if kind is None:
        raise UsageError(f"DST {str(dst)!r}: say what to write: a name ending in .pt (nanoGPT's ckpt.pt) or "
                         f"--to hf (a transformers GPT-2 folder)")
    if kind == "qkv" and not src.is_file():
        raise UsageError(f"SRC must be nanoGPT's ckpt.pt (a file) to make a qkv folder; {str(src)!r} is not a file")
    if kind in ("nanogpt", "hf") and not src.is_dir():
        raise UsageError(f"SRC must be a folder qkv train gpt wrote to make {kind}'s checkpoint; {str(src)!r} is "
                         f"not a folder")
    if kind == "nanogpt" and dst.suffix != ".pt":
        raise UsageError(f"DST must end in .pt for nanoGPT (its ckpt.pt); got {str(dst)!r}")
    if kind != "nanogpt" and dst.suffix == ".pt":
        raise UsageError(f"DST {str(dst)!r} ends in .pt, but --to {kind} writes a folder")
    if kind == "qkv" and args.dataset is not None:
        raise UsageError("--dataset names the data of a ckpt.pt being written; reading one, pass --meta PATH")
    if kind != "qkv" and args.meta is not None:
        raise UsageError("--meta is the vocabulary of a ckpt.pt being read; a qkv folder has its own")
    return kind


def run(args) -> int:
    require("safetensors", "models")
    src, dst = named_path(args.src, "SRC"), named_path(args.dst, "DST")
    try:
        return _convert(args, src, dst)
    except OSError as err:  # a name the file system refuses (too long, not a folder, no permission)
        name = err.filename if err.filename is not None else dst
        raise UsageError(f"cannot use {str(name)[:120]!r}: {err.strerror or err}") from None


def _convert(args, src: Path, dst: Path) -> int:
    from ..io import convert

    if not src.exists():
        raise UsageError(f"SRC {str(src)!r} does not exist")
    kind = _target(args, src, dst)
    if kind != "nanogpt" and dst.exists() and not dst.is_dir():
        raise UsageError(f"DST {str(dst)!r} is a file; --to {kind} writes a folder")
    if kind != "nanogpt" and (dst / "config.json").exists() and not args.force:
        raise UsageError(f"DST {str(dst)!r} already holds a model (config.json); choose another folder "
                         f"(or --force to replace its files)")
    if kind == "nanogpt":
        out_folder(dst.parent, "DST's folder")  # nanoGPT's out_dir, made as train.py makes it
    if kind == "qkv":
        meta = None if args.meta is None else Path(args.meta)
        if meta is not None and not meta.is_file():
            raise UsageError(f"--meta {args.meta!r} is not a file (nanoGPT's data/<dataset>/meta.pkl)")
        said = convert.nanogpt_to_folder(src, dst, meta, force=args.force)
        print(f"wrote {dst / 'model.safetensors'}, {dst / 'config.json'}; vocabulary: {said}; "
              f"sample with: qkv sample {dst}")
    elif kind == "nanogpt":
        print("\n".join(convert.folder_to_nanogpt(src, dst, args.dataset, force=args.force)))
    else:
        print("\n".join(convert.folder_to_gpt2(src, dst, force=args.force)))
    return 0
