"""Export a run's checkpoint in its model family's interchange format (Gemma: Hugging Face
safetensors + config.json + generation_config.json, LoRA merged):

    python -m runtime.export --checkpoint-dir outputs/gemma_sft/tiny_cpu/checkpoints --out hf-model [--step N]

The run's own config (saved in every checkpoint) rebuilds the state; the parameters are
restored into their shardings and handed to the family's `Task.export`. The checkpoint alone
is enough: the pretrained weights the run started from (arch.checkpoint) are not read again.
On a pod, run it on every worker (like training) so each restores its shards.

`--out` is written only when it is new, empty, or an earlier export (its EXPORT_MARKER, which
lists the files it wrote: those are replaced, files of that earlier export the new one does
not write are removed), unless `--overwrite` (the export's files replace those of the same
name; nothing else is touched). A write that fails is one line, exit 6, and leaves `--out` as it
found it: the files are written whole into STAGING inside it first, and take their places only
once all are there, under a marker naming them and the earlier export's; a folder `--out` the
export made is removed again. A staging folder left by a killed export is the next one's to clear.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import json
import logging
import posixpath
import sys
from typing import Iterator, Optional

from runtime.atomic import write_whole
from runtime.errors import EXIT_INTERRUPTED, StorageError, UserError, interrupted, one_line, storage_fault, storage_fix
from runtime.ranges import Rule, at_least, check_args, check_given
from runtime.run_log import console_logging
from runtime.task import DataShape

# fsspec, runtime.builder and runtime.registry (jax) are imported in the functions that use them: `--help` and
# bad arguments answer in 0.1 s without them (the builder alone takes 3 s).

EXPORT_MARKER = ".podrunner-export"
STAGING = ".podrunner-export.partial"  # inside --out: the files of an export under way
_RULES: dict[str, Rule] = {"--step": (at_least(0), ""), "--vocab-size": (at_least(1), "embedding rows")}


def _fs(path: str):
    import fsspec  # see the imports

    fs, root = fsspec.core.url_to_fs(path)
    return fs, root.rstrip("/") or root


def earlier_export(out_dir: str, overwrite: bool) -> list[str]:
    """The files an earlier export into `out_dir` wrote (its marker's list; [] for a new or empty
    folder); a UserError for a file, or for a folder of other files without `overwrite`."""
    fs, root = _fs(out_dir)
    try:
        if not fs.exists(root):
            return []
        if not fs.isdir(root):
            raise UserError(f"--out {out_dir} is a file, not a folder; give a new folder (or an earlier export's)")
        entries = sorted(posixpath.basename(p.rstrip("/")) for p in fs.ls(root, detail=False)
                         if posixpath.basename(p.rstrip("/")) != STAGING)  # a killed export's: ours
        if EXPORT_MARKER in entries:
            with fs.open(posixpath.join(root, EXPORT_MARKER)) as f:
                return list(json.load(f).get("files", []))
    except UserError:
        raise
    except (OSError, ValueError) as e:
        raise UserError(f"cannot read --out {out_dir} ({storage_fault(e) or one_line(e)[:200]}); check the path and "
                        "its access") from e
    if entries and not overwrite:
        shown = ", ".join(entries[:4]) + (", ..." if len(entries) > 4 else "")
        raise UserError(f"--out {out_dir} already holds files ({shown}) and no {EXPORT_MARKER} marker of an earlier "
                        "export, so nothing is written there; choose a new folder, or add --overwrite to replace the "
                        "files an export writes (config.json, model*.safetensors, ...)")
    return []


def export_checkpoint(checkpoint_dir: str, out_dir: str, *, step: Optional[int] = None, overwrite: bool = False,
                      **options) -> int:
    """Export step `step` (default: the latest) of `checkpoint_dir` into `out_dir`; returns the
    step exported. UserError (exit 2) for bad input, StorageError (exit 6) for a failed write,
    which leaves `out_dir` as it was (see the module docstring)."""
    import jax  # see the imports

    from runtime.builder import load_run_params
    from runtime.registry import family_of

    before = earlier_export(out_dir, overwrite)
    config, step, params = load_run_params(checkpoint_dir, step)
    task = family_of(config.arch).build_task(config.arch, DataShape(examples=0, vocab_size=1, seq_len=8))
    fs, root = _fs(out_dir)
    staging = posixpath.join(root, STAGING)
    writer = jax.process_index() == 0  # the one that writes (every process takes part in the gathers)
    made = writer and not fs.exists(root)
    with _undone_on_failure(fs, root if made else staging, out_dir, undo=writer):  # Ctrl-C too
        if writer and fs.exists(staging):  # a killed export's
            fs.rm(staging, recursive=True)
        written = list(task.export(params, f"{out_dir.rstrip('/')}/{STAGING}", data=config.data, **options) or [])
    if written:
        _put_in_place(fs, root, staging, written, before, {"checkpoint_dir": checkpoint_dir, "step": step},
                      out_dir, made)
    return step


def _put_in_place(fs, root: str, staging: str, written: list[str], before: list[str], source: dict, out_dir: str,
                  made: bool) -> None:
    """Move the staged files over their places in `root`, marked first as this tool's (the new
    files and the earlier export's), then drop the earlier export's files this one did not write."""
    marker = f"{out_dir.rstrip('/')}/{EXPORT_MARKER}"
    with _undone_on_failure(fs, root if made else staging, out_dir):
        for name in written:
            if fs.isdir(posixpath.join(root, name)):  # nothing moved yet: the folder is as it was
                raise IsADirectoryError(errno.EISDIR, "Is a directory", posixpath.join(root, name))
        if set(written) - set(before):  # a file the marker does not name yet is about to appear
            write_whole(marker, json.dumps({**source, "files": sorted(set(before) | set(written))}, indent=1))
    # From here the folder is marked as this tool's: after a failure, the same export again completes it.
    with _undone_on_failure(fs, staging, out_dir, undo=False):
        for name in written:
            fs.mv(posixpath.join(staging, name), posixpath.join(root, name))
        for name in sorted(set(before) - set(written)):  # an earlier export's files this one does not replace
            if fs.exists(posixpath.join(root, name)):
                fs.rm(posixpath.join(root, name))
        write_whole(marker, json.dumps({**source, "files": written}, indent=1))
        fs.rm(staging, recursive=True)


@contextlib.contextmanager
def _undone_on_failure(fs, path: str, out_dir: str, *, undo: bool = True) -> Iterator[None]:
    """When the block fails: `path` (what it wrote: the staging folder, or the folder the export
    made) removed if `undo` and it can be, and an OSError raised as the export's StorageError."""
    try:
        yield
    except BaseException as e:
        if undo:
            with contextlib.suppress(OSError):
                if fs.exists(path):
                    fs.rm(path, recursive=True)
        if isinstance(e, OSError):
            fault = storage_fault(e)
            raise StorageError(f"cannot write the export to {out_dir} ({fault or one_line(e)[:200]}); "
                               f"{storage_fix(fault, out_dir)} and export again") from e
        raise


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--checkpoint-dir", required=True, help="the run's checkpoint directory (local or gs://)")
    ap.add_argument("--out", required=True, help="output folder (local or gs://): new, empty or an earlier export")
    ap.add_argument("--overwrite", action="store_true", help="write into a folder that holds other files (files of "
                    "the same names are replaced, the rest left alone)")
    ap.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--vocab-size", type=int, help="embedding rows to write (default: the rows in use, without "
                    "padding: arch.real_vocab_size or arch.vocab_size)")
    ap.add_argument("--tokenizer", help="the tokenizer whose special token ids the export records (default: the "
                    "run's, from its data config)")
    args = ap.parse_args(argv)
    try:
        check_args(args, _RULES, UserError)
        check_given(args, ("--checkpoint-dir", "--out", "--tokenizer"), UserError)  # --out '': the working directory
        step = export_checkpoint(args.checkpoint_dir, args.out, step=args.step, overwrite=args.overwrite,
                                 dtype=args.dtype, vocab_size=args.vocab_size, tokenizer=args.tokenizer)
    except UserError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except ValueError as e:
        print(f"error: {one_line(e)}", file=sys.stderr)
        return UserError.exit_code
    except KeyboardInterrupt:
        line = interrupted(f"the export stopped; --out {args.out} is as it was (or, cut short as its files took "
                           "their places, marked as an export that the same command completes)")
        print(f"error: {line}", file=sys.stderr)
        return EXIT_INTERRUPTED
    print(f"exported step {step} of {args.checkpoint_dir} to {args.out}")
    return 0


if __name__ == "__main__":
    console_logging(logging.WARNING, "%(levelname)s %(message)s")  # the process's: not under an in-process caller
    sys.exit(main())
